"""GRPO: group relative policy optimization (Shao et al. 2024, DeepSeekMath §4.1, eq. 3-4).

For each prompt a group of G responses is sampled; each gets a scalar reward r. The advantage
of every token of response i is the group-normalised reward

  A_i = (r_i - mean(r)) / (std(r) + eps)        (population std over the group)

and a group whose rewards are all equal (or of size 1) gets A = 0 exactly. The loss over a
rollout batch is the token-level mean over response tokens (the mask ``loss_mask``) of

  -min(rho * A, clip(rho, 1 - eps_clip, 1 + eps_clip) * A) + beta * KL_k3,
  rho = exp(log pi(y_t) - log pi_old(y_t)),
  KL_k3 = exp(log pi_ref - log pi) - (log pi_ref - log pi) - 1     (Schulman 2020, k3)

with pi_old = the policy that sampled the batch (its log-probs computed once, before the
inner updates) and pi_ref = the initial policy (:attr:`PolicyTrainer.ref_params`).
Several optimizer updates (``inner_steps``) run on each rollout batch.
"""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np

from selforch_jax.trainers.logprobs import token_logprobs
from selforch_jax.trainers.policy import PolicyTrainer


def group_advantages(rewards, eps: float = 1e-4) -> np.ndarray:
  """Group-relative advantages.

  Args:
    rewards: float ``[P, G]``: G rewards for each of P prompts.
    eps: added to the group std.

  Returns:
    float32 ``[P, G]`` ``(r - mean) / (std + eps)`` per row (population std); rows whose
    rewards are all equal (including G = 1) are exactly 0.

  Raises:
    ValueError: ``rewards`` is not 2-D, or holds a non-finite value.
  """
  r = np.asarray(rewards, np.float64)
  if r.ndim != 2:
    raise ValueError(f"rewards must be [prompts, group], got shape {r.shape}")
  if not np.isfinite(r).all():
    raise ValueError("rewards must be finite")
  mean = r.mean(axis=1, keepdims=True)
  std = r.std(axis=1, keepdims=True)
  flat = (r.max(axis=1, keepdims=True) == r.min(axis=1, keepdims=True))
  adv = np.where(flat, 0.0, (r - mean) / (std + eps))
  return adv.astype(np.float32)


def grpo_token_terms(logp, old_logp, ref_logp, adv, loss_mask, clip_eps: float,
                     kl_coef: float):
  """The GRPO objective's per-token pieces, summed over the masked tokens.

  Args:
    logp, old_logp, ref_logp: float32 ``[B, T]`` log-probs of the targets under pi, pi_old,
      pi_ref.
    adv: float32 ``[B]`` advantage of each row (sequence).
    loss_mask: ``[B, T]`` 1 on response targets.
    clip_eps: PPO clip range; kl_coef: beta.

  Returns:
    ``(loss_sum, aux)``: the summed per-token loss and float32 sums ``count`` (tokens),
    ``pg_loss`` (the clipped surrogate, negated), ``kl`` (k3), ``clip_frac`` (tokens whose
    ratio was clipped in the direction that matters), ``ratio``.
  """
  m = loss_mask.astype(jnp.float32)
  a = adv[:, None].astype(jnp.float32)
  ratio = jnp.exp(logp - old_logp)
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
  surr = jnp.minimum(ratio * a, clipped * a)
  d = ref_logp - logp
  kl = jnp.exp(d) - d - 1.0
  per_token = -surr + kl_coef * kl
  aux = {"count": jnp.sum(m), "pg_loss": jnp.sum(-surr * m), "kl": jnp.sum(kl * m),
         "clip_frac": jnp.sum((ratio * a > clipped * a).astype(jnp.float32) * m),
         "ratio": jnp.sum(ratio * m)}
  return jnp.sum(per_token * m), aux


class GRPOTrainer(PolicyTrainer):
  """GRPO updates on rollout batches.

  Args:
    model, mesh, optim, total_steps, lora, train_embed_rows_from: as
      :class:`~selforch_jax.trainers.sft.SFTTrainer` (``total_steps`` counts optimizer steps:
      rollout batches x ``inner_steps``).
    clip_eps, kl_coef, inner_steps: see :func:`grpo_token_terms`; ``inner_steps >= 1``.

  A rollout batch (see :func:`selforch_jax.trainers.rollouts.to_batch`) holds ``tokens,
  targets, loss_mask, positions`` int32 ``[B, T]``, ``mask`` bool ``[B, T, T]`` and
  ``advantages`` float32 ``[B]``; :meth:`update` adds ``old_logp`` and ``ref_logp``.

  Raises:
    ValueError: ``inner_steps < 1``, ``clip_eps <= 0`` or ``kl_coef < 0``.
  """

  batch_ranks = {"tokens": 2, "targets": 2, "loss_mask": 2, "positions": 2, "mask": 3,
                 "old_logp": 2, "ref_logp": 2, "advantages": 1}

  def __init__(self, model, mesh, optim, total_steps: int, *, clip_eps: float = 0.2,
               kl_coef: float = 0.04, inner_steps: int = 1, **kw):
    if inner_steps < 1 or clip_eps <= 0 or kl_coef < 0:
      raise ValueError(f"GRPO needs inner_steps >= 1, clip_eps > 0, kl_coef >= 0; got "
                       f"{inner_steps}, {clip_eps}, {kl_coef}")
    self.clip_eps, self.kl_coef, self.inner_steps = float(clip_eps), float(kl_coef), int(inner_steps)
    super().__init__(model, mesh, optim, total_steps, **kw)

  def loss_terms(self, params, frozen, batch):
    logp = token_logprobs(self.merge(params, frozen), batch)
    return grpo_token_terms(logp, batch["old_logp"], batch["ref_logp"], batch["advantages"],
                            batch["loss_mask"], self.clip_eps, self.kl_coef)

  def update(self, batch: Mapping[str, np.ndarray]) -> list[dict[str, float]]:
    """Run ``inner_steps`` optimizer steps on one rollout batch.

    pi_old (the current policy, which sampled the batch) and pi_ref log-probs are computed
    once first. Returns the metrics of each inner step.
    """
    full = dict(batch)
    full["old_logp"] = self.logprobs(batch)
    full["ref_logp"] = self.logprobs(batch, reference=True)
    return [self.train_step(full) for _ in range(self.inner_steps)]
