"""Masked next-token cross entropy, the loss every trainer starts from."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-token CE ``-log softmax(logits)[target]``.

  Args:
    logits: ``[B, T, V]`` (any float dtype; computed in float32).
    targets: ``[B, T]`` int32.

  Returns:
    ``[B, T]`` float32 nats.
  """
  lf = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(lf, axis=-1)
  picked = jnp.take_along_axis(lf, targets[..., None], axis=-1)[..., 0]
  return lse - picked


def masked_loss_sum(logits, targets, loss_mask) -> tuple[jax.Array, jax.Array]:
  """``(sum of CE over loss_mask tokens, number of such tokens)``, both float32 scalars."""
  m = loss_mask.astype(jnp.float32)
  return jnp.sum(token_cross_entropy(logits, targets) * m), jnp.sum(m)
