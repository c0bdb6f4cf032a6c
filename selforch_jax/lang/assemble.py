"""The final text in logical order, tags stripped (DESIGN.md §3: "the final text always contains
every generated non-tag token in logical order").

Logical order: the main thread's tokens in order, where each promise that got a chunk is replaced
by that chunk's content (PASTA: "the async content is inserted at the position of its promise");
EOS tokens stay. Stripped: the structural tags (``<promise>``/``</promise>`` of a well-formed
promise, ``<async>``, ``</async>``, ``<sync/>``, ``<reg_k>``, ``<|mask|>``, ``[PAD]``) and the
topic/length tokens of a promise that was replaced by its chunk (``keep_topics=True`` keeps those,
just before the chunk content). Kept as text: every other token, including tags that degraded to
text (a stray ``</async>``, a nested ``<async>``, the ``<promise>`` of an abandoned promise) and the
topic of a promise without a chunk (its ``<promise>``/``</promise>`` stripped when it was closed).

So with ``keep_topics=True`` the multiset of non-tag tokens of the output equals that of the input.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from selforch_jax.lang.events import (
  MAIN, AsyncOpened, EndOfText, Event, PromiseAbandoned, PromiseClosed, PromiseOpened, Text,
)
from selforch_jax.lang.parser import DEFAULT_CAP, StreamParser
from selforch_jax.lang.tags import TOKENS_PER_UNIT, TagVocab

__all__ = ["Assembler", "assemble", "assemble_pieces", "assemble_text", "chunk_separator",
           "join_pieces"]


class _Slot:
  """A promise with a length, waiting for its chunk."""

  def __init__(self, round_: int, promise: int, inner: list[int]):
    self.round = round_
    self.promise = promise
    self.inner = inner


class Assembler:
  """Builds the final token list from parser events (sequence or stream mode), incrementally.

  Args:
    keep_topics: keep the topic/length tokens of promises replaced by chunks.
  """

  def __init__(self, *, keep_topics: bool = False):
    self.keep_topics = keep_topics
    self._out: list[int | _Slot] = []
    self._promise: tuple[int, list[int]] | None = None  # (open token id, inner ids)
    self._chunks: dict[tuple[int, int], list[int]] = {}
    self._round = 0

  def add(self, events: Iterable[Event]) -> None:
    """Consume events in the order the parser emitted them."""
    for e in events:
      if isinstance(e, PromiseOpened):
        self._promise = (e.token_id, [])
      elif isinstance(e, Text):
        if e.stream != MAIN:
          self._chunks.setdefault((self._round, e.stream), []).append(e.token_id)
        elif self._promise is not None:
          self._promise[1].append(e.token_id)
        else:
          self._out.append(e.token_id)
      elif isinstance(e, PromiseClosed):
        inner = self._promise[1] if self._promise is not None else []
        self._promise = None
        if e.promise is None:
          self._out.extend(inner)
        else:
          self._out.append(_Slot(e.round, e.promise, inner))
      elif isinstance(e, PromiseAbandoned):
        if self._promise is not None:
          self._out.append(self._promise[0])
          self._out.extend(self._promise[1])
        self._promise = None
      elif isinstance(e, AsyncOpened):
        self._round = e.round
        self._chunks.setdefault((e.round, e.chunk), [])
      elif isinstance(e, EndOfText):
        self._out.append(e.token_id)

  def tokens(self) -> list[int]:
    """The final token ids so far (an open promise's tokens are not included yet)."""
    out: list[int] = []
    for item in self._out:
      if isinstance(item, _Slot):
        chunk = self._chunks.get((item.round, item.promise))
        if chunk is None:
          out.extend(item.inner)
        else:
          if self.keep_topics:
            out.extend(item.inner)
          out.extend(chunk)
      else:
        out.append(item)
    return out


  def pieces(self) -> list[tuple[bool, list[int]]]:
    """:meth:`tokens` split where a chunk starts or ends: ``(is_chunk, ids)`` in logical order
    (concatenating the ids gives :meth:`tokens`)."""
    out: list[tuple[bool, list[int]]] = []
    for item in self._out:
      if isinstance(item, _Slot):
        chunk = self._chunks.get((item.round, item.promise))
        if chunk is not None:
          ids = (list(item.inner) if self.keep_topics else []) + list(chunk)
          out.append((True, ids))
          continue
        ids = list(item.inner)
      else:
        ids = [item]
      if out and not out[-1][0]:
        out[-1][1].extend(ids)
      else:
        out.append((False, ids))
    return out


_ITEM_START = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022]|#+)\s")


