"""Rotary position embeddings with explicit position ids.

Convention: the "rotate half" layout of Hugging Face Llama (the first and second
halves of each head are the two coordinates of every rotated pair). GGUF files
store q/k rows permuted for llama.cpp's interleaved layout; the GGUF importer
undoes that permutation so this one convention serves every weight source.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from selforch_jax.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies, float32 ``[head_dim // 2]`` (Su et al. 2021, RoFormer).

  Applies Llama-3 frequency scaling when ``cfg.rope_scaling`` is set (Meta's
  ``apply_scaling`` in llama-models ``reference_impl/model.py``).
  """
  dh = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
  rs = cfg.rope_scaling
  if rs is not None:
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    scaled = np.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    inv = scaled
  return inv.astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
  """Rotate ``x`` by its positions.

  Args:
    x: ``[B, T, H, Dh]`` queries or keys, any float dtype.
    positions: ``[B, T]`` int32 position ids (need not be contiguous: threads,
      trees and padded rows pass their own).
    inv_freq: ``[Dh // 2]`` float32 from :func:`rope_inv_freq`.

  Returns:
    ``[B, T, H, Dh]`` in ``x.dtype``; the angles are computed in float32.
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B,T,Dh/2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  xf = x.astype(jnp.float32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
