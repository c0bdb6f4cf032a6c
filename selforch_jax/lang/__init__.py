"""The orchestration language (DESIGN.md §3) and the one mask builder (DESIGN.md §2).

Modules (one job each):

* :mod:`~selforch_jax.lang.tags` — tag strings, :class:`TagVocab` (tag <-> id, digit and space ids),
  :func:`add_tags` (tokenizer + model rows, idempotent, in place).
* :mod:`~selforch_jax.lang.embeddings` — :func:`resize_vocab` (grow ``embed``/``lm_head``, mean init).
* :mod:`~selforch_jax.lang.events` — the parser's event types and :data:`DEGRADE_RULES`.
* :mod:`~selforch_jax.lang.parser` — :class:`StreamParser` (``feed(token_id, stream=None)``,
  ``finish()``), :func:`parse`.
* :mod:`~selforch_jax.lang.assemble` — :class:`Assembler`, :func:`assemble`, :func:`assemble_text`:
  final text in logical order, tags stripped.
* :mod:`~selforch_jax.lang.serialize` — :class:`Promise`, :class:`Round`, :func:`serialize`
  (structure -> canonical token ids), :func:`events_to_tokens`.
* :mod:`~selforch_jax.lang.mask` — :class:`Layout`, :class:`LayoutBuilder`, :func:`build_layout`,
  :func:`batch_layouts`.

Stable names the runtime consumes (keep them):

``Layout`` fields — ``token_ids int32[N]``, ``positions int32[N]``, ``segment_ids int32[N]``,
``visible bool[S,S]``, ``bidir bool[S]``, ``kill_at int32[N]`` (token i is alive for queries
``q < kill_at[i]``; N = never dies), ``doc_ids int32[N]``, ``streams int32[N]`` (-1 main, k chunk),
``segment_streams int32[S]``, ``notes``; methods ``token_mask() -> bool[N,N]``,
``alive(step) -> bool[N]``.

Events (``index``: feed index or None if synthetic; ``stream``: ``MAIN == -1`` or chunk k;
``token_id``): ``Text``, ``Fill``, ``PromiseOpened``, ``PromiseClosed(open_index, promise, round,
topic_ids, length)``, ``PromiseAbandoned(open_index)``, ``PlanEnded(round, lengths)`` (fork
point), ``AsyncOpened(chunk, round)``, ``AsyncClosed(chunk, round, forced)``, ``Sync(forced,
round, chunks)`` (join point), ``RegisterUse(register, killed)`` (evict ``killed`` before running
this token), ``EndOfText``, ``Degraded(rule, at)``.

Runtime recipe (PASTA through :class:`LayoutBuilder`, stream mode): feed the main thread's tokens
with ``stream=None``; on ``PlanEnded`` fork one thread per promise; feed thread k's tokens (its
``<async>`` first) with ``stream=k`` in any interleaving; stop a thread at its ``AsyncClosed``;
when all are closed feed ``<sync/>``; on ``RegisterUse`` evict ``killed``. Each fed token's
position, segment and visible segments are ``position_of``, ``segment_of``,
``visible_segments``; ``layout()`` gives the same mask as :func:`build_layout` of the canonical
sequence, up to the permutation of thread tokens.

Rules chosen where DESIGN.md is silent (details in each module): tags are appended in the order
``<promise> </promise> <async> </async> <sync/> <|mask|> [PAD] <reg_0..K-1>``; nested ``<async>``
and every tag other than ``</async>``/registers/fills inside a chunk are chunk text; a chunk ends
at ``</async>``, at ``max(2·10·N, cap)`` tokens, at EOS or the end; a main token after the chunks
without ``<sync/>`` joins implicitly; every stream has its own register file; a step runs from its
``<reg_k>`` to the stream's next register tag / ``<sync/>`` / EOS / ``</async>`` (exclusive) and a
killed step is dead for every later token of every stream (the join sees only a thread's surviving
tokens); the killing ``<reg_k>`` itself does not see the killed step.
"""

from selforch_jax.lang.assemble import Assembler, assemble, assemble_text
from selforch_jax.lang.embeddings import resize_vocab
from selforch_jax.lang.events import (
  DEGRADE_RULES, MAIN, AsyncClosed, AsyncOpened, Degraded, EndOfText, Event, Fill, PlanEnded,
  PromiseAbandoned, PromiseClosed, PromiseOpened, RegisterUse, Sync, Text,
)
from selforch_jax.lang.mask import Layout, LayoutBuilder, batch_layouts, build_layout
from selforch_jax.lang.parser import DEFAULT_CAP, StreamParser, parse
from selforch_jax.lang.serialize import Promise, Round, events_to_tokens, serialize
from selforch_jax.lang.tags import (
  ASYNC_CLOSE, ASYNC_OPEN, DEFAULT_NUM_REGISTERS, FIXED_TAGS, MASK, PAD, PROMISE_CLOSE,
  PROMISE_OPEN, SYNC, TOKENS_PER_UNIT, TagVocab, add_tags, register_tag, tag_strings,
)

__all__ = [
  "Assembler", "assemble", "assemble_text", "resize_vocab",
  "DEGRADE_RULES", "MAIN", "AsyncClosed", "AsyncOpened", "Degraded", "EndOfText", "Event", "Fill",
  "PlanEnded", "PromiseAbandoned", "PromiseClosed", "PromiseOpened", "RegisterUse", "Sync", "Text",
  "Layout", "LayoutBuilder", "batch_layouts", "build_layout",
  "DEFAULT_CAP", "StreamParser", "parse",
  "Promise", "Round", "events_to_tokens", "serialize",
  "ASYNC_CLOSE", "ASYNC_OPEN", "DEFAULT_NUM_REGISTERS", "FIXED_TAGS", "MASK", "PAD",
  "PROMISE_CLOSE", "PROMISE_OPEN", "SYNC", "TOKENS_PER_UNIT", "TagVocab", "add_tags",
  "register_tag", "tag_strings",
]
