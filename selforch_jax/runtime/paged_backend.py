"""The engine's kernel path: attention over the paged pool with the Pallas paged kernel.

By default the engine hands the model a dense ``bool [T, S]`` mask built by
:func:`~selforch_jax.runtime.mask.step_mask` (the jnp reference, DESIGN.md §2.3). An engine
built with ``attention="paged"`` (opt-in, for GPUs; :func:`default_attention_impl` says why)
hands it a :class:`PagedAttentionMask` instead for steps of at most
``engine.PAGED_MAX_QUERIES`` queries: the same visibility rule, as the per-slot metadata
the kernel reads (alive bits, segment ids, decode orders; the queries' segments and orders; the
segment tables), and the model's attention calls
:func:`kernels_pallas.paged_attention.paged_attention` with it — tiles of dead or invisible pages
are skipped instead of masked.

The engine's device KV row ``[1, S, K, Dh]`` (``S = num_pages * page_size``, slot = ``page *
page_size + offset``) is viewed as the kernel's ``[K, num_pages, page_size, Dh]`` pages; the page
table of the single engine row lists every page (``arange(num_pages)``): which slots count is
decided by the alive bits and the visibility rule, exactly as in ``step_mask``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import paged_attention as pa
from selforch_jax.runtime.kv_pool import ALIVE, KVPool

__all__ = ["PagedAttentionMask", "build_paged_mask", "default_attention_impl", "needs_dense_mask"]


@dataclasses.dataclass(frozen=True)
class PagedAttentionMask:
  """Visibility of one engine step in the paged kernel's form (a pytree; the model calls it).

  Attributes (device or numpy arrays):
    slot_alive: bool ``[num_pages, page_size]`` (pool ALIVE and not hidden by ``key_keep``).
    slot_segment, slot_order: int32 ``[num_pages, page_size]`` (0 on slots that are not alive).
    q_segment, q_order: int32 ``[1, T]`` (padding queries use segment ``G - 1``, a row that sees
      nothing).
    visible: bool ``[1, G, G]``; bidir: bool ``[1, G]``.
    interpret: static; run the kernel in Pallas interpret mode (CPU tests).
  """

  slot_alive: jax.Array
  slot_segment: jax.Array
  slot_order: jax.Array
  q_segment: jax.Array
  q_order: jax.Array
  visible: jax.Array
  bidir: jax.Array
  interpret: bool = False

  @property
  def shape(self) -> tuple[int, int, int]:
    """``(1, T, S)``: the dense mask this one stands for (the model checks it)."""
    P, ps = self.slot_alive.shape
    return (1, self.q_segment.shape[1], P * ps)

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Attention of the step's queries over the pool.

    Args:
      q: ``[1, T, H, Dh]`` (RoPE applied); k, v: ``[1, S, K, Dh]`` the layer's KV row after this
        step's writes.

    Returns:
      ``[1, T, H, Dh]`` in q's dtype; a query that sees no slot gets 0.
    """
    P, ps = self.slot_alive.shape
    _, S, K, Dh = k.shape
    kp = jnp.transpose(k[0].reshape(P, ps, K, Dh), (2, 0, 1, 3)).astype(q.dtype)
    vp = jnp.transpose(v[0].reshape(P, ps, K, Dh), (2, 0, 1, 3)).astype(q.dtype)
    out = pa.paged_attention(jnp.transpose(q, (0, 2, 1, 3)), kp, vp,
                             jnp.arange(P, dtype=jnp.int32)[None], self.slot_alive,
                             self.slot_segment, self.slot_order, self.q_segment, self.q_order,
                             self.visible, self.bidir, interpret=self.interpret)
    return jnp.transpose(out, (0, 2, 1, 3))


jax.tree_util.register_dataclass(
    PagedAttentionMask,
    data_fields=["slot_alive", "slot_segment", "slot_order", "q_segment", "q_order", "visible",
                 "bidir"],
    meta_fields=["interpret"])


