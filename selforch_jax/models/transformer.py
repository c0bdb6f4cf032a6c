"""Flax NNX decoder-only transformer for the Llama family (SmolLM2, Llama 2/3) and Qwen3.

Architecture (Touvron et al. 2023, Llama; Qwen3 technical report 2025): pre-RMSNorm
blocks of grouped-query attention with RoPE and a SwiGLU MLP, final RMSNorm, tied or
untied LM head. Qwen3 adds RMSNorm over each query/key head before RoPE.

Design points used by every runtime of the project (DESIGN.md §2):

* attention takes explicit ``positions`` ``[B, T]`` and an explicit boolean visibility
  ``mask`` ``[B, T, S]`` (query x key); the model never builds a causal mask itself;
* the layers' parameters are stacked along a leading ``layers`` axis and the forward
  scans over them (``jax.lax.scan``), so compiling the 30-layer SmolLM2 costs one layer;
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

  def stacked(self) -> dict[str, jax.Array]:
    """The stacked layer parameters (LoRA adapters included) as a dict of arrays (axis 0 = L)."""
    return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}


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
    mask: ``[B, T, S]`` bool, True where the query may see the key.
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
  scores = jnp.where(mask[:, None, None, :, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(dtype))
  if return_mass:
    mass = jnp.where(mask[:, None, None, :, :], probs.astype(jnp.float32), 0.0).sum((1, 2, 3))
    return out.reshape(B, T, H, Dh), mass
  return out.reshape(B, T, H, Dh)


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
               return_attn_mass: bool = False, key_len: int | None = None) -> tuple:
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

    Returns:
      ``(logits [B, T, V] float32, new_cache)`` (``new_cache`` is None without a cache);
      ``(logits, new_cache, attn_mass)`` with ``return_attn_mass``.

    Raises:
      ValueError: on inconsistent shapes (checked at trace time).
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
    x = jnp.take(self.embed[...], tokens, axis=0).astype(dtype)
    params = self.layers.stacked()
    ls = cfg.lora_alpha / cfg.lora_rank if cfg.lora_rank else 0.0

    def layer(x, p, cache_kv):
      h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
      q = proj(h, p, "q_proj", "btd,dhk->bthk", dtype, ls)
      k = proj(h, p, "k_proj", "btd,dhk->bthk", dtype, ls)
      v = proj(h, p, "v_proj", "btd,dhk->bthk", dtype, ls)
      if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
      q = apply_rope(q, positions, inv_freq)
      k = apply_rope(k, positions, inv_freq)
      if cache_kv is not None:
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
      if callable(mask):  # an attention backend, e.g. runtime.paged_backend.PagedAttentionMask
        if return_attn_mass:
          raise ValueError("return_attn_mass needs a dense mask, not an attention backend")
        a, mass = mask(q, keys, values), None
      elif return_attn_mass:
        a, mass = attention(q, keys, values, mask, dtype, return_mass=True)
      else:
        a, mass = attention(q, keys, values, mask, dtype), None
      x = x + proj(a, p, "o_proj", "bthk,hkd->btd", dtype, ls)
      h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
      g = proj(h, p, "gate_proj", "btd,df->btf", dtype, ls)
      u = proj(h, p, "up_proj", "btd,df->btf", dtype, ls)
      x = x + proj(jax.nn.silu(g) * u, p, "down_proj", "btf,fd->btd", dtype, ls)
      return x, cache_kv, mass

    if cfg.remat:
      layer = jax.checkpoint(layer)

    if kv_cache is None:
      def body(x, p):
        x, _, mass = layer(x, p, None)
        return x, mass
      x, masses = jax.lax.scan(body, x, params)
      new_cache = None
    else:
      def body(carry, xs):
        x, ck_all, cv_all = carry
        p, i = xs
        x, (ck_all, cv_all), mass = layer(x, p, (ck_all, cv_all, i))
        return (x, ck_all, cv_all), mass
      (x, k_all, v_all), masses = jax.lax.scan(
          body, (x, kv_cache.k, kv_cache.v), (params, jnp.arange(cfg.num_layers)))
      new_cache = KVCache(k=k_all, v=v_all)

    x = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
    extra = (masses.sum(0),) if return_attn_mass else ()
    if return_hidden:
      return (x, new_cache) + extra
    head = self.embed[...].T if cfg.tie_word_embeddings else self.lm_head[...]
    logits = jnp.einsum("btd,dv->btv", x, head.astype(dtype), preferred_element_type=jnp.float32)
    return (logits, new_cache) + extra


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
