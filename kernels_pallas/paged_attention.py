"""Paged decode attention with alive bits and segment visibility, Pallas kernel + jnp reference.

A decode step runs a few query tokens per sequence (``Tq``: PASTA threads, PTD tree nodes,
Orthrus blocks) against a paged KV pool shared by all sequences. Each pool slot carries an
alive bit (TIP eviction, SOL sparsity), a segment id and a sequence order; the rule of
DESIGN.md §2 (:mod:`kernels_pallas.segment_mask`) decides which slots a query sees. Softmax
over the visible slots, scale default ``D ** -0.5``, float32 accumulation, output in q's dtype;
**a query that sees no slot outputs 0** (never NaN), as the reference.

Algorithm: JAX's GPU paged attention (``pallas/ops/gpu/paged_attention.py``) — the whole page
pool of one KV head is the kernel's block; page ids are read from a per-sequence list and pages
are gathered ``pages_per_block`` at a time; FlashAttention-2 online softmax (Dao 2023) over
them; optional split of the page list over ``num_splits`` programs whose partial results
(``acc``, ``m``, ``l``) are merged afterwards (flash-decoding). GQA is folded into the rows:
the ``H // K`` query heads of a KV head and the ``Tq`` tokens form one ``[H//K * Tq, D]``
row block, so each KV page is read once per KV head.

Page skipping: a ``jnp`` pre-pass (:func:`visible_pages`; the per-tile summaries of
:func:`kernels_pallas.segment_mask.tile_visibility` with one q tile = the step's queries and
one kv tile = one page) marks the page-table entries that hold a slot visible to some query;
unused entries (``-1``) and pages whose slots are all dead or invisible are dropped from the
compacted list the kernel iterates over. Exact at page level, hence conservative.

Portability: rows padded to a power of two >= 16, D to a power of two >= 16 (zeros). On GPU
(``interpret=False``) ``page_size * pages_per_block`` must be a power of two >= 16 (Triton).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import segment_mask as sm
from kernels_pallas.segment_attention import (_check_bool, _check_int, _check_shape, _dtype,
                                              _shape, _online_softmax_step, _row_mask,
                                              attention_from_mask, TOLERANCES)

__all__ = ["PagedBlockSizes", "paged_attention", "paged_attention_reference", "visible_pages",
           "page_skip_ratio", "validate_inputs", "check_values", "TOLERANCES"]

_LOG2E = math.log2(math.e)
_MIN_GPU_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class PagedBlockSizes:
  """Block parameters of :func:`paged_attention`.

  Attributes:
    pages_per_block: pages gathered per inner-loop step (the kv tile is
      ``pages_per_block * page_size`` slots). ``None``: the smallest count giving >= 16 slots.
    num_splits: programs the (compacted) page list of one (sequence, KV head) is split over;
      their partial softmax states are merged in ``jnp`` (flash-decoding). 1 = no split.
    num_warps, num_stages: Triton parameters (GPU only).
  """
  pages_per_block: int | None = None
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2


# ---------------------------------------------------------------------------------------------
# validation

def validate_inputs(q, k_pages, v_pages, page_table, slot_alive, slot_segment, slot_order,
                    q_segment, q_order, visible, bidir, *,
                    block_sizes: PagedBlockSizes | None = None, interpret: bool = True):
  """Static (shape/dtype) validation of :func:`paged_attention` inputs (``ValueError``)."""
  qs, ks, vs = _shape(q), _shape(k_pages), _shape(v_pages)
  if len(qs) != 4:
    raise ValueError(f"q must have shape [B, H, Tq, D], got {qs}")
  if len(ks) != 4:
    raise ValueError(f"k_pages must have shape [K, num_pages, page_size, D], got {ks}")
  if ks != vs:
    raise ValueError(f"k_pages and v_pages must have the same shape, got {ks} and {vs}")
  B, H, Tq, D = qs
  K, P, ps, Dk = ks
  if Dk != D:
    raise ValueError(f"k_pages head dim {Dk} != q head dim {D} (q {qs}, k_pages {ks})")
  if K < 1 or H % K:
    raise ValueError(f"number of q heads H={H} must be a multiple of KV heads K={K} "
                     f"(q {qs}, k_pages {ks})")
  if min(B, Tq, D, P, ps) < 1:
    raise ValueError(f"empty input: q {qs}, k_pages {ks}")
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    if not jnp.issubdtype(_dtype(x), jnp.floating):
      raise ValueError(f"{name} must be floating point, got {_dtype(x)}")
  if not (_dtype(q) == _dtype(k_pages) == _dtype(v_pages)):
    raise ValueError(f"q, k_pages, v_pages must share a dtype, got {_dtype(q)}, "
                     f"{_dtype(k_pages)}, {_dtype(v_pages)}")
  pts = _shape(page_table)
  if len(pts) != 2 or pts[0] != B or pts[1] < 1:
    raise ValueError(f"page_table must have shape [B={B}, max_pages >= 1], got {pts}")
  _check_int("page_table", page_table)
  for name, x in (("slot_alive", slot_alive), ("slot_segment", slot_segment),
                  ("slot_order", slot_order)):
    _check_shape(name, x, (P, ps), "[num_pages, page_size]")
  _check_bool("slot_alive", slot_alive)
  _check_int("slot_segment", slot_segment)
  _check_int("slot_order", slot_order)
  for name, x in (("q_segment", q_segment), ("q_order", q_order)):
    _check_shape(name, x, (B, Tq), "[B, Tq]")
    _check_int(name, x)
  vis = _shape(visible)
  if len(vis) != 3 or vis[0] != B or vis[1] != vis[2] or vis[1] < 1:
    raise ValueError(f"visible must have shape [B, G, G] with B={B}, G >= 1, got {vis}")
  _check_bool("visible", visible)
  _check_shape("bidir", bidir, (B, vis[1]), "[B, G]")
  _check_bool("bidir", bidir)
  if block_sizes is not None:
    ppb = block_sizes.pages_per_block
    if ppb is not None and (not isinstance(ppb, (int, np.integer)) or ppb < 1):
      raise ValueError(f"pages_per_block must be a positive int or None, got {ppb!r}")
    if not isinstance(block_sizes.num_splits, (int, np.integer)) or block_sizes.num_splits < 1:
      raise ValueError(f"num_splits must be a positive int, got {block_sizes.num_splits!r}")
    if not interpret:
      bk = ps * _pages_per_block(block_sizes, ps)
      if bk < _MIN_GPU_BLOCK or bk & (bk - 1) or ps & (ps - 1):
        raise ValueError(f"page_size={ps} x pages_per_block: compiled (GPU/Triton) kernels "
                         f"need a power-of-two page_size and a kv tile of >= "
                         f"{_MIN_GPU_BLOCK} slots (power of two), got {bk}")


def check_values(page_table, slot_segment, q_segment, visible, *, num_pages: int | None = None,
                 allow_out_of_range: bool = False):
  """Host-side value checks (concrete arrays): page ids in ``[-1, num_pages)`` and segment ids
  in ``[0, G)`` (unless ``allow_out_of_range``). Raises ``ValueError``."""
  pt = np.asarray(page_table)
  P = np.shape(slot_segment)[0] if num_pages is None else num_pages
  if pt.size and (pt.min() < -1 or pt.max() >= P):
    raise ValueError(f"page_table values must lie in [-1, num_pages={P}), got range "
                     f"[{pt.min()}, {pt.max()}] (shape {pt.shape})")
  G = np.shape(visible)[-1]
  for name, x in (("slot_segment", slot_segment), ("q_segment", q_segment)):
    x = np.asarray(x)
    if x.size and not allow_out_of_range and (x.min() < 0 or x.max() >= G):
      raise ValueError(f"{name} values must lie in [0, G={G}), got range "
                       f"[{x.min()}, {x.max()}] (shape {x.shape})")


def _pages_per_block(block_sizes: PagedBlockSizes, page_size: int) -> int:
  if block_sizes.pages_per_block is not None:
    return int(block_sizes.pages_per_block)
  return max(1, -(-_MIN_GPU_BLOCK // page_size))


# ---------------------------------------------------------------------------------------------
# reference

def _gather_slots(page_table, slot_alive, slot_segment, slot_order):
  """Per-sequence slot metadata ``[B, max_pages * page_size]`` (unused pages are dead)."""
  P, ps = slot_alive.shape
  B, mp = page_table.shape
  used = (page_table >= 0) & (page_table < P)
  pt = jnp.where(used, page_table, 0)
  alive = slot_alive[pt] & used[..., None]
  return (pt, alive.reshape(B, mp * ps), slot_segment[pt].reshape(B, mp * ps).astype(jnp.int32),
          slot_order[pt].reshape(B, mp * ps).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_reference(q, k_pages, v_pages, page_table, slot_alive, slot_segment,
                              slot_order, q_segment, q_order, visible, bidir, *,
                              scale: float | None = None):
  """Dense ``jnp`` paged attention: gather each sequence's pages, build the dense mask, attend.

  Same arguments and semantics as :func:`paged_attention`; float32 math, output in q's dtype.
  """
  validate_inputs(q, k_pages, v_pages, page_table, slot_alive, slot_segment, slot_order,
                  q_segment, q_order, visible, bidir)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  B = q.shape[0]
  K, P, ps, D = k_pages.shape
  pt, alive, seg, order = _gather_slots(page_table, slot_alive, slot_segment, slot_order)
  mp = pt.shape[1]
  kg = jnp.transpose(k_pages[:, pt], (1, 0, 2, 3, 4)).reshape(B, K, mp * ps, D)
  vg = jnp.transpose(v_pages[:, pt], (1, 0, 2, 3, 4)).reshape(B, K, mp * ps, D)
  mask = sm.pair_visible(q_segment, q_order, seg, order, alive, visible, bidir)
  return attention_from_mask(q, kg, vg, mask, scale).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# page skipping

@jax.jit
def visible_pages(page_table, slot_alive, slot_segment, slot_order, q_segment, q_order, visible,
                  bidir) -> jax.Array:
  """``[B, max_pages]`` bool: the page-table entry holds a slot visible to some query.

  False for unused entries (< 0) and for pages whose slots are all dead or invisible to all
  of the step's queries. Exact at page level (hence conservative).
  """
  ps = slot_alive.shape[1]
  B, Tq = q_segment.shape
  _, alive, seg, order = _gather_slots(page_table, slot_alive, slot_segment, slot_order)
  tiles = sm.tile_visibility(q_segment.astype(jnp.int32), q_order.astype(jnp.int32),
                             jnp.ones((B, Tq), jnp.bool_), seg, order, alive, visible, bidir,
                             block_q=Tq, block_k=ps)
  return tiles[:, 0, :]


def page_skip_ratio(page_table, slot_alive, slot_segment, slot_order, q_segment, q_order,
                    visible, bidir) -> float:
  """Fraction of *used* page-table entries (>= 0) that the kernel skips (a float)."""
  vis = visible_pages(page_table, slot_alive, slot_segment, slot_order, q_segment, q_order,
                      visible, bidir)
  used = jnp.asarray(page_table) >= 0
  n_used = jnp.sum(used)
  return float(jnp.where(n_used > 0, 1.0 - jnp.sum(vis & used) / jnp.maximum(n_used, 1), 0.0))


# ---------------------------------------------------------------------------------------------
# kernel

def _paged_kernel(counts_ref, pages_ref, q_ref, qseg_ref, qord_ref, qbid_ref, qwords_ref,
                  k_ref, v_ref, salive_ref, sseg_ref, sord_ref, acc_ref, m_ref, l_ref, *,
                  pages_per_block: int, num_splits: int, num_words: int, scale_log2: float):
  rows, dp = q_ref.shape
  page_size = k_ref.shape[1]
  block_k = pages_per_block * page_size
  split = pl.program_id(2)
  q = q_ref[...]
  q_seg = qseg_ref[...][:, None]
  q_ord = qord_ref[...][:, None]
  q_bid = qbid_ref[...][:, None]
  q_words = [qwords_ref[w, :][:, None] for w in range(num_words)]
  count = counts_ref[0]
  n_steps = lax.div(count + (pages_per_block - 1), pages_per_block)   # counts are >= 0
  per_split = lax.div(n_steps + (num_splits - 1), num_splits)
  start = split * per_split
  end = jnp.minimum(start + per_split, n_steps)

  def body(t, carry):
    first = t * pages_per_block
    pages = pages_ref[pl.ds(first, pages_per_block)]                  # [ppb]
    kk = k_ref[pages].reshape(block_k, dp)
    vv = v_ref[pages].reshape(block_k, dp)
    entry_ok = (first + jnp.arange(pages_per_block, dtype=jnp.int32)) < count
    alive = salive_ref[pages] * entry_ok.astype(jnp.int32)[:, None]   # [ppb, page_size]
    mask = _row_mask(q_seg, q_ord, q_bid, q_words,
                     sseg_ref[pages].reshape(1, block_k), sord_ref[pages].reshape(1, block_k),
                     alive.reshape(1, block_k), num_words)
    return _online_softmax_step(q, kk, vv, mask, carry, scale_log2)

  init = (jnp.zeros((rows, dp), jnp.float32),
          jnp.full((rows,), sm.MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  acc, m, l = lax.fori_loop(start, end, body, init)
  acc_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l


def _forward(q, k_pages, v_pages, page_table, slot_alive, slot_segment, slot_order, q_segment,
             q_order, visible, bidir, scale, block_sizes, interpret, debug):
  B, H, Tq, D = q.shape
  K, P, ps, _ = k_pages.shape
  group = H // K
  M = group * Tq
  Mp = max(_MIN_GPU_BLOCK, sm.next_power_of_2(M))
  Dp = max(_MIN_GPU_BLOCK, sm.next_power_of_2(D))
  G = visible.shape[-1]
  W = sm.next_power_of_2(max(1, -(-G // 32)))
  ppb = _pages_per_block(block_sizes, ps)
  splits = int(block_sizes.num_splits)
  mp = page_table.shape[1]
  L = sm.round_up(mp, ppb)

  # Page list: visible page-table entries first, as pool page ids.
  vis_pages = visible_pages(page_table, slot_alive, slot_segment, slot_order, q_segment,
                            q_order, visible, bidir)                               # [B, mp]
  pos, counts = sm.compact_tiles(vis_pages, length=L)                               # [B, L]
  used = (page_table >= 0) & (page_table < P)       # every listed id is a valid pool page
  pt = jnp.pad(jnp.where(used, page_table, 0).astype(jnp.int32), ((0, 0), (0, L - mp)))
  pages = jnp.take_along_axis(pt, pos, axis=1)

  # Rows r = g * Tq + t (head g of the KV head's group, token t), padded to Mp.
  pad_r = ((0, 0), (0, Mp - M))
  row_seg = jnp.pad(jnp.tile(q_segment.astype(jnp.int32), (1, group)), pad_r, constant_values=-1)
  row_ord = jnp.pad(jnp.tile(q_order.astype(jnp.int32), (1, group)), pad_r)
  words = sm.query_visibility_words(row_seg, visible, num_words=W)                 # [B, W, Mp]
  row_bid = sm.query_bidir(row_seg, bidir).astype(jnp.int32)
  qr = q.reshape(B, K, M, D)
  qr = jnp.pad(qr, ((0, 0), (0, 0), (0, Mp - M), (0, Dp - D)))
  kp = jnp.pad(k_pages, ((0, 0), (0, 0), (0, 0), (0, Dp - D)))
  vp = jnp.pad(v_pages, ((0, 0), (0, 0), (0, 0), (0, Dp - D)))

  kernel = functools.partial(_paged_kernel, pages_per_block=ppb, num_splits=splits,
                             num_words=W, scale_log2=float(scale) * _LOG2E)
  row = lambda b, h, s: (b, 0)
  pool = lambda b, h, s: (0, 0)
  in_specs = [
      pl.BlockSpec((None, 1), lambda b, h, s: (b, 0)),                    # counts
      pl.BlockSpec((None, L), row),                                       # page list
      pl.BlockSpec((None, None, Mp, Dp), lambda b, h, s: (b, h, 0, 0)),   # q rows
      pl.BlockSpec((None, Mp), row),                                      # row segment
      pl.BlockSpec((None, Mp), row),                                      # row order
      pl.BlockSpec((None, Mp), row),                                      # row bidir
      pl.BlockSpec((None, W, Mp), lambda b, h, s: (b, 0, 0)),             # row words
      pl.BlockSpec((None, P, ps, Dp), lambda b, h, s: (h, 0, 0, 0)),      # k pool of head h
      pl.BlockSpec((None, P, ps, Dp), lambda b, h, s: (h, 0, 0, 0)),      # v pool of head h
      pl.BlockSpec((P, ps), pool),                                        # slot alive
      pl.BlockSpec((P, ps), pool),                                        # slot segment
      pl.BlockSpec((P, ps), pool),                                        # slot order
  ]
  out_specs = [
      pl.BlockSpec((None, None, None, Mp, Dp), lambda b, h, s: (b, h, s, 0, 0)),
      pl.BlockSpec((None, None, None, Mp), lambda b, h, s: (b, h, s, 0)),
      pl.BlockSpec((None, None, None, Mp), lambda b, h, s: (b, h, s, 0)),
  ]
  out_shape = [
      jax.ShapeDtypeStruct((B, K, splits, Mp, Dp), jnp.float32),
      jax.ShapeDtypeStruct((B, K, splits, Mp), jnp.float32),
      jax.ShapeDtypeStruct((B, K, splits, Mp), jnp.float32),
  ]
  extra: dict[str, Any] = {"debug": True} if debug else {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu  # GPU only
    extra["compiler_params"] = plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                                    num_stages=block_sizes.num_stages)
  acc, m, l = pl.pallas_call(
      kernel, grid=(B, K, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=interpret, name="paged_segment_attention", **extra,
  )(counts[:, None], pages, qr, row_seg, row_ord, row_bid, words, kp, vp,
    slot_alive.astype(jnp.int32), slot_segment.astype(jnp.int32), slot_order.astype(jnp.int32))

  # Merge the splits (log-sum-exp in base 2); empty splits have l = 0.
  m_all = jnp.max(m, axis=2, keepdims=True)
  w = jnp.exp2(m - m_all)                                                   # [B,K,s,Mp]
  l_all = jnp.sum(l * w, axis=2)                                            # [B,K,Mp]
  o = jnp.sum(acc * w[..., None], axis=2) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
  o = o[:, :, :M, :D].reshape(B, H, Tq, D)
  return o.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret", "debug"))
def paged_attention(q, k_pages, v_pages, page_table, slot_alive, slot_segment, slot_order,
                    q_segment, q_order, visible, bidir, *, scale: float | None = None,
                    block_sizes: PagedBlockSizes | None = None, interpret: bool = False,
                    debug: bool = False):
  """Paged decode attention over a KV pool with alive bits and segment visibility (Pallas).

  Args:
    q: ``[B, H, Tq, D]`` float queries of this step (Tq small: threads / tree nodes / block).
    k_pages, v_pages: ``[K, num_pages, page_size, D]`` the pool, same dtype as q; ``H % K == 0``.
    page_table: ``[B, max_pages]`` int32 pool page of each sequence's page; ``-1`` = unused.
    slot_alive: ``[num_pages, page_size]`` bool; slot_segment, slot_order: same shape, int32.
    q_segment, q_order: ``[B, Tq]`` int32 segment id and sequence order of each query.
    visible: ``[B, G, G]`` bool segment visibility; ``bidir``: ``[B, G]`` bool.
    scale: softmax scale (static), default ``D ** -0.5``.
    block_sizes: :class:`PagedBlockSizes` (static).
    interpret: Pallas interpret mode (CPU); False compiles (GPU/Triton).
    debug: print the kernel's jaxpr / lowered module.

  Returns:
    ``[B, H, Tq, D]`` in q's dtype; queries that see no slot are 0.

  Raises:
    ValueError: bad shapes / dtypes (naming the argument and its shape) or block sizes.
    NotImplementedError: compiled (``interpret=False``) on a TPU backend.
  """
  block_sizes = PagedBlockSizes() if block_sizes is None else block_sizes
  validate_inputs(q, k_pages, v_pages, page_table, slot_alive, slot_segment, slot_order,
                  q_segment, q_order, visible, bidir, block_sizes=block_sizes,
                  interpret=interpret)
  if not interpret and jax.default_backend() == "tpu":
    raise NotImplementedError(
        "paged_attention: the compiled kernel targets GPUs (Pallas Triton backend); on TPU use "
        "interpret=True or paged_attention_reference" )
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  return _forward(q, k_pages, v_pages, page_table, slot_alive, slot_segment, slot_order,
                  q_segment, q_order, visible, bidir, scale, block_sizes, bool(interpret),
                  bool(debug))
