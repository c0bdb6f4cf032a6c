"""Streaming parser of the orchestration language (DESIGN.md §3).

``StreamParser(tag_vocab).feed(token_id)`` reads one token and returns the events it causes
(:mod:`selforch_jax.lang.events`); ``finish()`` ends the text. It never raises on any token
sequence and every fed token comes back as exactly one token event.

Grammar (sequence mode, ``feed(token_id)``; the canonical training layout
``prefix · PLAN · <async>c_1</async> · … · <async>c_n</async> · <sync/> · continuation``)::

  main     := ( text | <promise> inner </promise> | <reg_k> | <|mask|> | [PAD] | <sync/> | EOS )*
  round    := PLAN chunk* (<sync/> | EOS | end)     # opened by the first promise with a length
  chunk    := <async> ( text | <reg_k> | <|mask|> | [PAD] )* </async>

* ``inner`` = topic tokens then the length N (digit tokens, :meth:`TagVocab.split_length`); a
  promise with a length is plan entry k of the current round (k = 0, 1, ... in plan order).
* The PLAN ends at the first ``<async>`` of the round (:class:`PlanEnded`); the j-th ``<async>``
  opens chunk j (the chunks follow the PLAN in order); ``<sync/>`` joins (:class:`Sync`).
* Registers (TIP): every stream (the main thread, each chunk) has its own register file. A step of
  a stream is its tokens from a ``<reg_k>`` up to, not including, the stream's next register tag,
  ``<sync/>``, EOS or (in a chunk) ``</async>``; steps hold every token of the stream in that span
  (promise tokens included). ``<reg_k>`` kills the step register k of the same stream held:
  :class:`RegisterUse` lists its feed indices. Registers of a thread never kill main-thread or
  sibling tokens; main-thread registers never kill chunk tokens.

Stream mode (``feed(token_id, stream=k)``) is for a runtime that decodes the chunks as parallel
threads: the token belongs to chunk k of the current round; feed each thread's ``<async>`` with
``stream=k`` (the first one ends the PLAN), and the main thread's tokens (``<sync/>`` once the
threads are done) with ``stream=None``. Sequence mode is stream mode with the threads run one after
another, so both give the same events up to the order of tokens of different threads.

Degradation (never raise, never lose a non-tag token; each application emits :class:`Degraded`
with a rule of :data:`~selforch_jax.lang.events.DEGRADE_RULES`):

* a stray ``</promise>`` / ``</async>`` / ``<async>`` (no open construct / no promise left) is text;
* a tag (or EOS) before ``</promise>`` abandons the promise: ``<promise>`` and its topic become
  text (:class:`PromiseAbandoned`), then the tag is read normally;
* a promise without a length N is kept as plan text and gets no chunk (``promise`` None);
* inside a chunk, ``<promise>``, ``</promise>``, ``<async>`` (nested) and ``<sync/>`` are chunk text
  (only ``</async>``, the cap, EOS or the end close a chunk);
* a chunk reaching ``max(2·10·N, cap)`` tokens after its ``<async>`` (its ``</async>`` counted) is
  closed (forced) right after that token -- or, when the parser knows the tokens' bytes
  (``token_bytes``) and that token ends inside a multi-byte UTF-8 character, right after the token
  that completes the character (at most :data:`MAX_CHAR_OVERRUN` more tokens), so that a cap never
  splits one character between a chunk and the main thread;
* a main-thread token after the chunks of a round other than ``<async>``/``<sync/>``/EOS joins the
  round first (implicit join, forced :class:`Sync`);
* EOS (or ``finish()``) abandons an open promise, closes open chunks and joins (forced), then the
  parser starts afresh; EOS itself is a main-thread :class:`EndOfText`.
"""

from __future__ import annotations

from collections.abc import Callable