def _bucket(n: int) -> int:
  return 1 << (max(int(n), 1) - 1).bit_length()


def build_paged_mask(pool: KVPool, q_segments, q_orders, visible, bidir, *, num_queries: int,
                     key_keep: np.ndarray | None = None, interpret: bool = False
                     ) -> PagedAttentionMask:
  """The :class:`PagedAttentionMask` of one step (the same rule as ``runtime.mask.step_mask``).

  Args:
    pool: the :class:`KVPool` after the step's own slots were written.
    q_segments, q_orders: int ``[T]`` of the real queries.
    visible: bool ``[G, G]``; bidir: bool ``[G]``.
    num_queries: the padded query count ``Tb >= T`` (padding queries see nothing).
    key_keep: optional bool ``[S]``: keys hidden for this step only.
    interpret: Pallas interpret mode.

  Returns:
    PagedAttentionMask with G padded to a power of two (> G; the last row is the padding
    queries' empty segment), so that a run compiles few shapes.

  Raises:
    ValueError: a query segment outside ``[0, G)``, an alive slot's segment ``>= G``, or an
      order beyond int32.
  """
  visible = np.asarray(visible, bool)
  bidir = np.asarray(bidir, bool)
  G = visible.shape[0]
  q_segments = np.asarray(q_segments, np.int64).reshape(-1)
  q_orders = np.asarray(q_orders, np.int64).reshape(-1)
  T = q_segments.shape[0]
  if T and (q_segments.min() < 0 or q_segments.max() >= G):
    raise ValueError(f"query segment ids must be in [0, {G}), got {q_segments.tolist()[:8]}")
  if max(int(pool.order.max(initial=0)), int(q_orders.max(initial=0))) >= 2 ** 31:
    raise ValueError("decode orders beyond int32 range")
  Gp = _bucket(G + 1)
  vis = np.zeros((1, Gp, Gp), bool)
  vis[0, :G, :G] = visible
  bid = np.zeros((1, Gp), bool)
  bid[0, :G] = bidir
  alive = pool.state == ALIVE
  if np.any(alive & (pool.segment >= G)):
    raise ValueError(f"an alive slot has a segment id >= G = {G}; grow the visibility table")
  if key_keep is not None:
    alive = alive & np.asarray(key_keep, bool)
  shape = (pool.num_pages, pool.page_size)
  qs = np.full((1, num_queries), Gp - 1, np.int32)
  qo = np.zeros((1, num_queries), np.int32)
  qs[0, :T] = q_segments
  qo[0, :T] = q_orders
  return PagedAttentionMask(
      slot_alive=alive.reshape(shape),
      slot_segment=np.where(alive, pool.segment, 0).astype(np.int32).reshape(shape),
      slot_order=np.where(alive, pool.order, 0).astype(np.int32).reshape(shape),
      q_segment=qs, q_order=qo, visible=vis, bidir=bid, interpret=interpret)


def default_attention_impl() -> str:
  """The engine's attention for ``attention="auto"``: ``"reference"`` (the dense jnp path over
  the key window) on every backend. The Pallas paged kernel (``"paged"``) stays opt-in: on one
  H200 its decode step ran at 0.45-0.60x the dense path's speed with half the pool evicted
  (``bench/results/engine_gpu_h200.json``), and its TPU lowering is not written."""
  return "reference"


def needs_dense_mask(spec) -> bool:
  """Whether a :class:`~selforch_jax.runtime.step.ForwardSpec` needs the dense ``bool [T, S]``
  mask (the jnp reference attention) instead of the paged kernel: it asks for the attention
  mass per slot, a sparsity (QUEST / recency select keys per query inside the step) or carries
  a per-query key keep ``[T, S]``. The engine runs such steps on the dense path also when its
  attention is ``"paged"``; views, hidden, MLP channel keep and fake-quant work on both."""
  return ("attn_mass" in spec.outputs or str(spec.sparsity).strip() != "none"
          or spec.query_key_keep is not None)
