"""The SOL policy in the decode loop: :class:`BudgetController` builds each step's observation
(akhauriyash/SOL ``predictor.py``: LM hidden at the previous token, embedding of the current
token, 8 scalars, previous action), runs the policy one step on its own cache, picks an action
per row and keeps the running usage the next observation's gaps come from. The decode scheduler
and the training episodes (:mod:`selforch_jax.runtime.schedulers.sol`) share it.

Usage is what the engine step applied (its ``usage`` output, usage units ``[kappa, rho,
bits / 16]``), averaged over a row's *controllable* steps: a step whose query sees at most
``sinks + window + 1`` keys is dense whatever the action (SOL's ``eff`` mask), takes the dense
action and counts neither in the gaps nor in the budget.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.models.sol_policy import NUM_SCALARS, PolicyCache, SolPolicy
from selforch_jax.models.transformer import SPARSE_DENSE_SINKS, SPARSE_DENSE_WINDOW
from selforch_jax.runtime.sol_actions import ActionGrid
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

  Raises:
    ValueError: ``targets`` not ``[N, 3]``, a policy for another action count or hidden size,
      ``horizon`` above the policy's ``max_len``, ``temperature <= 0``.
  """

  def __init__(self, policy: SolPolicy, grid: ActionGrid, targets, horizon: int, embed, *,
               temperature: float = 1.0, greedy: bool = False, seed: int = 0,
               record: bool = False):
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
    self.grid, self.horizon, self.embed = grid, int(horizon), embed
    self.temperature, self.greedy, self.record = float(temperature), bool(greedy), bool(record)
    self.graphdef, self.state = nnx.split(policy)
    N = self.targets.shape[0]
    self.cache = PolicyCache.zeros(pc, N)
    self.prev_action = np.full(N, grid.num_actions, np.int32)        # BOS
    self.usage_sum = np.zeros((N, 3))
    self.eff_steps = np.zeros(N, np.int64)
    self.nominal_sum = np.zeros((N, 3))
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

  def act(self, tokens, eff) -> np.ndarray:
    """The actions of the next step: int ``[N]`` (the dense action where ``eff`` is False).

    Args:
      tokens: int ``[N]`` each row's input token of this step.
      eff: bool ``[N]`` whether the row's step is controllable.
    """
    eff = np.asarray(eff, bool)
    sc = self.scalars(eff)
    emb = jnp.take(self.embed, jnp.asarray(tokens, jnp.int32), axis=0)
    logits, self.cache = _policy_step(self.graphdef, self.state, self.h_prev, emb,
                                      jnp.asarray(sc), jnp.asarray(self.prev_action), self.cache,
                                      self.t)
    logits = logits / self.temperature
    if self.greedy:
      a = jnp.argmax(logits, -1)
    else:
      a = jax.random.categorical(jax.random.fold_in(self.key, self.t), logits)
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

  def act(self, tokens, eff) -> np.ndarray:
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
