"""Planned Diffusion scheduler (issue 21) on a tiny random model and on scripted logits.

* Train = decode oracle: at every engine step (prefill, AR, every denoising step, the sync
  step), the logits the step computes for each query equal the training forward's (whole
  sequence, :func:`~selforch_jax.lang.planned_diffusion.planned_diffusion_layout` mask) on the
  sequence state of that step, float32 1e-5.
* Batch 2 decodes exactly as each request alone (tokens and per-request figures).
* Guards on scripted logits: a runaway planner, a promise without a length, too many promises,
  too many rounds, EOS right after a plan, a tiny budget: nothing crashes, no text is lost.
* Unmask options on scripted logits: ``pad_last`` commits content before filler; ``spread``
  never commits two neighbours in one step (the last step takes all, the chunk completes).
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from selforch_jax.lang import Promise, Round, TagVocab, assemble, batch_layouts, serialize
from selforch_jax.lang.planned_diffusion import dense_round_mask, planned_diffusion_layout
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime import schedulers
from selforch_jax.runtime.diffusion_unmask import confidence
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import execute, run
from selforch_jax.runtime.schedulers import planned_diffusion as pd
from selforch_jax.runtime.step import StepResult

BASE = 256
V = BASE + 11
EOS = 2
TV = TagVocab.appended(BASE, 4, eos_ids=[EOS], digit_ids=range(48, 58), space_ids=[32])
UNIT = 2   # tokens per promise unit: short chunks for the tiny model
PAD_TO = 160


@pytest.fixture(scope="module")
def tiny():
  model = init_model(get_preset("tiny_llama", vocab_size=V), seed=5)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  return model, state, fwd


def _plan_prompt(prefix, lengths):
  plan = [75] + [Promise((80 + k,), n) for k, n in enumerate(lengths)]
  return serialize(list(prefix) + [Round(plan=tuple(plan), sync=False)], TV) + [TV.async_open]


PROMPTS = [_plan_prompt([70, 71, 72], (1, 3, 2)), _plan_prompt([90, 91, 92, 93, 94], (2, 1))]


def _full(fwd, state, seq, full_attention=False):
  lay = planned_diffusion_layout(np.asarray(seq), TV, eos_ids=(), length_unit=UNIT)
  b = batch_layouts([lay], PAD_TO)
  mask = b["mask"]
  if full_attention:     # the trainer's dense rounds
    mask = dense_round_mask(b["tokens"], mask, TV) & b["valid"][:, None, :]
  return np.asarray(fwd(state, b["tokens"], b["positions"], mask))[0, :lay.num_tokens]


@pytest.mark.parametrize("full_attention,seed_topic", [(False, False), (True, False),
                                                        (False, True)])
def test_train_equals_decode_every_step(tiny, full_attention, seed_topic):
  model, state, fwd = tiny
  engine = Engine(model, num_pages=128, page_size=4)
  s = pd.PlannedDiffusionScheduler(PROMPTS, TV, 40, stop_ids=[EOS], length_unit=UNIT,
                                   vocab_size=V, full_attention=full_attention,
                                   seed_topic=seed_topic)
  kinds = collections.Counter()
  while (plan := s.next_step()) is not None:
    seqs = [s.sequence(i) for i in range(len(PROMPTS))]   # the state this step runs on
    result = execute(engine, plan)
    got = np.asarray(result.logits)
    kind, _, queries = plan.tag        # queries: (request, sequence index) per query row
    kinds[kind] += 1
    checked = 0
    for i in range(len(PROMPTS)):
      rows = [t for t, (ri, _) in enumerate(queries) if ri == i]
      if not rows:
        continue
      full = _full(fwd, state, seqs[i], full_attention)
      idx = [queries[t][1] for t in rows]
      np.testing.assert_allclose(got[rows], full[idx], atol=1e-5, rtol=1e-5)
      checked += len(rows)
    assert checked == len(plan.tokens)
    s.on_step(plan, result)
  # chunks of 2, 6, 4 and 4, 2 slots; a seeded topic (one id each) leaves one slot fewer
  want = [3 * UNIT - 1, 2 * UNIT - 1] if seed_topic else [3 * UNIT, 2 * UNIT]
  assert kinds["denoise"] == max(want) and kinds["ar"] >= 4
  assert [st["chunks"] for st in s.stats] == [3, 2] and all(st["rounds"] == 1 for st in s.stats)
  assert [st["denoise_steps"] for st in s.stats] == want
  if seed_topic:     # every chunk starts with its promise's topic id (80 + k)
    for r in s.reqs:
      assert [int(r.seq[c.start + 1]) for c in r.chunks] == [80 + k for k in range(len(r.chunks))]
  # the chunks' final state is in the sequence: no mask is left
  assert all(TV.mask not in s.sequence(i) for i in range(2))


@pytest.mark.parametrize("full_attention", [False, True])
def test_denoise_steps_skip_complete_chunks(tiny, full_attention):
  """A denoising step queries only the chunks that still hold a mask (chunks of 2, 6 and 4
  slots: the short ones complete first), every chunk under full attention (siblings see it)."""
  model, _, _ = tiny
  engine = Engine(model, num_pages=128, page_size=4)
  s = pd.PlannedDiffusionScheduler(PROMPTS, TV, 40, stop_ids=[EOS], length_unit=UNIT,
                                   vocab_size=V, full_attention=full_attention)
  skipped = 0
  while (plan := s.next_step()) is not None:
    if plan.tag[0] == "denoise":
      chunks = [c for ri in {ri for ri, _ in plan.tag[2]} for c in s.reqs[ri].chunks]
      live = [c for c in chunks if c.masked.any()]
      want = chunks if full_attention else live
      assert len(plan.tokens) == sum(c.length + 2 for c in want)
      skipped += len(chunks) - len(live)
    s.on_step(plan, execute(engine, plan))
  assert skipped > 0          # some chunk completed before the round's last step
  assert [st["denoise_steps"] for st in s.stats] == [3 * UNIT, 2 * UNIT]


def test_batch_equals_single(tiny):
  model, _, _ = tiny
  kw = dict(stop_ids=[EOS], length_unit=UNIT, vocab_size=V)
  prompts = PROMPTS + [[70, 71, 72, 73]]

  def go(ps):
    engine = Engine(model, num_pages=192, page_size=4)
    s = pd.PlannedDiffusionScheduler(ps, TV, 36, **kw)
    run(engine, s)
    return s

  both = go(prompts)
  for i, p in enumerate(prompts):
    one = go([p])
    assert both.results[i].token_ids == one.results[0].token_ids
    for k in ("forwards", "critical_path", "ar_steps", "denoise_steps", "rounds", "chunks"):
      assert both.stats[i][k] == one.stats[0][k], k
  assert both.stats[0]["critical_path"] < both.stats[0]["tokens"]


def test_registered_and_chunk_predictions(tiny):
  model, _, _ = tiny
  engine = Engine(model, num_pages=64, page_size=4)
  s = schedulers.make_scheduler("planned_diffusion", engine, [PROMPTS[1]], tag_vocab=TV,
                                max_new_tokens=24, stop_ids=[EOS], length_unit=UNIT)
  run(engine, s)
  assert s.stats[0]["chunks"] == 2 and len(s.results[0].token_ids) <= 24
  logits = np.random.default_rng(0).normal(size=(5, V)).astype(np.float32) * 3
  allowed = np.ones(V, bool)
  allowed[[3, 7, BASE]] = False
  for kind in ("entropy", "margin", "prob"):
    tok, conf, top = pd.chunk_predictions(jnp.asarray(logits), [4, 1, 2], allowed, kind)
    ref = np.where(allowed, logits, -1e30)[[4, 1, 2]]
    np.testing.assert_allclose(conf, confidence(ref, kind), atol=1e-5)
    np.testing.assert_array_equal(tok, ref.argmax(-1))
    assert np.all(allowed[tok])
  with pytest.raises(ValueError, match="confidence"):
    pd.chunk_predictions(jnp.asarray(logits), [0], allowed, "nope")


# ---- guards on scripted logits ------------------------------------------------------------------

def _drive(script, prompts, max_new=80, **kw):
  """Run the scheduler without a model: every AR query row's logits put the top mass on
  ``script(response so far)`` (and a little on text token 100), every chunk row on token 101."""
  s = pd.PlannedDiffusionScheduler(prompts, TV, max_new, stop_ids=[EOS], length_unit=UNIT,
                                   vocab_size=V, **kw)
  steps = 0
  while (plan := s.next_step()) is not None:
    steps += 1
    assert steps < 2000
    T = len(plan.tokens)
    lg = np.zeros((T, V), np.float32)
    lg[:, 100] = 5.0
    owners = np.asarray(plan.owners)
    for r in s.reqs:
      rows = owners == r.owner
      if rows.any():
        lg[rows, script(r.seq[r.resp_start:])] = 10.0
      lg[owners == r.scratch_owner, 101] = 10.0
    s.on_step(plan, StepResult(logits=jnp.asarray(lg), slots=np.arange(T), released_pages=[]))
  return s


def _no_text_lost(s, i):
  resp = s.results[i].token_ids
  text = assemble(s.sequence(i)[s.reqs[i].text_start:], s.tv, keep_topics=True,
                  length_unit=UNIT)
  keep = lambda ids: sorted(t for t in ids if not TV.is_tag(t))  # noqa: E731
  assert keep(text) == keep(resp)


def test_runaway_planner_is_closed():
  # <promise> then topic tokens forever: the plan cap closes it with the default length
  def script(resp):
    if TV.promise_open not in resp:
      return TV.promise_open
    return EOS if TV.sync in resp else 80
  s = _drive(script, [[70, 71]], plan_cap=12, default_length=3)
  st = s.stats[0]
  assert any("plan_cap" in n for n in st["notes"]) and st["chunks"] == 1
  assert s.results[0].finish_reason == "stop" and st["rounds"] == 1
  resp = s.results[0].token_ids
  chunk = resp[resp.index(TV.async_open) + 1:resp.index(TV.async_close)]
  assert chunk == [101] * (3 * UNIT)
  assert s.text_ids(0) == [101] * (3 * UNIT)
  _no_text_lost(s, 0)


def test_promise_without_length_gets_default():
  def script(resp):
    if TV.promise_open not in resp:
      return TV.promise_open
    if TV.promise_close not in resp:
      return 80 if resp.count(80) < 2 else TV.promise_close
    return TV.async_open if TV.async_open not in resp else EOS
  s = _drive(script, [[70, 71]], default_length=2)
  st = s.stats[0]
  assert any("default_length" in n for n in st["notes"]) and st["chunks"] == 1
  resp = s.results[0].token_ids
  assert resp[:6] == [TV.promise_open, 80, 80, 32, 50, TV.promise_close]   # " 2" written
  assert resp.count(TV.mask) == 0 and resp.count(101) == 2 * UNIT
  assert s.results[0].finish_reason == "stop"
  _no_text_lost(s, 0)


def test_too_many_promises_and_rounds():
  # promises with length 1 forever, <async> never: max_promises ends each plan; after
  # max_rounds the promise / async tags are banned and decoding is plain text (token 100)
  def script(resp):
    if resp[-1:] == [TV.promise_open]:
      return 81
    if resp[-1:] == [81]:
      return 49
    if resp[-1:] == [49]:
      return TV.promise_close
    return TV.promise_open
  s = _drive(script, [[70], [72, 73]], max_new=90, max_promises=3, max_rounds=2)
  for i in range(2):
    st = s.stats[i]
    assert st["rounds"] == 2 and st["chunks"] == 6
    assert any("max_promises" in n for n in st["notes"])
    resp = s.results[i].token_ids
    last_sync = len(resp) - 1 - resp[::-1].index(TV.sync)
    assert set(resp[last_sync + 1:]) == {100} and s.results[i].finish_reason == "length"
    assert len(resp) <= 90
    _no_text_lost(s, i)


def test_eos_after_plan_and_tiny_budget():
  def script(resp):
    if not resp:
      return TV.promise_open
    return {TV.promise_open: 82, 82: 49, 49: TV.promise_close}.get(resp[-1], EOS)
  s = _drive(script, [[70]])
  st = s.stats[0]
  assert st["chunks"] == 1 and st["rounds"] == 1 and s.results[0].finish_reason == "stop"
  assert s.results[0].token_ids[-1] == TV.async_close   # no <sync/>: EOS ended the round
  assert st["critical_path"] == 4 + UNIT   # 4 plan tokens, then UNIT denoising steps
  for budget in (3, 5, 7):
    t = _drive(script, [[70]], max_new=budget)
    assert t.results[0].finish_reason in ("length", "stop")
    assert len(t.results[0].token_ids) <= budget + 1
    _no_text_lost(t, 0)


def test_bad_options():
  with pytest.raises(ValueError, match="steps_ratio"):
    pd.PlannedDiffusionScheduler([[1]], TV, 8, steps_ratio=0)
  with pytest.raises(ValueError, match="max_promises"):
    pd.PlannedDiffusionScheduler([[1]], TV, 8, max_promises=0)
  with pytest.raises(ValueError, match="digit_ids"):
    pd.PlannedDiffusionScheduler([[1]], TagVocab.appended(BASE, 0), 8)
  with pytest.raises(ValueError, match="threshold"):
    pd.PlannedDiffusionScheduler([[1]], TV, 8, threshold=1.5)


def test_api_rows(tiny):
  from selforch_jax import api
  from tests.trace_fixtures import ByteTagTokenizer, forced_plan_prompt
  model, tok = tiny[0], ByteTagTokenizer()
  p = forced_plan_prompt(tok)          # promises of lengths 1, 2, 1 (10 tokens per unit)
  a, b = api.decode_ids(model, tok, [p, tok.encode_chat([{"role": "user", "content": "hi"}])],
                        runtime="planned_diffusion", max_new_tokens=56, tag_vocab=TV,
                        options={"steps_ratio": 0.5, "confidence": "margin"})
  for x in (a, b):
    assert {"raw", "rounds", "critical_path", "denoise_steps", "chunks"} <= set(x.figures)
    assert x.wall_s > 0 and x.forwards >= 1 and isinstance(x.text, str)
    assert x.figures["critical_path"] == x.forwards - 1
  assert a.figures["chunks"] == 3 and a.figures["denoise_steps"] == 10   # 0.5 x 20 masks
  assert a.token_ids[0] == TV.async_open and a.token_ids.count(TV.mask) == 0
  assert a.forwards < len(a.token_ids)
  with pytest.raises(api.ApiError, match="orchestration tags"):
    api.decode_ids(model, tok, [p], runtime="planned_diffusion", max_new_tokens=8)


def test_decode_cli_options():
  from selforch_jax.decoding import run as decode_run
  c = decode_run.defaults()
  c.runtime = "planned_diffusion"
  c.planned_diffusion.threshold = 0.9
  o = decode_run.options(c)
  assert o["threshold"] == 0.9 and o["steps_ratio"] == 1.0 and o["confidence"] == "entropy"
  assert o["spread"] is False and "planned_diffusion.spread" in decode_run.help_text()
  # the committed adapter's best setting
  assert o["window"] == 1 and o["pad_tail"] is True and o["seed_topic"] is True
  assert "planned_diffusion.window" in decode_run.help_text()
  c.planned_diffusion.threshold = 0.0
  assert decode_run.options(c)["threshold"] is None
  assert "planned_diffusion.plan_cap" in decode_run.help_text()


def _drive_chunk(pad_last):
  """One teacher-forced chunk of 4 slots whose answer is [101, 102, 103, PAD], under a scripted
  denoiser that (as a small model does) predicts the filler at slot 2 with high confidence while
  slot 1 is still masked, and 103 there once slot 1 is known. Returns the chunk's final tokens."""
  s = pd.PlannedDiffusionScheduler([_plan_prompt([70, 71, 72], (2,))], TV, 40, stop_ids=[EOS],
                                   length_unit=UNIT, vocab_size=V, steps_ratio=1.0,
                                   pad_last=pad_last)
  while (plan := s.next_step()) is not None:
    T = len(plan.tokens)
    lg = np.zeros((T, V), np.float32)
    lg[:, EOS] = 10.0                         # AR rows (the sync step): end
    kind, info, _ = plan.tag
    if kind == "denoise":
      for _, c, first in info:
        want = [101, 102, 103 if not c.masked[1] else TV.pad, TV.pad]
        for j, tok in enumerate(want):
          lg[first + j] = 0.0
          lg[first + j, tok] = 12.0 if tok == TV.pad else 6.0
    s.on_step(plan, StepResult(logits=jnp.asarray(lg), slots=np.arange(T), released_pages=[]))
  resp = s.results[0].token_ids
  return resp[resp.index(TV.async_open) + 1:resp.index(TV.async_close)]


