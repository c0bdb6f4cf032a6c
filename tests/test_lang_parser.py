"""Streaming parser, assembler and serializer (selforch_jax.lang): hand-written event sequences,
degradation rules, and hypothesis fuzzing (never raise, never lose a non-tag token).

Toy vocabulary as in test_lang_mask.py: text ids < 100 (digits "0".."9" = 10..19, space = 1,
EOS = 2), tags appended at 100.
"""

import collections

import pytest
from hypothesis import given, settings, strategies as st
from lang_strategies import mutate

from selforch_jax.lang import (
  DEGRADE_RULES, MAIN, Assembler, AsyncClosed, AsyncOpened, Degraded, EndOfText, Fill, PlanEnded,
  Promise, PromiseAbandoned, PromiseClosed, PromiseOpened, RegisterUse, Round, StreamParser, Sync,
  TagVocab, Text, assemble, events_to_tokens, parse, serialize,
)

TV = TagVocab.appended(100, 4, digit_ids=range(10, 20), space_ids=[1], eos_ids=[2])
P, CP, A, CA, S, M, PD = 100, 101, 102, 103, 104, 105, 106
R0, R1, R2, R3 = 107, 108, 109, 110
EOS, SP = 2, 1
D = {n: 10 + n for n in range(10)}
x, y, t, u, a, b, c, z = 50, 51, 60, 61, 70, 71, 72, 59


def rules(events):
  return [(e.rule, e.at) for e in events if isinstance(e, Degraded)]


def token_events(events):
  return [e for e in events if e.index is not None]


# ------------------------------------------------------------------------------------------------
# well-formed input
# ------------------------------------------------------------------------------------------------


def test_events_of_a_pasta_round():
  #      0  1  2  3   4     5   6  7  8   9  10
  seq = [x, P, t, SP, D[3], CP, A, a, CA, S, z]
  p = StreamParser(TV)
  ev = []
  for tok in seq:
    ev.extend(p.feed(tok))
  ev.extend(p.finish())
  assert ev == [
    Text(index=0, token_id=x),
    PromiseOpened(index=1, token_id=P),
    Text(index=2, token_id=t),
    Text(index=3, token_id=SP),
    Text(index=4, token_id=D[3]),
    PromiseClosed(index=5, token_id=CP, open_index=1, promise=0, round=0, topic_ids=(t,), length=3),
    PlanEnded(round=0, lengths=(3,)),
    AsyncOpened(index=6, stream=0, token_id=A, chunk=0, round=0),
    Text(index=7, stream=0, token_id=a),
    AsyncClosed(index=8, stream=0, token_id=CA, chunk=0, round=0),
    Sync(index=9, token_id=S, round=0, chunks=(0,)),
    Text(index=10, token_id=z),
  ]
  assert assemble(seq, TV) == [x, a, z]


def test_extra_async_after_the_chunks_joins_and_is_text():
  #      0  1  2     3   4  5  6   7  8   9  10
  seq = [x, P, t, D[3], CP, A, a, CA, A, CA, S]
  ev = parse(seq, TV)
  tail = ev[[type(e) for e in ev].index(AsyncClosed) + 1:]
  assert tail == [Degraded(rule="implicit_join", at=8),       # no promise left for a 2nd <async>
                  Sync(forced=True, round=0, chunks=(0,)),
                  Degraded(rule="stray_tag", at=8), Text(index=8, token_id=A),
                  Degraded(rule="stray_tag", at=9), Text(index=9, token_id=CA),
                  Sync(index=10, token_id=S)]                 # a no-op join
  assert assemble(seq, TV) == [x, a, A, CA]


def test_two_chunks_assemble_in_logical_order():
  seq = [x, P, t, D[1], CP, y, P, u, D[2], CP, A, a, CA, A, b, c, CA, S, z, EOS]
  ev = parse(seq, TV)
  assert rules(ev) == []
  assert [e for e in ev if isinstance(e, PromiseClosed)][1].topic_ids == (u,)
  assert [type(e) for e in ev if isinstance(e, (PlanEnded, Sync, EndOfText))] == [PlanEnded, Sync, EndOfText]
  assert assemble(seq, TV) == [x, a, y, b, c, z, EOS]
  assert assemble(seq, TV, keep_topics=True) == [x, t, D[1], a, y, u, D[2], b, c, z, EOS]


