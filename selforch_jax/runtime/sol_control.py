"""The SOL policy in the decode loop: :class:`BudgetController` builds each step's observation
(akhauriyash/SOL ``predictor.py``: LM hidden at the previous token, embedding of the current
token, 8 scalars, previous action), runs the policy one step on its own cache, picks an action
per row and keeps the running usage the next observation's gaps come from. The decode scheduler
and the training episodes (:mod:`selforch_jax.runtime.schedulers.sol`) share it.

Usage is what the engine step applied (its ``usage`` output, usage units ``[kappa, rho,
bits / 16]``), averaged over a row's *controllable* steps: a step whose query sees at most
``sinks + window + 1`` keys is dense whatever the action (SOL's ``eff`` mask), takes the dense
action and counts neither in the gaps nor in the budget.

The *budget guard* (``BudgetController(budget_guard=tol)``, :func:`guard_mask`) is our addition
beyond upstream SOL, which meets budgets only through its training penalty: a decode-time
projection of the learned policy onto the budget constraint. Before each controllable step the
row's choice is restricted to the actions that keep every axis' running mean usage (this step
included, at the usage the step will apply, :func:`applied_usage`) within ``tol`` of the target
or moving toward it, and the policy's greedy or sampled action is taken among those (its other
logits masked): constrained decoding of actions, the hard-constraint counterpart of the
Lagrangian budget penalty the policy was trained with. The decode CLI and the API turn it on
(:data:`DEFAULT_BUDGET_GUARD`); the scheduler, the training episodes and GRPO leave it off
unless asked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.models.sol_policy import NUM_SCALARS, PolicyCache, SolPolicy
from selforch_jax.models.transformer import SPARSE_DENSE_SINKS, SPARSE_DENSE_WINDOW
from selforch_jax.runtime.sol_actions import DEFAULT_SPARSITY, ActionGrid
from selforch_jax.runtime.step import parse_sparsity


@functools.partial(jax.jit, static_argnums=(0,))
def _policy_step(graphdef, state, h_prev, emb, scalars, prev_action, cache, t):
  return nnx.merge(graphdef, state).step(h_prev, emb, scalars, prev_action, cache, t)


def dense_limit(sparsity: str) -> int:
  """Keys a query may see and still be forced dense under ``sparsity``: ``sinks + window + 1``
  (recency's own, else QUEST's 4 + 2 + 1)."""
  sp = parse_sparsity(sparsity)
  if sp[0] == "recency":
    return sp[1] + sp[2] + 1
  return SPARSE_DENSE_SINKS + SPARSE_DENSE_WINDOW + 1


# the decode CLI's / API's default budget-guard tolerance (usage units): the tracking
# target; the scheduler and the training episodes default to no guard
DEFAULT_BUDGET_GUARD = 0.02


def budget_guard_option(value) -> float | None:
  """The budget guard of a decode option: ``None`` or ``0`` -> None (off), a number ``> 0`` ->
  that tolerance in usage units (:class:`BudgetController`).

  Raises:
    ValueError: not a number, negative or not finite (the message names ``budget_guard``)."""
  if value is None:
    return None
  try:
    tol = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"SOL budget_guard must be a number (a tolerance in usage units; 0 = off), "
                     f"got {value!r}") from None
  if not (np.isfinite(tol) and tol >= 0):
    raise ValueError(f"SOL budget_guard must be a tolerance >= 0 in usage units (0 = off), "
                     f"got {value!r}")
  return tol if tol > 0 else None


def applied_usage(grid: ActionGrid, kv_len, sparsity: str, hidden_size: int) -> np.ndarray:
  """The usage the engine step applies for each action of ``grid`` at each row's key count:
  float64 ``[N, A, 3]`` ``[kappa, rho, bits / 16]`` (the step's ``usage`` output,
  :class:`~selforch_jax.runtime.step.ForwardSpec`, before the step runs).

  * kappa: ``quest(P)`` / ``quest_gather(P)`` keep ``ceil(kappa * kv_len / P)`` pages of ``P``
    slots (:func:`~selforch_jax.models.transformer.quest_key_mask`), here counted as
    ``min(pages * P, kv_len) / kv_len``: exact when every kept page is full, an *upper bound*
    when a kept page holds fewer visible keys (the row's last, partly written page; which pages
    win depends on the query, unknown before the step). ``recency(S, W)`` keeps ``min(kv_len,
    S + max(W, ceil(kappa * kv_len)))`` keys (exact); ``none`` keeps all. 1 on the dense rule
    (``kv_len <= sinks + window + 1`` or ``kappa >= 1``). The products are taken in float32 as
    the step takes them.
  * rho: ``clip(ceil(rho * D), 1, D) / D`` (exact). bits: ``min(bits, 16) / 16`` (exact).

  Args:
    grid: the action grid (``A`` actions).
    kv_len: int ``[N]`` keys each row's query sees this step (its position + 1).
    sparsity: the token-attention rule of the step (:func:`~selforch_jax.runtime.step.
      parse_sparsity`).
    hidden_size: the LM's D.

  Raises:
    ValueError: a bad ``sparsity``; ``kv_len`` not 1-D or below 1.
  """
  n = np.asarray(kv_len, np.int64)
  if n.ndim != 1 or (n.size and n.min() < 1):
    raise ValueError(f"kv_len must be a 1-D array of key counts >= 1, got {n!r}")
  sp = parse_sparsity(sparsity)
  t = grid.table
  k32 = t[:, 0].astype(np.float32)[None]                             # [1, A]
  nf = n.astype(np.float32)[:, None]                                 # [N, 1]
  if sp[0] in ("quest", "quest_gather"):
    P = np.float32(sp[1])
    pages = np.ceil(k32 * nf / P)
    kept = np.minimum(pages.astype(np.float64) * sp[1], n[:, None]) / n[:, None]
  elif sp[0] == "recency":
    recent = np.maximum(sp[2], np.ceil(k32 * nf).astype(np.int64))
    kept = np.minimum(n[:, None], sp[1] + recent) / n[:, None]
  else:
    kept = np.ones((len(n), grid.num_actions))
  dense = (n[:, None] <= dense_limit(sparsity)) | (t[None, :, 0] >= 1.0)
  kept = np.where(dense, 1.0, kept)
  D = int(hidden_size)
  rho = np.clip(np.ceil(t[:, 1].astype(np.float32) * np.float32(D)), 1, D) / D
  bits = np.minimum(t[:, 2], 16.0) / 16.0
  out = np.empty((len(n), grid.num_actions, 3))
  out[..., 0] = kept
  out[..., 1] = rho[None]
  out[..., 2] = bits[None]
  return out


def guard_mask(usage_sum, steps, targets, predicted, tol: float) -> np.ndarray:
  """The budget guard's allowed actions: bool ``[N, A]``.

  Row n has taken ``steps[n]`` controllable steps with applied usage summing to
  ``usage_sum[n]``; action a would apply ``predicted[n, a]``. Its running mean after the step
  is ``m' = (usage_sum + predicted) / (steps + 1)``; the mean now is ``usage_sum / steps``
  (the target itself before the first controllable step, as the policy's gap inputs take it).
  Per axis i, a value is allowed when the gap ``|m'_i - target_i|`` is ``<= tol`` or the mean
  moves toward the target: the gap is at most ``gap_now * steps / (steps + 1)``, the gap a step
  using exactly the target would leave (so the step's own usage lies on the correcting side of
  the target). A mere shrink of the gap is not enough: page rounding makes one kappa action's
  applied kappa fall slowly as the context grows, and a policy preferring it would creep toward
  the target by a few thousandths a step (measured: kappa 0.59 for a 0.5 target over 8 steps).
  Where no action satisfies axis i, axis i allows the actions of the smallest gap
  ``|m'_i - target_i|`` instead (the issue's brief asked for the action of the smallest
  *largest* per-axis gap; per axis keeps the satisfiable axes constrained and the policy's
  choice among them). An action is
  allowed when every axis allows it. Predicted usage per axis depends on that axis' value
  only (:func:`applied_usage`) and :class:`ActionGrid` is a Cartesian product, so the result
  is never empty there; for any other ``predicted`` a row left empty allows the actions of the
  smallest largest-axis gap.

  Args:
    usage_sum: float ``[N, 3]``. steps: int ``[N]``. targets: float ``[N, 3]`` (usage units).
    predicted: float ``[N, A, 3]``. tol: the tolerance (usage units, >= 0).

  Raises:
    ValueError: mismatched shapes or ``tol < 0``.
  """
  S = np.asarray(usage_sum, np.float64)
  n = np.asarray(steps, np.float64)
  tg = np.asarray(targets, np.float64)
  pred = np.asarray(predicted, np.float64)
  N = S.shape[0]
  if S.shape != (N, 3) or tg.shape != (N, 3) or n.shape != (N,) or pred.ndim != 3 \
      or pred.shape[0] != N or pred.shape[2] != 3:
    raise ValueError(f"guard_mask: usage_sum [N, 3], steps [N], targets [N, 3], predicted "
                     f"[N, A, 3]; got {S.shape}, {n.shape}, {tg.shape}, {pred.shape}")
  if not tol >= 0:
    raise ValueError(f"budget guard tolerance must be >= 0, got {tol}")
  eps = 1e-9
  now = np.where(n[:, None] > 0, np.abs(S / np.maximum(n, 1)[:, None] - tg), 0.0)   # [N, 3]
  gap = np.abs((S[:, None] + pred) / (n[:, None, None] + 1) - tg[:, None])          # [N, A, 3]
  toward = now * (n / (n + 1))[:, None]                                             # [N, 3]
  ok = (gap <= tol + eps) | (gap <= toward[:, None] + eps)
  closest = gap <= gap.min(1, keepdims=True) + eps
  ok = np.where(ok.any(1, keepdims=True), ok, closest)
  allowed = ok.all(-1)
  worst = gap.max(-1)
  fallback = worst <= worst.min(1, keepdims=True) + eps
  return np.where(allowed.any(1, keepdims=True), allowed, fallback)


class BudgetController:
  """Per-row policy state over one job's decode steps.

  Args:
    policy: the :class:`~selforch_jax.models.sol_policy.SolPolicy` (split once here).
    grid: the :class:`~selforch_jax.runtime.sol_actions.ActionGrid` it was trained for.
    targets: float ``[N, 3]`` target budgets in usage units, one row per controlled sequence.
    horizon: T of the step fraction ``t / T`` (decode: max new tokens; training: rollout length).
    embed: the LM's input embedding ``[V, D]`` (device array).
    temperature: logits are divided by it (upstream: 1.3 for rollouts).
    greedy: argmax instead of sampling (upstream's evaluation).
    seed: sampling PRNG seed (step t uses ``fold_in(PRNGKey(seed), t)``).
    record: keep every step's observation, action and log-prob (training replay).
    budget_guard: None (off: the policy's own action, upstream SOL) or a tolerance ``tol >= 0``
      in usage units: the *budget guard*, our addition beyond upstream SOL. Before each
      controllable step the row's choice is restricted to the actions :func:`guard_mask`
      allows: those that keep every axis' running mean usage (over the row's controllable
      steps, this one included, at the usage the step will apply, :func:`applied_usage`)
      within ``tol`` of the target or moving toward it at least as fast as a step at the
      target would (per axis with no such action: the closest one); the action is then the policy's greedy or sampled one among the allowed
      actions (the others' logits set to -inf). It is a projection of the learned policy onto
      the budget constraint, in the spirit of constrained decoding: the policy ranks, the
      guard keeps the budget. The running mean is of the usage the steps reported, so where
      the prediction of kappa was an upper bound (a kept page partly empty) the next step
      sees the true figure. The recorded ``logp`` (``record``) stays the unguarded policy's.
      Off by default (GRPO training runs without it unless asked).
    sparsity: the steps' token-attention rule, for the guard's prediction of the applied
      kappa (:func:`applied_usage`); unused without the guard.

  Raises:
    ValueError: ``targets`` not ``[N, 3]``, a policy for another action count or hidden size,
      ``horizon`` above the policy's ``max_len``, ``temperature <= 0``, ``budget_guard < 0``
      or not finite, a bad ``sparsity``.
  """

  def __init__(self, policy: SolPolicy, grid: ActionGrid, targets, horizon: int, embed, *,
               temperature: float = 1.0, greedy: bool = False, seed: int = 0,
               record: bool = False, budget_guard: float | None = None,
               sparsity: str = DEFAULT_SPARSITY):
    self.targets = np.asarray(targets, np.float32)
    pc = policy.cfg
    if self.targets.ndim != 2 or self.targets.shape[1] != 3:
      raise ValueError(f"SOL targets must be [N, 3], got {self.targets.shape}")
    if pc.num_actions != grid.num_actions:
      raise ValueError(f"the policy has {pc.num_actions} actions, the grid {grid.num_actions}")
    if embed.shape[1] != pc.lm_dim:
      raise ValueError(f"the policy reads hidden size {pc.lm_dim}, the LM has {embed.shape[1]}")
    if not 1 <= horizon <= pc.max_len:
      raise ValueError(f"SOL horizon {horizon} must be in [1, policy max_len={pc.max_len}]")
    if temperature <= 0:
      raise ValueError(f"temperature must be > 0, got {temperature}")
    if budget_guard is not None and not (np.isfinite(budget_guard) and budget_guard >= 0):
      raise ValueError(f"SOL budget_guard must be a tolerance >= 0 (usage units) or None, "
                       f"got {budget_guard}")
    parse_sparsity(sparsity)
    self.budget_guard = None if budget_guard is None else float(budget_guard)
    self.sparsity = sparsity
    self.grid, self.horizon, self.embed = grid, int(horizon), embed
    self.temperature, self.greedy, self.record = float(temperature), bool(greedy), bool(record)
    self.graphdef, self.state = nnx.split(policy)
    N = self.targets.shape[0]
    self.cache = PolicyCache.zeros(pc, N)
    self.prev_action = np.full(N, grid.num_actions, np.int32)        # BOS
    self.usage_sum = np.zeros((N, 3))
    self.eff_steps = np.zeros(N, np.int64)
    self.nominal_sum = np.zeros((N, 3))
    self.predicted_sum = np.zeros((N, 3))   # the guard's predicted usage of the chosen actions
    self._predicted = None
    self.t = 0
    self.key = jax.random.PRNGKey(seed)
    self.h_prev = jnp.zeros((N, pc.lm_dim), jnp.float32)
    self.log: list[dict] = []
    self.history: list[np.ndarray] = []   # the actions of every step, int [N] each
    self._pending = None

  def set_hidden(self, rows, hidden) -> None:
    """The LM hidden state ``[len(rows), D]`` at each row's latest token (the next step's
    ``h_prev``)."""
    self.h_prev = self.h_prev.at[np.asarray(rows)].set(jnp.asarray(hidden, jnp.float32))

  def scalars(self, eff) -> np.ndarray:
    """float32 ``[N, 8]`` ``[t/T, eff, C_tok, C_pru, C_q, gaps...]`` of the next step (a row
    with no controllable step yet has gaps 0)."""
    N = self.targets.shape[0]
    mean = np.where(self.eff_steps[:, None] > 0,
                    self.usage_sum / np.maximum(self.eff_steps, 1)[:, None], self.targets)
    out = np.zeros((N, NUM_SCALARS), np.float32)
    out[:, 0] = self.t / self.horizon
    out[:, 1] = eff
    out[:, 2:5] = self.targets
    out[:, 5:8] = mean - self.targets
    return out

  def act(self, tokens, eff, kv_len=None) -> np.ndarray:
    """The actions of the next step: int ``[N]`` (the dense action where ``eff`` is False).

    Args:
      tokens: int ``[N]`` each row's input token of this step.
      eff: bool ``[N]`` whether the row's step is controllable.
      kv_len: int ``[N]`` keys each row's query sees (position + 1); needed by the budget
        guard (rows not stepping: any value >= 1), ignored without it.

    Raises:
      ValueError: the guard is on and ``kv_len`` is missing.
    """
    eff = np.asarray(eff, bool)
    sc = self.scalars(eff)
    emb = jnp.take(self.embed, jnp.asarray(tokens, jnp.int32), axis=0)
    logits, self.cache = _policy_step(self.graphdef, self.state, self.h_prev, emb,
                                      jnp.asarray(sc), jnp.asarray(self.prev_action), self.cache,
                                      self.t)
    logits = logits / self.temperature
    pick = logits
    if self.budget_guard is not None:
      if kv_len is None:
        raise ValueError("the SOL budget guard needs each row's kv_len")
      pred = applied_usage(self.grid, np.maximum(np.asarray(kv_len, np.int64), 1),
                           self.sparsity, self.embed.shape[1])
      ok = guard_mask(self.usage_sum, self.eff_steps, self.targets, pred, self.budget_guard)
      pick = jnp.where(jnp.asarray(ok), logits, -jnp.inf)
      self._predicted = pred
    if self.greedy:
      a = jnp.argmax(pick, -1)
    else:
      a = jax.random.categorical(jax.random.fold_in(self.key, self.t), pick)
    logp = jax.nn.log_softmax(logits, -1)
    a = np.asarray(a, np.int32)
    a = np.where(eff, a, self.grid.dense_idx).astype(np.int32)
    lp = np.asarray(jnp.take_along_axis(logp, jnp.asarray(a)[:, None], -1)[:, 0])
    if self.record:
      self.log.append(dict(h_prev=np.asarray(self.h_prev), emb=np.asarray(emb), scalars=sc,
                           prev_action=self.prev_action.copy(), action=a, logp=lp, eff=eff))
    self._pending = (a, eff)
    self.history.append(a)
    return a

  def observe(self, rows, usage) -> None:
    """Record the step's applied usage ``[len(rows), 3]`` for ``rows`` (the rows that ran)."""
    a, eff = self._pending
    rows = np.asarray(rows)
    u = np.asarray(usage, np.float64)
    e = eff[rows]
    self.usage_sum[rows[e]] += u[e]
    self.nominal_sum[rows[e]] += self.grid.nominal_usage(a[rows[e]])
    if getattr(self, "_predicted", None) is not None:
      r = rows[e]
      self.predicted_sum[r] += self._predicted[r, a[r]]
    self.eff_steps[rows[e]] += 1
    self.prev_action[rows] = a[rows]
    self.t += 1
    if self.record:
      self.log[-1]["usage"] = np.zeros((len(a), 3))
      self.log[-1]["usage"][rows] = u

  def achieved(self) -> np.ndarray:
    """float64 ``[N, 3]`` mean applied usage over each row's controllable steps (rows without
    one: 1, dense)."""
    n = np.maximum(self.eff_steps, 1)[:, None]
    return np.where(self.eff_steps[:, None] > 0, self.usage_sum / n, 1.0)

  def nominal(self) -> np.ndarray:
    """float64 ``[N, 3]`` mean nominal usage of the chosen actions (controllable steps)."""
    n = np.maximum(self.eff_steps, 1)[:, None]
    return np.where(self.eff_steps[:, None] > 0, self.nominal_sum / n, 1.0)


class ScheduleActor:
  """A fixed compute schedule with :class:`BudgetController`'s interface (SOL's baselines,
  akhauriyash/SOL ``evaluate_fixed_matched_keep`` / ``eval_random_alloc.py``): ``actions`` int
  ``[N, T]`` gives row n's action at its step t (the dense action on steps that are not
  controllable, or past T).

  Raises:
    ValueError: ``actions`` not 2-D or outside the grid.
  """

  def __init__(self, grid: ActionGrid, actions):
    self.grid = grid
    self.actions = np.asarray(actions, np.int64)
    if self.actions.ndim != 2:
      raise ValueError(f"schedule actions must be [N, T], got {self.actions.shape}")
    grid.values(self.actions.reshape(-1))
    N = self.actions.shape[0]
    self.t = 0
    self.usage_sum = np.zeros((N, 3))
    self.nominal_sum = np.zeros((N, 3))
    self.eff_steps = np.zeros(N, np.int64)
    self.prev_action = np.full(N, grid.num_actions, np.int32)
    self.history: list[np.ndarray] = []
    self._pending = None

  def set_hidden(self, rows, hidden) -> None:
    """Unused (a fixed schedule reads no state)."""

  def act(self, tokens, eff, kv_len=None) -> np.ndarray:
    """Row n's scheduled action at this step, int ``[N]`` (``tokens`` / ``kv_len`` unused)."""
    eff = np.asarray(eff, bool)
    col = self.actions[:, self.t] if self.t < self.actions.shape[1] else \
        np.full(self.actions.shape[0], self.grid.dense_idx)
    a = np.where(eff, col, self.grid.dense_idx).astype(np.int32)
    self._pending = (a, eff)
    self.history.append(a)
    return a

  observe = BudgetController.observe
  achieved = BudgetController.achieved
  nominal = BudgetController.nominal
  record = False
