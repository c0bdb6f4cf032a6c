"""The mask builder (DESIGN.md §2-§3): annotated tokens -> positions, segments, visibility,
bidirectional flags and death times. One pure function for the trainer (:func:`build_layout`) and
the same logic, incremental, for the runtime (:class:`LayoutBuilder`), both driven by the parser
(:class:`~selforch_jax.lang.parser.StreamParser`), so training and decoding agree by construction.

Segments (ids ``0..S-1`` in order of first token):

* the main thread is cut into segments at each plan entry and each join: a new main segment starts
  with the first main token after a ``</promise>`` that has a length, and with the join (the
  ``<sync/>`` token, or the first token after a forced join);
* each chunk (``<async>`` … ``</async>``) is one segment;
* packed documents never share a segment and never see each other.

Visibility (``visible[s_q, s_k]``; always ``visible[s, s]``):

* a main segment sees every earlier main segment of its document and every chunk of every round
  joined before it: PLAN and continuation are causal, PLAN sees no chunk, after ``<sync/>`` all is
  visible (the ``<sync/>`` token itself sees the chunks);
* chunk k sees what the main segment holding promise k's ``</promise>`` sees, that segment (prefix
  and PLAN up to the end of promise k, earlier joined rounds) and itself, not its siblings; with
  ``async_sees_full_plan`` it sees the whole PLAN instead (the main segments up to the plan end).

Positions: the main thread counts 0, 1, ... per document; with ``base`` the first position after
the PLAN, chunk k starts at ``base + Σ_{j<k} 10·N_j`` and the join continues at
``base + Σ_j 10·N_j`` (N_j: the lengths of all promises of the round, chunks or not).

Death (TIP): ``kill_at[i]`` is the index of the ``<reg_k>`` token that reused the register holding
token i's step (token i is dead for every query from that index on; the killing tag itself does not
see it), or N when token i never dies. Steps and register files are the parser's (per stream).

Bidirectional: main segments are causal; chunk segments are causal (``chunk_bidirectional=False``),
bidirectional (``True``), or bidirectional iff they contain ``<|mask|>``/``[PAD]`` (``"auto"``).

The token rule (:meth:`Layout.token_mask`): query q sees key k iff ``q < kill_at[k]`` and
``visible[seg q, seg k]`` and (``k <= q`` or (``seg q == seg k`` and ``bidir[seg q]``)). It equals
DESIGN.md §2's rule on every layout built from a sequence, because the builder only makes a segment
visible to segments that start after it ends; the extra ``k <= q`` across segments keeps stream-mode
layouts (interleaved threads) causal too, as a KV pool is.

Malformed sequences never raise: the parser's degradation rules apply and are listed in
``Layout.notes`` (``"<token index>: <rule>"``, ``"end: <rule>"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from selforch_jax.lang.events import (
  MAIN, AsyncOpened, Degraded, Event, Fill, PlanEnded, PromiseClosed, RegisterUse, Sync,
)
from selforch_jax.lang.parser import DEFAULT_CAP, StreamParser
from selforch_jax.lang.tags import TOKENS_PER_UNIT, TagVocab

__all__ = ["Layout", "LayoutBuilder", "build_layout", "batch_layouts"]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Attention layout of N tokens in S segments (see the module docstring for the rules).

  Attributes:
    token_ids: ``int32[N]``.
    positions: ``int32[N]`` RoPE position ids.
    segment_ids: ``int32[N]`` in ``[0, S)``.
    visible: ``bool[S, S]``, ``visible[a, b]``: segment a may see segment b.
    bidir: ``bool[S]``, attention inside the segment is bidirectional.
    kill_at: ``int32[N]``, token i is alive for queries ``q < kill_at[i]`` (N: never dies).
    doc_ids: ``int32[N]`` packed-document index (0, 1, ...).
    streams: ``int32[N]``, -1 (MAIN) or the chunk index k within its round.
    segment_streams: ``int32[S]``, -1 for main segments, k for chunk k.
    notes: the degradation rules that applied, ``"<index>: <rule>"``.
  """

  token_ids: np.ndarray
  positions: np.ndarray
  segment_ids: np.ndarray
  visible: np.ndarray
  bidir: np.ndarray
  kill_at: np.ndarray
  doc_ids: np.ndarray
  streams: np.ndarray
  segment_streams: np.ndarray
  notes: tuple[str, ...] = ()

  @property
  def num_tokens(self) -> int:
    """N."""
    return int(self.token_ids.shape[0])

  @property
  def num_segments(self) -> int:
    """S."""
    return int(self.bidir.shape[0])

  def token_mask(self) -> np.ndarray:
    """``bool[N, N]`` query x key: q sees k iff ``q < kill_at[k]``, ``visible[seg q, seg k]`` and
    (``k <= q`` or (same segment and bidirectional)). Every token sees itself."""
    n = self.num_tokens
    idx = np.arange(n)
    seg = self.segment_ids
    alive = idx[:, None] < self.kill_at[None, :]
    vis = self.visible[seg[:, None], seg[None, :]] if n else np.zeros((0, 0), bool)
    same_bidir = (seg[:, None] == seg[None, :]) & self.bidir[seg][:, None]
    return alive & vis & ((idx[None, :] <= idx[:, None]) | same_bidir)

  def alive(self, step: int) -> np.ndarray:
    """``bool[N]``: the tokens present and alive for the query at index ``step`` (``i <= step <
    kill_at[i]``): the live KV after running token ``step``."""
    idx = np.arange(self.num_tokens)
    return (idx <= step) & (step < self.kill_at)


