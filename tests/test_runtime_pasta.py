"""PASTA scheduler on tiny random models (must-show tests of issue 5).

* Greedy: every thread's tokens equal a sequential decode of that thread alone (plain engine
  steps, one segment) with exactly the context the layout's mask gives the thread; the plan is
  teacher-forced (prompt = prefix + PLAN + ``<async>``), so threads really fork.
* The scheduler's own step grouping replayed as a training forward: for every sampled token,
  the full-sequence forward with the builder's mask (``Layout.token_mask``) has the same argmax
  (greedy) / the same log-probability (sampled) at the query that produced it.
* Malformed plans: a model over a 23-token vocabulary (7 tags) sampled at high temperature
  writes promises without lengths, nested tags, threads that never close, EOS in threads and
  in plans; every request finishes and keeps all its text.
"""

import collections

import jax
import numpy as np
import pytest
from flax import nnx

from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.lang import Promise, Round, TagVocab, assemble, batch_layouts, serialize
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime import schedulers
from selforch_jax.runtime.schedulers import pasta
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import run

BASE = 256
TV = TagVocab.appended(BASE, 4, eos_ids=[2], digit_ids=range(48, 58), space_ids=[32])
PAD_TO = 128


@pytest.fixture(scope="module")
def tiny():
  model = init_model(get_preset("tiny_llama", vocab_size=BASE + 11), seed=5)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  return model, state, fwd


def _full(fwd, state, layout):
  b = batch_layouts([layout], PAD_TO)
  return np.asarray(fwd(state, b["tokens"], b["positions"], b["mask"]))[0, :layout.num_tokens]


def _forced_plan_prompt():
  prefix = [70, 71, 72, 73, 74]
  plan = [75, Promise((80, 81), 1), 76, Promise((82,), 2), Promise((83, 84), 1), 77]
  return serialize(prefix + [Round(plan=tuple(plan), sync=False)], TV) + [TV.async_open]


def test_threads_equal_sequential_decode_of_each_thread(tiny):
  model, state, fwd = tiny
  engine = Engine(model, num_pages=64, page_size=4)
  prompt = _forced_plan_prompt()
  sched = pasta.generate(engine, [prompt], TV, max_new_tokens=60, length_unit=2, cap=4,
                         stop_ids=[2])
  st = sched.stats[0]
  lay = sched.layout(0)
  thread_segs = np.flatnonzero(lay.segment_streams >= 0)
  assert st.threads == 3 and len(thread_segs) == 3 and st.max_parallel == 3
  assert st.rounds == 1 and st.forwards < st.tokens  # parallel steps: fewer forwards than tokens
  mask = lay.token_mask()
  solo = Engine(model, num_pages=64, page_size=4)
  one = (np.ones((1, 1), bool), np.zeros(1, bool))
  for s in thread_segs:
    idx = np.flatnonzero(lay.segment_ids == s)
    first = idx[0]
    assert lay.token_ids[first] == TV.async_open
    ctx = np.flatnonzero(mask[first])[:-1]       # what the thread's <async> sees, itself excluded
    assert np.all(lay.streams[ctx] == -1)          # prefix + PLAN only: no sibling thread
    toks = list(lay.token_ids[ctx]) + [TV.async_open]
    pos = list(lay.positions[ctx]) + [lay.positions[first]]
    logits, _ = solo.run_step(toks, pos, np.zeros(len(toks)), 0, *one)
    got = [TV.async_open]
    p = lay.positions[first]
    while len(got) < idx.size:
      t = int(np.asarray(logits)[-1].argmax())
      got.append(t)
      p += 1
      logits, _ = solo.run_step([t], [p], [0], 0, *one)
    assert got == lay.token_ids[idx].tolist(), (s, got, lay.token_ids[idx].tolist())
    solo.pool.free_owner(0)
  # the join and the continuation: every sampled token is the argmax of the training forward
  full = _full(fwd, state, lay)
  src = sched.reqs[0].pred_map
  assert len(src) == st.sampled_tokens - (sched.results[0].finish_reason == "stop")
  for j, q in src.items():
    assert full[q].argmax() == lay.token_ids[j], (j, q)
  after_sync = np.flatnonzero(lay.token_ids == TV.sync)
  assert after_sync.size == 1 and any(j > after_sync[0] for j in src)
  # max_rounds=1 ends the job at the join: the same threads, the response ends with <sync/>
  one = pasta.generate(engine, [prompt], TV, max_new_tokens=60, length_unit=2, cap=4,
                       stop_ids=[2], max_rounds=1)
  res = one.results[0]
  assert res.finish_reason == "rounds" and res.token_ids[-1] == TV.sync
  k = res.token_ids.index(TV.sync)
  assert res.token_ids == sched.results[0].token_ids[:k + 1]
  assert one.stats[0].forwards == 1 + max(lay.segment_ids.tolist().count(s) for s in thread_segs)


