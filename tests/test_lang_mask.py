"""Mask builder (selforch_jax.lang.mask): hand-written layouts drawn from DESIGN.md §2-§3, and
hypothesis fuzzing of its invariants.

Toy vocabulary: text ids < 100 (digits "0".."9" = ids 10..19, space = 1, EOS = 2), tags appended
at 100: <promise> 100, </promise> 101, <async> 102, </async> 103, <sync/> 104, <|mask|> 105,
[PAD] 106, <reg_0..3> 107..110. Expected masks are written as, per query row, the keys it sees.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from lang_strategies import mutate

from selforch_jax.lang import (
  MAIN, LayoutBuilder, Promise, Round, TagVocab, batch_layouts, build_layout, serialize,
)

TV = TagVocab.appended(100, 4, digit_ids=range(10, 20), space_ids=[1], eos_ids=[2])
P, CP, A, CA, S, M, PD = 100, 101, 102, 103, 104, 105, 106
R0, R1, R2, R3 = 107, 108, 109, 110
EOS, SP = 2, 1
D = {n: 10 + n for n in range(10)}  # digit n -> its id
x, y, t, u, a, b, c, d, e, f, z, q = 50, 51, 60, 61, 70, 71, 72, 73, 74, 75, 59, 58


def rows(n, spec):
  """bool[n, n] from one string per query row: comma-separated keys or ranges 'i-j'."""
  assert len(spec) == n
  m = np.zeros((n, n), bool)
  for qi, s in enumerate(spec):
    for part in s.split(","):
      lo, _, hi = part.partition("-")
      m[qi, int(lo):int(hi or lo) + 1] = True
  return m


def tril(n):
  return np.tril(np.ones((n, n), bool))


def vis(s, spec):
  m = np.zeros((s, s), bool)
  for i, keys in enumerate(spec):
    m[i, list(keys)] = True
  return m


# ------------------------------------------------------------------------------------------------
# hand-written cases
# ------------------------------------------------------------------------------------------------


def test_plain_text_is_causal():
  lay = build_layout([x, y, t, u, a], TV)
  np.testing.assert_array_equal(lay.token_mask(), tril(5))
  np.testing.assert_array_equal(lay.positions, [0, 1, 2, 3, 4])
  np.testing.assert_array_equal(lay.segment_ids, [0] * 5)
  np.testing.assert_array_equal(lay.kill_at, [5] * 5)
  assert lay.visible.tolist() == [[True]] and lay.bidir.tolist() == [False] and lay.notes == ()


def test_empty_sequence():
  lay = build_layout([], TV)
  assert lay.token_mask().shape == (0, 0) and lay.visible.shape == (0, 0)


def test_pasta_round_two_chunks():
  #      0  1  2  3  4     5   6  7  8     9   10 11 12  13 14 15 16  17 18
  seq = [x, y, P, t, D[1], CP, P, u, D[2], CP, A, a, CA, A, b, c, CA, S, z]
  lay = build_layout(seq, TV)
  # main 0..9; base = 10; chunk0 at 10; chunk1 at 10 + 10*1 = 20; sync at 10 + 10*(1+2) = 40
  np.testing.assert_array_equal(
      lay.positions, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 20, 21, 22, 23, 40, 41])
  # seg0: prefix + promise 0; seg1: promise 1; seg2: chunk0; seg3: chunk1; seg4: sync + after
  np.testing.assert_array_equal(lay.segment_ids, [0] * 6 + [1] * 4 + [2] * 3 + [3] * 4 + [4] * 2)
  np.testing.assert_array_equal(lay.visible, vis(5, [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 2, 3, 4}]))
  np.testing.assert_array_equal(lay.streams, [MAIN] * 10 + [0] * 3 + [1] * 4 + [MAIN] * 2)
  np.testing.assert_array_equal(lay.bidir, [False] * 5)
  expected = rows(19, [
      "0", "0-1", "0-2", "0-3", "0-4", "0-5", "0-6", "0-7", "0-8", "0-9",
      "0-5,10", "0-5,10-11", "0-5,10-12",                    # chunk 0: prefix + promise 0
      "0-9,13", "0-9,13-14", "0-9,13-15", "0-9,13-16",       # chunk 1: PLAN up to promise 1
      "0-17", "0-18"])                                        # after <sync/>: everything
  np.testing.assert_array_equal(lay.token_mask(), expected)
  assert lay.notes == ()


def test_diffusion_round():
  #      0  1  2  3     4   5  6  7     8   9  10 11 12  13  14 15 16  17  18
  seq = [q, P, t, D[1], CP, P, u, D[1], CP, A, M, M, PD, CA, A, M, PD, CA, S]
  full = build_layout(seq, TV, async_sees_full_plan=True, chunk_bidirectional=True)
  # base = 9; chunk0 at 9, chunk1 at 19; sync at 29
  np.testing.assert_array_equal(
      full.positions, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 19, 20, 21, 22, 29])
  np.testing.assert_array_equal(full.segment_ids, [0] * 5 + [1] * 4 + [2] * 5 + [3] * 4 + [4])
  np.testing.assert_array_equal(full.bidir, [False, False, True, True, False])
  expected_full = rows(19, [
      "0", "0-1", "0-2", "0-3", "0-4", "0-5", "0-6", "0-7", "0-8",
      "0-8,9-13", "0-8,9-13", "0-8,9-13", "0-8,9-13", "0-8,9-13",   # whole PLAN + whole chunk
      "0-8,14-17", "0-8,14-17", "0-8,14-17", "0-8,14-17",
      "0-18"])
  np.testing.assert_array_equal(full.token_mask(), expected_full)
  auto = build_layout(seq, TV, async_sees_full_plan=True, chunk_bidirectional="auto")
  np.testing.assert_array_equal(auto.token_mask(), expected_full)
  # default: chunk k sees the PLAN only up to the end of promise k
  part = build_layout(seq, TV, chunk_bidirectional=True)
  expected_part = rows(19, [
      "0", "0-1", "0-2", "0-3", "0-4", "0-5", "0-6", "0-7", "0-8",
      "0-4,9-13", "0-4,9-13", "0-4,9-13", "0-4,9-13", "0-4,9-13",
      "0-8,14-17", "0-8,14-17", "0-8,14-17", "0-8,14-17",
      "0-18"])
  np.testing.assert_array_equal(part.token_mask(), expected_part)
  # causal chunks (AR threads)
  causal = build_layout(seq, TV, async_sees_full_plan=True)
  expected_causal = rows(19, [
      "0", "0-1", "0-2", "0-3", "0-4", "0-5", "0-6", "0-7", "0-8",
      "0-9", "0-10", "0-11", "0-12", "0-13",
      "0-8,14", "0-8,14-15", "0-8,14-16", "0-8,14-17",
      "0-18"])
  np.testing.assert_array_equal(causal.token_mask(), expected_causal)
  # "auto" leaves a chunk without <|mask|>/[PAD] causal
  mixed = build_layout([q, P, t, D[1], CP, P, u, D[1], CP, A, a, b, CA, A, M, CA, S], TV,
                       chunk_bidirectional="auto")
  np.testing.assert_array_equal(mixed.bidir, [False, False, False, True, False])


def test_tip_register_reuse():
  #      0   1  2  3   4  5   6  7  8   9
  seq = [R0, a, b, R1, c, R0, d, e, R1, f]
  lay = build_layout(seq, TV)
  # step reg0 = {0,1,2} killed by <reg_0> at 5; step reg1 = {3,4} killed at 8; never = 10
  np.testing.assert_array_equal(lay.kill_at, [5, 5, 5, 8, 8, 10, 10, 10, 10, 10])
  np.testing.assert_array_equal(lay.positions, np.arange(10))  # dead tokens keep their positions
  expected = rows(10, ["0", "0-1", "0-2", "0-3", "0-4",
                       "3-5", "3-6", "3-7",       # reg_0 reused: 0-2 dead, the new tag included
                       "5-8", "5-9"])             # reg_1 reused: 3-4 dead
  np.testing.assert_array_equal(lay.token_mask(), expected)
  np.testing.assert_array_equal(lay.alive(5), [0, 0, 0, 1, 1, 1, 0, 0, 0, 0])
  # <sync/> ends a step: 'S' and 'b' are not in the reg_0 step and stay alive
  #       0   1  2  3  4   5
  lay2 = build_layout([R0, a, S, b, R0, c], TV)
  np.testing.assert_array_equal(lay2.kill_at, [4, 4, 6, 6, 6, 6])
  np.testing.assert_array_equal(
      lay2.token_mask(), rows(6, ["0", "0-1", "0-2", "0-3", "2-4", "2-5"]))


def test_register_inside_thread():
  #      0   1  2  3  4     5   6  7   8  9   10 11  12 13 14  15
  seq = [R0, x, P, t, D[1], CP, A, R0, a, R0, b, CA, S, y, R0, z]
  lay = build_layout(seq, TV)
  # main step reg0 = {0..5} (until <sync/>), killed by main <reg_0> at 14;
  # chunk step reg0 = {7, 8} killed by the chunk's own <reg_0> at 9; chunk registers are separate
  np.testing.assert_array_equal(
      lay.kill_at, [14] * 6 + [16, 9, 9, 16, 16, 16, 16, 16, 16, 16])
  # base = 6; chunk0 at 6..11; sync at 6 + 10 = 16
  np.testing.assert_array_equal(lay.positions, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19])
  np.testing.assert_array_equal(lay.segment_ids, [0] * 6 + [1] * 6 + [2] * 4)
  expected = rows(16, [
      "0", "0-1", "0-2", "0-3", "0-4", "0-5",
      "0-5,6", "0-5,6-7", "0-5,6-8",
      "0-5,6,9", "0-5,6,9-10", "0-5,6,9-11",     # the thread's kill hides 7-8 from it
      "0-6,9-12", "0-6,9-13",                    # the join sees only the thread's survivors
      "6,9-14", "6,9-15"])                       # main <reg_0> kills main's step 0-5
  np.testing.assert_array_equal(lay.token_mask(), expected)


def test_packed_documents():
  #      0  1  2    3  4
  lay = build_layout([a, b, EOS, c, d], TV)
  np.testing.assert_array_equal(lay.positions, [0, 1, 2, 0, 1])
  np.testing.assert_array_equal(lay.doc_ids, [0, 0, 0, 1, 1])
  np.testing.assert_array_equal(lay.token_mask(), rows(5, ["0", "0-1", "0-2", "3", "3-4"]))
  # explicit document ids: an EOS inside a document does not split it
  lay = build_layout([a, b, c, EOS, d], TV, doc_ids=[0, 0, 1, 1, 1])
  np.testing.assert_array_equal(lay.positions, [0, 1, 0, 1, 2])
  np.testing.assert_array_equal(lay.token_mask(), rows(5, ["0", "0-1", "2", "2-3", "2-4"]))
  # a PASTA round in the second document restarts positions and sees nothing of the first
  #      0  1    2  3  4     5   6  7  8   9  10
  seq = [a, EOS, P, t, D[1], CP, A, b, CA, S, c]
  lay = build_layout(seq, TV)
  np.testing.assert_array_equal(lay.positions, [0, 1, 0, 1, 2, 3, 4, 5, 6, 14, 15])
  np.testing.assert_array_equal(lay.segment_ids, [0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3])
  np.testing.assert_array_equal(lay.visible, vis(4, [{0}, {1}, {1, 2}, {1, 2, 3}]))
  np.testing.assert_array_equal(lay.token_mask(), rows(11, [
      "0", "0-1", "2", "2-3", "2-4", "2-5", "2-6", "2-7", "2-8", "2-9", "2-10"]))


def test_two_rounds_and_malformed_notes():
  # round 0 joined by <sync/>, round 1 closed by EOS with its chunk unclosed (forced sync)
  #      0  1  2     3   4  5  6   7  8  9  10    11  12 13 14
  seq = [P, t, D[2], CP, A, a, CA, S, P, u, D[1], CP, A, b, EOS]
  lay = build_layout(seq, TV)
  # round 0: base 4, <sync/> at 4 + 20 = 24; round 1 PLAN at 25..28, base 29, its chunk at 29;
  # EOS forces the join at 29 + 10 = 39
  np.testing.assert_array_equal(
      lay.positions, [0, 1, 2, 3, 4, 5, 6, 24, 25, 26, 27, 28, 29, 30, 39])
  assert lay.notes == ("14: unclosed_chunk",)
  np.testing.assert_array_equal(lay.segment_ids, [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 4])
  np.testing.assert_array_equal(
      lay.visible, vis(5, [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}]))
  # stray closing tag, implicit join: notes name the rules and the token indices
  lay = build_layout([CA, P, t, D[1], CP, A, a, CA, z], TV)
  assert lay.notes == ("0: stray_tag", "8: implicit_join")
  np.testing.assert_array_equal(lay.positions, [0, 1, 2, 3, 4, 5, 6, 7, 15])
  np.testing.assert_array_equal(lay.token_mask()[8], np.ones(9, bool))


def test_batch_layouts_feed_the_model():
  import jax.numpy as jnp

  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model

  seqs = [[x, y, P, t, D[1], CP, A, a, CA, S, z], [R0, a, b, R0, c], [x]]
  lays = [build_layout(s, TV) for s in seqs]
  batch = batch_layouts(lays, 12, pad_id=0)
  assert batch["tokens"].shape == (3, 12) and batch["mask"].shape == (3, 12, 12)
  np.testing.assert_array_equal(batch["valid"].sum(1), [11, 5, 1])
  assert not batch["mask"][0, 11:].any() and not batch["mask"][0, :, 11:].any()
  np.testing.assert_array_equal(batch["positions"][0, :11], lays[0].positions)
  np.testing.assert_array_equal(batch["kill_at"][1], [3, 3, 3, 12, 12] + [12] * 7)
  with pytest.raises(ValueError):
    batch_layouts(lays, 10)
  model = init_model(get_preset("tiny_llama"))
  logits, _ = model(jnp.asarray(batch["tokens"]), jnp.asarray(batch["positions"]),
                    jnp.asarray(batch["mask"]))
  lay = lays[0]  # padding and batching change nothing
  one, _ = model(jnp.asarray(lay.token_ids)[None], jnp.asarray(lay.positions)[None],
                 jnp.asarray(lay.token_mask())[None])
  np.testing.assert_allclose(np.asarray(logits[0, :lay.num_tokens]), np.asarray(one[0]),
                             rtol=1e-5, atol=1e-5)


def test_bad_arguments():
  with pytest.raises(ValueError):
    build_layout(np.zeros((2, 2), int), TV)
  with pytest.raises(ValueError):
    build_layout([1, 2], TV, doc_ids=[0])
  with pytest.raises(ValueError):
    build_layout([1, 2], TV, chunk_bidirectional="yes")


# ------------------------------------------------------------------------------------------------
# fuzzing
# ------------------------------------------------------------------------------------------------

ALPHABET = [x, y, t, SP, EOS, D[0], D[1], D[2]] + [P, CP, A, CA, S, M, PD, R0, R1, R2]


@st.composite
def annotated(draw):
  """Canonical annotated documents (rounds with promises, chunks, registers, fills, EOS) built with
  the serializer, then 0-3 random token insertions / deletions / substitutions."""
  parts = []
  for _ in range(draw(st.integers(0, 3))):
    parts += draw(st.lists(st.sampled_from([x, y, t, SP, R0, R1, EOS]), max_size=4))
    plan = []
    for _ in range(draw(st.integers(1, 3))):
      plan += draw(st.lists(st.sampled_from([x, y, R0, R1]), max_size=2))
      plan.append(Promise(tuple(draw(st.lists(st.sampled_from([t, u]), max_size=2))),
                          draw(st.integers(0, 2))))
    n_promises = sum(isinstance(p_, Promise) for p_ in plan)
    chunks = tuple(tuple(draw(st.lists(st.sampled_from([a, b, R0, R1, M, PD]), max_size=5)))
                   for _ in range(draw(st.integers(0, n_promises))))
    parts.append(Round(plan=tuple(plan), chunks=chunks, sync=draw(st.booleans())))
  parts += draw(st.lists(st.sampled_from([x, y, R0, EOS]), max_size=3))
  ids = serialize(parts, TV)
  return mutate(draw, ids, ALPHABET)


tokens = st.one_of(st.lists(st.sampled_from(ALPHABET), max_size=48), annotated())


def section2_mask(lay):
  """DESIGN.md §2 verbatim: alive, visible, and (other segment or bidir or k <= q)."""
  n = lay.num_tokens
  idx = np.arange(n)
  seg = lay.segment_ids
  m = np.zeros((n, n), bool)
  for qq in range(n):
    for kk in range(n):
      m[qq, kk] = (qq < lay.kill_at[kk] and lay.visible[seg[qq], seg[kk]]
                   and (seg[qq] != seg[kk] or lay.bidir[seg[qq]] or idx[kk] <= idx[qq]))
  return m


def check_invariants(lay):
  n = lay.num_tokens
  m = lay.token_mask()
  assert m.shape == (n, n) and m.dtype == bool
  assert m[np.arange(n), np.arange(n)].all()                  # every token sees itself
  assert (lay.kill_at > np.arange(n)).all() and (lay.kill_at <= n).all()
  seg = lay.segment_ids
  s = lay.num_segments
  assert set(seg.tolist()) == set(range(s)) and lay.visible[np.arange(s), np.arange(s)].all()
  # causality: across segments a query only sees earlier tokens, and only within its document
  qi, ki = np.nonzero(m)
  cross = seg[qi] != seg[ki]
  assert (ki[cross] < qi[cross]).all()
  assert (lay.doc_ids[qi] == lay.doc_ids[ki]).all()
  # the §2 rule gives the same mask (segments only see segments that end before they start)
  np.testing.assert_array_equal(m, section2_mask(lay))
  for sid in range(s):
    members = np.nonzero(seg == sid)[0]
    # positions inside a segment are consecutive
    assert (np.diff(lay.positions[members]) == 1).all()
    # death is monotone: within a segment, a later query never sees an earlier key that an
    # earlier query of the segment no longer saw
    for a_, b_ in zip(members[:-1], members[1:]):
      prev = m[a_, :a_ + 1]
      assert not (m[b_, :a_ + 1] & ~prev).any()
  # plain causal text: no tags at all -> lower triangular per document
  if not any(TV.is_tag(tok) for tok in lay.token_ids) and EOS not in lay.token_ids:
    np.testing.assert_array_equal(m, tril(n))


@settings(max_examples=150, deadline=None)
@given(tokens, st.booleans(), st.sampled_from([False, True, "auto"]), st.sampled_from([None, 3, 8]))
def test_fuzz_build_layout(seq, full_plan, bidir, cap):
  lay = build_layout(seq, TV, async_sees_full_plan=full_plan, chunk_bidirectional=bidir, cap=cap)
  assert lay.num_tokens == len(seq)
  np.testing.assert_array_equal(lay.token_ids, seq)
  check_invariants(lay)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.sampled_from([x, y, R0, R1, M, PD]), max_size=6), min_size=1,
                max_size=3),
       st.lists(st.sampled_from([x, y, t, R0, R1, S]), max_size=6),
       st.randoms(use_true_random=False), st.booleans())
def test_stream_mode_equals_sequence_mode(chunks, after, rnd, full_plan):
  """The runtime feeds thread tokens interleaved (stream mode); the layout is the sequence-mode
  layout of the canonical order, up to that permutation (the train = decode mask)."""
  plan = []
  for k, _ in enumerate(chunks):
    plan += [x, P, t, D[k + 1], CP]
  canonical = plan[:]
  for ch in chunks:
    canonical += [A] + ch + [CA]
  canonical += [S] + after
  seq_lay = build_layout(canonical, TV, async_sees_full_plan=full_plan, eos_ids=())
  assert seq_lay.notes == ()
  # stream order: the PLAN, then the threads' tokens randomly interleaved, then the rest
  b = LayoutBuilder(TV, async_sees_full_plan=full_plan)
  order = list(range(len(plan)))
  for i in order:
    b.feed(canonical[i])
  queues, start = [], len(plan)
  for ch in chunks:
    queues.append(list(range(start, start + len(ch) + 2)))
    start += len(ch) + 2
  while any(queues):
    k = rnd.choice([j for j, qu in enumerate(queues) if qu])
    i = queues[k].pop(0)
    b.feed(canonical[i], stream=k)
    order.append(i)
  for i in range(start, len(canonical)):
    b.feed(canonical[i])
    order.append(i)
  b.finish()
  st_lay = b.layout()
  assert st_lay.notes == ()
  perm = np.asarray(order)  # stream index j holds canonical token perm[j]
  np.testing.assert_array_equal(st_lay.token_ids, np.asarray(canonical)[perm])
  np.testing.assert_array_equal(st_lay.positions, seq_lay.positions[perm])
  np.testing.assert_array_equal(st_lay.streams, seq_lay.streams[perm])
  np.testing.assert_array_equal(st_lay.token_mask(), seq_lay.token_mask()[np.ix_(perm, perm)])
