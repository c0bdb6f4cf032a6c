"""Flax NNX decoder-only transformer for the Llama family (SmolLM2, Llama 2/3) and Qwen3.

Architecture (Touvron et al. 2023, Llama; Qwen3 technical report 2025): pre-RMSNorm
blocks of grouped-query attention with RoPE and a SwiGLU MLP, final RMSNorm, tied or
untied LM head. Qwen3 adds RMSNorm over each query/key head before RoPE.

Design points used by every runtime of the project (DESIGN.md §2):

* attention takes explicit ``positions`` ``[B, T]`` and an explicit boolean visibility
  ``mask`` ``[B, T, S]`` (query x key); the model never builds a causal mask itself;
* the layers' parameters are stacked along a leading ``layers`` axis and the forward
  scans over them (``jax.lax.scan``), so compiling the 30-layer SmolLM2 costs one layer, or
  runs them as an unrolled Python loop (``ModelConfig.layer_loop``);
* one forward serves every engine step's :class:`~selforch_jax.runtime.step.ForwardSpec`:
  attention views, hidden / attention-mass outputs, QUEST / recency key selection, MLP input
  channel keep and MLP-output fake-quant (all off by default: the plain program);
* every parameter carries ``logical_axes`` metadata; ``selforch_jax.sharding`` maps
  logical names to mesh axes with one rules table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.models.config import ModelConfig
from selforch_jax.models.rope import apply_rope, rope_inv_freq

MASK_VALUE = -1e30  # finite, so a fully masked (padding) query row gives no NaN


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Per-layer key/value cache.

  Attributes:
    k: ``[L, B, S, Hkv, Dh]`` keys (compute dtype), already rotated by RoPE.
    v: ``[L, B, S, Hkv, Dh]`` values.
  """

  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, max_len: int) -> "KVCache":
    """An empty cache of ``max_len`` slots per row, in ``cfg.dtype``."""
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return cls(k=jnp.zeros(shape, cfg.jnp_dtype), v=jnp.zeros(shape, cfg.jnp_dtype))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def nbytes(self) -> int:
    return self.k.nbytes + self.v.nbytes


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019) in float32; returns ``x.dtype``."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (y * weight.astype(jnp.float32)).astype(x.dtype)


def _param(rngs: nnx.Rngs, shape, axes, dtype, init="normal", fan_in: int | None = None):
  if init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    std = 0.02 if fan_in is None else fan_in ** -0.5
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


