"""SOL's GRPO objective for the compute policy (akhauriyash/SOL ``train.py::
train_one_epoch_grpo``; Akhauri & Abdelfattah 2026, "Compute Where it Counts"; GRPO: Shao et al.
2024).

Per episode (sequence b, rollout k) with per-step rewards ``r_t = (1 - w) log p(x_{t+1}) - w
KL(p_sparse || p_dense)``:

* returns ``G_t = sum_{j >= t} gamma^(j - t) r_j`` (:func:`discounted_returns`);
* budget penalty per axis a: ``alpha_a * max(|mean_t usage_a - C_a| - tol, 0)^2`` over the
  controllable steps, summed over the axes and subtracted from every ``G_t``
  (:func:`budget_penalty`);
* advantages: ``A = R - mean_k R`` within each (step, sequence) group of K rollouts
  (``grpo_level=process``, ``grpo_norm=center``), then whitened over every controllable step of
  the batch (:func:`sol_advantages`); an all-equal group gives 0, never NaN;
* loss: the PPO-clip surrogate (:func:`~selforch_jax.trainers.grpo.grpo_token_terms`, each
  (rollout, step) one "token", no reference KL) minus ``entropy_coef * H(pi)``
  (:class:`SOLPolicyTrainer`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from selforch_jax.trainers.grpo import grpo_token_terms


def discounted_returns(rewards, gamma: float) -> np.ndarray:
  """``G_t = sum_{j >= t} gamma^(j-t) r_j`` over the last axis of float ``rewards [..., T]``."""
  r = np.asarray(rewards, np.float64)
  out = np.zeros_like(r)
  acc = np.zeros(r.shape[:-1])
  for t in range(r.shape[-1] - 1, -1, -1):
    acc = r[..., t] + gamma * acc
    out[..., t] = acc
  return out


def budget_gaps(usage, eff, targets) -> np.ndarray:
  """``mean_t usage - target`` ``[..., 3]`` over the controllable steps (``eff``) of ``usage
  [..., T, 3]``; ``targets [..., 3]``. A row without a controllable step has gap 0."""
  u = np.asarray(usage, np.float64)
  e = np.asarray(eff, bool)[..., None]
  n = e.sum(-2)
  mean = np.where(n > 0, (u * e).sum(-2) / np.maximum(n, 1), np.asarray(targets, np.float64))
  return mean - np.asarray(targets, np.float64)


def budget_penalty(usage, eff, targets, alpha, tolerance: float) -> np.ndarray:
  """SOL's squared-hinge budget penalty ``sum_a alpha_a max(|gap_a| - tol, 0)^2`` ``[...]``
  (:func:`budget_gaps`; ``alpha [3]`` for kappa, rho, bits)."""
  g = np.abs(budget_gaps(usage, eff, targets))
  return (np.asarray(alpha, np.float64) * np.maximum(g - tolerance, 0.0) ** 2).sum(-1)


def sol_advantages(returns, eff, eps: float = 1e-8) -> np.ndarray:
  """Group-relative then whitened advantages.

  Args:
    returns: float ``[B, K, T]`` penalised returns of K rollouts of B sequences.
    eff: bool ``[B, K, T]`` controllable steps (the only ones that count).

  Returns:
    float32 ``[B, K, T]``: ``R - mean_k R`` per (b, t) (over the group's controllable
    rollouts), then ``(A - mean) / std`` over every controllable entry; 0 off ``eff``. Equal
    returns in a group give 0; a batch whose centred advantages are all 0 stays 0 (no NaN).

  Raises:
    ValueError: shapes differ or a return is not finite.
  """
  R = np.asarray(returns, np.float64)
  e = np.asarray(eff, bool)
  if R.shape != e.shape or R.ndim != 3:
    raise ValueError(f"returns {R.shape} and eff {e.shape} must both be [B, K, T]")
  if not np.isfinite(R[e]).all():
    raise ValueError("SOL returns must be finite")
  n = e.sum(1, keepdims=True)
  mean = (R * e).sum(1, keepdims=True) / np.maximum(n, 1)
  A = np.where(e, R - mean, 0.0)
  flat = (np.where(e, R, -np.inf).max(1, keepdims=True)
          == np.where(e, R, np.inf).min(1, keepdims=True))
  A = np.where(flat, 0.0, A)
  if e.any():
    m, s = A[e].mean(), A[e].std()
    A = np.where(e, (A - m) / s if s > eps else 0.0, 0.0)
  return A.astype(np.float32)


class SOLPolicyTrainer:
  """PPO-clip updates of a :class:`~selforch_jax.models.sol_policy.SolPolicy`.

  Args:
    policy: the policy (updated in place after each :meth:`update`).
    lr, weight_decay, grad_clip: AdamW (upstream lr 1e-4, grad clip 2.0).
    clip_eps: PPO clip (0.2). entropy_coef: c_H (0.05). temperature: the rollouts' logit
      temperature (1.3), applied in the replay too.

  Raises:
    ValueError: non-positive lr / clip / temperature, negative entropy_coef.
  """

  def __init__(self, policy, *, lr: float = 1e-4, weight_decay: float = 0.0,
               grad_clip: float = 2.0, clip_eps: float = 0.2, entropy_coef: float = 0.05,
               temperature: float = 1.3):
    if lr <= 0 or clip_eps <= 0 or temperature <= 0 or entropy_coef < 0:
      raise ValueError(f"SOL trainer needs lr, clip_eps, temperature > 0 and entropy_coef >= 0;"
                       f" got {lr}, {clip_eps}, {temperature}, {entropy_coef}")
    self.policy = policy
    self.graphdef, self.params = nnx.split(policy, nnx.Param)
    self.tx = optax.chain(optax.clip_by_global_norm(grad_clip),
                          optax.adamw(lr, weight_decay=weight_decay))
    self.opt_state = self.tx.init(self.params)
    self.clip_eps, self.entropy_coef, self.temperature = clip_eps, entropy_coef, temperature
    self.steps = 0

  def update(self, batch: dict) -> dict:
    """One optimizer step on a replay batch: ``h_prev, emb [N, T, D]``, ``scalars [N, T, 8]``,
    ``prev_action, action int [N, T]``, ``old_logp, advantages float [N, T]``, ``mask bool
    [N, T]`` (controllable steps). Returns float metrics (loss, pg_loss, entropy, clip_frac,
    ratio)."""
    b = {k: jnp.asarray(v) for k, v in batch.items()}
    self.params, self.opt_state, m = _update(self.graphdef, self.tx, self.clip_eps,
                                             self.entropy_coef, self.temperature, self.params,
                                             self.opt_state, b)
    nnx.update(self.policy, self.params)
    self.steps += 1
    return {k: float(v) for k, v in m.items()}


def _loss(graphdef, clip_eps, entropy_coef, temperature, params, b):
  pol = nnx.merge(graphdef, params)
  logits = pol(b["h_prev"], b["emb"], b["scalars"], b["prev_action"]) / temperature
  lsm = jax.nn.log_softmax(logits, -1)
  lp = jnp.take_along_axis(lsm, b["action"][..., None], -1)[..., 0]
  ent = -(jnp.exp(lsm) * lsm).sum(-1)
  m = b["mask"].astype(jnp.float32)
  flat = lambda x: x.reshape(-1, 1)   # noqa: E731  each (rollout, step) is one "token"
  loss_sum, aux = grpo_token_terms(flat(lp), flat(b["old_logp"]), jax.lax.stop_gradient(flat(lp)),
                                   b["advantages"].reshape(-1), flat(m), clip_eps, 0.0)
  n = jnp.maximum(aux["count"], 1.0)
  entropy = (ent * m).sum() / n
  loss = loss_sum / n - entropy_coef * entropy
  return loss, dict(loss=loss, pg_loss=aux["pg_loss"] / n, entropy=entropy,
                    clip_frac=aux["clip_frac"] / n, ratio=aux["ratio"] / n)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _update(graphdef, tx, clip_eps, entropy_coef, temperature, params, opt_state, b):
  grads, m = jax.grad(functools.partial(_loss, graphdef, clip_eps, entropy_coef, temperature),
                      has_aux=True)(params, b)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, m