def test_sampled_logprobs_equal_training_forward_and_ar_equivalence(tiny):
  model, state, fwd = tiny
  engine = Engine(model, num_pages=128, page_size=4)
  prompts = [_forced_plan_prompt(), [90, 91, 92], [100, 101, 102, 103, 104, 105]]
  sp = SamplingParams(temperature=1.0, seed=11)
  sched = pasta.generate(engine, prompts, TV, max_new_tokens=40, length_unit=2, cap=4,
                         sampling=sp, stop_ids=[2])
  assert engine.pool.owners() == []
  for i in range(len(prompts)):
    lay = sched.layout(i)
    full = np.asarray(jax.nn.log_softmax(_full(fwd, state, lay), -1))
    res = sched.results[i]
    inj = sched.injected[i]
    assert len(res.token_ids) == len(res.logprobs) == len(inj) <= 40
    lp_of = {j: full[q, lay.token_ids[j]] for j, q in sched.reqs[i].pred_map.items()}
    # canonical order (results) and feed order (layout) differ: compare the sorted values
    sampled_lps = [lp for lp, x in zip(res.logprobs, inj) if not x]
    assert len(sampled_lps) == len(lp_of)
    np.testing.assert_allclose(sorted(sampled_lps), sorted(lp_of.values()), atol=2e-4)
  # a plain prompt on a model that never plans: PASTA == AR (same tokens, 1 token per forward)
  ar = schedulers.make_scheduler("ar", engine, [prompts[1]], max_new_tokens=12,
                               sampling=SamplingParams(), stop_ids=[2])
  run(engine, ar)
  p = schedulers.make_scheduler("pasta", engine, [prompts[1]], tag_vocab=TV, max_new_tokens=12,
                              stop_ids=[2])
  run(engine, p)
  assert not any(TV.is_tag(t) for t in ar.results[0].token_ids)
  assert p.results[0].token_ids == ar.results[0].token_ids
  assert p.stats[0].theoretical_speedup == pytest.approx(1.0)
  assert p.stats[0].forwards == len(p.results[0].token_ids) + (p.results[0].finish_reason == "stop")


# ---- malformed plans: a small vocabulary where tags are frequent --------------------------
SB = 16  # ids 0..15: 2 = EOS, 3..12 digits, 13 space, 0, 1, 14, 15 text; tags 16..22
STV = TagVocab.appended(SB, 0, eos_ids=[2], digit_ids=range(3, 13), space_ids=[13])


def test_malformed_plans_finish_with_all_text_kept():
  model = init_model(get_preset("tiny_llama", vocab_size=SB + 7), seed=2)
  engine = Engine(model, num_pages=256, page_size=4)
  rules = collections.Counter()
  forks = stops_in_plan = 0
  # a PLAN with a promise without a length (no thread for it) and three with lengths
  bad = [STV.promise_open, 14, STV.promise_close]
  forced = ([0] + bad + serialize([Round(plan=(Promise((14,), 1), 1, Promise((15, 0), 2),
                                               Promise((1,), 3)), sync=False)], STV)
            + [STV.async_open])
  kinds = ("plain", "forced", "open_plan")
  for seed in range(2):
    # plain prompts; prompts ending in a PLAN + <async> (teacher-forced fork: threads of random
    # text); prompts ending in an open PLAN (the model itself must write <async> to fork)
    prompts = [[0, 1, 14, 15][: 1 + (i % 4)] + [14] * (i % 2) if i % 3 == 0 else
               forced if i % 3 == 1 else forced[:-1] for i in range(9)]
    sched = pasta.generate(engine, prompts, STV, max_new_tokens=32, length_unit=1, cap=4,
                           sampling=SamplingParams(temperature=4.0, seed=seed), stop_ids=[2])
    for i in range(len(prompts)):
      r = sched.reqs[i]
      res = sched.results[i]
      assert res.finish_reason in ("stop", "length")
      assert len(res.token_ids) <= 32
      rules.update(n.split(": ")[1] for n in sched.stats[i].degraded)
      forks += sched.stats[i].threads > 0 and kinds[i % 3] == "open_plan"
      if kinds[i % 3] == "forced":   # the promise without a length gets no thread
        assert sched.stats[i].threads >= 3 and sched.stats[i].max_parallel == 3
      stops_in_plan += res.finish_reason == "stop" and bool(r.round_lengths)
      # every generated non-tag token is in the final text (with topics kept: as a multiset)
      kept = assemble(res.token_ids, STV, keep_topics=True, cap=4, length_unit=1)
      plain = lambda ids: collections.Counter(t for t in ids if not STV.is_tag(t))
      assert plain(kept) == plain(res.token_ids)
      text = sched.text_ids(i)
      assert plain(text) <= plain(prompts[i] + res.token_ids)   # a forced PLAN's text included
      if kinds[i % 3] == "plain":
        assert plain(text) == plain(assemble(res.token_ids, STV, cap=4, length_unit=1))
      # the stream-mode layout holds exactly prompt + response tokens (a forced PLAN's final
      # <async> is thread 0's first response token)
      n_prompt = len(prompts[i]) - (kinds[i % 3] == "forced")
      assert sched.layout(i).num_tokens == n_prompt + len(res.token_ids)
      assert sched.stats[i].well_formed == (not sched.stats[i].degraded)
  assert engine.pool.owners() == []
  assert forks > 0   # the model itself planned and forked at least once
  for rule in ("promise_without_length", "tag_in_chunk", "chunk_cap", "eos_in_thread",
               "stray_tag", "tag_in_promise"):
    assert rules[rule] > 0, (rule, rules)
  assert stops_in_plan > 0 or rules["unclosed_promise"] > 0, rules