class DecoderLayers(nnx.Module):
  """All ``L`` decoder layers, parameters stacked on a leading ``layers`` axis.

  Parameter shapes (D hidden, H query heads, K kv heads, Dh head dim, F MLP width):
  ``attn_norm [L,D]``, ``q_proj [L,D,H,Dh]``, ``k_proj [L,D,K,Dh]``, ``v_proj [L,D,K,Dh]``,
  ``o_proj [L,H,Dh,D]``, (Qwen3) ``q_norm [L,Dh]``, ``k_norm [L,Dh]``, ``mlp_norm [L,D]``,
  ``gate_proj [L,D,F]``, ``up_proj [L,D,F]``, ``down_proj [L,F,D]``.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = cfg.jnp_param_dtype
    self.attn_norm = _param(rngs, (L, D), ("layers", "norm"), pd, "ones")
    self.q_proj = _param(rngs, (L, D, H, Dh), ("layers", "embed", "q_heads", "head_dim"), pd, fan_in=D)
    self.k_proj = _param(rngs, (L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), pd, fan_in=D)
    self.v_proj = _param(rngs, (L, D, K, Dh), ("layers", "embed", "kv_heads", "head_dim"), pd, fan_in=D)
    self.o_proj = _param(rngs, (L, H, Dh, D), ("layers", "q_heads", "head_dim", "embed"), pd, fan_in=H * Dh)
    if cfg.qk_norm:
      self.q_norm = _param(rngs, (L, Dh), ("layers", "norm"), pd, "ones")
      self.k_norm = _param(rngs, (L, Dh), ("layers", "norm"), pd, "ones")
    self.mlp_norm = _param(rngs, (L, D), ("layers", "norm"), pd, "ones")
    self.gate_proj = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), pd, fan_in=D)
    self.up_proj = _param(rngs, (L, D, F), ("layers", "embed", "mlp"), pd, fan_in=D)
    self.down_proj = _param(rngs, (L, F, D), ("layers", "mlp", "embed"), pd, fan_in=F)
    if cfg.lora_rank:
      r = cfg.lora_rank
      for name in cfg.lora_targets:
        base = getattr(self, name)
        n_in = LORA_IN_DIMS[name]
        in_shape, out_shape = base.shape[1:1 + n_in], base.shape[1 + n_in:]
        in_axes, out_axes = base.logical_axes[1:1 + n_in], base.logical_axes[1 + n_in:]
        std = float(np.prod(in_shape)) ** -0.5
        a = (std * jax.random.normal(rngs.params(), (L, *in_shape, r), jnp.float32)).astype(pd)
        setattr(self, f"{name}_lora_a",
                nnx.LoRAParam(a, logical_axes=("layers", *in_axes, "lora_rank")))
        setattr(self, f"{name}_lora_b", nnx.LoRAParam(
            jnp.zeros((L, r, *out_shape), pd), logical_axes=("layers", "lora_rank", *out_axes)))
    for view in cfg.attn_views:  # extra attention views: copies of the base projections
      for name in view_param_names(cfg):
        base = getattr(self, name)
        setattr(self, f"{name}_{view}", nnx.Param(jnp.array(base[...]),
                                                  logical_axes=base.logical_axes))

  def stacked(self) -> dict[str, jax.Array]:
    """The stacked layer parameters (LoRA adapters included) as a dict of arrays (axis 0 = L)."""
    return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


VIEW_PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj")


def view_param_names(cfg: ModelConfig) -> tuple[str, ...]:
  """The base layer parameters an attention view has its own copy of (``<name>_<view>``):
  the four attention projections, plus ``q_norm, k_norm`` when ``cfg.qk_norm``."""
  return VIEW_PARAMS + (("q_norm", "k_norm") if cfg.qk_norm else ())


def view_params(p: dict[str, Any], cfg: ModelConfig, view: str) -> dict[str, Any]:
  """The stacked layer parameter dict the forward of ``view`` uses: for ``"base"`` the base
  entries only (every view's copies dropped, so the program is the view-free one); for a view,
  its ``<name>_<view>`` arrays under the base names (no LoRA adapters on a view's projections).

  Raises:
    ValueError: ``view`` is neither ``"base"`` nor one of ``cfg.attn_views``.
  """
  if view != "base" and view not in cfg.attn_views:
    raise ValueError(f"unknown attention view {view!r}; the model has 'base' and "
                     f"{list(cfg.attn_views)}")
  names = view_param_names(cfg)
  extra = {f"{n}_{v}" for v in cfg.attn_views for n in names}
  out = {k: a for k, a in p.items() if k not in extra}
  if view != "base":
    for n in names:
      out[n] = p[f"{n}_{view}"]
      out.pop(f"{n}_lora_a", None)
      out.pop(f"{n}_lora_b", None)
  return out


# number of leading (input) dims of each projection after the layer axis
LORA_IN_DIMS = {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 2, "gate_proj": 1,
                "up_proj": 1, "down_proj": 1}


def proj(x: jax.Array, p: dict, name: str, eq: str, dtype, lora_scale: float) -> jax.Array:
  """``einsum(eq, x, p[name])`` plus the LoRA update ``scale * (x @ A) @ B`` when present.

  ``eq`` is the base einsum, e.g. ``"btd,dhk->bthk"``; the adapter einsums are derived
  from it (A: input dims + rank, B: rank + output dims).
  """
  y = jnp.einsum(eq, x, p[name].astype(dtype))
  if f"{name}_lora_a" in p:
    lhs, out = eq.split("->")
    xs, _ = lhs.split(",")
    in_sub, out_sub = xs[2:], out[2:]
    xa = jnp.einsum(f"{xs},{in_sub}r->{xs[:2]}r", x, p[f"{name}_lora_a"].astype(dtype))
    y = y + lora_scale * jnp.einsum(f"{xs[:2]}r,r{out_sub}->{out}", xa,
                                    p[f"{name}_lora_b"].astype(dtype))
  return y


def merge_lora(layer_params: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
  """Fold LoRA adapters into the base weights: ``W + (alpha/r) * A @ B``; drops the adapters.

  Args:
    layer_params: dict of stacked layer arrays (numpy or jax), as in :meth:`DecoderLayers.stacked`.
    cfg: the config the adapters were trained with (gives ``alpha / r``).
  """
  out = {k: v for k, v in layer_params.items() if "_lora_" not in k}
  for name in LORA_IN_DIMS:
    if f"{name}_lora_a" in layer_params:
      a = jnp.asarray(layer_params[f"{name}_lora_a"], jnp.float32)
      b = jnp.asarray(layer_params[f"{name}_lora_b"], jnp.float32)
      L, r = a.shape[0], a.shape[-1]
      delta = (a.reshape(L, -1, r) @ b.reshape(L, r, -1)).reshape(out[name].shape)
      scale = cfg.lora_alpha / cfg.lora_rank
      out[name] = (jnp.asarray(out[name], jnp.float32) + scale * delta).astype(out[name].dtype)
  return out


def attention(q, k, v, mask, dtype, return_mass: bool = False):
  """Grouped-query attention over an explicit visibility mask.

  Args:
    q: ``[B, T, H, Dh]`` queries (after RoPE).
    k, v: ``[B, S, K, Dh]`` keys / values, ``H % K == 0``.
    mask: ``[B, T, S]`` bool, True where the query may see the key; or ``[B, K, T, S]``: a
      mask per KV head (QUEST's per-head page selection), shared by the head's query group.
    dtype: compute dtype of the two matmuls; softmax runs in float32.
    return_mass: also return the attention mass per key (H2O's accumulated attention,
      Zhang et al. 2023): float32 ``[B, S]``, the attention probabilities summed over heads
      and queries, masked entries counted as 0 (a fully masked padding query adds nothing).

  Returns:
    ``[B, T, H, Dh]`` in ``dtype`` (and the ``[B, S]`` mass with ``return_mass``).
  """
  B, T, H, Dh = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, H // K, Dh).astype(dtype)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(dtype),
                      preferred_element_type=jnp.float32) * (Dh ** -0.5)
  m = mask[:, None, None, :, :] if mask.ndim == 3 else mask[:, :, None, :, :]
  scores = jnp.where(m, scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(dtype))
  if return_mass:
    mass = jnp.where(m, probs.astype(jnp.float32), 0.0).sum((1, 2, 3))
    return out.reshape(B, T, H, Dh), mass
  return out.reshape(B, T, H, Dh)


# SOL's dense rule (akhauriyash/SOL, "Compute Where it Counts"): a query that sees at most
# sinks + window + 1 keys attends densely; QUEST uses the same rule with these upstream defaults
SPARSE_DENSE_SINKS = 4
SPARSE_DENSE_WINDOW = 2


def _dense_rows(kv_len: jax.Array, keep_frac: jax.Array, sinks: int, window: int) -> jax.Array:
  return (kv_len <= sinks + window + 1) | (keep_frac >= 1.0)


def quest_key_mask(q: jax.Array, keys: jax.Array, mask: jax.Array, keep_frac: jax.Array,
                   page_size: int) -> jax.Array:
  """QUEST's query-aware page selection (Tang et al. 2024, "Quest: Query-Aware Sparsity for
  Efficient Long-Context LLM Inference", Alg. 1; SOL's ``quest`` knob, akhauriyash/SOL).

  Pages are ``page_size`` consecutive key slots (the key axis is padded to a whole page with
  invisible slots). Each page's per-channel min/max of the keys is taken over its slots that at
  least one query of the call may see (``mask.any`` over queries: dead / stale slots do not
  count). For query t and KV head k the page score is ``sum_g sum_d max(q_{g,d} maxK_d,
  q_{g,d} minK_d)``, summed over the group's query heads g (GQA choice: the query heads of a
  group share their KV head's selection, so the score is summed over the group; with
  ``H == K`` this is QUEST's per-head rule), computed as ``q . (max+min)/2 + |q| . (max-min)/2``
  (the same value). Query t keeps its ``ceil(keep_frac[t] * kv_len[t] / page_size)`` best pages
  among those it sees a key of (ties: the lower page), ``kv_len[t]`` = the keys it may see.
  Queries with ``kv_len <= SPARSE_DENSE_SINKS + SPARSE_DENSE_WINDOW + 1`` or ``keep_frac >= 1``
  stay dense.

  Args:
    q: ``[B, T, H, Dh]`` queries after RoPE (any float dtype; scored in float32).
    keys: ``[B, S, K, Dh]`` cached keys after RoPE.
    mask: bool ``[B, T, S]`` visibility.
    keep_frac: float ``[B, T]`` token-attention keep fraction per query.
    page_size: static int >= 1.

  Returns:
    bool ``[B, K, T, S]``: ``mask`` restricted to each (query, KV head)'s kept pages.
  """
  B, T, H, Dh = q.shape
  S = keys.shape[1]
  P = int(page_size)
  NP = -(-S // P)
  used = mask.any(axis=1)                                     # [B, S]
  kmax, kmin = _quest_page_minmax(keys, used, P)
  score = _quest_page_scores(q, kmax, kmin, _quest_page_any(used, P), mask, P)
  kv_len = mask.sum(-1)                                       # [B, T]
  n_keep = jnp.ceil(keep_frac * kv_len / P).astype(jnp.int32)
  rank = jnp.argsort(jnp.argsort(-score, axis=-1, stable=True), axis=-1, stable=True)
  keep_page = rank < n_keep[:, None, :, None]                 # [B, K, T, NP]
  keep = jnp.repeat(keep_page, P, axis=-1)[..., :S]
  dense = _dense_rows(kv_len, keep_frac, SPARSE_DENSE_SINKS, SPARSE_DENSE_WINDOW)
  return mask[:, None] & (keep | dense[:, None, :, None])


def _pad_to_pages(a: jax.Array, axis: int, P: int) -> jax.Array:
  """``a`` padded with zeros / False along ``axis`` to a whole number of ``P``-slot pages."""
  pad = -a.shape[axis] % P
  if not pad:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, pad)
  return jnp.pad(a, widths)


def _quest_page_any(used: jax.Array, P: int) -> jax.Array:
  """bool ``[B, NP, 1, 1]``: the page holds a slot of ``used`` (bool ``[B, S]``)."""
  B = used.shape[0]
  return _pad_to_pages(used, 1, P).reshape(B, -1, P).any(-1)[:, :, None, None]


def _quest_page_minmax(keys: jax.Array, used: jax.Array, P: int) -> tuple[jax.Array, jax.Array]:
  """QUEST page metadata: per-channel max / min of ``keys`` (``[B, S, K, Dh]``) over each page's
  slots where ``used`` (bool ``[B, S]``); float32 ``[B, NP, K, Dh]`` each, ``-inf`` / ``+inf`` on
  a page with no used slot."""
  B, _, K, Dh = keys.shape
  kp = _pad_to_pages(keys.astype(jnp.float32), 1, P).reshape(B, -1, P, K, Dh)
  u = _pad_to_pages(used, 1, P).reshape(B, -1, P, 1, 1)
  # one variadic reduce for both bounds: on XLA:CPU ~10x faster than two masked max / min
  # reductions (8k slots x 30 layers of SmolLM2: 45 ms vs 470 ms, a loaded 2-core machine)
  return jax.lax.reduce(
      (jnp.where(u, kp, -jnp.inf), jnp.where(u, kp, jnp.inf)),
      (np.float32(-np.inf), np.float32(np.inf)),
      lambda x, y: (jnp.maximum(x[0], y[0]), jnp.minimum(x[1], y[1])), (2,))


def _quest_page_scores(q: jax.Array, kmax: jax.Array, kmin: jax.Array, has: jax.Array,
                       mask: jax.Array, P: int) -> jax.Array:
  """QUEST page scores float32 ``[B, K, T, NP]`` of queries ``q [B, T, H, Dh]`` against the page
  bounds ``kmax / kmin [B, NP, K, Dh]`` (pages without ``has [B, NP, 1, 1]`` score as bounds 0),
  summed over each KV head's query group; ``-inf`` on pages query t sees no key of (``mask``
  bool ``[B, T, S]``)."""
  B, T, H, Dh = q.shape
  K = kmax.shape[2]
  kmax, kmin = jnp.where(has, kmax, 0.0), jnp.where(has, kmin, 0.0)
  qg = q.astype(jnp.float32).reshape(B, T, K, H // K, Dh)
  score = (jnp.einsum("btkgd,bpkd->bktp", qg, 0.5 * (kmax + kmin))
           + jnp.einsum("btkgd,bpkd->bktp", jnp.abs(qg), 0.5 * (kmax - kmin)))
  page_vis = _pad_to_pages(mask, 2, P).reshape(B, T, -1, P).any(-1)   # [B, T, NP]
  return jnp.where(page_vis[:, None], score, -jnp.inf)


def quest_gather_attention(q: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array,
                           keep_frac: jax.Array, page_size: int, num_pages: int, dtype,
                           fresh: tuple | None = None) -> tuple[jax.Array, jax.Array]:
  """QUEST attention over the kept pages only (the compute-saving form of
  :func:`quest_key_mask` + :func:`attention`, for decode steps of few queries).

  The page choice is :func:`quest_key_mask`'s (same page bounds over the slots some query sees,
  same scores, same ``ceil(keep_frac * kv_len / page_size)`` pages per query and KV head, same
  dense rule); then each (query, KV head) gathers the slots of its ``num_pages`` best pages
  (``jax.lax.top_k``; ties: the lower page, as the mask path) from ``keys`` / ``values`` and
  attends over those ``num_pages * page_size`` keys only, the ones past its own page count and
  the invisible ones masked. The result equals :func:`attention` over :func:`quest_key_mask`'s
  mask up to float summation order. Attention reads ``O(T * num_pages * page_size)`` keys
  instead of ``S``; the page bounds still read every key once.

  Args:
    q: ``[B, T, H, Dh]`` queries after RoPE.
    keys, values: ``[B, S, K, Dh]`` the cached keys (after RoPE) / values.
    mask: bool ``[B, T, S]`` visibility.
    keep_frac: float32 ``[B, T]`` keep fraction per query.
    page_size: static int >= 1.
    num_pages: static int in ``[1, ceil(S / page_size)]``: pages gathered per (query, KV head).
      Must be at least every sparse query's ``ceil(keep_frac * kv_len / page_size)`` and every
      dense query's count of pages it sees a key of (the engine computes it per step and buckets
      it, :func:`~selforch_jax.runtime.engine.quest_gather_pages`); a smaller value keeps fewer
      pages than the mask path.
    dtype: compute dtype of the two attention matmuls (softmax in float32).
    fresh: optional ``(k_new [B, T, K, Dh], v_new [B, T, K, Dh], slots int [B, T])``: this step's
      K/V, which ``keys`` / ``values`` do not hold yet (the unrolled decode loop passes the
      cache window before the step's write, so nothing copies the window): they replace the
      cached contents of ``slots`` in the page bounds and in the gathered keys (slots outside
      ``[0, S)`` are ignored, as the cache write drops them). None: ``keys`` / ``values`` are
      up to date.

  Returns:
    ``(out [B, T, H, Dh] in dtype, n_kept float32 [B, K, T])``: the attention output and the
    number of keys each (query, KV head) attended to.
  """
  B, T, H, Dh = q.shape
  S, K = keys.shape[1], keys.shape[2]
  P, NB = int(page_size), int(num_pages)
  NP = -(-S // P)
  if not 1 <= NB <= NP:
    raise ValueError(f"num_pages={NB} must be in [1, {NP}] (pages of {P} in {S} slots)")
  used = mask.any(axis=1)                                     # [B, S]
  rows = jnp.arange(B)[:, None]
  if fresh is None:
    kmax, kmin = _quest_page_minmax(keys, used, P)
  else:
    k_new, v_new, slots = fresh
    kmax, kmin = _quest_page_minmax(keys, used.at[rows, slots].set(False, mode="drop"), P)
    live = (slots >= 0) & (slots < S)
    live = live & jnp.take_along_axis(used, jnp.clip(slots, 0, S - 1), axis=1)
    page = jnp.where(live, slots // P, NP)                    # NP: dropped
    kn = k_new.astype(jnp.float32)
    kmax = kmax.at[rows, page].max(kn, mode="drop")
    kmin = kmin.at[rows, page].min(kn, mode="drop")
  score = _quest_page_scores(q, kmax, kmin, _quest_page_any(used, P), mask, P)
  kv_len = mask.sum(-1)                                       # [B, T]
  n_keep = jnp.ceil(keep_frac * kv_len / P).astype(jnp.int32)
  dense = _dense_rows(kv_len, keep_frac, SPARSE_DENSE_SINKS, SPARSE_DENSE_WINDOW)
  n_keep = jnp.where(dense, NB, jnp.minimum(n_keep, NB))
  _, top = jax.lax.top_k(score, NB)                           # [B, K, T, NB]
  keep_page = jnp.arange(NB) < n_keep[:, None, :, None]
  slot = (top[..., None] * P + jnp.arange(P)).reshape(B, K, T, NB * P)
  keep_slot = jnp.repeat(keep_page, P, axis=-1) & (slot < S)
  slot = jnp.minimum(slot, S - 1)
  bi = jnp.arange(B)[:, None, None, None]
  ki = jnp.arange(K)[None, :, None, None]
  ti = jnp.arange(T)[None, None, :, None]
  flat = (bi * S + slot) * K + ki                             # row of [B * S * K, Dh]
  kg = jnp.take(keys.reshape(B * S * K, Dh), flat, axis=0, mode="clip")   # [B, K, T, N, Dh]
  vg = jnp.take(values.reshape(B * S * K, Dh), flat, axis=0, mode="clip")
  vis = jnp.take(mask.reshape(-1), (bi * T + ti) * S + slot, mode="clip")   # [B, K, T, N]
  keep_slot = keep_slot & vis
  if fresh is not None:
    for j in range(T):
      hit = (slot == slots[:, j, None, None, None])[..., None]              # [B, K, T, N, 1]
      kg = jnp.where(hit, k_new[:, j, :, None, None, :].astype(kg.dtype), kg)
      vg = jnp.where(hit, v_new[:, j, :, None, None, :].astype(vg.dtype), vg)
  qg = q.reshape(B, T, K, H // K, Dh).astype(dtype)
  scores = jnp.einsum("btkgd,bktsd->bkgts", qg, kg.astype(dtype),
                      preferred_element_type=jnp.float32) * (Dh ** -0.5)
  scores = jnp.where(keep_slot[:, :, None], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgts,bktsd->btkgd", probs, vg.astype(dtype))
  return out.reshape(B, T, H, Dh), keep_slot.sum(-1).astype(jnp.float32)


def recency_key_mask(mask: jax.Array, keep_frac: jax.Array, sinks: int, window: int,
                     key_order: jax.Array | None = None) -> jax.Array:
  """Recency selection (StreamingLLM-style sinks + newest keys; SOL's ``recency`` knob,
  akhauriyash/SOL "Compute Where it Counts"): query t keeps, among the keys it may see, the
  ``sinks`` oldest and the ``max(window, ceil(keep_frac[t] * kv_len[t]))`` newest ones
  (``kv_len[t]`` = keys it may see; age by ``key_order``). Queries with ``kv_len <= sinks +
  window + 1`` or ``keep_frac >= 1`` stay dense.

  Args:
    mask: bool ``[B, T, S]`` visibility.
    keep_frac: float ``[B, T]``.
    sinks, window: static ints >= 0.
    key_order: optional int ``[B, S]``: the age rank of each slot (smaller = older; the engine
      passes the pool's decode order); None = slot order. Ties keep slot order.

  Returns:
    bool ``[B, T, S]`` (the same selection for every head).
  """
  S = mask.shape[-1]
  if key_order is None:
    perm = jnp.broadcast_to(jnp.arange(S), mask.shape[:1] + (S,))
  else:
    perm = jnp.argsort(key_order, axis=-1, stable=True)         # oldest first
  ms = jnp.take_along_axis(mask, perm[:, None, :], axis=-1)
  c = jnp.cumsum(ms.astype(jnp.int32), axis=-1)
  n = c[..., -1:]
  recent = jnp.maximum(int(window), jnp.ceil(keep_frac[..., None] * n).astype(jnp.int32))
  keep_sorted = ms & ((c <= int(sinks)) | (c > n - recent))
  inv = jnp.argsort(perm, axis=-1)
  keep = jnp.take_along_axis(keep_sorted, inv[:, None, :], axis=-1)
  dense = _dense_rows(n[..., 0], keep_frac, int(sinks), int(window))
  return mask & (keep | dense[..., None])


def fake_quant(x: jax.Array, bits: int) -> jax.Array:
  """Symmetric per-token absmax fake quantisation to ``bits`` bits (SOL's MLP-output knob,
  akhauriyash/SOL): ``round(x / s) * s`` with ``s = max_d |x_d| / (2^(bits-1) - 1)`` over the
  last axis, computed in float32 and returned in ``x.dtype``; ``bits >= 16`` is the identity (no
  op traced). An all-zero row stays zero."""
  if bits >= 16:
    return x
  xf = x.astype(jnp.float32)
  qmax = float(2 ** (int(bits) - 1) - 1)
  s = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / qmax
  safe = jnp.where(s > 0, s, 1.0)
  return (jnp.round(xf / safe) * safe).astype(x.dtype)


def channel_keep_mask(h: jax.Array, keep_frac: jax.Array) -> jax.Array:
  """SOL's structured MLP-input activation pruning (akhauriyash/SOL ``utils/masks.py``): keep
  the top ``ceil(keep_frac * D)`` channels of ``h`` ranked by ``|h|`` (ties: the lower channel)
  and zero the rest. Upstream ranks by ``max_t |h|`` over the call's tokens of one example;
  here each query ranks by its own ``|h_t|`` (a decode step's query is one token of one
  sequence, so for one query it is upstream's rule; several queries of one step may belong to
  different sequences, e.g. SOL's counterfactual rollouts).

  Args:
    h: ``[B, T, D]`` MLP input (the normed hidden state), any float dtype.
    keep_frac: float ``[B, T]`` channel keep fraction per query (``>= 1``: all, ``<= 0``: one
      channel: at least one channel is kept).

  Returns:
    float32 ``[B, T, D]`` 0/1 mask.
  """
  D = h.shape[-1]
  n = jnp.clip(jnp.ceil(keep_frac.astype(jnp.float32) * D), 1, D).astype(jnp.int32)
  a = jnp.abs(h.astype(jnp.float32))
  rank = jnp.argsort(jnp.argsort(-a, axis=-1, stable=True), axis=-1, stable=True)
  return (rank < n[..., None]).astype(jnp.float32)


def fake_quant_rows(x: jax.Array, bits: jax.Array) -> jax.Array:
  """:func:`fake_quant` with a bit-width per token: ``x [B, T, D]``, ``bits`` float or int
  ``[B, T]`` in [2, 16]; rows with ``bits >= 16`` are returned unchanged (SOL's per-step
  activation-bits knob when the queries of one step carry different actions)."""
  xf = x.astype(jnp.float32)
  b = bits.astype(jnp.float32)[..., None]
  qmax = jnp.exp2(jnp.minimum(b, 15.0) - 1.0) - 1.0
  s = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / qmax
  safe = jnp.where(s > 0, s, 1.0)
  return jnp.where(b >= 16, xf, jnp.round(xf / safe) * safe).astype(x.dtype)


class Transformer(nnx.Module):
  """Decoder-only causal LM (Llama / SmolLM2 / Qwen3).

  Call with ``(tokens, positions, mask, kv_cache=None, cache_index=None)``; see
  :meth:`__call__`. Parameters: ``embed [V, D]`` (logical ``vocab, embed``),
  ``layers`` (:class:`DecoderLayers`), ``final_norm [D]`` and, when untied,
  ``lm_head [D, V]``.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = cfg.jnp_param_dtype
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
    self.layers = DecoderLayers(cfg, rngs)
    self.final_norm = _param(rngs, (cfg.hidden_size,), ("norm",), pd, "ones")
    if not cfg.tie_word_embeddings:
      self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd,
                            fan_in=cfg.hidden_size)

  def __call__(self, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
               kv_cache: KVCache | None = None, cache_index: jax.Array | int | None = None,
               *, write_slots: jax.Array | None = None, return_hidden: bool = False,
               return_attn_mass: bool = False, key_len: int | None = None,
               view: str = "base", mlp_keep: jax.Array | None = None, act_bits: int = 16,
               sparsity: tuple = ("none",), keep_frac: jax.Array | None = None,
               key_order: jax.Array | None = None,
               layer_params: dict[str, list] | None = None,
               mlp_keep_frac: jax.Array | None = None, query_bits: jax.Array | None = None,
               return_usage: bool = False, query_view: jax.Array | None = None) -> tuple:
    """Forward pass.

    Args:
      tokens: ``[B, T]`` int32 token ids.
      positions: ``[B, T]`` int32 RoPE position ids.
      mask: ``[B, T, S]`` bool visibility (query x key). Without a cache, ``S == T``
        and keys are the T tokens themselves; with a cache, ``S == kv_cache.max_len``
        and keys are the cache slots after this call's writes. Or an attention backend: a
        callable ``mask(q [B,T,H,Dh], keys [B,S,K,Dh], values) -> [B,T,H,Dh]`` with a ``shape``
        of ``(B, T, S)`` that applies its own visibility (the engine's paged kernel path,
        :class:`selforch_jax.runtime.paged_backend.PagedAttentionMask`).
      kv_cache: optional :class:`KVCache`; the T new keys/values are written to its
        slots before attention: ``[cache_index, cache_index + T)`` of every row, or the
        slots ``write_slots[b, t]`` (a paged pool seen as a flat slot array).
      cache_index: int32 scalar, first slot to write (contiguous writes).
      write_slots: ``[B, T]`` int32 slot of each new token (scatter writes); exactly one
        of ``cache_index`` / ``write_slots`` is required with ``kv_cache``. Slots must be
        distinct within a row.
      return_hidden: return the final hidden states ``[B, T, D]`` instead of logits.
      return_attn_mass: also return float32 ``[B, S]``, the attention probabilities each key
        received, summed over layers, heads and the T queries (H2O's accumulated attention
        score, Zhang et al. 2023). Off by default (then the program is unchanged).
      key_len: with a cache, attend over its first ``key_len`` slots only (a static Python
        int in ``[1, max_len]``; the writes still go to any slot): ``mask`` and the attention
        mass are then ``[B, T, key_len]`` / ``[B, key_len]``. The engine passes the bucketed
        end of the slots its step can see, so a pool with its used pages packed at the front
        costs attention over that prefix, not over the whole pool. None = every slot.
      view: ``"base"`` or one of ``cfg.attn_views``: the attention projections (and q/k norms)
        every layer uses; embeddings, norms, MLP and LM head are shared. A view's K/V are
        written to the cache like any other (a scheduler that must not keep them runs the step
        as scratch).
      mlp_keep: optional float or bool ``[D]`` or ``[B, T, D]``: every layer's MLP input (the
        normed hidden state) is multiplied by it (1 = channel kept, 0 = dropped; SOL's channel
        knob, the caller chooses the channels).
      act_bits: MLP-output fake-quant bits (:func:`fake_quant`, per token absmax); 16 = off.
      sparsity: static ``("none",)``, ``("quest", page_size)`` (:func:`quest_key_mask`, per
        layer from that layer's queries and keys) or ``("recency", sinks, window)``
        (:func:`recency_key_mask`, the same for every layer) or ``("quest_gather", page_size,
        num_pages)``: QUEST's choice with attention over the ``num_pages`` gathered pages of each
        (query, KV head) only (:func:`quest_gather_attention`; static ``num_pages``; the same
        logits as ``("quest", page_size)`` up to float summation order; for decode steps of few
        queries; not with ``return_attn_mass``). Not with an attention backend.
      keep_frac: float ``[B, T]`` keep fraction per query; required when ``sparsity`` is set.
      key_order: optional int ``[B, S]`` age rank of the keys for ``recency``.
      mlp_keep_frac: optional float ``[B, T]``: every layer keeps the top ``ceil(frac * D)``
        MLP input channels of each query by ``|h|`` (:func:`channel_keep_mask`; after
        ``mlp_keep``).
      query_bits: optional ``[B, T]`` MLP-output fake-quant bits per query
        (:func:`fake_quant_rows`; 16 = off; after ``act_bits``).
      return_usage: also return float32 ``[B, T, 3]``, the compute each query got: the kept
        fraction of the keys it may see (mean over layers and KV heads; 1 without sparsity or on
        the dense rule), the kept fraction of MLP input channels (mean over layers; counts the
        nonzero channels of ``mlp_keep`` too) and its MLP-output bits / 16.
      query_view: optional bool ``[B, T]`` with ``view`` a view name: per-query view
        selection (Orthrus's fused verify + draft step): query t uses ``view``'s attention
        projections (and q/k norms) where True and the base ones (LoRA included) where False;
        both are computed for every query and selected, so one program serves any split.
        None = every query uses ``view``.
      layer_params: optional ``{name: [L arrays]}``: the layer parameters unstacked, one array
        per layer (:func:`unstack_layers`); with ``layer_loop="unroll"`` layer i reads its own
        arrays instead of slicing the stacked ones (no per-step weight copy on CPU).

    Returns:
      ``(logits [B, T, V] float32, new_cache)`` (``new_cache`` is None without a cache);
      ``(logits, new_cache, attn_mass)`` with ``return_attn_mass``; the usage ``[B, T, 3]``
      comes last with ``return_usage``. With every spec argument
      at its default the traced program is the plain one.

    Raises:
      ValueError: on inconsistent shapes (checked at trace time), an unknown view, sparsity
        without ``keep_frac`` or with an attention backend.
    """
    cfg = self.cfg
    B, T = tokens.shape
    S = kv_cache.max_len if kv_cache is not None else T
    if key_len is not None:
      if kv_cache is None or not 1 <= int(key_len) <= S:
        raise ValueError(f"key_len={key_len} needs a kv_cache and 1 <= key_len <= {S}")
      S = int(key_len)
    if positions.shape != (B, T):
      raise ValueError(f"positions shape {positions.shape} != tokens shape {(B, T)}")
    if mask.shape != (B, T, S):
      raise ValueError(f"mask shape {mask.shape} != (batch, queries, keys) = {(B, T, S)}")
    if kv_cache is not None and (cache_index is None) == (write_slots is None):
      raise ValueError("give exactly one of cache_index / write_slots with kv_cache")
    if write_slots is not None and write_slots.shape != (B, T):
      raise ValueError(f"write_slots shape {write_slots.shape} != tokens shape {(B, T)}")
    dtype = cfg.jnp_dtype
    inv_freq = rope_inv_freq(cfg)
    sparse = tuple(sparsity)
    if sparse[0] != "none":
      if keep_frac is None:
        raise ValueError(f"sparsity={sparse} needs keep_frac [B, T]")
      if callable(mask):
        raise ValueError("sparsity needs a dense mask, not an attention backend")
      if keep_frac.shape != (B, T):
        raise ValueError(f"keep_frac shape {keep_frac.shape} != {(B, T)}")
      if sparse[0] == "quest_gather" and (len(sparse) != 3 or return_attn_mass):
        raise ValueError(f"sparsity={sparse}: give ('quest_gather', page_size, num_pages), "
                         f"without return_attn_mass")
    if mlp_keep is not None and mlp_keep.shape not in ((cfg.hidden_size,),
                                                       (B, T, cfg.hidden_size)):
      raise ValueError(f"mlp_keep shape {mlp_keep.shape} is neither [D] nor [B, T, D]")
    for name, arr in (("mlp_keep_frac", mlp_keep_frac), ("query_bits", query_bits)):
      if arr is not None and arr.shape != (B, T):
        raise ValueError(f"{name} shape {arr.shape} != {(B, T)}")
    x = jnp.take(self.embed[...], tokens, axis=0).astype(dtype)
    loop = cfg.resolved_layer_loop(decode=kv_cache is not None)
    if layer_params is not None and loop != "unroll":
      raise ValueError("layer_params (per-layer weights) needs layer_loop='unroll'")
    all_params = layer_params if layer_params is not None else self.layers.stacked()
    mixed = query_view is not None
    if mixed:
      if view == "base":
        raise ValueError("query_view selects between the base and a view: give view=<name>")
      if query_view.shape != (B, T):
        raise ValueError(f"query_view shape {query_view.shape} != {(B, T)}")
      params = view_params(all_params, cfg, "base")
      params.update({f"{n}@view": a for n, a in view_params(all_params, cfg, view).items()
                     if n in view_param_names(cfg)})
      sel = query_view.astype(bool)[:, :, None, None]                     # [B, T, 1, 1]
    else:
      params = view_params(all_params, cfg, view)
    ls = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0
    step_mask = mask
    if sparse[0] == "recency":
      step_mask = recency_key_mask(mask, keep_frac.astype(jnp.float32), sparse[1], sparse[2],
                                   key_order)

    def layer(x, p, cache_kv):
      h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
      q = proj(h, p, "q_proj", "btd,dhk->bthk", dtype, ls)
      k = proj(h, p, "k_proj", "btd,dhk->bthk", dtype, ls)
      v = proj(h, p, "v_proj", "btd,dhk->bthk", dtype, ls)
      if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
      if mixed:   # the view's projections too, selected per query
        pv = {n: p[f"{n}@view"] for n in view_param_names(cfg)}
        qv, kv_, vv = (proj(h, pv, n, "btd,dhk->bthk", dtype, 0.0)
                       for n in ("q_proj", "k_proj", "v_proj"))
        if cfg.qk_norm:
          qv = rms_norm(qv, pv["q_norm"], cfg.rms_norm_eps)
          kv_ = rms_norm(kv_, pv["k_norm"], cfg.rms_norm_eps)
        q, k, v = jnp.where(sel, qv, q), jnp.where(sel, kv_, k), jnp.where(sel, vv, v)
      q = apply_rope(q, positions, inv_freq)
      k = apply_rope(k, positions, inv_freq)
      fresh = None
      if cache_kv is not None and len(cache_kv) == 2:
        # unrolled loop: attention reads a copy of this layer's key window [B, S, K, Dh] with
        # the new K/V scattered in (slots past the window dropped); the caller writes every
        # layer's new K/V into the stacked cache once, after the loop
        kw_, vw_ = cache_kv
        fresh = (k, v, slots_eff)   # the gather path reads the window before the write
        rows = jnp.arange(B)[:, None]
        keys = kw_.at[rows, slots_eff].set(k.astype(kw_.dtype))
        values = vw_.at[rows, slots_eff].set(v.astype(vw_.dtype))
        cache_kv = (k, v)
      elif cache_kv is not None:
        # writes and reads go straight to layer i of the stacked cache [L, B, max_len, K, Dh]
        # (no copy of the layer's whole row), and attention reads the first S slots only
        ck, cv, i = cache_kv
        if write_slots is None:
          at = (i, 0, cache_index, 0, 0)
          ck = jax.lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), at)
          cv = jax.lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), at)
        else:
          rows = jnp.arange(B)[:, None]
          ck = ck.at[i, rows, write_slots].set(k.astype(ck.dtype))
          cv = cv.at[i, rows, write_slots].set(v.astype(cv.dtype))
        size = (1, B, S) + ck.shape[3:]
        keys = jax.lax.dynamic_slice(ck, (i, 0, 0, 0, 0), size)[0]
        values = jax.lax.dynamic_slice(cv, (i, 0, 0, 0, 0), size)[0]
        cache_kv = (ck, cv)
      else:
        keys, values = k, v
      m = step_mask
      if sparse[0] == "quest":
        m = quest_key_mask(q, keys, mask, keep_frac.astype(jnp.float32), sparse[1])
      use, n_kept = None, None
      if sparse[0] == "quest_gather":
        # the unrolled loop passes the window before this step's write plus the new K/V
        src = (kw_, vw_) if fresh is not None else (keys, values)
        a, n_kept = quest_gather_attention(q, *src, mask, keep_frac.astype(jnp.float32),
                                           sparse[1], sparse[2], dtype, fresh)   # [B, K, T]
        mass = None
      elif callable(m):  # an attention backend, e.g. runtime.paged_backend.PagedAttentionMask
        if return_attn_mass:
          raise ValueError("return_attn_mass needs a dense mask, not an attention backend")
        a, mass = m(q, keys, values), None
      elif return_attn_mass:
        a, mass = attention(q, keys, values, m, dtype, return_mass=True)
      else:
        a, mass = attention(q, keys, values, m, dtype), None
      if return_usage:
        kept = jnp.ones((B, T), jnp.float32)
        if sparse[0] != "none":
          seen = jnp.maximum(mask.sum(-1), 1).astype(jnp.float32)          # [B, T]
          if n_kept is None:
            n_kept = m.sum(-1).astype(jnp.float32)                          # [B, K, T]: QUEST
          n_kept = n_kept.mean(1) if n_kept.ndim == 3 else n_kept
          kept = jnp.where(mask.any(-1), n_kept / seen, 1.0)
      o = proj(a, p, "o_proj", "bthk,hkd->btd", dtype, ls)
      if mixed:
        o = jnp.where(sel[..., 0], proj(a, pv, "o_proj", "bthk,hkd->btd", dtype, 0.0), o)
      x = x + o
      h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
      if mlp_keep is not None:
        h = h * mlp_keep.astype(h.dtype)
      if mlp_keep_frac is not None:
        h = h * channel_keep_mask(h, mlp_keep_frac).astype(h.dtype)
      g = proj(h, p, "gate_proj", "btd,df->btf", dtype, ls)
      u = proj(h, p, "up_proj", "btd,df->btf", dtype, ls)
      y = fake_quant(proj(jax.nn.silu(g) * u, p, "down_proj", "btf,fd->btd", dtype, ls), act_bits)
      if query_bits is not None:
        y = fake_quant_rows(y, query_bits)
      x = x + y
      if return_usage:
        D = cfg.hidden_size
        chan = jnp.ones((B, T), jnp.float32)
        if mlp_keep is not None:
          chan = jnp.broadcast_to((mlp_keep != 0).astype(jnp.float32).sum(-1) / D, (B, T))
        if mlp_keep_frac is not None:
          n = jnp.clip(jnp.ceil(mlp_keep_frac.astype(jnp.float32) * D), 1, D)
          chan = jnp.minimum(chan, n / D)
        use = jnp.stack([kept, chan], -1)                                   # [B, T, 2]
      return x, cache_kv, (mass, use)

    if cfg.remat:
      layer = jax.checkpoint(layer)

    if loop == "unroll":
      # a Python loop over the layers (static layer index): no scan carry; with a cache, each
      # layer attends over a copy of its key window and the new K/V of all layers are scattered
      # into the stacked cache in one write at the end (chained per-layer writes into the
      # stacked cache make XLA copy the whole cache per layer on CPU)
      if kv_cache is not None:
        slots_eff = (write_slots if write_slots is not None
                     else jnp.broadcast_to(cache_index + jnp.arange(T), (B, T)))
      masses, uses, new_kv = [], [], []
      for i in range(cfg.num_layers):
        p = {name: arr[i] for name, arr in params.items()}
        if kv_cache is None:
          x, _, (mass, use) = layer(x, p, None)
        else:
          x, kv, (mass, use) = layer(x, p, (kv_cache.k[i, :, :S], kv_cache.v[i, :, :S]))
          new_kv.append(kv)
        masses.append(mass)
        uses.append(use)
      new_cache = None
      if kv_cache is not None:
        rows = jnp.arange(B)[:, None]
        ks = jnp.stack([a for a, _ in new_kv]).astype(kv_cache.k.dtype)   # [L, B, T, K, Dh]
        vs = jnp.stack([b for _, b in new_kv]).astype(kv_cache.v.dtype)
        new_cache = KVCache(k=kv_cache.k.at[:, rows, slots_eff].set(ks),
                            v=kv_cache.v.at[:, rows, slots_eff].set(vs))
      masses = jnp.stack(masses) if return_attn_mass else None
      uses = jnp.stack(uses) if return_usage else None
    elif kv_cache is None:
      def body(x, p):
        x, _, aux = layer(x, p, None)
        return x, aux
      x, (masses, uses) = jax.lax.scan(body, x, params)
      new_cache = None
    else:
      def body(carry, xs):
        x, ck_all, cv_all = carry
        p, i = xs
        x, (ck_all, cv_all), aux = layer(x, p, (ck_all, cv_all, i))
        return (x, ck_all, cv_all), aux
      (x, k_all, v_all), (masses, uses) = jax.lax.scan(
          body, (x, kv_cache.k, kv_cache.v), (params, jnp.arange(cfg.num_layers)))
      new_cache = KVCache(k=k_all, v=v_all)

    x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    extra = (masses.sum(0),) if return_attn_mass else ()
    if return_usage:
      if query_bits is not None:
        bits = jnp.minimum(query_bits.astype(jnp.float32), 16.0)
        if act_bits < 16:
          bits = jnp.minimum(bits, float(act_bits))
      else:
        bits = jnp.full((B, T), float(min(act_bits, 16)), jnp.float32)
      extra = extra + (jnp.concatenate([uses.mean(0), (bits / 16.0)[..., None]], -1),)
    if return_hidden:
      return (x, new_cache) + extra
    return (self.logits_from_hidden(x), new_cache) + extra

  def logits_from_hidden(self, x: jax.Array) -> jax.Array:
    """LM-head logits float32 ``[B, T, V]`` of final (normed) hidden states ``x [B, T, D]``
    (what :meth:`__call__` returns with ``return_hidden``), matmul in ``cfg.dtype``."""
    cfg = self.cfg
    head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
    return jnp.einsum("btd,dv->btv", x, head.astype(cfg.jnp_dtype),
                      preferred_element_type=jnp.float32)