class LayoutBuilder:
  """Incremental mask builder: feed tokens (sequence or stream mode), read :meth:`layout`.

  Args:
    tag_vocab: the vocabulary's tags.
    async_sees_full_plan: chunks see the whole PLAN (Planned Diffusion) instead of the PLAN up to
      the end of their promise.
    chunk_bidirectional: False, True or ``"auto"`` (bidirectional iff the chunk holds a
      ``<|mask|>``/``[PAD]``).
    cap, length_unit: parser settings (:class:`~selforch_jax.lang.parser.StreamParser`).

  Raises:
    ValueError: ``chunk_bidirectional`` not in (False, True, "auto"); invalid ``cap`` /
      ``length_unit`` (from the parser).
  """

  def __init__(self, tag_vocab: TagVocab, *, async_sees_full_plan: bool = False,
               chunk_bidirectional: bool | str = False, cap: int | None = DEFAULT_CAP,
               length_unit: int = TOKENS_PER_UNIT):
    if chunk_bidirectional not in (False, True, "auto"):
      raise ValueError(f"chunk_bidirectional must be False, True or 'auto', got {chunk_bidirectional!r}")
    self.tag_vocab = tag_vocab
    self.async_sees_full_plan = bool(async_sees_full_plan)
    self.chunk_bidirectional = chunk_bidirectional
    self.cap = cap
    self.length_unit = int(length_unit)
    self._tokens: list[int] = []
    self._pos: list[int] = []
    self._seg: list[int] = []
    self._stream: list[int] = []
    self._doc: list[int] = []
    self._kill: dict[int, int] = {}
    self._seg_vis: list[frozenset[int]] = []
    self._seg_stream: list[int] = []
    self._seg_fill: list[bool] = []
    self._notes: list[str] = []
    self._doc_index = -1
    self._start_document()

  # ---- documents ----------------------------------------------------------------------------

  def _start_document(self) -> None:
    self._parser = StreamParser(self.tag_vocab, cap=self.cap, length_unit=self.length_unit)
    self._offset = len(self._tokens)
    self._doc_index += 1
    self._main_pos = 0
    self._main_seg: int | None = None
    self._main_ctx: frozenset[int] = frozenset()
    self._new_round()

  def _new_round(self) -> None:
    self._base = self._main_pos
    self._offsets: list[int] = []
    self._join_pos = self._main_pos
    self._promise_ctx: dict[int, frozenset[int]] = {}
    self._plan_ctx: frozenset[int] = frozenset()
    self._chunk_seg: dict[int, int] = {}
    self._chunk_pos: dict[int, int] = {}

  def new_document(self) -> list[Event]:
    """End the current document (``finish()`` of its parser) and start a packed new one: fresh
    positions from 0, segments that see nothing before.

    Returns:
      The finishing events of the old document.
    """
    ev = self.finish()
    self._start_document()
    return ev

  # ---- feeding ------------------------------------------------------------------------------

  @property
  def num_tokens(self) -> int:
    """Tokens fed so far."""
    return len(self._tokens)

  def feed(self, token_id: int, stream: int | None = None) -> list[Event]:
    """Feed one token (see :meth:`StreamParser.feed`); returns the parser's events (feed indices
    relative to the current document: add ``document_offset``)."""
    ev = self._parser.feed(token_id, stream)
    self._consume(ev)
    return ev

  def finish(self) -> list[Event]:
    """End the current text (:meth:`StreamParser.finish`); returns its events."""
    ev = self._parser.finish()
    self._consume(ev)
    return ev

  @property
  def document_offset(self) -> int:
    """Global index of the current document's first token (parser indices are relative to it)."""
    return self._offset

  def position_of(self, index: int) -> int:
    """Position id of the token at global index ``index``."""
    return self._pos[index]

  def segment_of(self, index: int) -> int:
    """Segment id of the token at global index ``index``."""
    return self._seg[index]

  def visible_segments(self, segment: int) -> frozenset[int]:
    """The segments ``segment`` sees (itself included)."""
    return self._seg_vis[segment]

  # ---- event handling -------------------------------------------------------------------------

  def _new_segment(self, ctx: frozenset[int], stream: int) -> int:
    s = len(self._seg_vis)
    self._seg_vis.append(frozenset(ctx) | {s})
    self._seg_stream.append(stream)
    self._seg_fill.append(False)
    return s

  def _main_vis(self) -> frozenset[int]:
    return self._seg_vis[self._main_seg] if self._main_seg is not None else self._main_ctx

  def _place(self, e: Event) -> None:
    if e.stream == MAIN:
      if self._main_seg is None:
        self._main_seg = self._new_segment(self._main_ctx, MAIN)
      seg, pos = self._main_seg, self._main_pos
      self._main_pos += 1
    else:
      seg = self._chunk_seg[e.stream]
      pos = self._chunk_pos[e.stream]
      self._chunk_pos[e.stream] = pos + 1
    self._tokens.append(int(e.token_id))
    self._pos.append(pos)
    self._seg.append(seg)
    self._stream.append(e.stream)
    self._doc.append(self._doc_index)

  def _consume(self, events: Sequence[Event]) -> None:
    off = self._offset
    for e in events:
      if isinstance(e, Degraded):
        where = "end" if e.at is None else str(e.at + off)
        self._notes.append(f"{where}: {e.rule}")
        continue
      if isinstance(e, PlanEnded):
        self._base = self._main_pos
        units = [self.length_unit * n for n in e.lengths]
        self._offsets = [sum(units[:k]) for k in range(len(units))]
        self._join_pos = self._base + sum(units)
        self._plan_ctx = self._main_vis()
        continue
      if isinstance(e, AsyncOpened):
        ctx = self._plan_ctx if self.async_sees_full_plan else self._promise_ctx.get(e.chunk, self._plan_ctx)
        self._chunk_seg[e.chunk] = self._new_segment(ctx, e.chunk)
        self._chunk_pos[e.chunk] = self._base + self._offsets[e.chunk]
      elif isinstance(e, Sync) and e.round is not None:
        self._main_ctx = self._main_vis() | frozenset(self._chunk_seg.values())
        self._main_seg = None
        self._main_pos = self._join_pos
        self._new_round()
      if e.index is None:
        continue
      self._place(e)
      if isinstance(e, PromiseClosed) and e.promise is not None:
        self._promise_ctx[e.promise] = self._seg_vis[self._main_seg]
        self._main_ctx = self._seg_vis[self._main_seg]
        self._main_seg = None
      elif isinstance(e, RegisterUse):
        for j in e.killed:
          self._kill[j + off] = e.index + off
      elif isinstance(e, Fill) and e.stream != MAIN:
        self._seg_fill[self._chunk_seg[e.stream]] = True

  # ---- output -------------------------------------------------------------------------------

  def layout(self) -> Layout:
    """A snapshot :class:`Layout` of every token fed so far (the current text is not finished:
    call :meth:`finish` first for a complete one)."""
    n = len(self._tokens)
    s = len(self._seg_vis)
    visible = np.zeros((s, s), bool)
    for a, vis in enumerate(self._seg_vis):
      visible[a, sorted(vis)] = True
    streams = np.asarray(self._seg_stream, np.int32).reshape(s)
    if self.chunk_bidirectional == "auto":
      bidir = np.asarray(self._seg_fill, bool).reshape(s) & (streams != MAIN)
    else:
      bidir = (streams != MAIN) & bool(self.chunk_bidirectional)
    kill_at = np.full((n,), n, np.int32)
    for i, j in self._kill.items():
      kill_at[i] = j
    return Layout(
      token_ids=np.asarray(self._tokens, np.int32).reshape(n),
      positions=np.asarray(self._pos, np.int32).reshape(n),
      segment_ids=np.asarray(self._seg, np.int32).reshape(n),
      visible=visible,
      bidir=bidir,
      kill_at=kill_at,
      doc_ids=np.asarray(self._doc, np.int32).reshape(n),
      streams=np.asarray(self._stream, np.int32).reshape(n),
      segment_streams=streams,
      notes=tuple(self._notes),
    )


