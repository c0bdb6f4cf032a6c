"""Events of the streaming parser (:class:`selforch_jax.lang.parser.StreamParser`).

Every event has ``index`` (the feed index of the token it stands for: 0 for the first token fed
to the parser, 1 for the next, ...; ``None`` for a *synthetic* event that no token carries),
``stream`` (:data:`MAIN` for the main thread, ``k >= 0`` for chunk k of the current round) and
``token_id`` (``None`` when synthetic).

**Token events** (``index is not None``): exactly one per fed token, in feed order, so the token
stream can always be rebuilt from the events (:func:`selforch_jax.lang.serialize.events_to_tokens`):
:class:`Text`, :class:`Fill`, :class:`PromiseOpened`, :class:`PromiseClosed`, :class:`AsyncOpened`,
:class:`AsyncClosed`, :class:`Sync`, :class:`RegisterUse`, :class:`EndOfText`.

**Synthetic events** (``index is None``): :class:`PromiseAbandoned`, :class:`PlanEnded`, an
implicit :class:`AsyncOpened`, a forced :class:`AsyncClosed` / :class:`Sync`, :class:`Degraded`.
Synthetic events come before the token event of the token that caused them, except a cap close
(after the chunk's last token).
"""

from __future__ import annotations

import dataclasses

__all__ = [
  "MAIN", "Event", "Text", "Fill", "PromiseOpened", "PromiseClosed", "PromiseAbandoned",
  "PlanEnded", "AsyncOpened", "AsyncClosed", "Sync", "RegisterUse", "EndOfText", "Degraded",
  "DEGRADE_RULES",
]

MAIN = -1  # stream id of the main thread

# Degraded.rule values (DESIGN.md §3: malformed output never crashes and never loses text).
DEGRADE_RULES = {
  "stray_tag": "a </promise>, </async> or <async> with nothing to apply to is plain text",
  "tag_in_promise": "a tag before </promise> abandons the promise: its tokens become plain text",
  "unclosed_promise": "a promise still open at EOS / end / plan end is abandoned (plain text)",
  "promise_without_length": "a closed promise without a length N is plan text without a chunk",
  "tag_in_chunk": "inside a chunk, <promise>, </promise>, <async> and <sync/> are chunk text",
  "chunk_cap": "a chunk reaching max(2*10*N, cap) tokens after <async> is closed",
  "unclosed_chunk": "a chunk still open at <sync/> / EOS / end is closed",
  "implicit_join": "a main-thread token after the chunks of a round, without <sync/>, joins first",
  "unmatched_promise": "a round joined with fewer chunks than promises: those promises stay text",
  "eos_in_thread": "EOS generated inside a thread (stream mode) is chunk text and ends the thread",
  "implicit_async": "stream mode: the first token of a thread was not <async>; it is opened anyway",
  "closed_thread": "stream mode: a token for a closed thread is appended to it as text",
  "no_such_thread": "stream mode: a token for a stream with no promise is read as main-thread text",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Event:
  """Base class. ``index``: feed index or None (synthetic); ``stream``: MAIN or chunk k;
  ``token_id``: the token (None when synthetic)."""

  index: int | None = None
  stream: int = MAIN
  token_id: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Text(Event):
  """A content token of ``stream``: plain text, a promise's topic/length token (between
  :class:`PromiseOpened` and its close), a tag that degraded to text, or a token of a chunk."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fill(Event):
  """``<|mask|>`` or ``[PAD]`` (diffusion chunk filler); stripped from the final text."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromiseOpened(Event):
  """``<promise>`` in the main thread; topic tokens follow as :class:`Text` events."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromiseClosed(Event):
  """``</promise>``.

  Attributes:
    open_index: feed index of the matching ``<promise>``.
    promise: k, the index of this plan entry in its round (its chunk is chunk k), or None when
      the promise has no length (it gets no chunk; ``promise_without_length``).
    round: the round number (per parser, from 0), or None with ``promise`` None.
    topic_ids: the topic's token ids (the length digits and surrounding spaces stripped; all
      inner tokens when there is no length).
    length: N (the chunk is about ``10*N`` tokens), or None.
  """

  open_index: int = -1
  promise: int | None = None
  round: int | None = None
  topic_ids: tuple[int, ...] = ()
  length: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromiseAbandoned(Event):
  """Synthetic: the promise opened at ``open_index`` will never close; its ``<promise>`` tag and
  its topic tokens are plain text."""

  open_index: int = -1


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanEnded(Event):
  """Synthetic: the PLAN of ``round`` is complete (before its first chunk opens, or at its join
  when no chunk opened). The runtime forks the threads here: chunk k reserves ``10*lengths[k]``
  positions.

  Attributes:
    round: round number.
    lengths: N of every promise of the round, in plan order.
  """

  round: int = 0
  lengths: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncOpened(Event):
  """``<async>`` opening chunk ``chunk`` of ``round`` (``stream == chunk``); synthetic
  (``index`` None) when a thread's first token was not ``<async>`` (stream mode)."""

  chunk: int = 0
  round: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncClosed(Event):
  """``</async>`` closing chunk ``chunk`` (``stream == chunk``), or a synthetic forced close
  (``forced`` True: cap, ``<sync/>`` / EOS / end with the chunk open, implicit join)."""

  chunk: int = 0
  round: int = 0
  forced: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sync(Event):
  """Join: what follows in the main thread sees every chunk of the round. A ``<sync/>`` token
  (``forced`` False), or synthetic and forced (EOS / end / implicit join). A ``<sync/>`` with no
  round open is a no-op join (``round`` None).

  Attributes:
    forced: True for a synthetic join.
    round: the round joined, or None.
    chunks: indices of the chunks that were opened in the round (what the join sees).
  """

  forced: bool = False
  round: int | None = None
  chunks: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RegisterUse(Event):
  """``<reg_k>`` in ``stream``: starts a step held in register ``register`` of that stream.

  Attributes:
    register: k.
    killed: feed indices of the step register k of this stream held before (now dead: no later
      token sees them; the runtime evicts them before running this token); empty if k was free.
  """

  register: int = 0
  killed: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndOfText(Event):
  """An EOS id (``TagVocab.eos_ids``) in the main thread, after forced closes and a forced join.
  The parser then starts afresh (no promise, no round, empty register files)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Degraded(Event):
  """Synthetic: a degradation rule applied (``rule`` is a key of :data:`DEGRADE_RULES`) because
  of the token at feed index ``at`` (None: at :meth:`StreamParser.finish`)."""

  rule: str = ""
  at: int | None = None