def unstack_layers(model: "Transformer") -> dict[str, list[jax.Array]]:
  """The stacked layer parameters of ``model`` as ``{name: [L arrays]}`` (one device array per
  layer, each ``arr[i]`` of the stacked ``[L, ...]`` array), for ``layer_params=``."""
  return {k: [v[i] for i in range(v.shape[0])] for k, v in model.layers.stacked().items()}


def causal_mask(valid: jax.Array) -> jax.Array:
  """Causal mask over one sequence per row that ignores padding.

  Args:
    valid: ``[B, T]`` bool, False on padding tokens.

  Returns:
    ``[B, T, T]`` bool: query t sees key s iff ``s <= t`` and both are valid
    (padding queries see nothing).
  """
  T = valid.shape[1]
  tri = jnp.tril(jnp.ones((T, T), bool))
  return tri[None] & valid[:, None, :] & valid[:, :, None]


def positions_from_valid(valid: jax.Array) -> jax.Array:
  """Position ids ``[B, T]`` int32 that skip padding: the count of valid tokens before each."""
  return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
  """A randomly initialised :class:`Transformer` (normal(0, fan_in^-1/2) matrices, unit norms)."""
  return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def add_lora(model: Transformer, rank: int, alpha: float = 16.0,
             targets: tuple[str, ...] | str | None = None, seed: int = 0) -> Transformer:
  """A copy of ``model`` with LoRA adapters (Hu et al. 2021) of rank ``rank``.

  A is random normal(0, fan_in^-1/2), B is zero, so the new model computes exactly what
  ``model`` computes until B is trained. ``rank == 0`` returns ``model`` unchanged.
  """
  if rank <= 0:
    return model
  kw = dict(lora_rank=rank, lora_alpha=alpha)
  if targets is not None:
    kw["lora_targets"] = targets
  new = Transformer(model.cfg.replace(**kw), rngs=nnx.Rngs(params=seed))
  nnx.update(new, nnx.state(model, nnx.Param))
  return new