def test_pasta_scheduler_train_equals_decode_smollm2():
  """The oracle on the real SmolLM2 with the scheduler's own step grouping (threads batched,
  ``<sync/>`` fused into the last thread step): every query's engine logits equal the training
  forward's (``build_layout``-equivalent stream-mode layout), tolerance as in
  ``test_runtime_oracle_smollm2.py``; a prompt + teacher-forced PLAN of 3 promises forks 3 threads."""
  from selforch_jax.checkpoints.assets import smollm2_gguf_path
  from selforch_jax.checkpoints.gguf_import import load_gguf
  from selforch_jax.lang import add_tags, build_layout
  from selforch_jax.tokenizers import HFTokenizer

  path = smollm2_gguf_path()
  _, model, _ = load_gguf(path)
  tok = HFTokenizer.from_gguf(path)
  tv = add_tags(tok, model)
  prompt = tok.encode_chat([{"role": "user", "content": "Give three tips for sleeping well."}])
  plan = [Promise(tuple(tok.encode(w)), 1) for w in (" routine", " light", " caffeine")]
  prompt += serialize([Round(plan=tuple(plan), sync=False)], tv) + [tv.async_open]
  logits_of = {}

  class Recording(pasta.PASTAScheduler):
    def on_step(self, plan, result):
      for j, i in enumerate(plan.tag[3]["index"]):
        logits_of[i] = np.asarray(result.logits[j])
      super().on_step(plan, result)

  engine = Engine(model, num_pages=16, page_size=8)
  sched = Recording([prompt], tv, max_new_tokens=20, length_unit=2, cap=1, stop_ids=[])
  run(engine, sched)
  lay = sched.layout(0)
  assert sched.stats[0].threads == 3 and sched.stats[0].rounds == 1
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  full = _full(fwd, state, lay)
  idx = sorted(logits_of)
  eng = np.stack([logits_of[i] for i in idx])
  assert float(np.abs(eng - full[idx]).max()) < 5e-4
  np.testing.assert_array_equal(eng.argmax(-1), full[idx].argmax(-1))
  # the stream-mode layout is the training layout (annotated_example: build_layout with
  # eos_ids=()) of the canonical sequence, up to the order of thread tokens
  canon = build_layout(prompt[:-1] + sched.results[0].token_ids, tv, eos_ids=(), cap=1,
                       length_unit=2)
  assert sorted(zip(canon.positions.tolist(), canon.token_ids.tolist())) == \
      sorted(zip(lay.positions.tolist(), lay.token_ids.tolist()))


