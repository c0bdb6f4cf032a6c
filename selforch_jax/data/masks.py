"""Attention masks for packed / padded training rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_mask(segment_ids: jax.Array) -> jax.Array:
  """Causal attention restricted to each packed example.

  Args:
    segment_ids: ``[B, T]`` integer array (numpy or jax); ``1..k`` per example in a row,
      0 on padding (the ``segment_ids`` field of :mod:`selforch_jax.data.packing` rows).

  Returns:
    ``[B, T, T]`` bool ``mask[b, q, k]``: True iff ``k <= q``, ``segment_ids[b, q] ==
    segment_ids[b, k]`` and ``segment_ids[b, k] != 0``. Padding queries see nothing (the
    model's finite mask value keeps their outputs NaN-free). For a row holding one example
    this equals ``models.transformer.causal_mask(segment_ids > 0)``.

  Raises:
    ValueError: if ``segment_ids`` is not 2-D.
  """
  seg = jnp.asarray(segment_ids)
  if seg.ndim != 2:
    raise ValueError(f"segment_ids must be [B, T], got shape {seg.shape}")
  T = seg.shape[1]
  causal = jnp.tril(jnp.ones((T, T), bool))
  same = seg[:, :, None] == seg[:, None, :]
  return causal[None] & same & (seg[:, None, :] != 0)