from selforch_jax.lang.events import (
  MAIN, AsyncClosed, AsyncOpened, Degraded, EndOfText, Event, Fill, PlanEnded, PromiseAbandoned,
  PromiseClosed, PromiseOpened, RegisterUse, Sync, Text,
)
from selforch_jax.lang.tags import TOKENS_PER_UNIT, TagVocab

__all__ = ["StreamParser", "parse", "DEFAULT_CAP", "MAX_CHAR_OVERRUN", "utf8_pending"]

DEFAULT_CAP = 256  # floor of a chunk's token budget: max(2*10*N, cap) (DESIGN.md §3)
# Tokens a capped chunk may run past its budget to finish a multi-byte character (a UTF-8
# character has at most 4 bytes, so 3 byte tokens; the rest covers tokens that end a character
# and start another).
MAX_CHAR_OVERRUN = 8


def utf8_pending(pending: int, data: bytes) -> int:
  """Continuation bytes still owed after reading ``data``, given ``pending`` owed before.

  A UTF-8 decoder's state in one int: 0 = at a character boundary. A byte that is not the
  continuation byte owed starts a new character (an invalid sequence is dropped, like a
  decoder with ``errors='replace'`` does).

  Args:
    pending: 0..3, continuation bytes owed before ``data``.
    data: the next bytes.

  Returns:
    int: 0..3.
  """
  for b in data:
    if pending and 0x80 <= b < 0xC0:
      pending -= 1
    elif 0xC2 <= b < 0xE0:
      pending = 1
    elif 0xE0 <= b < 0xF0:
      pending = 2
    elif 0xF0 <= b < 0xF5:
      pending = 3
    else:  # ASCII, a stray continuation byte or an invalid lead byte
      pending = 0
  return pending


class _Registers:
  """One stream's register file: register -> feed indices of the step it holds."""

  def __init__(self):
    self.held: dict[int, list[int]] = {}
    self.current: list[int] | None = None

  def use(self, reg: int, index: int) -> tuple[int, ...]:
    killed = tuple(self.held.get(reg, ()))
    self.current = [index]
    self.held[reg] = self.current
    return killed

  def add(self, index: int) -> None:
    if self.current is not None:
      self.current.append(index)

  def end_step(self) -> None:
    self.current = None


class _Chunk:
  def __init__(self, limit: int | None):
    self.limit = limit
    self.count = 0
    self.pending = 0  # UTF-8 continuation bytes owed by the chunk's text (utf8_pending)
    self.open = True
    self.regs = _Registers()


class _Round:
  def __init__(self, number: int):
    self.number = number
    self.lengths: list[int] = []
    self.plan_ended = False
    self.chunks: dict[int, _Chunk] = {}
    self.seq_chunk: int | None = None  # chunk receiving sequence-mode tokens

  def next_unopened(self) -> int | None:
    for k in range(len(self.lengths)):
      if k not in self.chunks:
        return k
    return None


class _OpenPromise:
  def __init__(self, open_index: int):
    self.open_index = open_index
    self.inner: list[int] = []