def chunk_separator(before: str, after: str) -> tuple[str, str]:
  """How two adjacent texts, at least one of them a PASTA chunk, are joined:
  ``(before, separator)`` (``before`` possibly with trailing spaces dropped).

  The layout implies the separator: a chunk that starts a list item or heading (``"3. "``,
  ``"- "``, ``"## "``) starts a new line; otherwise texts that do not already meet at
  whitespace get one space (chunks are parallel pieces of one text, never one word).
  """
  if not before or not after:
    return before, ""
  if _ITEM_START.match(after):
    if before.endswith("\n") or after.startswith("\n"):
      return before, ""
    return before.rstrip(" \t"), "\n"
  if before[-1].isspace() or after[0].isspace():
    return before, ""
  return before, " "


def join_pieces(texts: Sequence[tuple[bool, str]]) -> str:
  """Join decoded :meth:`Assembler.pieces` with :func:`chunk_separator` at every boundary."""
  out = ""
  for k, (_, t) in enumerate(texts):
    if k:
      out, sep = chunk_separator(out, t)
      out += sep
    out += t
  return out


def _assembler(token_ids: Sequence[int], tag_vocab: TagVocab, keep_topics: bool,
               cap: int | None, length_unit: int, token_bytes: Any) -> "Assembler":
  """Parse ``token_ids`` with a fresh :class:`StreamParser` into a filled :class:`Assembler`."""
  parser = StreamParser(tag_vocab, cap=cap, length_unit=length_unit, token_bytes=token_bytes)
  asm = Assembler(keep_topics=keep_topics)
  for t in token_ids:
    asm.add(parser.feed(int(t)))
  asm.add(parser.finish())
  return asm


def assemble(token_ids: Sequence[int], tag_vocab: TagVocab, *, keep_topics: bool = False,
             cap: int | None = DEFAULT_CAP, length_unit: int = TOKENS_PER_UNIT,
             token_bytes: Any = None) -> list[int]:
  """Final token ids of an annotated sequence (canonical training layout, sequence mode).

  Args:
    token_ids: 1-D int sequence (any ints; never raises).
    tag_vocab: the vocabulary's tags.
    keep_topics: keep the topic/length tokens of promises that got a chunk.
    cap, length_unit, token_bytes: parser settings (:class:`~selforch_jax.lang.parser.StreamParser`;
      ``token_bytes`` keeps a capped chunk from ending inside a multi-byte character).

  Returns:
    list[int] in logical order (see the module docstring).
  """
  return _assembler(token_ids, tag_vocab, keep_topics, cap, length_unit, token_bytes).tokens()


def assemble_pieces(token_ids: Sequence[int], tag_vocab: TagVocab, *, keep_topics: bool = False,
                    cap: int | None = DEFAULT_CAP, length_unit: int = TOKENS_PER_UNIT,
                    token_bytes: Any = None) -> list[tuple[bool, list[int]]]:
  """:func:`assemble` split at chunk boundaries: ``(is_chunk, ids)`` in logical order
  (:meth:`Assembler.pieces`; the ids concatenated are :func:`assemble`'s)."""
  return _assembler(token_ids, tag_vocab, keep_topics, cap, length_unit, token_bytes).pieces()


def assemble_text(token_ids: Sequence[int], tag_vocab: TagVocab, tokenizer: Any, *,
                  skip_special_tokens: bool = False, separate_chunks: bool = False,
                  **kwargs: Any) -> str:
  """:func:`assemble`, decoded with ``tokenizer.decode`` (tags that degraded to text are written
  as their text unless ``skip_special_tokens``). ``separate_chunks``: each chunk and the text
  around it are decoded apart and joined by :func:`join_pieces` (a chunk that starts a list item
  goes on a new line; words never run together), the text a reader sees. ``kwargs`` go to :func:`assemble`; ``token_bytes``
  defaults to ``tokenizer.token_bytes`` (a cap never splits a character)."""
  kwargs.setdefault("token_bytes", getattr(tokenizer, "token_bytes", None))
  if separate_chunks:
    pieces = assemble_pieces(token_ids, tag_vocab, **kwargs)
    return join_pieces([(c, tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))
                        for c, ids in pieces])
  return tokenizer.decode(assemble(token_ids, tag_vocab, **kwargs),
                          skip_special_tokens=skip_special_tokens)
