"""Serializer: structure -> token ids in the canonical layout (DESIGN.md §3), and events -> ids.

Structure::

  serialize([prefix ids..., Round(plan=(text ids..., Promise(topic, N), ...),
                                  chunks=((chunk 1 ids...), (chunk 2 ids...)), sync=True),
             continuation ids...], tag_vocab)
  == prefix · PLAN · <async>c_1</async> · … · <async>c_n</async> · <sync/> · continuation

where a :class:`Promise` is written ``<promise> TOPIC [space] N </promise>`` (N in digit tokens,
``TagVocab.space_ids[0]`` between topic and N when the vocabulary has one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from selforch_jax.lang.events import Event
from selforch_jax.lang.tags import TagVocab

__all__ = ["Promise", "Round", "serialize", "events_to_tokens"]


@dataclasses.dataclass(frozen=True)
class Promise:
  """A plan entry: ``topic_ids`` (text ids) and the length N (chunk of about 10*N tokens)."""

  topic_ids: tuple[int, ...]
  length: int


@dataclasses.dataclass(frozen=True)
class Round:
  """One round: the PLAN (text ids and :class:`Promise` entries), the chunks in promise order
  (chunk k fills promise k; fewer chunks than promises is allowed), and whether ``<sync/>`` ends
  it (False: the text ends or EOS follows)."""

  plan: tuple[int | Promise, ...]
  chunks: tuple[tuple[int, ...], ...] = ()
  sync: bool = True


def _check_text(ids: Iterable[int], forbidden: set[int], where: str) -> list[int]:
  out = [int(i) for i in ids]
  bad = sorted(set(out) & forbidden)
  if bad:
    raise ValueError(f"{where} contains structural tag ids {bad}; they would change the parse")
  return out


def serialize(parts: Sequence[int | Promise | Round], tag_vocab: TagVocab) -> list[int]:
  """Token ids of a document in the canonical layout.

  Args:
    parts: text ids (main thread; registers, fills and EOS allowed), :class:`Round` objects and
      (outside rounds) no bare :class:`Promise`.
    tag_vocab: the tags.

  Returns:
    list[int] that :class:`~selforch_jax.lang.parser.StreamParser` reads back as the given
    structure (no :class:`~selforch_jax.lang.events.Degraded` event, when chunks fit the cap).

  Raises:
    ValueError: a bare Promise outside a Round, more chunks than promises, a round without a
      promise, structural tags (``<promise>``, ``</promise>``, ``<async>``, ``</async>``, and in
      plans/chunks ``<sync/>`` and EOS) inside text, a topic ending in a number token when the
      vocabulary has no space id to separate it from the length, or a negative length.
  """
  tv = tag_vocab
  structural = {tv.promise_open, tv.promise_close, tv.async_open, tv.async_close}
  inner_forbidden = structural | {tv.sync} | set(tv.eos_ids)
  out: list[int] = []
  for part in parts:
    if isinstance(part, Promise):
      raise ValueError("a Promise must be inside a Round's plan")
    if isinstance(part, Round):
      promises = 0
      for item in part.plan:
        if isinstance(item, Promise):
          promises += 1
          topic = _check_text(item.topic_ids, inner_forbidden | set(tv.registers) | {tv.mask, tv.pad},
                              "a promise topic")
          if not tv.space_ids and topic and tv.is_number(topic[-1]):
            raise ValueError("a topic ending in a number needs a space id before the length")
          out.append(tv.promise_open)
          out.extend(topic)
          if tv.space_ids:
            out.append(tv.space_ids[0])
          out.extend(tv.encode_length(item.length))
          out.append(tv.promise_close)
        else:
          out.extend(_check_text([item], inner_forbidden, "a plan"))
      if promises == 0:
        raise ValueError("a Round needs at least one Promise in its plan")
      if len(part.chunks) > promises:
        raise ValueError(f"{len(part.chunks)} chunks for {promises} promises")
      for chunk in part.chunks:
        out.append(tv.async_open)
        out.extend(_check_text(chunk, inner_forbidden, "a chunk"))
        out.append(tv.async_close)
      if part.sync:
        out.append(tv.sync)
    else:
      out.extend(_check_text([part], structural, "main text"))
  return out


def events_to_tokens(events: Iterable[Event]) -> list[int]:
  """The fed token ids back from a parser's events (the token events, in feed order); the
  inverse of feeding: ``events_to_tokens(parse(ids)) == ids``."""
  toks = sorted((e.index, e.token_id) for e in events if e.index is not None)
  return [t for _, t in toks]
