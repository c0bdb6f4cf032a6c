"""The one host-side mask rule of the engine (DESIGN.md §2), for a step and for a sequence.

Query q sees key k iff::

  alive[k] and visible[seg(q), seg(k)] and
  (seg(q) != seg(k) or bidir[seg(q)] or order(k) <= order(q))

``order`` is the decode index of a token (its index in the annotated training sequence),
so "causal inside a segment" means "not after me in the sequence". Every scheduler builds
its step masks with :func:`step_mask`; the train = decode oracle compares the engine with
full-sequence forwards whose mask is :func:`sequence_mask` (or the lang builder's, which
implements the same rule).

:class:`SegmentTable` is a growable ``visible`` / ``bidir`` pair for schedulers that
create segments while decoding (a fork = a new segment that sees its parent's).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from selforch_jax.runtime.kv_pool import ALIVE, KVPool


def _check_tables(visible: np.ndarray, bidir: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  visible = np.asarray(visible, bool)
  bidir = np.asarray(bidir, bool)
  if visible.ndim != 2 or visible.shape[0] != visible.shape[1]:
    raise ValueError(f"visible must be a square [G, G] bool matrix, got shape {visible.shape}")
  if bidir.shape != (visible.shape[0],):
    raise ValueError(f"bidir shape {bidir.shape} != (G,) = ({visible.shape[0]},)")
  return visible, bidir


def step_mask(pool: KVPool, q_segments, q_orders, visible, bidir,
              key_keep: np.ndarray | None = None) -> np.ndarray:
  """The visibility mask of one engine step over all pool slots.

  Call it after the step's own slots were written (:meth:`KVPool.write`), so the queries
  see each other as the rule says.

  Args:
    pool: the :class:`KVPool` (its ``state``, ``segment`` and ``order`` are read).
    q_segments: int ``[T]`` segment of each query (``< G``).
    q_orders: int ``[T]`` decode index of each query.
    visible: bool ``[G, G]``: ``visible[a, b]`` = segment a may see segment b.
    bidir: bool ``[G]``: attention inside the segment is bidirectional.
    key_keep: optional bool ``[S]``: further keys to hide this step (SOL sparsity).

  Returns:
    bool ``[T, S]`` (``S = pool.num_slots``).

  Raises:
    ValueError: malformed tables, or a segment id (query or ALIVE slot) outside ``[0, G)``.
  """
  visible, bidir = _check_tables(visible, bidir)
  G = visible.shape[0]
  q_segments = np.asarray(q_segments, np.int64).reshape(-1)
  q_orders = np.asarray(q_orders, np.int64).reshape(-1)
  if q_segments.shape != q_orders.shape:
    raise ValueError(f"q_segments {q_segments.shape} and q_orders {q_orders.shape} differ")
  alive = pool.state == ALIVE
  seg = pool.segment.astype(np.int64)
  if q_segments.size and (q_segments.min() < 0 or q_segments.max() >= G):
    raise ValueError(f"query segment ids must be in [0, {G}), got {q_segments.tolist()[:8]}")
  if np.any(alive & (seg >= G)):
    raise ValueError(f"an alive slot has a segment id >= G = {G}; grow the visibility table")
  kseg = np.where(alive, seg, 0)
  m = visible[q_segments][:, kseg]                        # [T, S]
  same = q_segments[:, None] == kseg[None, :]
  causal_ok = pool.order[None, :] <= q_orders[:, None]
  m &= ~same | bidir[q_segments][:, None] | causal_ok
  m &= alive[None, :]
  if key_keep is not None:
    m &= np.asarray(key_keep, bool)[None, :]
  return m


def sequence_mask(segments, visible, bidir, kill_at=None) -> np.ndarray:
  """The same rule over one whole annotated sequence (the training forward's mask).

  Args:
    segments: int ``[N]`` segment ids. visible: bool ``[G, G]``. bidir: bool ``[G]``.
    kill_at: optional int ``[N]``: token i is dead for queries at index ``>= kill_at[i]``
      (a large value = never).

  Returns:
    bool ``[N, N]`` (query x key), order = index.
  """
  visible, bidir = _check_tables(visible, bidir)
  seg = np.asarray(segments, np.int64)
  n = seg.shape[0]
  idx = np.arange(n)
  m = visible[seg][:, seg]
  m &= (seg[:, None] != seg[None, :]) | bidir[seg][:, None] | (idx[None, :] <= idx[:, None])
  if kill_at is not None:
    m &= idx[:, None] < np.asarray(kill_at, np.int64)[None, :]
  return m


class SegmentTable:
  """A growable segment visibility table: ``visible [G, G]`` and ``bidir [G]`` (numpy).

  Example::

    t = SegmentTable()
    prompt = t.new()                        # sees itself (causally)
    thread = t.new(sees=[prompt])           # a fork: sees the prompt and itself
    join = t.new(sees=[prompt, thread])
  """

  def __init__(self, capacity: int = 16):
    self.visible = np.zeros((capacity, capacity), bool)
    self.bidir = np.zeros(capacity, bool)
    self.size = 0

  def new(self, sees: Iterable[int] = (), bidir: bool = False) -> int:
    """Add a segment that sees itself and the segments ``sees``; returns its id."""
    sees = list(sees)
    if any(not 0 <= s < self.size for s in sees):
      raise ValueError(f"sees {sees} names unknown segments (have {self.size})")
    if self.size == self.visible.shape[0]:
      cap = 2 * self.size
      vis = np.zeros((cap, cap), bool)
      vis[:self.size, :self.size] = self.visible
      self.visible = vis
      self.bidir = np.concatenate([self.bidir, np.zeros(cap - self.size, bool)])
    g = self.size
    self.size += 1
    self.visible[g, g] = True
    self.visible[g, sees] = True
    self.bidir[g] = bidir
    return g

  def see(self, seg: int, others: Iterable[int]) -> None:
    """Let ``seg`` also see ``others`` from now on (e.g. a join after a sync)."""
    self.visible[seg, list(others)] = True

  def tables(self) -> tuple[np.ndarray, np.ndarray]:
    """``(visible [G, G], bidir [G])`` views of the segments created so far."""
    return self.visible[:self.size, :self.size], self.bidir[:self.size]
