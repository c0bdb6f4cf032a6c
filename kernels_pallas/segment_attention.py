"""Block-sparse segment attention (prefill / training), Pallas kernel + jnp reference.

Semantics (DESIGN.md §2; :mod:`kernels_pallas.segment_mask`): query ``q`` sees key ``k`` iff
``kv_alive[k] and visible[seg(q), seg(k)] and (seg(q) != seg(k) or bidir[seg(q)] or
kv_order[k] <= q_order[q])``; segment ids outside ``[0, G)`` belong to no segment. Softmax over
the visible keys, scaled by ``scale`` (default ``D ** -0.5``), float32 accumulation, output in
q's dtype. **A query row that sees no key outputs 0** (never NaN; the reference does the same;
note the model's dense ``attention`` gives such rows a uniform average instead — they never
occur in a well-formed mask, where every token sees itself).

Algorithm: FlashAttention-2 forward (Dao 2023, arXiv:2307.08691, Alg. 1): for each q tile, an
online softmax over kv tiles with running max ``m``, normaliser ``l`` and unnormalised
accumulator, in the base-2 domain as JAX's ``pallas/ops/gpu/attention.py``. Block sparsity as
JAX's splash attention: a cheap ``jnp`` pre-pass (:func:`visible_tiles`, exact at tile level,
so conservative) marks the (q tile, kv tile) pairs holding any visible pair; they are
compacted into a per-q-tile list (``ids``, ``counts``) that the kernel iterates over, so
invisible tiles cost neither loads nor FLOPs. The mask inside a tile is elementwise only
(bit-packed visibility rows per query, no gathers), which keeps the kernel portable to the
Triton GPU backend.

Layout and portability: grid ``(B, H, T_pad // block_q)``; one program holds a q tile
``[block_q, D_pad]`` and reads kv tiles ``[block_k, D_pad]`` of its KV head (GQA: head ``h``
uses KV head ``h // (H // K)``) from the whole-sequence K/V block with dynamic ``pl.ds`` slices
(as JAX's GPU flash attention). ``T``/``S`` are padded to block multiples and ``D`` to a power
of two >= 16 (zeros; padded keys are dead, padded queries are sliced off), so any lengths work.
On GPU (``interpret=False``) the block sizes must be powers of two >= 16 (Triton).

Gradients: :func:`segment_attention` is differentiable (``custom_vjp``). The forward also
writes the log-sum-exp per row; the backward is FlashAttention-2's Alg. 2 as two Pallas kernels
over the same skip map: dQ per q tile (looping over its visible kv tiles) and dK/dV per (q head,
kv tile) (looping over the q tiles that see it, i.e. the transposed compacted map), summed over
the GQA group in ``jnp``. Memory is O(T·D), never O(T·S).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas import segment_mask as sm

__all__ = [
    "BlockSizes", "segment_attention", "segment_attention_reference", "visible_tiles",
    "tile_skip_ratio", "validate_inputs", "check_values", "TOLERANCES",
]

# Tolerances (atol = rtol) of kernel vs reference, keyed by the dtype of q/k/v.
TOLERANCES = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}

_LOG2E = math.log2(math.e)
_MIN_GPU_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of :func:`segment_attention`.

  Attributes:
    block_q: queries per tile (grid axis). Clipped to ``max(16, next_pow2(T))`` for short T.
    block_k: keys per tile (inner loop step, and granularity of the skip map).
    num_warps: Triton warps per program (GPU only; default 4 for D <= 64 else 8).
    num_stages: Triton software-pipelining stages (GPU only).
  """
  block_q: int = 128
  block_k: int = 128
  num_warps: int | None = None
  num_stages: int = 2


# ---------------------------------------------------------------------------------------------
# validation

def _shape(x) -> tuple:
  return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def _dtype(x):
  return jnp.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _check_int(name, x):
  if not jnp.issubdtype(_dtype(x), jnp.integer):
    raise ValueError(f"{name} must have an integer dtype (int32), got {_dtype(x)} "
                     f"with shape {_shape(x)}")


def _check_bool(name, x):
  if _dtype(x) != jnp.bool_:
    raise ValueError(f"{name} must be bool, got {_dtype(x)} with shape {_shape(x)}")