def test_tag_grammar_and_constrained_sampling():
  """The grammar's table, and the sampler never returns a banned id (a banned argmax falls to the
  next best; only-tags rows pick among the allowed tags)."""
  inner_len = [20, 4, 48 + 3]   # text, text, the digit "3" (a length)
  K = len(TV.registers)
  assert pasta.grammar_ids(TV)[:5] == (TV.promise_open, TV.promise_close, TV.async_open,
                                       TV.async_close, TV.sync)
  thread, _ = pasta.tag_grammar(TV, True, False, [], False, False)
  assert [i for i, b in zip(pasta.grammar_ids(TV), thread) if not b] == [TV.async_close,
                                                                         *TV.registers]
  assert pasta.tag_grammar(TV, False, True, inner_len[:2], False, False)[0] == [True] * (7 + K)
  in_promise, _ = pasta.tag_grammar(TV, False, True, inner_len, False, False)   # "... 3"
  assert [i for i, b in zip(pasta.grammar_ids(TV), in_promise) if not b] == [TV.promise_close]
  after, only = pasta.tag_grammar(TV, False, False, [], True, True)
  assert only and [i for i, b in zip(pasta.grammar_ids(TV), after) if not b] == [
      TV.promise_open, TV.async_open]
  main, only = pasta.tag_grammar(TV, False, False, [], False, False)   # no round: no <async>
  assert not only and [i for i, b in zip(pasta.grammar_ids(TV), main) if not b] == [
      TV.promise_open, *TV.registers]
  V = 40
  ids = (30, 31, 32)
  logits = np.full((3, V), -5.0, np.float32)
  logits[:, 31] = 9.0     # the best token of every row is tag 31
  logits[:, 5] = 8.0      # then text 5
  logits[:, 30] = 7.0     # then tag 30
  ban = [[False, True, False], [False, False, False], [False, True, False]]
  only = [False, False, True]
  tok, lp = pasta.sample_rows(jax.numpy.asarray(logits), [0, 1, 2], jax.random.PRNGKey(0), 0,
                              SamplingParams(), constraint=(ids, ban, only))
  assert tok.tolist() == [5, 31, 30]
  # log-probs of the constrained distribution: row 2 chooses among tags 30 and 32 only
  assert np.isclose(lp[2], 7.0 - np.logaddexp(7.0, -5.0), atol=1e-5)
  free, _ = pasta.sample_rows(jax.numpy.asarray(logits), [0, 1, 2], jax.random.PRNGKey(0), 0,
                              SamplingParams())
  assert free.tolist() == [31, 31, 31]


def test_constrained_decoding_writes_only_well_formed_tags():
  """The malformed-plan model of the test above (high temperature over 7 tags), decoded under
  the tag grammar: the rules that constrained decoding rules out never fire, the model still
  plans and forks, and every request keeps its text."""
  model = init_model(get_preset("tiny_llama", vocab_size=SB + 7), seed=2)
  engine = Engine(model, num_pages=256, page_size=4)
  rules, free_rules = collections.Counter(), collections.Counter()
  forks = 0
  prompts = [[0, 1, 14, 15][: 1 + (i % 4)] for i in range(16)]
  for seed in range(2):
    for constrain, counter in ((True, rules), (False, free_rules)):
      sched = pasta.generate(engine, prompts, STV, max_new_tokens=48, length_unit=1, cap=4,
                             sampling=SamplingParams(temperature=4.0, seed=seed), stop_ids=[2],
                             constrain_tags=constrain)
      for i in range(len(prompts)):
        counter.update(n.split(": ")[1] for n in sched.stats[i].degraded)
        if constrain:
          forks += sched.stats[i].threads > 0
          res = sched.results[i]
          kept = assemble(res.token_ids, STV, keep_topics=True, cap=4, length_unit=1)
          plain = lambda ids: collections.Counter(t for t in ids if not STV.is_tag(t))
          assert plain(kept) == plain(res.token_ids)
  assert engine.pool.owners() == []
  assert forks > 0
  ruled_out = ("stray_tag", "tag_in_promise", "promise_without_length", "tag_in_chunk",
               "eos_in_thread", "implicit_async", "closed_thread", "no_such_thread")
  assert sum(free_rules[r] for r in ruled_out) > 0, free_rules   # the unconstrained model errs
  assert all(rules[r] == 0 for r in ruled_out), rules
  # what remains is the budget: a thread at its cap, a promise or chunk open at max_new_tokens
  assert set(rules) <= {"chunk_cap", "unclosed_promise", "unclosed_chunk", "unmatched_promise"}, \
      rules


