"""Token and sequence log-probabilities of a batch under a model (GRPO, BoNBoN/IPO, ...).

A batch row holds a prompt and a response laid out for teacher forcing, exactly like an SFT row:
``tokens[t]`` is the input at index t, ``targets[t]`` the token that follows it, ``loss_mask[t]``
marks the targets that count (response tokens only). The attention mask is the batch's
``mask`` (bool ``[B, T, T]``, e.g. ``lang.build_layout(...).token_mask()`` so that the forward
sees what the runtime saw when decoding, DESIGN.md §2.2); without it, causal attention within
``segment_ids`` (when given) or over the whole row.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from selforch_jax.data.masks import segment_mask
from selforch_jax.trainers.loss import token_cross_entropy


def batch_mask(batch: Mapping[str, jax.Array]) -> jax.Array:
  """The attention mask of a batch: ``batch["mask"]`` (bool ``[B, T, T]``) if present, else
  :func:`~selforch_jax.data.masks.segment_mask` of ``segment_ids``, else causal ``[B, T, T]``."""
  if "mask" in batch:
    return batch["mask"]
  if "segment_ids" in batch:
    return segment_mask(batch["segment_ids"])
  B, T = batch["tokens"].shape
  return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))


def token_logprobs(model, batch: Mapping[str, jax.Array]) -> jax.Array:
  """``log p(targets[b, t] | row b up to t)`` under ``model``, for every index.

  Args:
    model: a :class:`~selforch_jax.models.transformer.Transformer` (called as
      ``model(tokens, positions, mask)``).
    batch: ``tokens, targets, positions`` int32 ``[B, T]``; optional ``mask`` bool
      ``[B, T, T]`` (query x key) or ``segment_ids`` int32 ``[B, T]``.

  Returns:
    float32 ``[B, T]`` natural-log probabilities (entries outside ``loss_mask`` are computed
    but meaningless; multiply by ``loss_mask``).
  """
  logits, _ = model(batch["tokens"], batch["positions"], batch_mask(batch))
  return -token_cross_entropy(logits, batch["targets"])


def sequence_logprobs(token_lp: jax.Array, loss_mask: jax.Array) -> jax.Array:
  """Sum of ``token_lp [B, T]`` over ``loss_mask [B, T]`` (the response): float32 ``[B]``."""
  return jnp.sum(token_lp * loss_mask.astype(jnp.float32), axis=-1)
