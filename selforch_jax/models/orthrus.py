"""Orthrus's model additions (Nguyen et al. 2026, "Memory-Efficient Parallel Token Generation via
Dual-View Diffusion", chiennv2000/orthrus ``src/model.py``; seed_systems.md §2): the diffusion
attention view, the mask token, and the dual-pass training forward.

* **Diffusion view**: every layer gets its own ``{q,k,v,o}_proj_diffusion`` (and q/k norms where
  the family has them, Qwen3), initialised as copies of the AR projections
  (:func:`~selforch_jax.models.transformer.add_attn_view`); embeddings, norms, MLP and LM head are
  shared. A forward with ``view="diffusion"`` uses them.
* **Mask token** ``<|mask|>``: SmolLM2 (and Llama) have none, so one special-token row is appended
  to the vocabulary, initialised to the mean of the existing embedding rows (and, for an untied
  head, the mean of the existing ``lm_head`` columns), the project's rule for added tokens
  (:func:`~selforch_jax.lang.embeddings.resize_vocab`, as the orchestration tags). With a tied
  head the mask id also gets an output logit (``h . mean row``); AR decoding and verification use
  the same grown model, so AR and Orthrus stay identical.
* **Dual pass** (:func:`dual_pass_logits`; upstream's ``generate_dual_pass_mask`` with
  ``causal_limit = block_start - 1``): the frozen AR pass over the whole sequence writes every
  layer's K/V into a cache; then one diffusion-view pass over every block ``[x_s, MASK x (B-1)]``
  at positions ``s .. s+B-1``: a block query sees the AR keys strictly before ``s`` and every key
  of its own block (bidirectional), exactly what the runtime's scratch diffusion step sees (the
  committed cache ``[0, s)`` plus the block).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from selforch_jax.lang.embeddings import resize_vocab
from flax import nnx

from selforch_jax.models.transformer import (LORA_IN_DIMS, VIEW_PARAMS, KVCache, Transformer,
                                             add_attn_view)

VIEW = "diffusion"
MASK_TOKEN = "<|mask|>"

__all__ = ["VIEW", "MASK_TOKEN", "add_orthrus", "mask_token_id", "add_view_delta",
           "view_delta_names", "apply_view_delta", "block_inputs", "dual_pass_mask",
           "dual_pass_logits"]


def mask_token_id(model: Transformer, tokenizer: Any = None) -> int:
  """The mask id of an Orthrus model: the tokenizer's ``<|mask|>`` when given, else the last
  vocabulary row (where :func:`add_orthrus` puts it without a tokenizer).

  Raises:
    ValueError: the model has no diffusion view, or the tokenizer has no ``<|mask|>``.
  """
  if VIEW not in model.cfg.attn_views:
    raise ValueError(f"the model has no {VIEW!r} attention view (add it with add_orthrus)")
  if tokenizer is None:
    return int(model.cfg.vocab_size) - 1
  i = tokenizer.token_to_id(MASK_TOKEN)
  if i is None:
    raise ValueError(f"the tokenizer has no {MASK_TOKEN!r} token (add it with add_orthrus)")
  return int(i)


def add_orthrus(model: Transformer, tokenizer: Any = None) -> tuple[Transformer, int]:
  """A copy of ``model`` with the diffusion view and the mask-token row (module docstring).

  Args:
    model: a view-free :class:`Transformer` (or one that already has the view: only the mask
      row is then added, if missing).
    tokenizer: optional tokenizer; ``<|mask|>`` is added to it as a special token (**mutated in
      place**) and its id is the row. Without one the row is appended at ``vocab_size``.

  Returns:
    ``(model, mask_id)``: ``model.cfg.vocab_size > mask_id``; the new row is the mean of the
    first ``V`` rows of the original vocabulary.
  """
  new = model if VIEW in model.cfg.attn_views else add_attn_view(model, VIEW)
  old = int(new.cfg.vocab_size)
  if tokenizer is not None:
    base = min(old, int(tokenizer.vocab_size))
    mask_id = int(tokenizer.add_special_tokens([MASK_TOKEN])[0])
    mean_of = min(base, mask_id) if mask_id < old else base
  else:
    mask_id, mean_of = old, old
  if mask_id >= old:
    resize_vocab(new, mask_id + 1, init_ids=[mask_id], mean_of=mean_of)
  return new, mask_id


def block_inputs(tokens: jax.Array, starts: jax.Array, block_size: int, mask_id: int,
                 reveal: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The diffusion pass's inputs of every block: ``[x_s, MASK x (B-1)]`` at ``s .. s+B-1``.

  With ``reveal`` (multi-step denoising, MDLM-style partial unmasking: Sahoo et al. 2024, the
  Orthrus post's multi-step ablation), block slot ``i`` holds the true token ``x_{s+i}`` where
  ``reveal[.., k, i]`` and the mask elsewhere; slot 0 (the anchor ``x_s``) is always revealed.
  ``reveal=None`` is the single-step block (this path is unchanged).

  Args:
    tokens: int ``[Bt, N]``. starts: int ``[Bt, NB]`` block starts (``0 <= s < N``).
    block_size: B. mask_id: the mask token id.
    reveal: optional bool ``[Bt, NB, B]``; a revealed slot past ``N - 1`` reads ``x_{N-1}``
      (such a block is garbage the caller masks out).

  Returns:
    ``(block_tokens, block_positions)``, both int32 ``[Bt, NB * B]`` (block-major).

  Raises:
    ValueError: ``reveal`` is not ``[Bt, NB, B]``.
  """
  Bt, NB = starts.shape
  bpos = (starts[:, :, None] + jnp.arange(block_size)[None, None]).astype(jnp.int32)
  if reveal is None:
    x0 = jnp.take_along_axis(tokens, starts, axis=1)                    # [Bt, NB]
    first = jnp.arange(block_size) == 0
    btok = jnp.where(first[None, None], x0[:, :, None], mask_id).astype(jnp.int32)
  else:
    if tuple(reveal.shape) != (Bt, NB, block_size):
      raise ValueError(f"reveal must be [Bt, NB, B] = {(Bt, NB, block_size)}, got "
                       f"{tuple(reveal.shape)}")
    N = tokens.shape[1]
    idx = jnp.clip(bpos, 0, N - 1).reshape(Bt, NB * block_size)
    true = jnp.take_along_axis(tokens, idx, axis=1).reshape(Bt, NB, block_size)
    show = reveal.astype(bool) | (jnp.arange(block_size) == 0)[None, None]
    btok = jnp.where(show, true, mask_id).astype(jnp.int32)
  return btok.reshape(Bt, NB * block_size), bpos.reshape(Bt, NB * block_size)


