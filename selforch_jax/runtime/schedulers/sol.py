"""SOL (Akhauri & Abdelfattah 2026, "Compute Where it Counts", akhauriyash/SOL) on the engine:
a frozen LM whose every decode step runs the compute action a small policy picks (QUEST page
keep kappa, MLP input channel keep rho, MLP-output bits; :mod:`~selforch_jax.runtime.sol_actions`).

* :class:`SOLScheduler` (registered ``"sol"``): AR decoding (:class:`~selforch_jax.runtime.
  schedulers.ar.ARScheduler`) with a dense prefill; before each decode step the actor
  (:class:`~selforch_jax.runtime.sol_control.BudgetController` over the policy, or a fixed
  :class:`~selforch_jax.runtime.sol_control.ScheduleActor`) picks one action per live row from
  the LM hidden state at the previous token; the step applies it (one
  :class:`~selforch_jax.runtime.step.ForwardSpec` with per-query knobs) and reports the usage
  it applied. Each row's :meth:`SOLScheduler.budget` carries ``target_budget`` and
  ``achieved_budget`` (``[kappa, rho, bits]``, means over the row's controllable steps).
* :class:`SOLEpisodeScheduler`: SOL's teacher-forced episodes (upstream ``train.py::
  train_one_epoch_grpo``): dense prefill of B contexts, a dense teacher-forced reference of the
  next T tokens (scratch: its K/V are released), then K counterfactual rollouts per context
  that fork the prefix (their own owners and segments seeing the prefix: no K/V copy), each
  step running the ground-truth token under the actor's action. Per (row, step) it returns
  ``log p(x_{t+1})`` and ``KL(p_sparse || p_dense)`` and the applied usage: the rewards of the
  GRPO trainer and the perplexity of the evaluation.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.generation import check_context
from selforch_jax.runtime.registry import fresh_bases, register
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult
from selforch_jax.runtime.schedulers.ar import ARScheduler
from selforch_jax.runtime.sol_actions import DEFAULT_SPARSITY, ActionGrid, budget_triple, \
    parse_budget
from selforch_jax.runtime.sol_control import BudgetController, dense_limit
from selforch_jax.runtime.step import ForwardSpec, gathered_sparsity

HIDDEN = ForwardSpec(outputs=("logits", "hidden"))


class SOLScheduler(ARScheduler):
  """AR decoding under a per-step compute actor (module docstring).

  Args:
    prompts, max_new_tokens, sampling, stop_ids, owner_base, segment_base, **kw: as
      :class:`ARScheduler`.
    actor: a :class:`BudgetController` or :class:`ScheduleActor` with one row per prompt.
    grid: its :class:`ActionGrid`. sparsity: the token-attention rule (``"quest(8)"``).
    gather: run ``quest(P)`` decode steps as ``quest_gather(P)`` (the same page selection and
      logits up to float summation order, attention over the gathered kept pages only: the
      compute saved; the engine falls back to the mask program where that saves nothing, and an
      all-dense step is the plain step exactly). False: the mask over the whole key window.

  Raises:
    ValueError: as :class:`ARScheduler`; an actor with another row count than prompts.
  """

  def __init__(self, prompts, max_new_tokens, actor, grid: ActionGrid,
               sparsity: str = DEFAULT_SPARSITY, gather: bool = True, **kw):
    super().__init__(prompts, max_new_tokens, **kw)
    n = len(getattr(actor, "eff_steps"))
    if n != len(self.prompts):
      raise ValueError(f"SOL actor has {n} rows for {len(self.prompts)} prompts")
    self.actor, self.grid, self.sparsity = actor, grid, sparsity
    self.step_sparsity = gathered_sparsity(sparsity) if gather else sparsity
    self.limit = dense_limit(sparsity)
    self.actions: list[list[int]] = [[] for _ in self.prompts]

  def next_step(self) -> StepPlan | None:
    plan = super().next_step()
    if plan is None:
      return None
    kind, rows = plan.tag
    if kind == "prefill":
      plan.spec = HIDDEN
      return plan
    N = len(self.prompts)
    toks, eff = np.zeros(N, np.int32), np.zeros(N, bool)
    toks[rows] = plan.tokens
    kv = np.ones(N, np.int64)
    kv[rows] = np.asarray(plan.positions) + 1
    eff[rows] = kv[rows] > self.limit
    a = self.actor.act(toks, eff, kv)
    for i in rows:
      self.actions[i].append(int(a[i]))
    plan.spec = self.grid.spec(a[rows], self.step_sparsity)
    return plan

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    kind, rows = plan.tag
    if kind == "prefill":
      self.actor.set_hidden(rows, result.hidden[-1:])
    else:
      self.actor.observe(rows, np.asarray(result.usage))
      self.actor.set_hidden(rows, result.hidden)
    super().on_step(plan, result)

  def budget(self, j: int) -> dict:
    """Row j's figures: ``target_budget`` (None for a fixed schedule), ``achieved_budget`` (the
    applied usage) and ``nominal_budget`` (the actions' grid values), each ``[kappa, rho,
    bits]`` averaged over its controllable steps, ``controlled_steps`` and ``budget_guard``
    (the guard's tolerance, None: off)."""
    tg = getattr(self.actor, "targets", None)
    return dict(target_budget=None if tg is None else budget_triple(tg[j]),
                achieved_budget=budget_triple(self.actor.achieved()[j]),
                nominal_budget=budget_triple(self.actor.nominal()[j]),
                controlled_steps=int(self.actor.eff_steps[j]),
                budget_guard=getattr(self.actor, "budget_guard", None))


class SOLEpisodeScheduler(Scheduler):
  """Teacher-forced SOL episodes (module docstring).

  Args:
    sequences: int ``[B, context_len + T + 1]`` token ids.
    context_len: tokens prefilled densely (>= 1).
    actor: the per-row actor over ``B * K`` rows (row ``b * K + k`` = rollout k of sequence b).
    grid, sparsity: as :class:`SOLScheduler`.
    rollouts: K.
    reference: run the dense teacher-forced reference (needed for the KL reward).
    owner_base / segment_base: first ids (prefix b: base + b; reference: base + B + b;
      rollout (b, k): base + 2B + b K + k).

  After :func:`~selforch_jax.runtime.scheduler.run`: :attr:`logp` float32 ``[B, K, T]`` (the
  target's log-probability under the rollout's compute), :attr:`kl` ``[B, K, T]``
  (``KL(p_sparse || p_dense)``, nats; 0 without ``reference``), :attr:`dense_logp` ``[B, T]``,
  :attr:`usage` ``[B, K, T, 3]`` and :attr:`eff` bool ``[B, K, T]``.

  Raises:
    ValueError: sequences not 2-D or shorter than ``context_len + 2``, ``rollouts < 1``, an
      actor with another row count.
  """

  def __init__(self, sequences, context_len: int, actor, grid: ActionGrid,
               sparsity: str = DEFAULT_SPARSITY, rollouts: int = 1, reference: bool = True,
               owner_base: int = 0, segment_base: int = 0):
    seqs = np.asarray(sequences, np.int32)
    if seqs.ndim != 2 or context_len < 1 or seqs.shape[1] < context_len + 2 or rollouts < 1:
      raise ValueError(f"SOL episodes need sequences [B, context_len + T + 1] with T >= 1 and "
                       f"rollouts >= 1; got {seqs.shape}, context_len={context_len}, "
                       f"rollouts={rollouts}")
    B, K = seqs.shape[0], int(rollouts)
    if len(actor.eff_steps) != B * K:
      raise ValueError(f"SOL actor has {len(actor.eff_steps)} rows, episodes need B*K = {B * K}")
    self.seqs, self.Lc, self.K = seqs, int(context_len), K
    self.T = seqs.shape[1] - self.Lc - 1
    self.actor, self.grid, self.sparsity = actor, grid, sparsity
    self.reference = bool(reference)
    self.limit = dense_limit(sparsity)
    self.pre = owner_base + np.arange(B)
    self.ref = owner_base + B + np.arange(B)
    self.roll = owner_base + 2 * B + np.arange(B * K)
    self.owners = np.concatenate([self.pre, self.ref, self.roll])
    s_pre, s_ref = segment_base + np.arange(B), segment_base + B + np.arange(B)
    s_roll = segment_base + 2 * B + np.arange(B * K)
    G = segment_base + 2 * B + B * K
    vis = np.zeros((G, G), bool)
    vis[s_pre, s_pre] = vis[s_ref, s_ref] = vis[s_roll, s_roll] = True
    vis[s_ref, s_pre] = True
    vis[s_roll, np.repeat(s_pre, K)] = True
    self.visible, self.bidir = vis, np.zeros(G, bool)
    self.s_pre, self.s_ref, self.s_roll = s_pre, s_ref, s_roll
    self.phase, self.t = "prefill", 0
    self.logp = np.zeros((B, K, self.T), np.float32)
    self.kl = np.zeros((B, K, self.T), np.float32)
    self.dense_logp = np.zeros((B, self.T), np.float32)
    self.usage = np.ones((B, K, self.T, 3), np.float32)
    self.eff = np.zeros((B, K, self.T), bool)
    self._dense_lsm = None

  def next_step(self) -> StepPlan | None:
    B, Lc, T, K = self.seqs.shape[0], self.Lc, self.T, self.K
    if self.phase == "prefill":
      return StepPlan(tokens=self.seqs[:, :Lc].reshape(-1), positions=np.tile(np.arange(Lc), B),
                      segments=np.repeat(self.s_pre, Lc), owners=np.repeat(self.pre, Lc),
                      visible=self.visible, bidir=self.bidir, spec=ForwardSpec(outputs=("hidden",)),
                      tag="prefill")
    if self.phase == "reference":
      return StepPlan(tokens=self.seqs[:, Lc:Lc + T].reshape(-1),
                      positions=np.tile(Lc + np.arange(T), B),
                      segments=np.repeat(self.s_ref, T), owners=np.repeat(self.ref, T),
                      visible=self.visible, bidir=self.bidir, scratch=True, tag="reference")
    if self.phase == "rollout":
      t = self.t
      toks = np.repeat(self.seqs[:, Lc + t], K)
      eff = np.full(B * K, Lc + t + 1 > self.limit)
      a = self.actor.act(toks, eff, np.full(B * K, Lc + t + 1))
      self.eff[:, :, t] = eff.reshape(B, K)
      return StepPlan(tokens=toks, positions=np.full(B * K, Lc + t), segments=self.s_roll,
                      owners=self.roll, visible=self.visible, bidir=self.bidir,
                      spec=self.grid.spec(a, self.sparsity), tag="rollout")
    return None

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    B, Lc, T, K = self.seqs.shape[0], self.Lc, self.T, self.K
    if plan.tag == "prefill":
      last = result.hidden.reshape(B, Lc, -1)[:, -1]
      self.actor.set_hidden(np.arange(B * K), jnp.repeat(last, K, axis=0))
      self.phase = "reference" if self.reference else "rollout"
      return
    if plan.tag == "reference":
      lsm = jax.nn.log_softmax(result.logits, -1).reshape(B, T, -1)
      tgt = jnp.asarray(self.seqs[:, Lc + 1:Lc + T + 1])
      self.dense_logp[:] = np.asarray(jnp.take_along_axis(lsm, tgt[..., None], -1)[..., 0])
      self._dense_lsm = lsm
      self.phase = "rollout"
      return
    t = self.t
    lp, kl = _rewards(result.logits, jnp.asarray(np.repeat(self.seqs[:, Lc + t + 1], K)),
                      None if self._dense_lsm is None else
                      jnp.repeat(self._dense_lsm[:, t], K, axis=0))
    self.logp[:, :, t] = np.asarray(lp).reshape(B, K)
    self.kl[:, :, t] = np.asarray(kl).reshape(B, K)
    u = np.asarray(result.usage)
    self.usage[:, :, t] = u.reshape(B, K, 3)
    self.actor.observe(np.arange(B * K), u)
    self.actor.set_hidden(np.arange(B * K), result.hidden)
    self.t += 1
    if self.t == T:
      self.phase = "done"


@jax.jit
def _rewards(logits, targets, dense_lsm):
  """``log p(target)`` ``[N]`` and ``KL(p || p_dense)`` ``[N]`` (0 without ``dense_lsm``)."""
  lsm = jax.nn.log_softmax(logits, -1)
  lp = jnp.take_along_axis(lsm, targets[:, None], -1)[:, 0]
  if dense_lsm is None:
    return lp, jnp.zeros_like(lp)
  return lp, jnp.sum(jnp.exp(lsm) * (lsm - dense_lsm), -1)


def make_controller(engine: Engine, policy, grid: ActionGrid, budget, n: int, horizon: int, *,
                    greedy: bool = True, temperature: float = 1.0, seed: int = 0,
                    budget_guard: float | None = None,
                    sparsity: str = DEFAULT_SPARSITY) -> BudgetController:
  """A :class:`BudgetController` for ``n`` rows at one target ``budget`` (``"kappa,rho,bits"``
  or a 3-sequence; :func:`parse_budget`) over the engine's LM embedding; ``budget_guard``
  (None: off) and ``sparsity`` as :class:`BudgetController`.

  Raises:
    ValueError: a bad budget or guard tolerance (:class:`BudgetController`)."""
  embed = nnx.merge(engine.graphdef, engine.state).embed[...]
  tg = np.tile(parse_budget(budget), (n, 1))
  return BudgetController(policy, grid, tg, horizon, embed, temperature=temperature,
                          greedy=greedy, seed=seed, budget_guard=budget_guard,
                          sparsity=sparsity)


@register("sol")
def _sol(engine: Engine, prompts: Sequence[Sequence[int]], tag_vocab=None, *, policy=None,
         grid: ActionGrid | None = None, budget="0.5,0.8,8", sparsity: str = DEFAULT_SPARSITY,
         actor=None, greedy_policy: bool = True, gather: bool = True,
         budget_guard: float | None = None, **kw) -> Scheduler:
  """SOL decoding (:class:`SOLScheduler`): ``policy`` (a trained
  :class:`~selforch_jax.models.sol_policy.SolPolicy`) and its ``grid`` at target ``budget``
  (greedy actions by default, upstream's evaluation), or a ready ``actor``; ``budget_guard``:
  the guard's tolerance (usage units; None: off; :class:`BudgetController`), for the policy
  built here; ``gather``: QUEST decode steps attend over the gathered kept pages
  (:class:`SOLScheduler`); ``tag_vocab`` unused.

  Raises:
    ValueError: neither ``policy`` + ``grid`` nor ``actor``; a bad budget or guard tolerance.
    ContextLengthError: a prompt plus ``max_new_tokens`` exceeds the model's context."""
  max_new = int(kw.get("max_new_tokens", 128))
  check_context([len(p) for p in prompts], max_new, engine.cfg.max_position_embeddings)
  if grid is None:
    raise ValueError("runtime 'sol' needs the policy's action grid")
  if actor is None:
    if policy is None:
      raise ValueError("runtime 'sol' needs a trained policy (a SOL adapter) or an actor")
    actor = make_controller(engine, policy, grid, budget, len(prompts), max_new,
                            greedy=greedy_policy, seed=kw.get("sampling").seed
                            if kw.get("sampling") is not None else 0,
                            budget_guard=budget_guard, sparsity=sparsity)
  owner_base, segment_base = fresh_bases(engine)
  return SOLScheduler(prompts, actor=actor, grid=grid, sparsity=sparsity, gather=gather,
                      owner_base=owner_base, segment_base=segment_base, **kw)
