"""Decode traces (issue 18): :class:`selforch_jax.runtime.trace.TraceRecorder` as the ``observer``
of the one decode loop, and :mod:`selforch_jax.trace_render` (HTML / PNG / JSON), for every
runtime on a tiny random model with the orchestration tags (tests/trace_fixtures.py).

What would be wrong if the recorder were wrong: one row per engine step (``engine.num_steps``),
the tokens of each row are the ones the scheduler committed, PASTA's forced plan forks three
threads and joins once, TIP's register reuse kills exactly the dead step, StreamingLLM / H2O
evictions agree with the pool's live-token counts, draft bookkeeping (relabel, free, rollback,
scratch, reported rejections) ends in the right fates.
"""

import json

import numpy as np
import pytest

from selforch_jax import api, trace_render
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, run
from selforch_jax.runtime.schedulers import ar, kv_policies, pasta, tip
from selforch_jax.runtime.trace import TraceRecorder, step_kind
from tests.trace_fixtures import BASE, RUNTIMES, TV, forced_plan_prompt, tiny  # noqa: F401

PROMPT_TEXT = "Name three colors."


def _rec(tok, sched, title="t"):
  return TraceRecorder(token_text=lambda t: tok.decode([t]), title=title).attach(sched)


def _html_rows(path):
  return open(path, encoding="utf-8").read().count("<div class='step")


def _check_png(rec, path):
  import matplotlib.image as mpimg
  img = mpimg.imread(path)
  assert img.shape[:2] == trace_render.png_size(rec)   # height grows with the step rows
  assert float(img[..., :3].std()) > 0.01              # something was drawn


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_decode_ids_trace_has_one_row_per_engine_step(tiny, runtime, tmp_path, monkeypatch):
  model, tok = tiny
  from selforch_jax.runtime import build
  engines = []
  make = build.make_engine
  monkeypatch.setattr(build, "make_engine", lambda *a, **k: engines.append(make(*a, **k))
                      or engines[-1])
  prompt = (tok.encode("Steps:\n1.") if runtime == "apar" else
            forced_plan_prompt(tok) if runtime == "pasta" else
            tok.encode_chat([{"role": "user", "content": PROMPT_TEXT}]))
  opts = {"budget": 12} if runtime in ("streaming_llm", "h2o") else {}
  rec = TraceRecorder(token_text=lambda t: tok.decode([t]), title=runtime)
  a, = api.decode_ids(model, tok, [prompt], runtime=runtime, max_new_tokens=8, tag_vocab=TV,
                      options=opts, questions=[PROMPT_TEXT], trace=rec)
  (engine,) = engines
  assert rec.num_steps == engine.num_steps > 1
  # the answer's forwards are the steps that ran one of its tokens (one prompt: every step but
  # the KV policies' partial prefill chunks)
  assert a.forwards == sum(st.kind != "prefill_part" for st in rec.steps)
  assert rec.steps[0].kind == "prefill" and rec.steps[0].tokens[0].group == "prompt"
  groups = set(rec.groups) - {"prompt"}
  want = {"ar": {"answer"}, "streaming_llm": {"answer"}, "h2o": {"answer"}, "tip": {"answer"},
          "apar": {"main", "item 1"}, "pasta": {"thread 0", "thread 1", "thread 2"},
          "sot": {"skeleton", "point 1"} if a.figures.get("parsed") else {"skeleton"}}[runtime]
  assert want <= groups, (runtime, groups)
  c = rec.counts()
  if runtime == "pasta":
    assert c["forks"] == a.figures["threads"] == 3
  if runtime == "apar":
    assert c["forks"] == a.figures["forks"] >= 1
  if runtime in ("streaming_llm", "h2o"):
    assert c["evicted"] > 0 and any(st.evicted for st in rec.steps)
  else:
    assert c["evicted"] == 0
  html, png = tmp_path / "t.html", tmp_path / "t.png"
  trace_render.render(rec, str(html))
  trace_render.render(rec, str(png))
  assert _html_rows(html) == engine.num_steps
  text = html.read_text(encoding="utf-8")
  for g in rec.groups:
    assert f">{g}</span>" in text          # the legend names every colour group
  if c["evicted"]:
    assert "✂ evict" in text and "class='tok evicted'" in text
  if c["forks"]:
    assert f"⑂ fork ×{c['forks']}" in text or "⑂ fork" in text
  assert "http" not in text and "<script" not in text and "<link" not in text  # self-contained
  _check_png(rec, str(png))