def test_registers_events():
  #      0   1  2   3  4   5  6  7  8     9   10 11  12 13  14 15
  seq = [R0, a, R1, b, R0, c, P, t, D[1], CP, A, R0, a, R0, CA, S]
  ev = parse(seq, TV)
  uses = [(e.index, e.stream, e.register, e.killed) for e in ev if isinstance(e, RegisterUse)]
  assert uses == [(0, MAIN, 0, ()), (2, MAIN, 1, ()), (4, MAIN, 0, (0, 1)),
                  (11, 0, 0, ()),          # a thread has its own register file
                  (13, 0, 0, (11, 12))]
  p = StreamParser(TV)
  for tok in seq[:10]:
    p.feed(tok)
  assert p.registers(MAIN) == {0: (4, 5, 6, 7, 8, 9), 1: (2, 3)}  # the step runs through the promise


def test_fill_tokens_are_stripped():
  seq = [P, t, D[1], CP, A, M, a, PD, PD, CA, S]
  ev = parse(seq, TV)
  assert [e.index for e in ev if isinstance(e, Fill)] == [5, 7, 8]
  assert assemble(seq, TV) == [a]


# ------------------------------------------------------------------------------------------------
# degradation (DESIGN.md §3): never raise, never lose text
# ------------------------------------------------------------------------------------------------


def test_unclosed_promise_at_eos_is_text():
  seq = [a, P, t, EOS]
  ev = parse(seq, TV)
  assert rules(ev) == [("tag_in_promise", 3)]
  assert PromiseAbandoned(open_index=1) in ev
  assert assemble(seq, TV) == [a, P, t, EOS]
  ev = parse([a, P, t], TV)  # no EOS: finish() abandons it
  assert rules(ev) == [("unclosed_promise", None)]
  assert assemble([a, P, t], TV) == [a, P, t]


def test_promise_without_length_is_plan_text_without_chunk():
  seq = [P, t, u, CP, A, a, CA, S]
  ev = parse(seq, TV)
  closed = [e for e in ev if isinstance(e, PromiseClosed)]
  assert closed == [PromiseClosed(index=3, token_id=CP, open_index=0, promise=None, round=None,
                                  topic_ids=(t, u), length=None)]
  assert rules(ev) == [("promise_without_length", 3), ("stray_tag", 4), ("stray_tag", 6)]
  assert assemble(seq, TV) == [t, u, A, a, CA]
  # too many digits: no length either
  assert TV.split_length([t, SP, D[1], D[2], D[3], D[4], D[5]]) == ((t, SP, D[1], D[2], D[3], D[4], D[5]), None)
  assert TV.split_length([t, SP, D[1], D[2], SP]) == ((t,), 12)


def test_tag_inside_promise_abandons_it():
  seq = [P, t, R0, a, P, u, D[2], CP, A, b, CA, S]
  ev = parse(seq, TV)
  assert rules(ev) == [("tag_in_promise", 2)]
  assert assemble(seq, TV) == [P, t, a, b]


def test_nested_async_and_sync_inside_a_chunk_are_chunk_text():
  seq = [P, t, D[1], CP, A, a, A, b, S, c, CA, S, z]
  ev = parse(seq, TV)
  assert rules(ev) == [("tag_in_chunk", 6), ("tag_in_chunk", 8)]
  assert [e.stream for e in token_events(ev)][4:11] == [0] * 7
  assert assemble(seq, TV) == [a, A, b, S, c, z]


def test_eos_with_open_chunk_forces_close_and_sync():
  seq = [P, t, D[1], CP, P, u, D[1], CP, A, a, EOS, b]
  ev = parse(seq, TV)
  assert rules(ev) == [("unclosed_chunk", 10), ("unmatched_promise", None)]
  kinds = [type(e).__name__ for e in ev[ev.index(Text(index=9, stream=0, token_id=a)) + 1:]]
  assert kinds == ["Degraded", "AsyncClosed", "Degraded", "Sync", "EndOfText", "Text"]
  # the promise without a chunk keeps its topic; the parser starts afresh after EOS
  assert assemble(seq, TV) == [a, u, D[1], EOS, b]