def add_attn_view(model: Transformer, name: str) -> Transformer:
  """A copy of ``model`` with one more attention view ``name`` (``ModelConfig.attn_views``).

  The view's ``q_proj_<name>, k_proj_<name>, v_proj_<name>, o_proj_<name>`` (and ``q_norm_<name>,
  k_norm_<name>`` with ``qk_norm``), each ``[L, ...]`` like its base parameter, start as copies
  of the base (AR) projections, so the forward with ``view=name`` computes exactly the base
  logits until the view is trained (a LoRA adapter of a base projection is not copied: the view
  starts from the base weights). Every other parameter is the same array as in ``model``.
  Checkpoint notes: Hugging Face export (``checkpoints.hf_layout.hf_from_params``) writes the
  base weights only (views are dropped); load an HF checkpoint into a view-free model, then add
  the view.

  Raises:
    ValueError: ``name`` is not a valid view name or the model already has it.
  """
  cfg = model.cfg
  if name in cfg.attn_views:
    raise ValueError(f"the model already has an attention view {name!r}")
  new_cfg = cfg.replace(attn_views=cfg.attn_views + (name,))
  new = nnx.eval_shape(lambda: Transformer(new_cfg, rngs=nnx.Rngs(params=0)))
  old = nnx.state(model, nnx.Param)
  flat = dict(nnx.to_flat_state(old))
  state = nnx.state(new, nnx.Param)
  for path, var in nnx.to_flat_state(state):
    if path in flat:
      var.set_value(flat[path].get_value())
    else:   # ("layers", "<base>_<name>")
      base = path[-1][:-(len(name) + 1)]
      var.set_value(jnp.array(flat[path[:-1] + (base,)].get_value()))
  nnx.update(new, state)
  return new


def merged_model(model: Transformer) -> Transformer:
  """A LoRA-free copy of ``model`` with the adapters folded in (:func:`merge_lora`).

  A model without adapters is returned unchanged.
  """
  if not model.cfg.lora_rank:
    return model
  cfg = model.cfg.replace(lora_rank=0)
  new = Transformer(cfg, rngs=nnx.Rngs(params=0))
  base = nnx.state(model, nnx.Param)
  merged = merge_lora(model.layers.stacked(), model.cfg)
  nnx.update(new, nnx.filter_state(base, nnx.Not(nnx.LoRAParam)))
  for k, v in merged.items():
    getattr(new.layers, k)[...] = v
  return new


def param_dict(model: Transformer) -> dict[str, Any]:
  """Nested dict of plain arrays of ``model``'s parameters (for import/export)."""
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))