def _check_shape(name, x, want, what):
  if _shape(x) != tuple(want):
    raise ValueError(f"{name} must have shape {what} = {tuple(want)}, got {_shape(x)}")


def validate_metadata(q_segment, q_order, kv_segment, kv_order, kv_alive, visible, bidir, *,
                      B: int, T: int, S: int, names=("q_segment", "q_order", "kv_segment",
                                                     "kv_order", "kv_alive")):
  """Shape/dtype checks of the segment metadata (raises ``ValueError``)."""
  n_qs, n_qo, n_ks, n_ko, n_ka = names
  for name, x, want, what in ((n_qs, q_segment, (B, T), "[B, T]"),
                              (n_qo, q_order, (B, T), "[B, T]"),
                              (n_ks, kv_segment, (B, S), "[B, S]"),
                              (n_ko, kv_order, (B, S), "[B, S]"),
                              (n_ka, kv_alive, (B, S), "[B, S]")):
    _check_shape(name, x, want, what)
  for name, x in ((n_qs, q_segment), (n_qo, q_order), (n_ks, kv_segment), (n_ko, kv_order)):
    _check_int(name, x)
  _check_bool(n_ka, kv_alive)
  vs = _shape(visible)
  if len(vs) != 3 or vs[0] != B or vs[1] != vs[2] or vs[1] < 1:
    raise ValueError(f"visible must have shape [B, G, G] with B={B}, G >= 1, got {vs}")
  _check_bool("visible", visible)
  _check_shape("bidir", bidir, (B, vs[1]), "[B, G]")
  _check_bool("bidir", bidir)