def test_pad_last_commits_content_before_filler():
  # confidence order alone commits the confident [PAD] at slot 2 first and cuts the content;
  # pad_last commits every content prediction first, and slot 2 is then re-predicted as 103
  assert _drive_chunk(pad_last=False) == [101, 102, TV.pad, TV.pad]
  assert _drive_chunk(pad_last=True) == [101, 102, 103, TV.pad]


def _drive_spread(spread, threshold=None):
  """One teacher-forced chunk of 8 slots, answer [101..108], under a scripted denoiser whose
  confidence falls from left to right; steps_ratio 0.5 (4 iterations committing 1, 2, 2, 3).
  Returns (the chunk's final tokens, the slots committed at each iteration)."""
  tokens, steps, _ = _drive_script(list(range(101, 109)), [8.0 - 0.5 * j for j in range(8)],
                                   steps_ratio=0.5, spread=spread, threshold=threshold)
  return tokens, steps


def test_spread_never_commits_neighbours_in_one_step():
  tokens, steps = _drive_spread(spread=False)
  assert tokens == list(range(101, 109)) and steps == [[0], [1, 2], [3, 4], [5, 6, 7]]
  tokens, steps = _drive_spread(spread=True)
  # step 1: slot 2 sits next to slot 1 (picked this step) -> slot 3; step 2: 2 and 4 (1 and 3
  # were committed before, they block nothing); the last step commits all left, neighbours too
  assert steps == [[0], [1, 3], [2, 4], [5, 6, 7]]
  assert tokens == list(range(101, 109))      # the chunk completes in the same 4 iterations
  for st in steps[:-1]:
    assert all(b - a > 1 for a, b in zip(st, st[1:]))
  # Fast-dLLM threshold (every slot's top probability is above 0.2): one step commits all;
  # with spread every other slot, then the rest
  assert _drive_spread(False, threshold=0.2) == (list(range(101, 109)), [list(range(8))])
  assert _drive_spread(True, threshold=0.2) == (list(range(101, 109)),
                                                [[0, 2, 4, 6], [1, 3, 5, 7]])


