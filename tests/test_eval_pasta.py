"""PASTA evaluation end to end on a tiny random model with SmolLM2's tokenizer (2 AlpacaEval
prompts), the pairwise judges (OpenAI-compatible backend against a local ``http.server``; the
local-model backend through the engine) and the Pareto plot."""

import json
import math

import numpy as np
import pytest

from selforch_jax.eval import judges
from tests.fake_openai import ChatHandler, serve
from selforch_jax.eval import pasta as eval_pasta
from selforch_jax.eval.plots import pareto_plot


def test_eval_pasta_tiny(tmp_path, tiny_tagged_model_dir):
  c = eval_pasta.defaults()
  c.model.preset = "tiny_smollm2"
  c.model.weights = "random"
  c.model.tokenizer = "smollm2_gguf"
  c.model.tags = True
  c.n, c.max_new_tokens, c.offset = 2, 6, 3
  c.sot.skeleton_tokens, c.sot.point_tokens, c.sot.max_points = 4, 4, 2
  c.apar.child_tokens = 4
  c.forced.n, c.forced.promises, c.forced.length = 1, 3, 1
  c.n_boot = 200
  c.warmup = False   # compiles happen inside the timed runs here (a test, not a measurement)
  c.judge.backend = "local"
  c.pareto = f"lam1/r1={tiny_tagged_model_dir}"
  c.nll_ref = tiny_tagged_model_dir   # another network (seed 1), same tokenizer
  out = eval_pasta.run(c, str(tmp_path))
  saved = json.loads((tmp_path / "pasta_eval.json").read_text())
  assert saved["n"] == 2 and saved["subset"] == [3, 5]
  ar = saved["systems"]["ar"]
  assert ar["theoretical_speedup"]["mean"] == pytest.approx(1.0)
  assert ar["wall_speedup"]["mean"] == pytest.approx(1.0)
  for s in ("pasta", "sot", "apar", "pasta[lam1/r1]"):   # pareto runs are judged too
    d = saved["systems"][s]
    for k in ("wall_speedup", "theoretical_speedup", "tokens_per_forward", "parse_rate", "nll",
              "nll_minus_ar", "length", "win_rate_vs_ar"):
      assert d[k]["n"] == 2 and d[k]["lo"] <= d[k]["mean"] <= d[k]["hi"], (s, k, d[k])
    assert 0.0 <= d["win_rate_vs_ar"]["mean"] <= 1.0
  # an untrained model never plans: PASTA decodes like AR (same text, 1 token per forward)
  recs = [json.loads(l) for l in (tmp_path / "pasta_eval_records.jsonl").read_text().splitlines()]
  by = {(r["system"], r["prompt_index"]): r for r in recs}
  for i in (3, 4):
    if by[("pasta", i)]["threads"] == 0 and by[("pasta", i)]["parsed"]:
      assert by[("pasta", i)]["text"] == by[("ar", i)]["text"]
      assert by[("pasta", i)]["nll"] == pytest.approx(by[("ar", i)]["nll"], abs=1e-5)
  assert out["systems"]["sot"]["length"]["n"] == 2
  # nll_ref: the record's answer scored by the nll_ref model, not by the baseline
  from selforch_jax.data.sources import load_examples, prompt_and_reference
  ref_model, tok, _ = eval_pasta._load(c, tiny_tagged_model_dir)
  score_ref = eval_pasta._NLL(ref_model)
  rows = load_examples("alpaca_eval", split="test", max_examples=5)
  r = by[("ar", 3)]
  prompt = tok.encode_chat(prompt_and_reference(rows[3])[0], add_generation_prompt=True)
  assert r["nll_ref"] == pytest.approx(score_ref(prompt, tok.encode(r["text"])), abs=1e-5)
  assert abs(r["nll_ref"] - r["nll"]) > 1e-3
  assert saved["systems"]["pasta"]["nll_ref_minus_ar"]["n"] == 2
  assert saved["models"]["nll_ref"] == tiny_tagged_model_dir
  # forced plan: 3 threads of 20 tokens each decoded together
  fp = saved["forced_plan"]
  assert fp["records"][0]["threads"] == 3
  assert fp["records"][0]["ar_forwards"] == fp["records"][0]["tokens"]
  assert fp["tokens_per_forward"]["mean"] > 2.5
  assert (tmp_path / "pasta_pareto.png").stat().st_size > 1000
  assert "pasta" in eval_pasta.summary(out)


