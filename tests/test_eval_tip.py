"""The TIP evaluation end to end on a toy-width model with the real SmolLM2 tokenizer (+ tags):
every system on GSM8K and the synthetic chain task in one run, matched budgets, JSON + PNG."""

import json
import math

import numpy as np
import pytest

from selforch_jax import config_lib
from selforch_jax.eval.tip import defaults, model_paths, run, summary, validate
from tests.repo_files import load_config


def _config():
  c = defaults()
  c.model.preset = "tiny_smollm2"
  c.model.weights = "random"
  c.model.tokenizer = "smollm2_gguf"
  c.eval.datasets = "gsm8k,synthetic_chain"
  c.eval.n = 3
  c.eval.offset = 1
  c.eval.max_new_tokens = 16
  c.eval.batch_size = 2
  c.eval.page_size = 8
  c.eval.n_boot = 200
  return c


def test_eval_tip_all_systems_matched_budgets(tmp_path):
  out = run(_config(), str(tmp_path))
  assert set(out["datasets"]) == {"gsm8k", "synthetic_chain"}
  for d, r in out["datasets"].items():
    assert r["n"] == 3 and r["subset"] == [1, 4]
    assert set(r["systems"]) == {"tip", "dense", "streaming_llm", "h2o", "paged_h2o"}
    recs = {s: [json.loads(l) for l in open(tmp_path / f"tip_{d}_{s}.jsonl")]
            for s in r["systems"]}
    for s, m in r["systems"].items():
      assert m["accuracy"]["n"] == 3
      assert m["accuracy"]["mean"] == np.mean([x["correct"] for x in recs[s]])
      assert m["live_kv_mean_tokens"] == pytest.approx(
          np.mean([x["mean_live_tokens"] for x in recs[s]]))
      assert m["decode_s"] > 0 and m["new_tokens"] == sum(x["new_tokens"] for x in recs[s])
    # the untrained model writes no register tags: TIP decodes exactly like dense (same model)
    assert [x["output"] for x in recs["tip"]] == [x["output"] for x in recs["dense"]]
    assert all(x["raw"] == x["output"] for x in recs["tip"])  # no register tag was written
    assert r["tip_minus"]["dense"]["mean"] == 0.0
    assert r["live_kv_reduction_vs_dense"]["mean"] == pytest.approx(0.0)
    assert r["live_kv_reduction_vs_dense"]["response_mean"] == pytest.approx(0.0)
    assert all(x["prompt_tokens"] > 0 for x in recs["tip"])
    for s in ("streaming_llm", "h2o", "paged_h2o"):
      for t, x in zip(recs["tip"], recs[s]):
        # matched budget = ceil(TIP's mean live KV on the same problem)
        assert x["budget"] == math.ceil(t["mean_live_tokens"])
        prompt_len = t["peak_live_tokens"] - t["new_tokens"] + (t["finish_reason"] == "length")
        assert x["peak_live_tokens"] <= max(x["budget"], prompt_len)
      # the budget bit: every baseline holds less live KV on average than dense
      assert r["systems"][s]["live_kv_mean_tokens"] < r["systems"]["dense"]["live_kv_mean_tokens"]
    # the reference solutions with register tags, teacher-forced through TIP
    tf = r["teacher_forced"]
    assert tf["n"] == 3 and tf["tip_live_kv_peak_tokens"] <= tf["dense_live_kv_peak_tokens"]
    if d == "synthetic_chain":     # its annotations kill steps: live KV strictly below dense
      assert tf["tip_live_kv_mean_tokens"] < tf["dense_live_kv_mean_tokens"]
      assert 0 < tf["killed_share"] < 1 and tf["response_reduction_mean"] > tf["reduction_mean"]
    # a problem's reference is its final answer (synthetic chain: the computed value)
    if d == "synthetic_chain":
      assert all(x["reference"].lstrip("-").isdigit() for x in recs["tip"])
  png = (tmp_path / "tip_accuracy_vs_live_kv.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
  saved = json.load(open(tmp_path / "tip_eval.json"))
  assert saved["datasets"]["gsm8k"]["systems"]["h2o"]["accuracy_str"].endswith("(n=3)")
  assert "TIP live KV vs dense" in summary(out)


@pytest.mark.parametrize("key,value,match", [
    ("datasets", "gsm8k,nope", "eval.datasets"),
    ("systems", "tip,lru", "eval.systems"),
    ("budget", "lots", "eval.budget"),
    ("offset", -1, "eval.offset"),
])
def test_eval_tip_config_errors_name_the_key(key, value, match):
  c = _config()
  c.eval[key] = value
  with pytest.raises(config_lib.ConfigError, match=match):
    validate(c)


def test_an_offset_past_a_test_file_fails_before_any_model_loads(tmp_path, monkeypatch):
  import selforch_jax.eval.tip as tip
  monkeypatch.setattr(tip, "_load_models", lambda *a: pytest.fail("models loaded"))
  c = _config()
  c.eval.datasets, c.eval.offset = "gsm8k,aime", 40     # AIME 2024 has 30 problems
  with pytest.raises(config_lib.ConfigError, match="aime's test file has only 30 problems"):
    run(c, str(tmp_path))


def test_per_dataset_models_override_tip_and_dense():
  c = _config()
  c.tip, c.dense = "out/t", "out/d"
  c.tip_for.synthetic_chain = "out/t_chain"
  assert model_paths(c, "gsm8k") == {"tip": "out/t", "dense": "out/d"}
  assert model_paths(c, "synthetic_chain") == {"tip": "out/t_chain", "dense": "out/d"}
  c.dense_for.synthetic_chain = "out/d_chain"
  assert model_paths(c, "synthetic_chain") == {"tip": "out/t_chain", "dense": "out/d_chain"}
  c.dense = ""  # no dense model: the TIP model of that dataset is the dense one
  assert model_paths(c, "gsm8k") == {"tip": "out/t", "dense": "out/t"}


def test_per_dataset_model_that_is_no_model_dir_is_named(tmp_path):
  c = _config()
  c.dense_for.gsm8k = str(tmp_path)
  with pytest.raises(config_lib.ConfigError, match="dense_for.gsm8k"):
    validate(c)
  c.tip_for.synthetic_walk = str(tmp_path / "missing")   # every bad path is named at once
  with pytest.raises(config_lib.ConfigError,
                     match=r"tip_for.synthetic_walk='.*missing', dense_for.gsm8k="):
    validate(c)


def test_models_are_loaded_once_and_checked_before_any_dataset_runs(tmp_path, monkeypatch):
  from selforch_jax.eval import run as eval_run
  from selforch_jax.eval import tip as eval_tip
  c = _config()
  plain_cfg = _config().model
  plain_cfg.tags = False
  plain = config_lib.load_model(plain_cfg)[1:]   # a model without register tags
  loads, ran = [], []
  monkeypatch.setattr(eval_run, "is_model_dir", lambda p: True)
  monkeypatch.setattr(eval_run, "load_finetuned", lambda p: loads.append(p) or plain)
  monkeypatch.setattr(eval_tip, "evaluate_dataset",
                      lambda d, models, ec, wd: ran.append((d, models)) or {})
  monkeypatch.setattr(eval_tip, "plot", lambda out, path: None)
  # the dense model of both datasets, spelled two ways: loaded once, tags not needed
  c.dense_for.gsm8k, c.dense_for.synthetic_chain = "out/d", "out/d/"
  eval_tip.run(c, str(tmp_path / "a"))
  assert loads == ["out/d"] and [d for d, _ in ran] == ["gsm8k", "synthetic_chain"]
  assert all(m["dense"][0] is plain[0] and m["tip"][2] is not None for _, m in ran)
  # a TIP model without register tags for the second dataset fails before the first runs
  ran.clear()
  c.tip_for.synthetic_chain = "out/t"
  with pytest.raises(config_lib.ConfigError, match=r"TIP model \(out/t\) has no register tags"):
    eval_tip.run(c, str(tmp_path / "b"))
  assert ran == []


def test_eval_tip_config_file_takes_a_shard_offset():
  c = load_config("configs/eval_tip.py",
                  "n=150,offset=150,max_new_tokens=320,datasets=synthetic_walk+gsm8k")
  assert (c.eval.n, c.eval.offset, c.eval.max_new_tokens) == (150, 150, 320)
  assert c.eval.datasets == "synthetic_walk,gsm8k" and c.kind == "tip"
  validate(c)
  assert load_config("configs/eval_tip.py").eval.offset == 0