def test_cap_closes_a_runaway_chunk():
  # N = 0 and cap = 3: the chunk holds at most 3 tokens after <async> (its </async> included)
  seq = [P, t, D[0], CP, A, a, b, c, y, CA, S]
  ev = parse(seq, TV, cap=3)
  assert rules(ev) == [("chunk_cap", 7), ("implicit_join", 8), ("stray_tag", 9)]
  assert AsyncClosed(stream=0, chunk=0, round=0, forced=True) in ev
  assert assemble(seq, TV, cap=3) == [a, b, c, y, CA]
  # a budget of 2*10*N wins over a small cap
  assert rules(parse([P, t, D[1]] + [CP, A] + [a] * 19 + [CA, S], TV, cap=3)) == []


def test_stream_mode_threads():
  p = StreamParser(TV)
  ev = []
  for tok in [x, P, t, D[1], CP, P, u, D[2], CP]:
    ev += p.feed(tok)
  assert not any(isinstance(e, PlanEnded) for e in ev)
  ev = p.feed(A, stream=1)  # thread 1 starts first: the PLAN ends
  assert ev == [PlanEnded(round=0, lengths=(1, 2)),
                AsyncOpened(index=9, stream=1, token_id=A, chunk=1, round=0)]
  assert p.feed(b, stream=1) == [Text(index=10, stream=1, token_id=b)]
  ev = p.feed(a, stream=0)  # thread 0 never got its <async>: opened implicitly
  assert ev == [Degraded(rule="implicit_async", at=11),
                AsyncOpened(stream=0, chunk=0, round=0), Text(index=11, stream=0, token_id=a)]
  assert p.live_chunks == (0, 1)
  assert p.feed(R0, stream=0)[0].killed == () and p.feed(R0, stream=1)[0].killed == ()
  assert p.feed(R0, stream=0)[0].killed == (12,)
  p.feed(CA, stream=1)
  assert p.live_chunks == (0,)
  ev = p.feed(c, stream=1)  # closed thread: kept as its text
  assert ev == [Degraded(rule="closed_thread", at=16), Text(index=16, stream=1, token_id=c)]
  ev = p.feed(EOS, stream=0)
  assert ev == [Text(index=17, stream=0, token_id=EOS), Degraded(rule="eos_in_thread", at=17),
                AsyncClosed(stream=0, chunk=0, round=0, forced=True)]
  ev = p.feed(S)
  assert ev == [Sync(index=18, token_id=S, round=0, chunks=(0, 1))]
  ev = p.feed(y, stream=3)  # no such thread: main text
  assert ev == [Degraded(rule="no_such_thread", at=19), Text(index=19, token_id=y)]


def test_stream_mode_assembles_like_sequence_mode():
  seq = [x, P, t, D[1], CP, P, u, D[1], CP, A, a, b, CA, A, c, CA, S, z]
  p = StreamParser(TV)
  asm = Assembler()
  for tok in seq[:9]:
    asm.add(p.feed(tok))
  for tok, k in [(A, 1), (A, 0), (c, 1), (a, 0), (CA, 1), (b, 0), (CA, 0)]:
    asm.add(p.feed(tok, stream=k))
  for tok in [S, z]:
    asm.add(p.feed(tok))
  asm.add(p.finish())
  assert asm.tokens() == assemble(seq, TV) == [x, a, b, c, z]


# ------------------------------------------------------------------------------------------------
# serializer
# ------------------------------------------------------------------------------------------------


def test_serialize_canonical_layout():
  doc = [x, Round(plan=(y, Promise((t,), 3), Promise((u,), 12)), chunks=((a,), (b, R0, c))), z, EOS]
  ids = serialize(doc, TV)
  assert ids == [x, y, P, t, SP, D[3], CP, P, u, SP, D[1], D[2], CP,
                 A, a, CA, A, b, R0, c, CA, S, z, EOS]
  ev = parse(ids, TV)
  assert rules(ev) == []
  assert [(e.promise, e.topic_ids, e.length) for e in ev if isinstance(e, PromiseClosed)] == [
    (0, (t,), 3), (1, (u,), 12)]
  assert events_to_tokens(ev) == ids
  assert assemble(ids, TV) == [x, y, a, b, c, z, EOS]
  assert serialize([Round(plan=(Promise((t,), 1),), sync=False)], TV) == [P, t, SP, D[1], CP]
  with pytest.raises(ValueError):
    serialize([Promise((t,), 1)], TV)
  with pytest.raises(ValueError):
    serialize([Round(plan=(Promise((t,), 1),), chunks=((a,), (b,)))], TV)
  with pytest.raises(ValueError):
    serialize([Round(plan=(Promise((t,), 1),), chunks=((a, CA),))], TV)
  with pytest.raises(ValueError):
    serialize([Round(plan=(x,))], TV)


