"""Optimizer and learning-rate schedule from the ``optim`` config section (optax).

AdamW (Loshchilov & Hutter 2019) with linear warmup then cosine or linear decay, and
global-norm gradient clipping. Gradient accumulation is done by the train step itself
(a scan over micro-batches), so one optimizer update = one train step.
"""

from __future__ import annotations

import jax
import ml_collections
import optax


def optim_defaults() -> ml_collections.ConfigDict:
  """Keys of the ``optim`` section.

  lr: peak learning rate; warmup_steps: linear warmup from 0; schedule: ``"cosine"``,
  ``"linear"`` or ``"constant"`` decay after warmup, to ``lr * end_lr_frac`` at the last
  step; weight_decay: decoupled AdamW decay (applied to matrices, not norms);
  b1, b2, eps: Adam moments; clip_norm: global-norm clip (0 = off); grad_accum: micro-batches
  per step (the batch is split into this many equal parts).
  """
  return ml_collections.ConfigDict(dict(
      lr=1e-4, warmup_steps=10, schedule="cosine", end_lr_frac=0.1, weight_decay=0.0,
      b1=0.9, b2=0.999, eps=1e-8, clip_norm=1.0, grad_accum=1))


def make_schedule(oc, total_steps: int) -> optax.Schedule:
  """The learning-rate schedule (a function of the optimizer step).

  Raises:
    ValueError: for an unknown ``schedule``.
  """
  warm = max(int(oc.warmup_steps), 0)
  decay = max(int(total_steps) - warm, 1)
  end = oc.lr * oc.end_lr_frac
  if oc.schedule == "cosine":
    after = optax.cosine_decay_schedule(oc.lr, decay, alpha=oc.end_lr_frac)
  elif oc.schedule == "linear":
    after = optax.linear_schedule(oc.lr, end, decay)
  elif oc.schedule == "constant":
    after = optax.constant_schedule(oc.lr)
  else:
    raise ValueError(f"optim.schedule={oc.schedule!r} must be cosine, linear or constant")
  if warm == 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, oc.lr, warm), after], [warm])


def make_optimizer(oc, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """``(tx, schedule)``: clip-by-global-norm then AdamW with the schedule."""
  schedule = make_schedule(oc, total_steps)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  parts = []
  if oc.clip_norm and oc.clip_norm > 0:
    parts.append(optax.clip_by_global_norm(oc.clip_norm))
  parts.append(optax.adamw(schedule, b1=oc.b1, b2=oc.b2, eps=oc.eps,
                           weight_decay=oc.weight_decay, mask=decay_mask))
  return optax.chain(*parts), schedule
