"""Schedulers by name: ``make_scheduler(name, engine, prompts, **kw)``.

Trainers (GRPO, BoNBoN rollouts) and evaluation pick a decoding system by a config string.
Each entry is a factory ``(engine, prompts, **kw) -> Scheduler``; the factory chooses fresh
owner and segment ids on ``engine`` (so sequences already in the pool stay invisible).

Contract every registered scheduler meets (what :mod:`selforch_jax.trainers.rollouts` reads):
after :func:`selforch_jax.runtime.scheduler.run` returns, ``scheduler.results`` is a list with
one :class:`~selforch_jax.decoding.generate.GenerationResult` per prompt whose ``token_ids``
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


def available() -> list[str]:
  """The registered scheduler names, sorted."""
  return _REGISTRY.names()


def fresh_bases(engine: Engine) -> tuple[int, int]:
  """``(owner_base, segment_base)``: ids above every owner / segment already in the pool."""
  owner_base = max(engine.pool.owners(), default=-1) + 1
  segment_base = int(engine.pool.segment.max(initial=-1)) + 1
  return owner_base, segment_base


def make_scheduler(name: str, engine: Engine, prompts: Sequence[Sequence[int]],
                   **kw) -> Scheduler:
  """Build the scheduler ``name`` for ``prompts`` (lists of int token ids) on ``engine``.

  Args:
    name: a registered name (see :func:`available`).
    engine: the :class:`Engine` the job will run on.
    prompts: B non-empty lists of int token ids.
    **kw: the system's own options (for "ar": ``max_new_tokens``, ``sampling``,
      ``stop_ids``); every factory accepts ``tag_vocab`` (the model's
      :class:`~selforch_jax.lang.tags.TagVocab`, or None).

  Raises:
    KeyError: unknown ``name`` (the message lists the registered ones).
  """
  return _REGISTRY.get(name)(engine, prompts, **kw)


@register("ar")
def _ar(engine: Engine, prompts: Sequence[Sequence[int]], tag_vocab=None, **kw) -> Scheduler:
  """Plain AR decoding (:class:`~selforch_jax.runtime.ar.ARScheduler`); ``tag_vocab`` is
  accepted and unused (tags are decoded as ordinary tokens)."""
  from selforch_jax.runtime.ar import ARScheduler
  owner_base, segment_base = fresh_bases(engine)
  return ARScheduler(prompts, owner_base=owner_base, segment_base=segment_base, **kw)


@register("tip")
def _tip(engine: Engine, prompts: Sequence[Sequence[int]], **kw) -> Scheduler:
  """TIP: AR decoding where reusing a thought register evicts the dead step's KV pages
  (:class:`~selforch_jax.runtime.tip.TIPScheduler`; needs ``tag_vocab``, takes
  ``max_new_tokens``, ``sampling``, ``stop_ids``)."""
  from selforch_jax.runtime.tip import TIPScheduler
  return TIPScheduler(engine, prompts, **kw)


@register("pasta")
def _pasta(engine: Engine, prompts: Sequence[Sequence[int]], **kw) -> Scheduler:
  """PASTA parallel-thread decoding (:class:`~selforch_jax.runtime.pasta.PASTAScheduler`);
  ``kw``: ``tag_vocab`` (required), ``max_new_tokens``, ``sampling``, ``stop_ids``, ``cap``,
  ``length_unit``. ``results[i].token_ids`` are canonical (threads in promise order)."""
  from selforch_jax.runtime.pasta import PASTAScheduler
  owner_base, segment_base = fresh_bases(engine)
  tv = kw.pop("tag_vocab")
  return PASTAScheduler(prompts, tv, owner_base=owner_base, segment_base=segment_base, **kw)