# ------------------------------------------------------------------------------------------------
# fuzzing
# ------------------------------------------------------------------------------------------------

ALPHABET = [x, y, t, SP, EOS, D[0], D[1], D[2]] + [P, CP, A, CA, S, M, PD, R0, R1, R2]


@st.composite
def documents(draw):
  """Well-formed documents as structures: text, rounds with promises, chunks, registers, fills."""
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
    # a round without chunks needs its <sync/>, or the next round's promises extend its PLAN
    parts.append(Round(plan=tuple(plan), chunks=chunks, sync=draw(st.booleans()) if chunks else True))
  parts += draw(st.lists(st.sampled_from([x, y, R0, EOS]), max_size=3))
  return parts


@st.composite
def annotated(draw):
  """Canonical annotated token streams (:func:`documents` serialized), then 0-3 random token
  insertions / deletions / substitutions."""
  parts = draw(documents())
  ids = serialize(parts, TV)
  return mutate(draw, ids, ALPHABET)


streams = st.one_of(st.lists(st.sampled_from(ALPHABET), max_size=60), annotated())


def non_tags(ids):
  return collections.Counter(i for i in ids if not TV.is_tag(i))


@settings(max_examples=300, deadline=None)
@given(streams, st.sampled_from([None, 2, 5, 256]))
def test_fuzz_parser_and_assemble(seq, cap):
  p = StreamParser(TV, cap=cap)
  events = []
  for i, tok in enumerate(seq):
    ev = p.feed(tok)
    toks = token_events(ev)
    assert len(toks) == 1 and toks[0].index == i and toks[0].token_id == tok
    events += ev
  events += p.finish()
  assert events_to_tokens(events) == seq
  for e in events:
    if isinstance(e, Degraded):
      assert e.rule in DEGRADE_RULES
  full = assemble(seq, TV, keep_topics=True, cap=cap)
  assert non_tags(full) == non_tags(seq)  # every non-tag token exactly once
  short = assemble(seq, TV, cap=cap)
  assert not non_tags(short) - non_tags(seq)
  dropped = non_tags(seq) - non_tags(short)  # only topic/length tokens of promises with a chunk
  topics = collections.Counter()
  for e in events:
    if isinstance(e, PromiseClosed) and e.promise is not None:
      topics.update(events_to_tokens(
          [f for f in events if f.index is not None and e.open_index < f.index < e.index]))
  assert not dropped - topics
  # text without tags assembles to itself
  if not any(TV.is_tag(tok) for tok in seq):
    assert short == seq


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(ALPHABET), st.sampled_from([None, None, 0, 1, 2, 5])),
                max_size=60))
def test_fuzz_stream_mode_never_raises(feed):
  p = StreamParser(TV, cap=4)
  asm = Assembler(keep_topics=True)
  for i, (tok, stream) in enumerate(feed):
    ev = p.feed(tok, stream=stream)
    toks = token_events(ev)
    assert len(toks) == 1 and toks[0].index == i and toks[0].token_id == tok
    asm.add(ev)
  asm.add(p.finish())
  assert non_tags(asm.tokens()) == non_tags(tok for tok, _ in feed)


def logical_order(parts):
  """The final text of a well-formed document, computed from its structure."""
  out = []
  for part in parts:
    if isinstance(part, Round):
      k = 0
      for item in part.plan:
        if isinstance(item, Promise):
          if k < len(part.chunks):
            out += part.chunks[k]
          else:
            out += list(item.topic_ids) + [SP] + TV.encode_length(item.length)
          k += 1
        else:
          out.append(item)
    else:
      out.append(part)
  return [i for i in out if not TV.is_tag(i)]


@settings(max_examples=200, deadline=None)
@given(documents())
def test_well_formed_documents_assemble_in_logical_order(parts):
  ids = serialize(parts, TV)
  ev = parse(ids, TV)
  assert {r for r, _ in rules(ev)} <= {"implicit_join", "unmatched_promise"}
  assert assemble(ids, TV) == logical_order(parts)