def _drive_script(want, conf, **kw):
  """One teacher-forced chunk of 8 slots under a scripted denoiser: slot j predicts ``want[j]``
  with logit ``conf[j]`` (the rest 0), whatever the chunk holds. Returns (the chunk's final
  tokens, the slots committed at each iteration, the scheduler)."""
  s = pd.PlannedDiffusionScheduler([_plan_prompt([70, 71, 72], (4,))], TV, 40, stop_ids=[EOS],
                                   length_unit=UNIT, vocab_size=V, **kw)
  steps = []
  while (plan := s.next_step()) is not None:
    T = len(plan.tokens)
    lg = np.zeros((T, V), np.float32)
    lg[:, EOS] = 10.0
    kind, info, _ = plan.tag
    before = None
    if kind == "denoise":
      (_, c, first), = info
      before = c.masked.copy()
      for j in range(c.length):
        lg[first + j, want[j]] = conf[j]
    s.on_step(plan, StepResult(logits=jnp.asarray(lg), slots=np.arange(T), released_pages=[]))
    if before is not None:
      steps.append(np.flatnonzero(before & ~c.masked).tolist())
  resp = s.results[0].token_ids
  assert s.stats[0]["denoise_steps"] == len(steps)
  return resp[resp.index(TV.async_open) + 1:resp.index(TV.async_close)], steps, s