def test_ar_rows_hold_the_committed_tokens(tiny):
  model, tok = tiny
  prompts = [[5, 6, 7, 8, 9], [10, 11]]
  engine = Engine(model, num_pages=8, page_size=8)
  sched = ar.ARScheduler(prompts, 6, owner_base=0, segment_base=0)
  rec = _rec(tok, sched)
  steps = run(engine, sched, observer=rec)
  assert rec.num_steps == steps == engine.num_steps == 2 + 6 - 1
  assert [t.id for t in rec.steps[0].tokens] == prompts[0]
  assert [t.id for t in rec.steps[1].tokens] == prompts[1]
  for row, res in enumerate(sched.results):
    ran = [t.id for st in rec.steps[2:] for t in st.tokens if t.owner == row]
    assert ran == res.token_ids[:-1]           # the last token is sampled, never run
    pos = [t.position for st in rec.steps[2:] for t in st.tokens if t.owner == row]
    assert pos == list(range(len(prompts[row]), len(prompts[row]) + 5))
  assert rec.groups == ["prompt", "answer"] and rec.counts()["forks"] == 0
  assert all(t.text == tok.decode([t.id]) for st in rec.steps for t in st.tokens)


def test_pasta_forced_plan_forks_three_threads_and_joins(tiny, tmp_path):
  model, tok = tiny
  engine = Engine(model, num_pages=64, page_size=4)
  prompt = forced_plan_prompt(tok)
  sched = pasta.PASTAScheduler([prompt], TV, 60, length_unit=2, cap=4, stop_ids=[2])
  rec = _rec(tok, sched, "pasta")
  run(engine, sched, observer=rec)
  st = sched.stats[0]
  assert st.threads == 3 and st.rounds >= 1
  c = rec.counts()
  assert c["forks"] == st.threads and c["joins"] == st.rounds
  fork_step = next(s for s in rec.steps if s.forks)
  asyncs = [t for t in fork_step.tokens if t.id == TV.async_open]
  assert [t.group for t in asyncs] == ["thread 0", "thread 1", "thread 2"]
  assert len({t.owner for t in asyncs}) == 3 and len({t.segment for t in asyncs}) == 3
  join_step = next(s for s in rec.steps if s.joins)
  assert join_step.tokens[-1].id == TV.sync and join_step.tokens[-1].group == "main"
  assert join_step.index > fork_step.index
  # each thread runs on its own owner, one token per step, from the fork up to the join
  for k in range(3):
    mine = [(s.index, t) for s in rec.steps for t in s.tokens if t.group == f"thread {k}"]
    assert len({t.owner for _, t in mine}) == 1
    assert [i for i, _ in mine] == list(range(fork_step.index, fork_step.index + len(mine)))
    assert mine[-1][0] <= join_step.index
  html = tmp_path / "p.html"
  trace_render.render(rec, str(html))
  text = html.read_text(encoding="utf-8")
  assert "⑂ fork ×3" in text and f"⋈ join ×1" in text
  assert text.count("<div class='step") == engine.num_steps == st.forwards