def validate_inputs(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir,
                    *, block_sizes: BlockSizes | None = None, interpret: bool = True):
  """Static (shape/dtype) validation of :func:`segment_attention` inputs.

  Raises ``ValueError`` naming the bad argument and its shape.
  """
  qs, ks, vs = _shape(q), _shape(k), _shape(v)
  if len(qs) != 4:
    raise ValueError(f"q must have shape [B, H, T, D], got {qs}")
  if len(ks) != 4:
    raise ValueError(f"k must have shape [B, K, S, D], got {ks}")
  if ks != vs:
    raise ValueError(f"k and v must have the same shape [B, K, S, D], got k {ks} and v {vs}")
  B, H, T, D = qs
  if ks[0] != B:
    raise ValueError(f"k batch {ks[0]} != q batch {B} (q {qs}, k {ks})")
  if ks[3] != D:
    raise ValueError(f"k head dim {ks[3]} != q head dim {D} (q {qs}, k {ks})")
  K, S = ks[1], ks[2]
  if K < 1 or H % K:
    raise ValueError(f"number of q heads H={H} must be a multiple of KV heads K={K} "
                     f"(q {qs}, k {ks})")
  if min(T, S, D) < 1:
    raise ValueError(f"empty q/k: q {qs}, k {ks}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not jnp.issubdtype(_dtype(x), jnp.floating):
      raise ValueError(f"{name} must be floating point, got {_dtype(x)}")
  if not (_dtype(q) == _dtype(k) == _dtype(v)):
    raise ValueError(f"q, k, v must share a dtype, got {_dtype(q)}, {_dtype(k)}, {_dtype(v)}")
  validate_metadata(q_segment, q_order, kv_segment, kv_order, kv_alive, visible, bidir,
                    B=B, T=T, S=S)
  if block_sizes is not None:
    _validate_blocks(block_sizes.block_q, "block_q", interpret)
    _validate_blocks(block_sizes.block_k, "block_k", interpret)


def _validate_blocks(b, name, interpret):
  if not isinstance(b, (int, np.integer)) or b < 1:
    raise ValueError(f"{name} must be a positive int, got {b!r}")
  if not interpret and (b < _MIN_GPU_BLOCK or b & (b - 1)):
    raise ValueError(f"{name}={b}: compiled (GPU/Triton) kernels need a power of two "
                     f">= {_MIN_GPU_BLOCK}")


def check_values(q_segment, kv_segment, visible, *, allow_out_of_range: bool = False):
  """Host-side value checks (concrete arrays only, not under ``jit``).

  Segment ids must lie in ``[0, G)`` unless ``allow_out_of_range`` (then they mean "no
  segment"). Raises ``ValueError`` with the offending argument and value range.
  """
  G = _shape(visible)[-1]
  for name, x in (("q_segment", q_segment), ("kv_segment", kv_segment)):
    x = np.asarray(x)
    if x.size and not allow_out_of_range and (x.min() < 0 or x.max() >= G):
      raise ValueError(f"{name} values must lie in [0, G={G}), got range "
                       f"[{x.min()}, {x.max()}] (shape {x.shape})")


# ---------------------------------------------------------------------------------------------
# reference

def attention_from_mask(q, k, v, mask, scale):
  """Dense masked GQA attention; rows without a visible key give 0. Float32 throughout.

  q ``[B, H, T, D]``, k/v ``[B, K, S, D]``, mask ``[B, T, S]`` bool -> ``[B, H, T, D]`` f32.
  """
  B, H, T, D = q.shape
  K = k.shape[1]
  qg = q.astype(jnp.float32).reshape(B, K, H // K, T, D)
  s = jnp.einsum("bkgtd,bksd->bkgts", qg, k.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * scale
  m = mask[:, None, None, :, :]
  s = jnp.where(m, s, sm.MASK_VALUE)
  p = jnp.where(m, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  o = jnp.einsum("bkgts,bksd->bkgtd", p, v.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST)
  return o.reshape(B, H, T, D)


@functools.partial(jax.jit, static_argnames=("scale",))
def segment_attention_reference(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive,
                                visible, bidir, *, scale: float | None = None):
  """Dense ``jnp`` segment attention: the oracle of :func:`segment_attention`.

  Same arguments and semantics (builds the ``[B, T, S]`` mask with
  :func:`kernels_pallas.segment_mask.pair_visible`); float32 math, output in q's dtype.
  """
  validate_inputs(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  mask = sm.pair_visible(q_segment, q_order, kv_segment, kv_order, kv_alive, visible, bidir)
  return attention_from_mask(q, k, v, mask, scale).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# skip map

def _effective_blocks(T, S, block_sizes: BlockSizes):
  bq = min(block_sizes.block_q, max(_MIN_GPU_BLOCK, sm.next_power_of_2(T)))
  bk = min(block_sizes.block_k, max(_MIN_GPU_BLOCK, sm.next_power_of_2(S)))
  return bq, bk


def _padded_metadata(q_segment, kv_segment, q_order, kv_order, kv_alive, bq, bk):
  B, T = q_segment.shape
  S = kv_segment.shape[1]
  Tp, Sp = sm.round_up(T, bq), sm.round_up(S, bk)
  pad_q = ((0, 0), (0, Tp - T))
  pad_k = ((0, 0), (0, Sp - S))
  qs = jnp.pad(q_segment.astype(jnp.int32), pad_q, constant_values=-1)
  qo = jnp.pad(q_order.astype(jnp.int32), pad_q)
  qv = jnp.pad(jnp.ones((B, T), jnp.bool_), pad_q)
  ks = jnp.pad(kv_segment.astype(jnp.int32), pad_k, constant_values=-1)
  ko = jnp.pad(kv_order.astype(jnp.int32), pad_k)
  ka = jnp.pad(kv_alive, pad_k)
  return qs, qo, qv, ks, ko, ka


@functools.partial(jax.jit, static_argnames=("block_q", "block_k"))
def visible_tiles(q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir, *,
                  block_q: int = 128, block_k: int = 128) -> jax.Array:
  """The skip map: ``[B, ceil(T/block_q), ceil(S/block_k)]`` bool, True = tile is computed.

  Exact at tile level (True iff some pair of the tile is visible), hence conservative.
  Uses the block sizes as given (no clipping), after padding T and S to multiples.
  """
  B, T = _shape(q_segment)
  S = _shape(kv_segment)[1]
  validate_metadata(q_segment, q_order, kv_segment, kv_order, kv_alive, visible, bidir,
                    B=B, T=T, S=S)
  qs, qo, qv, ks, ko, ka = _padded_metadata(q_segment, kv_segment, q_order, kv_order, kv_alive,
                                            block_q, block_k)
  return sm.tile_visibility(qs, qo, qv, ks, ko, ka, visible, bidir,
                            block_q=block_q, block_k=block_k)


def tile_skip_ratio(q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir, *,
                    block_q: int = 128, block_k: int = 128) -> float:
  """Fraction of (q tile, kv tile) pairs the kernel skips, over all batch rows (a float).

  Heads do not matter (the map is shared by all heads). See :func:`visible_tiles`.
  """
  tiles = visible_tiles(q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir,
                        block_q=block_q, block_k=block_k)
  return float(1.0 - jnp.mean(tiles.astype(jnp.float32)))


# ---------------------------------------------------------------------------------------------
# kernel

def _row_mask(q_seg, q_ord, q_bid, q_words, k_seg, k_ord, k_alive, num_words):
  """Elementwise DESIGN.md §2 rule on a tile: rows ``[M, 1]``, keys ``[1, N]`` -> ``[M, N]``.

  ``q_words`` is a list of ``num_words`` ``[M, 1]`` int32 visibility words.
  """
  vis = None
  for w in range(num_words):
    lo = 32 * w
    in_word = (k_seg >= lo) & (k_seg < lo + 32)
    shift = jnp.where(in_word, k_seg - lo, 0)
    # Arithmetic shift then & 1 reads bit `shift` whatever the sign (shift < 32).
    bit = (jnp.right_shift(q_words[w], shift) & 1) == 1
    term = in_word & bit
    vis = term if vis is None else (vis | term)
  causal_ok = (q_seg != k_seg) | (q_bid != 0) | (k_ord <= q_ord)
  return vis & causal_ok & (k_alive != 0)


def _precision(a, b):
  """float32 dots at full precision: on GPU the default would be TF32 (~1e-3 error)."""
  if a.dtype == jnp.float32 and b.dtype == jnp.float32:
    return lax.Precision.HIGHEST
  return None


def _online_softmax_step(q, kk, vv, mask, carry, scale_log2):
  """One FlashAttention-2 update (base-2 domain); masked probabilities are exactly 0."""
  acc, m_prev, l_prev = carry
  s = _dot_t(q, kk)
  s = jnp.where(mask, s * scale_log2, sm.MASK_VALUE)
  m_next = jnp.maximum(m_prev, jnp.max(s, axis=-1))
  alpha = jnp.exp2(m_prev - m_next)
  p = jnp.where(mask, jnp.exp2(s - m_next[:, None]), 0.0)
  l_next = alpha * l_prev + jnp.sum(p, axis=-1)
  pv = _dot(p.astype(vv.dtype), vv)
  return alpha[:, None] * acc + pv, m_next, l_next


class _Prep(NamedTuple):
  """Padded metadata and tile lists shared by the forward and backward kernels."""
  qs: jax.Array       # [B, Tp] int32 query segment (-1 = padding)
  qo: jax.Array       # [B, Tp] int32 query order
  qbid: jax.Array     # [B, Tp] int32 bidir[seg(q)]
  words: jax.Array    # [B, W, Tp] int32 visibility words
  ks: jax.Array       # [B, Sp] int32 key segment (-1 = padding)
  ko: jax.Array       # [B, Sp] int32 key order
  ka: jax.Array       # [B, Sp] int32 key alive
  tiles: jax.Array    # [B, nq, nk] bool skip map


def _dims(T, S, D, G, block_sizes):
  bq, bk = _effective_blocks(T, S, block_sizes)
  Tp, Sp = sm.round_up(T, bq), sm.round_up(S, bk)
  Dp = max(_MIN_GPU_BLOCK, sm.next_power_of_2(D))
  W = sm.next_power_of_2(max(1, -(-G // 32)))
  return bq, bk, Tp, Sp, Dp, W


def _prepare(q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir, bq, bk, W):
  qs, qo, qv, ks, ko, ka = _padded_metadata(q_segment, kv_segment, q_order, kv_order, kv_alive,
                                            bq, bk)
  tiles = sm.tile_visibility(qs, qo, qv, ks, ko, ka, visible, bidir, block_q=bq, block_k=bk)
  return _Prep(qs, qo, sm.query_bidir(qs, bidir).astype(jnp.int32),
               sm.query_visibility_words(qs, visible, num_words=W), ks, ko,
               ka.astype(jnp.int32), tiles)


def _compiler_params(block_sizes, Dp, interpret, debug):
  extra: dict[str, Any] = {"debug": True} if debug else {}
  if not interpret:
    from jax.experimental.pallas import triton as plgpu  # GPU only
    nw = block_sizes.num_warps or (4 if Dp <= 64 else 8)
    extra["compiler_params"] = plgpu.CompilerParams(num_warps=nw,
                                                    num_stages=block_sizes.num_stages)
  return extra


def _dot_t(a, b):
  """``a @ b.T`` with float32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=_precision(a, b),
                         preferred_element_type=jnp.float32)


def _dot_tn(a, b):
  """``a.T @ b`` with float32 accumulation."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_precision(a, b),
                         preferred_element_type=jnp.float32)


def _dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=_precision(a, b),
                         preferred_element_type=jnp.float32)


def _fwd_kernel(counts_ref, ids_ref, q_ref, qseg_ref, qord_ref, qbid_ref, qwords_ref, k_ref,
                v_ref, kseg_ref, kord_ref, kalive_ref, o_ref, lse_ref, *, block_k: int,
                num_words: int, scale_log2: float):
  """One q tile: online softmax over its compacted list of visible kv tiles."""
  bq, dp = q_ref.shape
  q = q_ref[...]
  q_seg = qseg_ref[...][:, None]
  q_ord = qord_ref[...][:, None]
  q_bid = qbid_ref[...][:, None]
  q_words = [qwords_ref[w, :][:, None] for w in range(num_words)]

  def body(t, carry):
    j = ids_ref[t]
    kv = pl.ds(j * block_k, block_k)
    mask = _row_mask(q_seg, q_ord, q_bid, q_words, kseg_ref[kv][None, :],
                     kord_ref[kv][None, :], kalive_ref[kv][None, :], num_words)
    return _online_softmax_step(q, k_ref[kv, :], v_ref[kv, :], mask, carry, scale_log2)

  init = (jnp.zeros((bq, dp), jnp.float32),
          jnp.full((bq,), sm.MASK_VALUE, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  acc, m, l = lax.fori_loop(0, counts_ref[0], body, init)
  seen = l > 0
  o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), 0.0)


def _dq_kernel(counts_ref, ids_ref, q_ref, do_ref, lse_ref, delta_ref, qseg_ref, qord_ref,
               qbid_ref, qwords_ref, k_ref, v_ref, kseg_ref, kord_ref, kalive_ref, dq_ref, *,
               block_k: int, num_words: int, scale_log2: float, scale: float):
  """dQ of one q tile (FlashAttention-2 backward, Alg. 2, the dQ half)."""
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...][:, None]
  delta = delta_ref[...][:, None]
  q_seg = qseg_ref[...][:, None]
  q_ord = qord_ref[...][:, None]
  q_bid = qbid_ref[...][:, None]
  q_words = [qwords_ref[w, :][:, None] for w in range(num_words)]

  def body(t, dq):
    j = ids_ref[t]
    kv = pl.ds(j * block_k, block_k)
    kk = k_ref[kv, :]
    mask = _row_mask(q_seg, q_ord, q_bid, q_words, kseg_ref[kv][None, :],
                     kord_ref[kv][None, :], kalive_ref[kv][None, :], num_words)
    p = jnp.where(mask, jnp.exp2(_dot_t(q, kk) * scale_log2 - lse), 0.0)
    ds = p * (_dot_t(do, v_ref[kv, :]) - delta)
    return dq + _dot(ds.astype(kk.dtype), kk)

  dq = lax.fori_loop(0, counts_ref[0], body, jnp.zeros(q_ref.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(counts_ref, ids_ref, q_ref, do_ref, lse_ref, delta_ref, qseg_ref, qord_ref,
                qbid_ref, qwords_ref, k_ref, v_ref, kseg_ref, kord_ref, kalive_ref, dk_ref,
                dv_ref, *, block_q: int, num_words: int, scale_log2: float, scale: float):
  """dK, dV of one kv tile for one q head, over the q tiles that see it (Alg. 2)."""
  kk = k_ref[...]
  vv = v_ref[...]
  k_seg = kseg_ref[...][None, :]
  k_ord = kord_ref[...][None, :]
  k_alive = kalive_ref[...][None, :]

  def body(t, carry):
    dk, dv = carry
    i = ids_ref[t]
    rows = pl.ds(i * block_q, block_q)
    q = q_ref[rows, :]
    do = do_ref[rows, :]
    q_words = [qwords_ref[w, rows][:, None] for w in range(num_words)]
    mask = _row_mask(qseg_ref[rows][:, None], qord_ref[rows][:, None],
                     qbid_ref[rows][:, None], q_words, k_seg, k_ord, k_alive, num_words)
    p = jnp.where(mask, jnp.exp2(_dot_t(q, kk) * scale_log2 - lse_ref[rows][:, None]), 0.0)
    dv = dv + _dot_tn(p.astype(do.dtype), do)
    ds = p * (_dot_t(do, vv) - delta_ref[rows][:, None])
    dk = dk + _dot_tn(ds.astype(q.dtype), q)
    return dk, dv

  zeros = jnp.zeros(k_ref.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, counts_ref[0], body, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _pad_qkv(q, k, v, Tp, Sp, Dp):
  T, D = q.shape[2], q.shape[3]
  S = k.shape[2]
  return (jnp.pad(q, ((0, 0), (0, 0), (0, Tp - T), (0, Dp - D))),
          jnp.pad(k, ((0, 0), (0, 0), (0, Sp - S), (0, Dp - D))),
          jnp.pad(v, ((0, 0), (0, 0), (0, Sp - S), (0, Dp - D))))


def _forward(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir,
             scale, block_sizes, interpret, debug):
  """Kernel forward: ``(out [B, H, T, D], lse [B, H, Tp] f32, base 2, scaled logits)``."""
  B, H, T, D = q.shape
  K, S = k.shape[1], k.shape[2]
  group = H // K
  bq, bk, Tp, Sp, Dp, W = _dims(T, S, D, visible.shape[-1], block_sizes)
  nq, nk = Tp // bq, Sp // bk
  nkp = sm.next_power_of_2(nk)
  pr = _prepare(q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir, bq, bk, W)
  ids, counts = sm.compact_tiles(pr.tiles, length=nkp)             # [B,nq,nkp], [B,nq]
  qp, kp, vp = _pad_qkv(q, k, v, Tp, Sp, Dp)

  kernel = functools.partial(_fwd_kernel, block_k=bk, num_words=W,
                             scale_log2=float(scale) * _LOG2E)
  row = lambda b, h, i: (b, i)
  kv_row = lambda b, h, i: (b, 0)
  kv_head = lambda b, h, i: (b, h // group, 0, 0)
  in_specs = [
      pl.BlockSpec((None, 1), row),                                   # counts
      pl.BlockSpec((None, None, nkp), lambda b, h, i: (b, i, 0)),     # ids
      pl.BlockSpec((None, None, bq, Dp), lambda b, h, i: (b, h, i, 0)),  # q
      pl.BlockSpec((None, bq), row),                                  # q segment
      pl.BlockSpec((None, bq), row),                                  # q order
      pl.BlockSpec((None, bq), row),                                  # q bidir
      pl.BlockSpec((None, W, bq), lambda b, h, i: (b, 0, i)),         # q visibility words
      pl.BlockSpec((None, None, Sp, Dp), kv_head),                    # k (whole sequence)
      pl.BlockSpec((None, None, Sp, Dp), kv_head),                    # v
      pl.BlockSpec((None, Sp), kv_row),                               # kv segment
      pl.BlockSpec((None, Sp), kv_row),                               # kv order
      pl.BlockSpec((None, Sp), kv_row),                               # kv alive
  ]
  out, lse = pl.pallas_call(
      kernel,
      grid=(B, H, nq),
      in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, bq, Dp), lambda b, h, i: (b, h, i, 0)),
                 pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))],
      out_shape=[jax.ShapeDtypeStruct((B, H, Tp, Dp), q.dtype),
                 jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
      interpret=interpret,
      name="segment_attention_fwd",
      **_compiler_params(block_sizes, Dp, interpret, debug),
  )(counts, ids, qp, pr.qs, pr.qo, pr.qbid, pr.words, kp, vp, pr.ks, pr.ko, pr.ka)
  return out[:, :, :T, :D], lse


def _backward(q, k, v, meta, out, lse, do, scale, block_sizes, interpret, debug):
  """Kernel backward (FlashAttention-2 Alg. 2 as two kernels: dQ per q tile, dK/dV per kv
  tile and q head, summed over the GQA group), over the same skip map (transposed for dK/dV)."""
  B, H, T, D = q.shape
  K, S = k.shape[1], k.shape[2]
  group = H // K
  q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir = meta
  bq, bk, Tp, Sp, Dp, W = _dims(T, S, D, visible.shape[-1], block_sizes)
  nq, nk = Tp // bq, Sp // bk
  pr = _prepare(q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir, bq, bk, W)
  ids, counts = sm.compact_tiles(pr.tiles, length=sm.next_power_of_2(nk))
  ids_t, counts_t = sm.compact_tiles(jnp.swapaxes(pr.tiles, 1, 2),
                                     length=sm.next_power_of_2(nq))
  qp, kp, vp = _pad_qkv(q, k, v, Tp, Sp, Dp)
  dop = jnp.pad(do.astype(q.dtype), ((0, 0), (0, 0), (0, Tp - T), (0, Dp - D)))
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = jnp.pad(delta, ((0, 0), (0, 0), (0, Tp - T)))                # [B, H, Tp]
  extra = _compiler_params(block_sizes, Dp, interpret, debug)
  scale_log2 = float(scale) * _LOG2E
  kv_head = lambda b, h, i: (b, h // group, 0, 0)

  # dQ: grid over q tiles, loop over their visible kv tiles.
  row = lambda b, h, i: (b, i)
  q_tile = pl.BlockSpec((None, None, bq, Dp), lambda b, h, i: (b, h, i, 0))
  q_vec = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, block_k=bk, num_words=W, scale_log2=scale_log2,
                        scale=float(scale)),
      grid=(B, H, nq),
      in_specs=[
          pl.BlockSpec((None, 1), row), pl.BlockSpec((None, None, ids.shape[-1]),
                                                     lambda b, h, i: (b, i, 0)),
          q_tile, q_tile, q_vec, q_vec,
          pl.BlockSpec((None, bq), row), pl.BlockSpec((None, bq), row),
          pl.BlockSpec((None, bq), row), pl.BlockSpec((None, W, bq), lambda b, h, i: (b, 0, i)),
          pl.BlockSpec((None, None, Sp, Dp), kv_head), pl.BlockSpec((None, None, Sp, Dp), kv_head),
          pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
          pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
          pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
      ],
      out_specs=q_tile,
      out_shape=jax.ShapeDtypeStruct((B, H, Tp, Dp), jnp.float32),
      interpret=interpret, name="segment_attention_dq", **extra,
  )(counts, ids, qp, dop, lse, delta, pr.qs, pr.qo, pr.qbid, pr.words, kp, vp, pr.ks, pr.ko,
    pr.ka)

  # dK, dV: grid over (q head, kv tile), loop over the q tiles that see the kv tile.
  col = lambda b, h, j: (b, j)
  q_all = pl.BlockSpec((None, None, Tp, Dp), lambda b, h, j: (b, h, 0, 0))
  q_all_vec = pl.BlockSpec((None, None, Tp), lambda b, h, j: (b, h, 0))
  q_meta = pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0))
  kv_tile = pl.BlockSpec((None, None, bk, Dp), lambda b, h, j: (b, h // group, j, 0))
  out_tile = pl.BlockSpec((None, None, bk, Dp), lambda b, h, j: (b, h, j, 0))
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, block_q=bq, num_words=W, scale_log2=scale_log2,
                        scale=float(scale)),
      grid=(B, H, nk),
      in_specs=[
          pl.BlockSpec((None, 1), col), pl.BlockSpec((None, None, ids_t.shape[-1]),
                                                     lambda b, h, j: (b, j, 0)),
          q_all, q_all, q_all_vec, q_all_vec, q_meta, q_meta, q_meta,
          pl.BlockSpec((None, W, Tp), lambda b, h, j: (b, 0, 0)),
          kv_tile, kv_tile,
          pl.BlockSpec((None, bk), col), pl.BlockSpec((None, bk), col),
          pl.BlockSpec((None, bk), col),
      ],
      out_specs=[out_tile, out_tile],
      out_shape=[jax.ShapeDtypeStruct((B, H, Sp, Dp), jnp.float32)] * 2,
      interpret=interpret, name="segment_attention_dkv", **extra,
  )(counts_t, ids_t, qp, dop, lse, delta, pr.qs, pr.qo, pr.qbid, pr.words, kp, vp, pr.ks,
    pr.ko, pr.ka)
  dk = dk.reshape(B, K, group, Sp, Dp).sum(axis=2)
  dv = dv.reshape(B, K, group, Sp, Dp).sum(axis=2)
  return (dq[:, :, :T, :D].astype(q.dtype), dk[:, :, :S, :D].astype(k.dtype),
          dv[:, :, :S, :D].astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(10,))
def _segment_attention(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible,
                       bidir, cfg):
  return _forward(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir,
                  *cfg)[0]


def _segment_attention_fwd(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible,
                           bidir, cfg):
  out, lse = _forward(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible,
                      bidir, *cfg)
  meta = (q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir)
  return out, (q, k, v, meta, out, lse)


def _segment_attention_bwd(cfg, res, g):
  q, k, v, meta, out, lse = res
  dq, dk, dv = _backward(q, k, v, meta, out, lse, g, *cfg)
  return (dq, dk, dv) + (None,) * 7


_segment_attention.defvjp(_segment_attention_fwd, _segment_attention_bwd)


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret", "debug"))
def segment_attention(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible,
                      bidir, *, scale: float | None = None,
                      block_sizes: BlockSizes | None = None, interpret: bool = False,
                      debug: bool = False):
  """Block-sparse segment attention (Pallas): prefill / training forward.

  Args:
    q: ``[B, H, T, D]`` float queries (after RoPE).
    k, v: ``[B, K, S, D]`` keys / values, same dtype as q; ``H % K == 0`` (GQA).
    q_segment, q_order: ``[B, T]`` int32 segment id and sequence order of each query.
    kv_segment, kv_order: ``[B, S]`` int32 segment id and sequence order of each key.
    kv_alive: ``[B, S]`` bool, False = dead (evicted / padding) key.
    visible: ``[B, G, G]`` bool segment visibility; ``bidir``: ``[B, G]`` bool.
    scale: softmax scale (static), default ``D ** -0.5``.
    block_sizes: :class:`BlockSizes` (static), default ``BlockSizes()`` (128 x 128).
    interpret: run the kernel in Pallas interpret mode (CPU); False compiles it (GPU/Triton).
    debug: print the kernel's jaxpr / lowered module.

  Returns:
    ``[B, H, T, D]`` in q's dtype; rows that see no key are 0.

  Raises:
    ValueError: bad shapes / dtypes (naming the argument and its shape), or block sizes
      that are not powers of two >= 16 when compiled.
    NotImplementedError: compiled (``interpret=False``) on a TPU backend.
  """
  block_sizes = BlockSizes() if block_sizes is None else block_sizes
  validate_inputs(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive, visible, bidir,
                  block_sizes=block_sizes, interpret=interpret)
  if not interpret and jax.default_backend() == "tpu":
    raise NotImplementedError(
        "segment_attention: the compiled kernel targets GPUs (Pallas Triton backend); on TPU use "
        "interpret=True or segment_attention_reference" )
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  return _segment_attention(q, k, v, q_segment, kv_segment, q_order, kv_order, kv_alive,
                            visible, bidir, (scale, block_sizes, bool(interpret), bool(debug)))
