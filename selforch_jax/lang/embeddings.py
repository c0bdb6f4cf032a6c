"""Growing a model's vocabulary for added tokens (DESIGN.md §3: "embedding rows appended; new rows
initialised from existing embeddings, e.g. their mean")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["resize_vocab"]


def _mean_init(table: Any, axis: int, new_size: int, init_ids: Sequence[int],
               mean_of: int) -> Any:
  """``table`` with its vocab axis grown to ``new_size`` and the ``init_ids`` slices set to the
  float32 mean of the first ``mean_of`` slices (cast back to the table's dtype)."""
  import jax.numpy as jnp  # lazily: the rest of selforch_jax.lang is numpy-only

  old = table.shape[axis]
  moved = jnp.moveaxis(table, axis, 0)
  mean = jnp.mean(moved[:mean_of].astype(jnp.float32), axis=0).astype(table.dtype)
  if new_size > old:
    pad = jnp.broadcast_to(mean, (new_size - old,) + moved.shape[1:])
    moved = jnp.concatenate([moved, pad], axis=0)
  ids = np.asarray(sorted({int(i) for i in init_ids if 0 <= int(i) < new_size}), np.int32)
  if ids.size:
    moved = moved.at[ids].set(mean)
  return jnp.moveaxis(moved, 0, axis)


def resize_vocab(model: Any, vocab_size: int, *, init_ids: Sequence[int] = (),
                 mean_of: int | None = None) -> Any:
  """Grow (never shrink) a Transformer's vocabulary **in place**.

  ``model.embed [V, D]`` becomes ``[vocab_size, D]`` and, for untied models, ``model.lm_head
  [D, V]`` becomes ``[D, vocab_size]``; ``model.cfg`` is replaced by ``cfg.replace(vocab_size=
  vocab_size)``. Appended rows, and the existing rows listed in ``init_ids``, are set to the mean
  (computed in float32, stored in the parameter dtype) of the first ``mean_of`` rows (columns of
  ``lm_head``). Parameter metadata (``logical_axes``) is kept.

  Args:
    model: a :class:`selforch_jax.models.transformer.Transformer`.
    vocab_size: the new V' (``>= model.cfg.vocab_size``).
    init_ids: ids whose rows are (re)initialised to the mean besides the appended ones.
    mean_of: how many leading rows the mean is over (default: all old rows).

  Returns:
    ``model`` (the same object).

  Raises:
    ValueError: ``vocab_size < model.cfg.vocab_size`` or ``mean_of`` not in ``[1, V]``.
  """
  cfg = model.cfg
  old = cfg.vocab_size
  if vocab_size < old:
    raise ValueError(f"resize_vocab only grows: {vocab_size} < {old}")
  mean_of = old if mean_of is None else int(mean_of)
  if not 1 <= mean_of <= old:
    raise ValueError(f"mean_of={mean_of} must be in [1, {old}]")
  if vocab_size == old and not init_ids:
    return model
  model.embed.set_value(_mean_init(model.embed[...], 0, vocab_size, init_ids, mean_of))
  if not cfg.tie_word_embeddings:
    model.lm_head.set_value(_mean_init(model.lm_head[...], 1, vocab_size, init_ids, mean_of))
  model.cfg = cfg.replace(vocab_size=int(vocab_size))
  return model