def test_max_threads_caps_the_threads_of_a_request():
  """With ``max_threads`` the tag grammar bans ``<promise>`` once a request has promised that
  many threads (all rounds together): right after ``</promise>`` only ``<async>`` remains."""
  after, only = pasta.tag_grammar(TV, False, False, [], True, True, threads_full=True)
  assert only and [i for i, b in zip(pasta.grammar_ids(TV), after) if not b] == [TV.async_open]
  # no round open after a (prompt's) promise without a length: <promise> stays allowed
  stuck, _ = pasta.tag_grammar(TV, False, False, [], True, False, threads_full=True)
  assert [i for i, b in zip(pasta.grammar_ids(TV), stuck) if not b] == [TV.promise_open]
  main, _ = pasta.tag_grammar(TV, False, False, [], False, False, threads_full=True)
  assert [i for i, b in zip(pasta.grammar_ids(TV), main) if not b] == list(TV.registers)
  with pytest.raises(ValueError, match="max_threads"):
    pasta.PASTAScheduler([[0]], STV, 4, max_threads=0)
  model = init_model(get_preset("tiny_llama", vocab_size=SB + 7), seed=2)
  engine = Engine(model, num_pages=256, page_size=4)
  prompts = [[0, 1, 14, 15][: 1 + (i % 4)] for i in range(16)]
  most = {}
  for cap in (None, 2):
    most[cap] = 0
    for seed in range(2):
      sched = pasta.generate(engine, prompts, STV, max_new_tokens=48, length_unit=1, cap=4,
                             sampling=SamplingParams(temperature=4.0, seed=seed), stop_ids=[2],
                             constrain_tags=True, max_threads=cap)
      for i in range(len(prompts)):
        most[cap] = max(most[cap], sched.stats[i].threads)
        if cap is not None:
          assert sched.stats[i].threads <= cap
  assert most[None] > 2 and most[2] == 2   # the cap binds, and only where it applies


def _promises(ids, tv):
  """The inner ids of every promise in ``ids`` (a promise open at the end included) and how it
  ended (the closing tag, or None)."""
  out, inner = [], None
  for t in ids:
    if t == tv.promise_open:
      inner = []
    elif inner is not None and tv.is_tag(t):
      out.append((inner, t))
      inner = None
    elif inner is not None:
      inner.append(t)
  return out + ([(inner, None)] if inner is not None else [])


def test_max_topic_tokens_makes_a_long_topic_write_its_length():
  """Once a promise without a length holds ``max_topic_tokens`` tokens, it must go on with a
  space, one or two digits and ``</promise>``; right after ``</promise>`` comes ``<promise>`` or
  ``<async>`` (never a digit); without the limit the same model runs on."""
  with pytest.raises(ValueError, match="max_topic_tokens"):
    pasta.PASTAScheduler([[0]], STV, 4, max_topic_tokens=0)
  assert pasta.constraint_ids(STV, [2], digits=True) == (*pasta.grammar_ids(STV), 2,
                                                         *STV.digit_ids, 13)
  model = init_model(get_preset("tiny_llama", vocab_size=SB + 7), seed=2)
  engine = Engine(model, num_pages=256, page_size=4)
  prompts = [[0, 1, 14, 15][: 1 + (i % 4)] for i in range(16)]
  M = 2
  digits = set(STV.digit_ids)
  broken, onsets, closed = {}, {}, 0
  for limit in (None, M):
    broken[limit] = onsets[limit] = 0
    for seed in range(3):
      sched = pasta.generate(engine, prompts, STV, max_new_tokens=48, length_unit=1, cap=4,
                             sampling=SamplingParams(temperature=4.0, seed=seed), stop_ids=[2],
                             constrain_tags=True, max_topic_tokens=limit)
      for res in sched.results:
        ids = res.token_ids
        for a, b in zip(ids, ids[1:]):   # after </promise>: only <promise> or <async>
          assert a != STV.promise_close or b in (STV.promise_open, STV.async_open)
        for inner, end in _promises(ids, STV):
          onset = next((k for k in range(M, len(inner) + 1)
                        if STV.split_length(inner[:k])[1] is None), None)
          if onset is None:
            continue
          onsets[limit] += 1
          tail = inner[onset:] + ([end] if end is not None else [])
          want = [13, "d", "d|close", "close"]   # space, digit, digit or </promise>, </promise>
          ok = len(tail) <= 4
          for t, w in zip(tail, want):
            ok &= ((t == 13) if w == 13 else (t in digits) if w == "d" else
                   (t in digits or t == STV.promise_close) if w == "d|close" else
                   t == STV.promise_close)
            if t == STV.promise_close:
              break
          if limit is not None and end == STV.promise_close:
            closed += 1
            assert STV.split_length(inner)[1] is not None   # it has its length
          broken[limit] += not ok
  assert onsets[M] > 0 and broken[M] == 0 and closed > 0, (onsets, broken, closed)
  assert broken[None] > 0, broken   # the unconstrained topic runs on