class _FakeJudge(ChatHandler):
  """An OpenAI-compatible endpoint that prefers the longer output (answers m or M)."""

  requests = []

  def reply(self, path, auth, body):
    _FakeJudge.requests.append((path, auth, body))
    prompt = body["messages"][0]["content"]
    a = prompt.split("### Output (m)\n\n")[1].split("\n\n### Output (M)")[0]
    b = prompt.split("### Output (M)\n\n")[1].split("\n\n## Task")[0]
    reply = "m" if len(a) > len(b) else ("M" if len(b) > len(a) else "tie")
    return 200, {"choices": [{"message": {"role": "assistant", "content": reply}}]}


def test_openai_judge_against_local_server():
  with serve(_FakeJudge) as url:
    j = judges.OpenAIJudge(url, "judge-x", api_key="k1")
    res = judges.win_rate(j, ["q1", "q2", "q3"], ["long answer", "s", "same"],
                          ["short", "longer one", "same"], n_boot=100)
  assert res["per_example"] == [1.0, 0.0, 0.5]
  assert res["ci"]["n"] == 3 and res["ci"]["mean"] == pytest.approx(0.5)
  assert res["unparsed"] == 2  # the tie, in both orders
  path, auth, body = _FakeJudge.requests[0]
  assert path == "/v1/chat/completions" and auth == "Bearer k1"
  assert body["model"] == "judge-x" and body["temperature"] == 0
  assert "## Instruction\n\nq1" in body["messages"][0]["content"]