def test_tip_register_reuse_kills_the_dead_step(tiny, tmp_path):
  model, tok = tiny
  r0, r1 = TV.registers[0], TV.registers[1]
  forced = [r0, 65, 66, r1, 67, r0, 68, 69]   # reusing <reg_0> kills its first step
  engine = Engine(model, num_pages=32, page_size=4)
  sched = tip.TIPScheduler(engine, [[10, 11, 12]], TV, forced=[forced], stop_ids=[2])
  rec = _rec(tok, sched, "tip")
  run(engine, sched, observer=rec)
  assert rec.num_steps == engine.num_steps
  toks = [t for s in rec.steps for t in s.tokens if t.group != "prompt"]
  assert [t.id for t in toks] == forced[:-1]
  assert [t.group for t in toks] == ["reg 0", "reg 0", "reg 0", "reg 1", "reg 1", "reg 0", "reg 0"]
  assert len({toks[0].owner, toks[3].owner, toks[5].owner}) == 3   # one owner per register step
  kill_step = [s for s in rec.steps if any(t.id == r0 for t in s.tokens)][1]
  dead = [t for t in toks if t.fate != "kept"]
  assert dead and all(t.fate in ("evicted", "released") for t in dead)
  assert all(t.fate_step == kill_step.index for t in dead)
  assert {t.id for t in dead} <= {r0, 65, 66}     # only the first <reg_0> step dies
  assert all(t.fate == "kept" for t in toks if t.id in (r1, 67, 68))
  assert kill_step.evicted or kill_step.freed
  html = tmp_path / "t.html"
  trace_render.render(rec, str(html))
  assert html.read_text(encoding="utf-8").count("class='tok evicted'") + \
      html.read_text(encoding="utf-8").count("class='tok released'") == len(dead)


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o"])
def test_kv_policy_evictions_match_the_pools_live_tokens(tiny, policy):
  model, tok = tiny
  engine = Engine(model, num_pages=16, page_size=4)
  pol = kv_policies.make_policy(policy, 6)
  sched = kv_policies.PolicyScheduler(engine, [list(range(20, 30))], [pol], max_new_tokens=8)
  rec = _rec(tok, sched, policy)
  run(engine, sched, observer=rec)
  assert rec.num_steps == engine.num_steps
  live, trace = 0, []
  for st in rec.steps:
    live += len(st.tokens) - len(st.evicted) - sum(st.freed.values())
    if st.kind != "prefill_part":
      trace.append(live)
  assert trace == sched.live_trace[0]      # the recorder's evictions are the pool's
  assert rec.counts()["evicted"] > 0
  evicted = [t for s in rec.steps for t in s.tokens if t.fate == "evicted"]
  assert len(evicted) == sum(len(s.evicted) for s in rec.steps)
  assert all(t.fate_step > t.step for t in evicted)


class _Scripted(Scheduler):
  """Runs a fixed list of plans (a drafter's shape: tree step, relabel + free, scratch step,
  rollback) and reports one rejected query through ``trace_report``."""

  def __init__(self, plans, report=None):
    self.plans, self.i, self.report, self.slots = list(plans), 0, report or {}, []

  def next_step(self):
    if self.i >= len(self.plans):
      return None
    p = self.plans[self.i]
    return p(self) if callable(p) else p

  def on_step(self, plan, result):
    self.slots.append(np.asarray(result.slots).tolist())
    self.i += 1

  def trace_report(self, plan, result):
    return self.report.get(self.i - 1)


