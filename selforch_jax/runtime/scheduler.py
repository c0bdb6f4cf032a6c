"""The scheduler interface: what each engine step runs, and what the pool does around it.

A system (AR, PASTA, TIP, Planned Diffusion, PTD, Orthrus, SOL) is a :class:`Scheduler`;
the decode loop is :func:`run`, shared by all of them (DESIGN.md §2.4; the JetStream
``Engine`` API and vLLM's scheduler/worker split, reduced to two calls)::

  while (plan := scheduler.next_step()) is not None:
    result = execute(engine, plan)     # pool changes, then one jitted step
    scheduler.on_step(plan, result)    # sample, commit, decide forks / evictions

How the verbs map onto a :class:`StepPlan`:

* **run**: ``tokens / positions / segments / owners`` (and ``orders``): the step's queries.
* **fork**: a new owner (page table) and a new segment that sees its parent's segments
  (:class:`~selforch_jax.runtime.mask.SegmentTable`); no KV is copied.
* **join**: a segment that sees every joined segment (``visible`` rows).
* **evict**: ``evict`` slots die before the step (pages with no live slot are reused);
  ``free_owners`` release finished sequences / threads.
* **verify**: ``scratch=True``: the step's K/V are written, attended to by the step itself,
  and released right after (nothing is written back).
* **commit / reject**: a draft step is a normal step; the next plan's ``rollback``
  (``{owner: n}``) crops the rejected suffix before it runs.

Pool exhaustion raises :class:`~selforch_jax.runtime.kv_pool.PoolExhausted`; a scheduler may
catch it in :meth:`Scheduler.on_exhausted` and return a plan with evictions instead.
"""

from __future__ import annotations

import abc

import numpy as np

from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.kv_pool import PoolExhausted
from selforch_jax.runtime.step import ForwardSpec, StepPlan, StepResult

__all__ = ["Scheduler", "StepPlan", "StepResult", "ForwardSpec", "execute", "run"]

MAX_EXHAUSTED_RETRIES = 64  # replacement plans tried for one step before PoolExhausted escapes


class Scheduler(abc.ABC):
  """Decides every step of one decoding job (see the module docstring)."""

  @abc.abstractmethod
  def next_step(self) -> StepPlan | None:
    """The next step to run, or None when the job is finished."""

  @abc.abstractmethod
  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    """Consume a step's logits: sample, accept/reject, plan forks and evictions."""

  def on_exhausted(self, plan: StepPlan, error: PoolExhausted) -> StepPlan | None:
    """The pool could not hold ``plan``'s step: return a replacement plan (e.g. the same step
    with evictions), or None to re-raise ``error``. The default re-raises.

    ``plan``'s own pool changes (free, rollback, evict) were already applied; the replacement's
    are applied on top, then its step is tried; :func:`run` keeps asking until a step fits."""
    return None


def execute(engine: Engine, plan: StepPlan) -> StepResult:
  """Apply ``plan``'s pool changes (relabel, free, rollback, evict, in that order), then run
  its step.

  Relabel comes first: the kept slots of a tree / verify step leave their scratch owner
  (:meth:`~selforch_jax.runtime.kv_pool.KVPool.relabel`), so the same plan's ``free_owners`` /
  ``rollback`` / ``evict`` of that owner drop the rest of the tree without touching them, and a
  ``rollback`` of the target owner in the same plan counts them as its newest slots. With
  ``write_slots`` the step rewrites those held slots in place (nothing is allocated). After the
  step, a ``scratch`` plan's slots are released, or only those of its ``scratch_owners``.

  Raises:
    PoolExhausted: the step's slots do not fit (the pool changes before it were applied).
    ValueError: malformed plan (see :meth:`Engine.run_step`, ``KVPool.relabel``); a scratch
      step with ``write_slots`` (a rewrite in place cannot be released).
  """
  pool = engine.pool
  if plan.scratch and plan.write_slots is not None:
    raise ValueError("execute: a scratch step cannot rewrite in place (write_slots): its K/V "
                     "would overwrite held slots that scratch then cannot give back")
  for slots, owner, segment in plan.relabel:
    pool.relabel(slots, int(owner), int(segment))
  for o in plan.free_owners:
    pool.free_owner(int(o))
  for o, n in plan.rollback.items():
    pool.rollback(int(o), int(n))
  released = pool.evict(plan.evict) if len(plan.evict) else []
  out, slots = engine.run_step(plan.tokens, plan.positions, plan.segments, plan.owners,
                               plan.visible, plan.bidir, orders=plan.orders,
                               key_keep=plan.key_keep, write_slots=plan.write_slots,
                               spec=plan.spec)
  owners = np.broadcast_to(np.asarray(plan.owners, np.int64), slots.shape)
  drop = np.unique(owners) if plan.scratch else np.asarray(plan.scratch_owners, np.int64)
  for o in drop[::-1]:   # (scratch_owners: the fused step's draft queries, the rest kept)
    if np.any(owners == o):
      pool.rollback(int(o), int(np.count_nonzero(owners == o)))
  return StepResult(logits=out["logits"], slots=slots, released_pages=released,
                    hidden=out["hidden"], attn_mass=out["attn_mass"], usage=out["usage"])


def run(engine: Engine, scheduler: Scheduler, max_steps: int | None = None,
        observer=None) -> int:
  """Drive ``scheduler`` on ``engine`` until it returns no plan; returns the steps run.

  ``observer``: optional ``callback(plan, result)`` after each step's ``on_step`` (the plan
  that ran, after any ``on_exhausted`` replacement), e.g. a
  :class:`~selforch_jax.runtime.trace.TraceRecorder`.

  Raises:
    PoolExhausted: the pool is full and :meth:`Scheduler.on_exhausted` offered no plan (it is
      asked again after each replacement that still does not fit, up to
      ``MAX_EXHAUSTED_RETRIES`` times).
    RuntimeError: ``max_steps`` reached (a scheduler that never finishes).
  """
  steps = 0
  while (plan := scheduler.next_step()) is not None:
    if max_steps is not None and steps >= max_steps:
      raise RuntimeError(f"scheduler did not finish within max_steps={max_steps}")
    for attempt in range(MAX_EXHAUSTED_RETRIES + 1):
      try:
        result = execute(engine, plan)
        break
      except PoolExhausted as e:
        replacement = scheduler.on_exhausted(plan, e)
        if replacement is None or attempt == MAX_EXHAUSTED_RETRIES:
          raise
        plan = replacement
    scheduler.on_step(plan, result)
    if observer is not None:
      observer(plan, result)
    steps += 1
  return steps


def run_job(engine: Engine, scheduler: Scheduler, free_after: bool = True) -> Scheduler:
  """:func:`run` ``scheduler`` to the end, then (``free_after``) release every page-table owner
  it lists in ``scheduler.owners``; returns the scheduler (its ``results`` are ready).

  Raises:
    As :func:`run`.
  """
  run(engine, scheduler)
  if free_after:
    for o in getattr(scheduler, "owners", ()):
      engine.pool.free_owner(int(o))
  return scheduler