def build_layout(token_ids: Sequence[int] | np.ndarray, tag_vocab: TagVocab, *,
                 doc_ids: Sequence[int] | np.ndarray | None = None,
                 eos_ids: Sequence[int] | None = None,
                 async_sees_full_plan: bool = False,
                 chunk_bidirectional: bool | str = False,
                 cap: int | None = DEFAULT_CAP,
                 length_unit: int = TOKENS_PER_UNIT) -> Layout:
  """The :class:`Layout` of an annotated token sequence (canonical training layout; DESIGN.md
  §2-§3, rules in the module docstring). Pure: same input, same output.

  Args:
    token_ids: ``int[N]`` token ids.
    tag_vocab: the vocabulary's tags.
    doc_ids: optional ``int[N]`` packed-document ids (e.g. a packed row's ``segment_ids`` without
      padding); a new document starts wherever the value changes. Without it, a new document
      starts after every EOS id.
    eos_ids: the EOS ids (default ``tag_vocab.eos_ids``); ``()`` disables both the EOS split and
      EOS's forced sync.
    async_sees_full_plan, chunk_bidirectional, cap, length_unit: see :class:`LayoutBuilder`.

  Returns:
    Layout (``notes`` lists the degradation rules that applied; malformed input never raises).

  Raises:
    ValueError: ``token_ids`` (or ``doc_ids``) is not 1-D of the same length, or an invalid option.
  """
  toks = np.asarray(token_ids)
  if toks.ndim != 1:
    raise ValueError(f"token_ids must be 1-D, got shape {toks.shape}")
  if toks.size and not np.issubdtype(toks.dtype, np.integer):
    raise ValueError(f"token_ids must be integers, got dtype {toks.dtype}")
  docs = None
  if doc_ids is not None:
    docs = np.asarray(doc_ids)
    if docs.shape != toks.shape:
      raise ValueError(f"doc_ids shape {docs.shape} != token_ids shape {toks.shape}")
  if eos_ids is not None:
    tag_vocab = dataclasses.replace(tag_vocab, eos_ids=tuple(int(i) for i in eos_ids))
  eos = set(tag_vocab.eos_ids)
  b = LayoutBuilder(tag_vocab, async_sees_full_plan=async_sees_full_plan,
                    chunk_bidirectional=chunk_bidirectional, cap=cap, length_unit=length_unit)
  n = toks.shape[0]
  for i in range(n):
    t = int(toks[i])
    if i and ((docs is not None and docs[i] != docs[i - 1]) or
              (docs is None and int(toks[i - 1]) in eos)):
      b.new_document()
    b.feed(t)
  b.finish()
  return b.layout()