def dual_pass_mask(valid: jax.Array, starts: jax.Array, block_size: int) -> tuple[jax.Array,
                                                                                  jax.Array]:
  """The two attention masks of the dual-pass training forward over a cache of ``N + NB * B``
  slots (the AR tokens first, then the blocks).

  Args:
    valid: bool ``[Bt, N]`` (False on padding). starts: int ``[Bt, NB]``. block_size: B.

  Returns:
    ``(ar_mask [Bt, N, N + NB*B], diff_mask [Bt, NB*B, N + NB*B])`` bool: the AR pass is causal
    over the valid tokens and sees no block slot; a block query of block k sees AR key j iff
    ``valid[j] and j < starts[k]``, and every slot of block k.
  """
  Bt, N = valid.shape
  NB = starts.shape[1]
  Nd = NB * block_size
  tri = jnp.tril(jnp.ones((N, N), bool))
  ar = tri[None] & valid[:, None, :] & valid[:, :, None]
  ar = jnp.concatenate([ar, jnp.zeros((Bt, N, Nd), bool)], axis=2)
  blk = jnp.repeat(jnp.arange(NB), block_size)                            # [Nd]
  qstart = jnp.repeat(starts, block_size, axis=1)                         # [Bt, Nd]
  see_ar = (jnp.arange(N)[None, None, :] < qstart[:, :, None]) & valid[:, None, :]
  see_blk = jnp.broadcast_to(blk[:, None] == blk[None, :], (Bt, Nd, Nd))
  return ar, jnp.concatenate([see_ar, see_blk], axis=2)


def dual_pass_logits(model: Transformer, tokens: jax.Array, positions: jax.Array,
                     valid: jax.Array, starts: jax.Array, block_size: int,
                     mask_id: int, reveal: jax.Array | None = None) -> tuple[jax.Array,
                                                                             jax.Array]:
  """The dual-pass training forward (module docstring).

  Args:
    model: a model with the diffusion view.
    tokens, positions: int ``[Bt, N]``; valid: bool ``[Bt, N]``.
    starts: int ``[Bt, NB]`` block starts in ``[0, N)`` (a block past the valid tokens computes
      garbage the caller masks out).
    block_size: B >= 2. mask_id: the mask token id.
    reveal: optional bool ``[Bt, NB, B]``: block slots given their true token instead of the
      mask (:func:`block_inputs`; multi-step denoising). ``None``: the single-step blocks.

  Returns:
    ``(ar_logits float32 [Bt, N, V], diff_logits float32 [Bt, NB, B, V])``: row ``i`` of block
    k predicts the token at ``starts[k] + i + 1`` (the AR teacher's row ``starts[k] + i``). The AR
    pass is under ``stop_gradient`` (frozen teacher and keys).

  Raises:
    ValueError: no diffusion view, ``block_size < 2``, a ``reveal`` of the wrong shape.
  """
  if VIEW not in model.cfg.attn_views:
    raise ValueError(f"dual_pass_logits needs the {VIEW!r} view (add_orthrus)")
  if block_size < 2:
    raise ValueError(f"block_size must be >= 2, got {block_size}")
  Bt, N = tokens.shape
  NB = starts.shape[1]
  ar_mask, diff_mask = dual_pass_mask(valid, starts, block_size)
  cache = KVCache.zeros(model.cfg, Bt, N + NB * block_size)
  ar_logits, cache = model(tokens, positions, ar_mask, kv_cache=cache, cache_index=0)
  ar_logits = jax.lax.stop_gradient(ar_logits)
  cache = jax.tree.map(jax.lax.stop_gradient, cache)
  btok, bpos = block_inputs(tokens, starts, block_size, mask_id, reveal)
  diff_logits, _ = model(btok, bpos, diff_mask, kv_cache=cache, cache_index=N, view=VIEW)
  return ar_logits, diff_logits.reshape(Bt, NB, block_size, -1)


