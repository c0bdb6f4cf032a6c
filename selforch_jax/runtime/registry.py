"""The scheduler registry: ``register(name)`` and :func:`fresh_bases`.

Each scheduler module under :mod:`selforch_jax.runtime.schedulers` registers its factory here;
:func:`selforch_jax.runtime.schedulers.make_scheduler` builds one by name (importing the package
registers every system, so this module imports no scheduler and no import cycle runs through it).

Trainers (GRPO, BoNBoN rollouts) and evaluation pick a decoding system by a config string.
Each entry is a factory ``(engine, prompts, **kw) -> Scheduler``; the factory chooses fresh
owner and segment ids on ``engine`` (so sequences already in the pool stay invisible).

Contract every registered scheduler meets (what :mod:`selforch_jax.trainers.rollouts` reads):
after :func:`selforch_jax.runtime.scheduler.run` returns, ``scheduler.results`` is a list with
one :class:`~selforch_jax.runtime.generation.GenerationResult` per prompt whose ``token_ids``
are the response in canonical (serialized) order, tags included, stop token excluded; and
``scheduler.owners`` lists the page-table owners to free afterwards.

Register a system with an additive edit::

  @register("pasta")
  def _pasta(engine, prompts, **kw): ...
"""

from __future__ import annotations

from typing import Callable, Sequence

from selforch_jax.registry import Registry
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import Scheduler

SchedulerFactory = Callable[..., Scheduler]
_REGISTRY: Registry[SchedulerFactory] = Registry("scheduler")


def register(name: str) -> Callable[[SchedulerFactory], SchedulerFactory]:
  """Decorator: register ``factory(engine, prompts, **kw) -> Scheduler`` under ``name``.

  Raises:
    ValueError: ``name`` is already registered.
  """
  return _REGISTRY.register(name)


def registered() -> Registry[SchedulerFactory]:
  """The registry itself (what :mod:`selforch_jax.runtime.schedulers` reads)."""
  return _REGISTRY


def fresh_bases(engine: Engine) -> tuple[int, int]:
  """``(owner_base, segment_base)``: ids above every owner / segment already in the pool."""
  owner_base = max(engine.pool.owners(), default=-1) + 1
  segment_base = int(engine.pool.segment.max(initial=-1)) + 1
  return owner_base, segment_base