class StreamParser:
  """Incremental parser of one token stream (see the module docstring for the rules).

  Args:
    tag_vocab: the :class:`TagVocab` of the vocabulary.
    cap: floor of a chunk's budget ``max(2*length_unit*N, cap)`` in tokens after its ``<async>``;
      None = unlimited.
    length_unit: tokens per unit of a promise length N (10 in DESIGN.md §3).
    token_bytes: optional ``token_id -> bytes`` (e.g. ``Tokenizer.token_bytes``); with it a capped
      chunk closes only at a character boundary (see the module docstring). An id it rejects
      (any exception) counts as a character boundary.

  Raises:
    ValueError: ``cap`` < 1 or ``length_unit`` < 1 (construction only; feeding never raises).
  """

  def __init__(self, tag_vocab: TagVocab, *, cap: int | None = DEFAULT_CAP,
               length_unit: int = TOKENS_PER_UNIT,
               token_bytes: Callable[[int], bytes] | None = None):
    if cap is not None and cap < 1:
      raise ValueError(f"cap must be >= 1 or None, got {cap}")
    if length_unit < 1:
      raise ValueError(f"length_unit must be >= 1, got {length_unit}")
    self.tag_vocab = tag_vocab
    self.cap = cap
    self.length_unit = int(length_unit)
    self.token_bytes = token_bytes
    self._fed = 0
    self._rounds_started = 0
    self._promise: _OpenPromise | None = None
    self._round: _Round | None = None
    self._main_regs = _Registers()

  # ---- public ---------------------------------------------------------------------------------

  @property
  def num_fed(self) -> int:
    """Number of tokens fed so far (the next token's feed index)."""
    return self._fed

  @property
  def in_promise(self) -> bool:
    """Whether a ``<promise>`` is open."""
    return self._promise is not None

  @property
  def round_open(self) -> bool:
    """Whether a round (a PLAN with at least one promise with a length) awaits its join."""
    return self._round is not None

  @property
  def live_chunks(self) -> tuple[int, ...]:
    """Chunks of the current round that are open (live threads)."""
    r = self._round
    return () if r is None else tuple(k for k, c in sorted(r.chunks.items()) if c.open)

  def registers(self, stream: int = MAIN) -> dict[int, tuple[int, ...]]:
    """``{register: feed indices of the step it holds}`` of a stream (MAIN or a chunk of the
    current round; ``{}`` for an unknown stream)."""
    if stream == MAIN:
      regs = self._main_regs
    else:
      c = self._round.chunks.get(stream) if self._round is not None else None
      if c is None:
        return {}
      regs = c.regs
    return {k: tuple(v) for k, v in regs.held.items()}

  def feed(self, token_id: int, stream: int | None = None) -> list[Event]:
    """Read one token.

    Args:
      token_id: the token (any int; ids that are not tags are text).
      stream: None (sequence mode: the grammar decides the stream) or k >= 0 (stream mode: the
        token was generated by thread k of the current round).

    Returns:
      The events, synthetic ones first (except a cap close, which follows), with exactly one token
      event whose ``index`` is this token's feed index.
    """
    token_id = int(token_id)
    i = self._fed
    self._fed += 1
    ev: list[Event] = []
    if stream is None or stream == MAIN:
      self._feed_seq(token_id, i, ev)
    else:
      self._feed_thread(token_id, i, int(stream), ev)
    return ev

  def finish(self) -> list[Event]:
    """End of the text without an EOS token: abandon an open promise, close open chunks and join
    (forced). The parser can be fed again afterwards (a fresh text, feed indices continue).

    Returns:
      The synthetic events.
    """
    ev: list[Event] = []
    self._end(None, ev)
    return ev

  # ---- sequence mode ----------------------------------------------------------------------------

  def _feed_seq(self, tok: int, i: int, ev: list[Event]) -> None:
    tv = self.tag_vocab
    r = self._round
    if r is not None and r.seq_chunk is not None:
      self._chunk(r.seq_chunk, tok, i, ev, seq=True)
      return
    if r is not None and r.plan_ended:
      nxt = r.next_unopened()
      if tok == tv.async_open and nxt is not None:
        self._open_chunk(nxt, i, tok, ev, seq=True)
        return
      if tok == tv.sync:
        self._join(i, tok, ev, forced=False)
        return
      if tv.is_eos(tok):
        self._end_of_text(i, tok, ev)
        return
      ev.append(Degraded(rule="implicit_join", at=i))
      self._join(None, None, ev, forced=True)
    self._main(tok, i, ev)

  def _main(self, tok: int, i: int, ev: list[Event]) -> None:
    tv = self.tag_vocab
    regs = self._main_regs
    p = self._promise
    if p is not None:
      if tok == tv.promise_close:
        self._close_promise(tok, i, ev)
        return
      if tv.is_tag(tok) or tv.is_eos(tok):
        self._abandon(ev, "tag_in_promise", i)
      else:
        p.inner.append(tok)
        regs.add(i)
        ev.append(Text(index=i, token_id=tok))
        return
    if tok == tv.promise_open:
      self._promise = _OpenPromise(i)
      regs.add(i)
      ev.append(PromiseOpened(index=i, token_id=tok))
    elif tok == tv.async_open and self._round is not None and self._round.next_unopened() is not None:
      self._end_plan(ev)
      self._open_chunk(self._round.next_unopened(), i, tok, ev, seq=True)
    elif tok == tv.sync:
      self._join(i, tok, ev, forced=False)
    elif tv.register_of(tok) is not None:
      k = tv.register_of(tok)
      ev.append(RegisterUse(index=i, token_id=tok, register=k, killed=regs.use(k, i)))
    elif tv.is_fill(tok):
      regs.add(i)
      ev.append(Fill(index=i, token_id=tok))
    elif tv.is_eos(tok):
      self._end_of_text(i, tok, ev)
    else:
      if tv.is_tag(tok):
        ev.append(Degraded(rule="stray_tag", at=i))
      regs.add(i)
      ev.append(Text(index=i, token_id=tok))

  def _close_promise(self, tok: int, i: int, ev: list[Event]) -> None:
    p = self._promise
    self._promise = None
    self._main_regs.add(i)
    topic, n = self.tag_vocab.split_length(p.inner)
    if n is None:
      ev.append(Degraded(rule="promise_without_length", at=i))
      ev.append(PromiseClosed(index=i, token_id=tok, open_index=p.open_index, topic_ids=topic))
      return
    if self._round is None:
      self._round = _Round(self._rounds_started)
      self._rounds_started += 1
    r = self._round
    r.lengths.append(n)
    ev.append(PromiseClosed(index=i, token_id=tok, open_index=p.open_index,
                            promise=len(r.lengths) - 1, round=r.number, topic_ids=topic, length=n))

  def _abandon(self, ev: list[Event], rule: str, at: int | None) -> None:
    p = self._promise
    self._promise = None
    ev.append(Degraded(rule=rule, at=at))
    ev.append(PromiseAbandoned(open_index=p.open_index))

  # ---- rounds and chunks -------------------------------------------------------------------------

  def _end_plan(self, ev: list[Event], at: int | None = None) -> None:
    r = self._round
    if r.plan_ended:
      return
    if self._promise is not None:
      self._abandon(ev, "unclosed_promise", at)
    r.plan_ended = True
    ev.append(PlanEnded(round=r.number, lengths=tuple(r.lengths)))

  def _open_chunk(self, k: int, i: int | None, tok: int | None, ev: list[Event], seq: bool) -> None:
    r = self._round
    limit = None if self.cap is None else max(2 * self.length_unit * r.lengths[k], self.cap)
    r.chunks[k] = _Chunk(limit)
    if seq:
      r.seq_chunk = k
    ev.append(AsyncOpened(index=i, stream=k, token_id=tok, chunk=k, round=r.number))

  def _chunk(self, k: int, tok: int, i: int, ev: list[Event], seq: bool) -> None:
    tv = self.tag_vocab
    r = self._round
    c = r.chunks[k]
    c.count += 1
    if tok == tv.async_close:
      c.open = False
      c.regs.end_step()
      if r.seq_chunk == k:
        r.seq_chunk = None
      ev.append(AsyncClosed(index=i, stream=k, token_id=tok, chunk=k, round=r.number))
      return
    if tv.is_eos(tok):
      if seq:
        self._force_close(k, ev, "unclosed_chunk", i)
        self._end_of_text(i, tok, ev)
      else:
        ev.append(Text(index=i, stream=k, token_id=tok))
        self._force_close(k, ev, "eos_in_thread", i)
      return
    reg = tv.register_of(tok)
    if reg is not None:
      ev.append(RegisterUse(index=i, stream=k, token_id=tok, register=reg, killed=c.regs.use(reg, i)))
    elif tv.is_fill(tok):
      c.regs.add(i)
      ev.append(Fill(index=i, stream=k, token_id=tok))
    else:
      if tv.is_tag(tok):
        ev.append(Degraded(rule="tag_in_chunk", at=i))
      c.regs.add(i)
      ev.append(Text(index=i, stream=k, token_id=tok))
    if c.limit is None:
      return
    if self.token_bytes is not None:
      try:
        data = self.token_bytes(tok)
      except Exception:  # noqa: BLE001 - never raise while feeding
        data = b""
      c.pending = utf8_pending(c.pending, data)
    if c.count >= c.limit and (c.pending == 0 or c.count >= c.limit + MAX_CHAR_OVERRUN):
      self._force_close(k, ev, "chunk_cap", i)

  def _force_close(self, k: int, ev: list[Event], rule: str, at: int | None) -> None:
    r = self._round
    c = r.chunks[k]
    c.open = False
    c.regs.end_step()
    if r.seq_chunk == k:
      r.seq_chunk = None
    ev.append(Degraded(rule=rule, at=at))
    ev.append(AsyncClosed(stream=k, chunk=k, round=r.number, forced=True))

  def _join(self, i: int | None, tok: int | None, ev: list[Event], forced: bool) -> None:
    r = self._round
    if r is not None:
      self._end_plan(ev, i)
      for k in sorted(r.chunks):
        if r.chunks[k].open:
          self._force_close(k, ev, "unclosed_chunk", i)
      if len(r.chunks) < len(r.lengths):
        ev.append(Degraded(rule="unmatched_promise", at=i))
      self._round = None
    self._main_regs.end_step()
    if i is not None or r is not None:
      ev.append(Sync(index=i, token_id=tok, forced=forced,
                     round=None if r is None else r.number,
                     chunks=() if r is None else tuple(sorted(r.chunks))))

  def _end(self, i: int | None, ev: list[Event]) -> None:
    if self._promise is not None:
      self._abandon(ev, "unclosed_promise", i)
    if self._round is not None:
      self._join(None, None, ev, forced=True)
    self._main_regs = _Registers()

  def _end_of_text(self, i: int, tok: int, ev: list[Event]) -> None:
    self._end(i, ev)
    ev.append(EndOfText(index=i, token_id=tok))

  # ---- stream mode ------------------------------------------------------------------------------

  def _feed_thread(self, tok: int, i: int, k: int, ev: list[Event]) -> None:
    r = self._round
    if r is None or not 0 <= k < len(r.lengths):
      ev.append(Degraded(rule="no_such_thread", at=i))
      self._feed_seq(tok, i, ev)
      return
    c = r.chunks.get(k)
    if c is None:
      self._end_plan(ev, i)
      if tok == self.tag_vocab.async_open:
        self._open_chunk(k, i, tok, ev, seq=False)
        return
      ev.append(Degraded(rule="implicit_async", at=i))
      self._open_chunk(k, None, None, ev, seq=False)
      self._chunk(k, tok, i, ev, seq=False)
      return
    if not c.open:
      ev.append(Degraded(rule="closed_thread", at=i))
      ev.append(Text(index=i, stream=k, token_id=tok))
      return
    self._chunk(k, tok, i, ev, seq=False)


def parse(token_ids, tag_vocab: TagVocab, *, cap: int | None = DEFAULT_CAP,
          length_unit: int = TOKENS_PER_UNIT,
          token_bytes: Callable[[int], bytes] | None = None) -> list[Event]:
  """All events of a token sequence in sequence mode, ``finish()`` included.

  Args:
    token_ids: 1-D int sequence.
    tag_vocab, cap, length_unit, token_bytes: as for :class:`StreamParser`.

  Returns:
    list of events (never raises on any int sequence).
  """
  p = StreamParser(tag_vocab, cap=cap, length_unit=length_unit, token_bytes=token_bytes)
  out: list[Event] = []
  for t in token_ids:
    out.extend(p.feed(int(t)))
  out.extend(p.finish())
  return out