def test_draft_bookkeeping_relabel_free_scratch_rollback_and_reports(tiny, tmp_path):
  model, tok = tiny
  vis = np.eye(3, dtype=bool)
  vis[1, 0] = vis[2, 0] = vis[2, 1] = True   # tree: seg 1 sees 0, seg 2 sees 0 and 1
  bid = np.zeros(3, bool)
  plans = [
      StepPlan(tokens=[1, 2, 3], positions=[0, 1, 2], segments=[0, 0, 0], owners=0, visible=vis,
               bidir=bid, tag=("prefill",)),
      # a guess tree on scratch owner 9: nodes 4, 5 (chain) and 6
      StepPlan(tokens=[4, 5, 6], positions=[3, 4, 3], segments=[1, 2, 1], owners=[9, 9, 9],
               visible=vis, bidir=bid),
      # accept node 4: relabel its slot into owner 0, free the tree owner (5 and 6 rejected)
      lambda s: StepPlan(tokens=[7], positions=[4], segments=[0], owners=[0], visible=vis,
                         bidir=bid, relabel=[([s.slots[1][0]], 0, 0)], free_owners=(9,)),
      StepPlan(tokens=[8, 9], positions=[5, 6], segments=[0, 0], owners=[0, 0], visible=vis,
               bidir=bid, scratch=True),
      StepPlan(tokens=[10, 11], positions=[5, 6], segments=[0, 0], owners=[0, 0], visible=vis,
               bidir=bid),
      StepPlan(tokens=[12], positions=[6], segments=[0], owners=[0], visible=vis, bidir=bid,
               rollback={0: 1}),
  ]
  engine = Engine(model, num_pages=8, page_size=4)
  sched = _Scripted(plans, report={5: {"rejected": [0], "notes": ["verify: 0 of 1"]}})
  rec = _rec(tok, sched)
  run(engine, sched, observer=rec)
  s = rec.steps
  assert [st.kind for st in s] == ["prefill", "step", "step", "step", "step", "step"]
  n4, n5, n6 = s[1].tokens
  assert n4.accepted and n4.fate == "kept"
  assert (n5.fate, n5.fate_step, n6.fate, n6.fate_step) == ("rejected", 2, "rejected", 2)
  assert s[2].rejected_earlier == 2 and s[2].relabel == [(1, 0, 0)] and s[2].freed == {9: 2}
  assert s[1].forks == [1] and s[1].joins == []  # the tree branches off seg 0; seg 2 extends 1
  assert s[3].scratch and all(t.fate == "scratch" for t in s[3].tokens)
  assert s[4].tokens[1].fate == "rolled_back" and s[4].tokens[0].fate == "kept"
  assert s[5].rollback == {0: 1}
  assert s[5].rejected == [0] and s[5].tokens[0].fate == "rejected"
  assert s[5].notes == ["verify: 0 of 1"]
  c = rec.counts()
  assert (c["rejected"], c["rolled_back"], c["scratch"], c["scratch_steps"]) == (3, 1, 2, 1)
  html = tmp_path / "d.html"
  trace_render.render(rec, str(html))
  text = html.read_text(encoding="utf-8")
  assert "✗ rejected 2" in text and "✗ rejected 1" in text and "✓ accept 1" in text
  assert "↶ rollback 1" in text and "verify: 0 of 1" in text
  assert text.count("class='step scratch'") == 1
  js = tmp_path / "d.json"
  trace_render.render(rec, str(js))
  d = json.loads(js.read_text())
  assert d["counts"] == c and len(d["steps"]) == 6 and d["steps"][2]["freed"] == {"9": 2}
  info = trace_render.to_png(rec, str(tmp_path / "d.png"))
  assert info["rows"] == 6 and info["boxes"] == 12 and info["markers"]["rejected"] == 2


def test_join_needs_two_sibling_segments_and_step_kind():
  assert step_kind((("prefill", [0]), ())) == "prefill"
  assert step_kind(("decode", None, [], {})) == "decode"
  assert step_kind([object()]) == ""
  with pytest.raises(ValueError, match="must end in"):
    trace_render.render(TraceRecorder(), "/tmp/x.svg")
  with pytest.raises(TypeError):
    trace_render.to_html(object())


def test_decode_ids_trace_path_and_bad_extension(tiny, tmp_path):
  model, tok = tiny
  p = tok.encode_chat([{"role": "user", "content": PROMPT_TEXT}])
  out = tmp_path / "sub" / "trace.html"
  a, b = api.decode_ids(model, tok, [p, p[:-3]], runtime="ar", max_new_tokens=5, batch_size=1,
                        trace=str(out))
  rows = _html_rows(out)
  assert rows == a.forwards + b.forwards == 10   # two jobs (batch_size=1), five steps each
  assert "data-job='2'" in out.read_text(encoding="utf-8")
  with pytest.raises(api.ApiError, match="trace="):
    api.decode_ids(model, tok, [p], max_new_tokens=2, trace=str(tmp_path / "t.txt"))


def test_decode_run_config_trace(tmp_path):
  from selforch_jax import config_lib
  from selforch_jax.decoding.run import defaults, help_text, run as decode_run, validate
  c = defaults()
  assert c.trace == "" and "--config.trace=''  draw every engine step" in help_text(c)
  c.model.preset, c.model.weights, c.model.tokenizer = "tiny_smollm2", "random", "smollm2_gguf"
  c.max_new_tokens = 3
  c.trace = str(tmp_path / "t.png")
  s = decode_run(c, str(tmp_path / "wd"), prompt="Name three colors.")
  assert s["trace"] == c.trace
  import matplotlib.image as mpimg
  h, w = mpimg.imread(c.trace).shape[:2]
  assert h == int(round((trace_render.HEADER_IN + trace_render.ROW_IN * 3) * trace_render.DPI))
  c.trace = "out/trace.svg"
  with pytest.raises(config_lib.ConfigError, match="trace='out/trace.svg' must end in"):
    validate(c)