def batch_layouts(layouts: Sequence[Layout], pad_to: int, *, pad_id: int = 0) -> dict[str, np.ndarray]:
  """Pad layouts into a batch the model takes directly
  (``model(out["tokens"], out["positions"], out["mask"])``).

  Args:
    layouts: B layouts.
    pad_to: T, at least the longest layout.
    pad_id: token id written on padding.

  Returns:
    dict of numpy arrays: ``tokens int32[B,T]``, ``positions int32[B,T]`` (0 on padding),
    ``mask bool[B,T,T]`` (:meth:`Layout.token_mask`; padding queries and keys see nothing),
    ``valid bool[B,T]``, ``segment_ids int32[B,T]`` (-1 on padding), ``doc_ids int32[B,T]`` (-1 on
    padding), ``kill_at int32[B,T]`` (T on padding and for tokens that never die).

  Raises:
    ValueError: a layout longer than ``pad_to``, or ``pad_to < 1``.
  """
  if pad_to < 1:
    raise ValueError(f"pad_to must be >= 1, got {pad_to}")
  B, T = len(layouts), int(pad_to)
  out = {
    "tokens": np.full((B, T), pad_id, np.int32),
    "positions": np.zeros((B, T), np.int32),
    "mask": np.zeros((B, T, T), bool),
    "valid": np.zeros((B, T), bool),
    "segment_ids": np.full((B, T), -1, np.int32),
    "doc_ids": np.full((B, T), -1, np.int32),
    "kill_at": np.full((B, T), T, np.int32),
  }
  for b, lay in enumerate(layouts):
    n = lay.num_tokens
    if n > T:
      raise ValueError(f"layout {b} has {n} tokens > pad_to={T}")
    out["tokens"][b, :n] = lay.token_ids
    out["positions"][b, :n] = lay.positions
    out["mask"][b, :n, :n] = lay.token_mask()
    out["valid"][b, :n] = True
    out["segment_ids"][b, :n] = lay.segment_ids
    out["doc_ids"][b, :n] = lay.doc_ids
    out["kill_at"][b, :n] = np.where(lay.kill_at >= n, T, lay.kill_at)
  return out