def test_window_unmasks_left_to_right():
  want, rising = list(range(101, 109)), [4.0 + 0.5 * j for j in range(8)]
  # confidence rises to the right: plain order fills the chunk right to left
  _, steps, _ = _drive_script(want, rising, steps_ratio=1.0)
  assert steps == [[7], [6], [5], [4], [3], [2], [1], [0]]
  # window 1: left to right whatever the confidence, one slot per iteration
  tokens, steps, _ = _drive_script(want, rising, steps_ratio=1.0, window=1)
  assert tokens == want and steps == [[j] for j in range(8)]
  # window 2 at ratio 0.5 (counts 1, 2, 2, 3): the more confident of the first two masked
  # slots, then both of the next two, ...; the last iteration commits everything left
  _, steps, _ = _drive_script(want, rising, steps_ratio=0.5, window=2)
  assert steps == [[1], [0, 2], [3, 4], [5, 6, 7]]
  # with the threshold (every slot's top probability is over it): the window's slots only
  _, steps, _ = _drive_script(want, [8.0] * 8, threshold=0.2, window=3)
  assert steps == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_pad_tail_and_text_cut_at_first_pad():
  # the answer [101, 102, 103] then filler; the denoiser writes junk (200) after the filler
  want = [101, 102, 103, TV.pad, 200, 200, 200, 200]
  conf = [6.0] * 8
  tokens, steps, s = _drive_script(want, conf, steps_ratio=1.0, window=1)
  assert tokens == want and len(steps) == 8
  assert s.text_ids(0) == [101, 102, 103]          # the text ends at the chunk's first [PAD]
  assert s.stats[0]["content_tokens"] == 3
  tokens, steps, s = _drive_script(want, conf, steps_ratio=1.0, window=1, pad_tail=True)
  # the [PAD] at slot 3 fills slots 4..7 in its iteration: the chunk is done after 4
  assert tokens == [101, 102, 103] + [TV.pad] * 5 and steps == [[0], [1], [2], [3, 4, 5, 6, 7]]
  assert s.text_ids(0) == [101, 102, 103] and s.stats[0]["denoise_steps"] == 4
  with pytest.raises(ValueError, match="window must be >= 0"):
    pd.check_options(window=-1)