def view_delta_names() -> list[tuple[str, str, str]]:
  """``(view param, delta A, delta B)`` names of the low-rank view parametrisation, per
  projection: ``q_proj_diffusion, q_proj_diffusion_delta_a, q_proj_diffusion_delta_b``, ..."""
  return [(f"{n}_{VIEW}", f"{n}_{VIEW}_delta_a", f"{n}_{VIEW}_delta_b") for n in VIEW_PARAMS]


def add_view_delta(model: Transformer, rank: int, seed: int = 0) -> Transformer:
  """Give the diffusion view a low-rank parametrisation **in place** (beyond upstream, which
  trains full copies): ``view = base + A @ B`` per projection and layer, ``A [L, *in, r]``
  normal(0, in^-1/2), ``B [L, r, *out]`` zero (so the view starts as the AR projections, as
  :func:`add_orthrus` copies them). The deltas are ``nnx.Param`` s on ``model.layers``; the
  trainer trains only them and writes the view with :func:`apply_view_delta` before each forward,
  and the adapter stores A and B (a few MB instead of the full view's 4 projections x L).

  Raises:
    ValueError: no diffusion view, ``rank < 1``.
  """
  if VIEW not in model.cfg.attn_views:
    raise ValueError(f"add_view_delta needs the {VIEW!r} view (add_orthrus)")
  if rank < 1:
    raise ValueError(f"view delta rank must be >= 1, got {rank}")
  key = jax.random.PRNGKey(seed)
  for n, (_, an, bn) in zip(VIEW_PARAMS, view_delta_names()):
    base = getattr(model.layers, n)
    k = LORA_IN_DIMS[n]
    L, in_shape, out_shape = base.shape[0], base.shape[1:1 + k], base.shape[1 + k:]
    in_axes, out_axes = base.logical_axes[1:1 + k], base.logical_axes[1 + k:]
    key, sub = jax.random.split(key)
    fan_in = 1
    for d in in_shape:
      fan_in *= int(d)
    a = (fan_in ** -0.5) * jax.random.normal(sub, (L, *in_shape, rank), jnp.float32)
    setattr(model.layers, an, nnx.Param(a.astype(base.dtype),
                                        logical_axes=("layers", *in_axes, "lora_rank")))
    setattr(model.layers, bn, nnx.Param(jnp.zeros((L, rank, *out_shape), base.dtype),
                                        logical_axes=("layers", "lora_rank", *out_axes)))
  return model


def view_from_delta(base: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  """``base + A @ B`` over the flattened input / output dims (float32, cast to ``base.dtype``).

  Args:
    base: ``[L, *in, *out]``; a: ``[L, *in, r]``; b: ``[L, r, *out]``.
  """
  L, r = a.shape[0], a.shape[-1]
  d = jnp.asarray(a, jnp.float32).reshape(L, -1, r) @ jnp.asarray(b, jnp.float32).reshape(L, r, -1)
  return (jnp.asarray(base, jnp.float32) + d.reshape(base.shape)).astype(base.dtype)


def apply_view_delta(model: Transformer) -> Transformer:
  """Set every diffusion-view projection to ``base + A @ B`` (:func:`add_view_delta`), in place
  (inside a traced loss too: the view then depends on A and B). A model without deltas is
  returned unchanged."""
  for n, (vn, an, bn) in zip(VIEW_PARAMS, view_delta_names()):
    if hasattr(model.layers, an):
      getattr(model.layers, vn).set_value(view_from_delta(
          getattr(model.layers, n)[...], getattr(model.layers, an)[...],
          getattr(model.layers, bn)[...]))
  return model
