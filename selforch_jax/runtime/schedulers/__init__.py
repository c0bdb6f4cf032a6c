"""One scheduler per system, built by name: :func:`make_scheduler` (DESIGN.md §2.5).

Importing this package registers every system (each module registers its own factory with
:func:`selforch_jax.runtime.registry.register`): ``ar``, ``pasta``, ``sot``, ``apar``, ``tip``,
``streaming_llm``, ``h2o`` (and the later systems). Trainers (GRPO, BoNBoN rollouts), evaluation
and the decode CLI pick a system by this name.
"""

from __future__ import annotations

from typing import Sequence

from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.registry import registered
from selforch_jax.runtime.scheduler import Scheduler
from selforch_jax.runtime.schedulers import apar, ar, kv_policies, pasta, sot, tip  # noqa: F401  (registration)
from selforch_jax.runtime.schedulers import lookahead, pld, ptd  # noqa: F401  (registration)
from selforch_jax.runtime.schedulers import orthrus  # noqa: F401  (registration)
from selforch_jax.runtime.schedulers import sol  # noqa: F401  (registration)
from selforch_jax.runtime.schedulers import planned_diffusion  # noqa: F401  (registration)


def available() -> list[str]:
  """The registered scheduler names, sorted."""
  return registered().names()


def make_scheduler(name: str, engine: Engine, prompts: Sequence[Sequence[int]],
                   **kw) -> Scheduler:
  """Build the scheduler ``name`` for ``prompts`` (lists of int token ids) on ``engine``.

  Args:
    name: a registered name (see :func:`available`).
    engine: the :class:`~selforch_jax.runtime.engine.Engine` the job will run on.
    prompts: B non-empty lists of int token ids.
    **kw: the system's own options (for "ar": ``max_new_tokens``, ``sampling``,
      ``stop_ids``); every factory accepts ``tag_vocab`` (the model's
      :class:`~selforch_jax.lang.tags.TagVocab`, or None).

  Raises:
    KeyError: unknown ``name`` (the message lists the registered ones).
  """
  return registered().get(name)(engine, prompts, **kw)