def test_seed_topic_commits_the_topic_at_the_scaffold():
  """seed_topic: the chunk's first slots are its promise's topic ids from the scaffold on (never
  re-committed, the denoiser's prediction there is ignored), the iterations count the masked
  slots left; a topic as long as the chunk keeps one mask; off, the chunk is all masks."""
  want = list(range(101, 109))
  conf = [6.0] * 8
  tokens, steps, _ = _drive_script(want, conf, steps_ratio=1.0, window=1)
  assert tokens == want and steps == [[j] for j in range(8)]
  tokens, steps, s = _drive_script(want, conf, steps_ratio=1.0, window=1, seed_topic=True)
  # topic (80,): slot 0 holds 80, the denoiser's 101 there never lands; 7 iterations
  assert tokens == [80] + want[1:] and steps == [[j] for j in range(1, 8)]
  assert s.stats[0]["denoise_steps"] == 7 and s.text_ids(0)[:1] == [80]
  # a topic of 3 ids in a chunk of 2 slots (1 unit): 1 id is seeded, 1 slot denoised
  s = pd.PlannedDiffusionScheduler(
      [serialize([70, Round(plan=(75, Promise((80, 81, 82), 1)), sync=False)], TV)
       + [TV.async_open]], TV, 40, stop_ids=[EOS], length_unit=UNIT, vocab_size=V,
      seed_topic=True)
  while (plan := s.next_step()) is not None:
    T = len(plan.tokens)
    lg = np.zeros((T, V), np.float32)
    lg[:, EOS] = 10.0
    lg[:, 101] = 6.0 if plan.tag[0] == "denoise" else 0.0
    s.on_step(plan, StepResult(logits=jnp.asarray(lg), slots=np.arange(T), released_pages=[]))
  resp = s.results[0].token_ids
  assert resp[resp.index(TV.async_open) + 1:resp.index(TV.async_close)] == [80, 101]
  assert s.stats[0]["denoise_steps"] == 1