def test_pareto_plot_and_errors(tmp_path):
  ci = lambda m: {"mean": m, "lo": m - 0.1, "hi": m + 0.1, "n": 5}
  pts = [dict(label="pasta λ=1", x=ci(1.5), y=ci(-0.2), kind="pasta"),
         dict(label="pasta λ=4", x=ci(1.2), y=ci(-0.05), kind="pasta"),
         dict(label="SoT", x=ci(0.8), y=ci(-0.4), kind="baseline"),
         dict(label="AR", x=ci(1.0), y=ci(0.0), kind="reference")]
  p = pareto_plot(pts, str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  with pytest.raises(ValueError, match="at least one"):
    pareto_plot([], p)
  with pytest.raises(ValueError, match="lacks x or y"):
    pareto_plot([dict(label="bad", x=ci(1.0))], p)
  pareto_plot(pts, p, series={"λ": ["pasta λ=1", "pasta λ=4"]})
  with pytest.raises(ValueError, match="unknown points"):
    pareto_plot(pts, p, series={"λ": ["pasta λ=1", "pasta λ=9"]})
  c = eval_pasta.defaults()
  c.systems = "pasta,sot"
  with pytest.raises(Exception, match="'ar' required"):
    eval_pasta.validate(c)
  c = eval_pasta.defaults()
  c.max_threads = 0
  with pytest.raises(Exception, match="max_threads=0 must be >= 1"):
    eval_pasta.validate(c)


def test_summarize_throughput_and_reference_nll():
  """``throughput_speedup`` is the geometric mean of per-prompt (tokens/s) ratios, not the wall
  ratio; ``nll_ref_minus_ar`` pairs prompts; records without ``nll_ref`` (older runs) leave it out."""
  c = eval_pasta.defaults()
  c.n_boot = 200
  ar = [dict(wall_s=2.0, length=100, theoretical_speedup=1.0, tokens_per_forward=1.0,
             parsed=True, nll=1.0, nll_ref=2.0),
        dict(wall_s=4.0, length=200, theoretical_speedup=1.0, tokens_per_forward=1.0,
             parsed=True, nll=1.0, nll_ref=2.5)]
  sys_ = [dict(wall_s=1.0, length=50, theoretical_speedup=2.0, tokens_per_forward=2.0,
               parsed=True, nll=1.5, nll_ref=2.25),
          dict(wall_s=1.0, length=200, theoretical_speedup=2.0, tokens_per_forward=2.0,
               parsed=True, nll=1.5, nll_ref=2.25)]
  got = eval_pasta.summarize(sys_, ar, c)
  assert got["wall_speedup"]["mean"] == pytest.approx(math.sqrt(2.0 * 4.0))
  # prompt 0: 50 tok/s vs 50 tok/s = 1; prompt 1: 200 vs 50 = 4
  assert got["throughput_speedup"]["mean"] == pytest.approx(2.0)
  assert got["nll_ref_minus_ar"]["mean"] == pytest.approx(0.0)
  assert got["nll_ref"]["mean"] == pytest.approx(2.25)
  old = [{k: v for k, v in r.items() if k != "nll_ref"} for r in sys_]   # an older run's records
  assert "nll_ref" not in eval_pasta.summarize(old, ar, c)
  c.nll_ref = "no/such/dir"
  with pytest.raises(Exception, match="nll_ref='no/such/dir'"):
    eval_pasta.validate(c)
  c.nll_ref, c.pareto = "base", "a=x,a=y"
  with pytest.raises(Exception, match="pareto label 'a' is given twice"):
    eval_pasta.validate(c)


def test_parse_rate_counts_budget_truncation_apart():
  """A plan whose threads are still open when the answer reaches max_new_tokens is cut like an
  AR answer: ``parsed`` (the parse rate) but not ``parsed_strict``; with room to finish, the
  same plan is well-formed under both."""
  from selforch_jax.lang import Promise, Round, TagVocab, serialize
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  from selforch_jax.runtime.engine import Engine

  tv = TagVocab.appended(64, 0, eos_ids=[2], digit_ids=range(3, 13), space_ids=[13])
  model = init_model(get_preset("tiny_llama", vocab_size=64 + 7), seed=1)
  engine = Engine(model, num_pages=64, page_size=4)

  class Tok:
    stop_ids = ()

    def decode(self, ids, skip_special_tokens=False):
      return " ".join(map(str, ids))

  prompt = serialize([20, 21, Round(plan=(Promise((30,), 1), Promise((31,), 1)), sync=False)],
                     tv) + [tv.async_open]
  cut = eval_pasta.run_pasta(engine, Tok(), tv, prompt, 6, 3, constrain_tags=True)
  assert cut["finish_reason"] == "length" and cut["degraded"]
  assert all(d.startswith("end:") for d in cut["degraded"])
  assert cut["parsed"] and not cut["parsed_strict"]
  room = eval_pasta.run_pasta(engine, Tok(), tv, prompt, 40, 3, constrain_tags=True)
  assert room["threads"] == 2
  assert room["parsed"] == room["parsed_strict"] == (not room["degraded"])


def test_final_text_of_a_cut_plan_keeps_each_chunk_alone():
  """Threads cut by max_new_tokens: the final text is each chunk's tokens in promise order (no tag
  ids, no promise topics, no later chunk read as text of an earlier one)."""
  from selforch_jax.lang import Promise, Round, TagVocab, serialize
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  from selforch_jax.runtime.schedulers import pasta
  from selforch_jax.runtime.engine import Engine

  tv = TagVocab.appended(64, 0, eos_ids=[2], digit_ids=range(3, 13), space_ids=[13])
  model = init_model(get_preset("tiny_llama", vocab_size=64 + 7), seed=1)
  engine = Engine(model, num_pages=64, page_size=4)
  prompt = serialize([20, 21, Round(plan=(Promise((30,), 1), Promise((31,), 1), Promise((32,), 1)),
                                    sync=False)], tv) + [tv.async_open]
  s = pasta.generate(engine, [prompt], tv, max_new_tokens=9, cap=3, constrain_tags=True)
  res = s.results[0]
  assert res.finish_reason == "length" and s.stats[0].threads == 3
  chunks, cur = [], None
  for t in res.token_ids:            # canonical order: chunk 0, chunk 1, chunk 2
    if t == tv.async_open:
      cur = []
      chunks.append(cur)
    elif not tv.is_tag(t):
      cur.append(t)
  assert len(chunks) == 3
  assert s.text_ids(0) == [t for c in chunks for t in c]


def test_pareto_figure_joins_each_lambda_through_its_rounds(tmp_path, monkeypatch):
  from selforch_jax.eval import plots
  seen = {}
  monkeypatch.setattr(plots, "pareto_plot", lambda pts, path, **kw: seen.update(pts=pts, **kw))
  ci = lambda m: {"mean": m, "lo": m - 0.1, "hi": m + 0.1, "n": 3}  # noqa: E731
  fig = lambda s, q: {"wall_speedup": ci(s), "nll_minus_ar": ci(q)}  # noqa: E731
  out = {"n": 3, "systems": {"ar": fig(1.0, 0.0), "pasta": fig(1.2, 0.3), "sot": fig(0.6, 0.4),
                             "pasta[lam1/r3]": fig(1.4, 0.2), "pasta[lam4/r3]": fig(1.1, 0.1),
                             "pasta[lam1/r6]": fig(1.6, 0.25), "pasta[other]": fig(1.0, 0.0)}}
  eval_pasta.pareto_figure(out, False, str(tmp_path))
  assert seen["series"] == {"lam1": ["pasta", "pasta[lam1/r3]", "pasta[lam1/r6]"],
                            "lam4": ["pasta", "pasta[lam4/r3]"]}
  by = {p["label"]: p for p in seen["pts"]}
  assert by["sot"]["kind"] == "baseline" and by["AR"]["kind"] == "reference"
  assert by["pasta[lam1/r3]"]["y"]["mean"] == pytest.approx(-0.2)   # quality = AR NLL - NLL
  assert by["pasta[lam1/r3]"]["y"]["lo"] == pytest.approx(-0.3)
