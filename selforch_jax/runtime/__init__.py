"""The runtime (DESIGN.md §2.4): one engine — a paged KV pool and one jitted step — and one
scheduler per system.

Modules (one job each):

* :mod:`~selforch_jax.runtime.kv_pool` — :class:`KVPool` (pages, free list, page tables, per-slot
  position / segment / order / owner / state, eviction, live-KV accounting), :class:`PoolExhausted`.
* :mod:`~selforch_jax.runtime.mask` — the §2 visibility rule: :func:`step_mask` (a step over the
  pool), :func:`sequence_mask` (a whole sequence), :class:`SegmentTable` (growable visibility).
* :mod:`~selforch_jax.runtime.engine` — :class:`Engine` (model split once, device KV, jitted
  ``step(tokens[T], positions[T], write_slots[T], mask[T, S]) -> logits[T, V]`` with T padded to
  powers of two and the cache donated; :meth:`Engine.run_step` allocates, masks and steps).
* :mod:`~selforch_jax.runtime.scheduler` — :class:`Scheduler` (``next_step`` / ``on_step`` /
  ``on_exhausted``), :class:`StepPlan`, :class:`StepResult`, :func:`execute`, :func:`run`.
* :mod:`~selforch_jax.runtime.ar` — :class:`ARScheduler` and :func:`generate`: greedy / sampled
  AR decoding, token for token equal to ``decoding.generate.Generator``.
* :mod:`~selforch_jax.runtime.oracle` — :func:`plan_groups`, :func:`replay`: feed an annotated
  sequence to the engine step by step (the train = decode oracle, DESIGN.md §2.2).
* :mod:`~selforch_jax.runtime.annotated` — random annotated sequences of every kind (tests,
  fuzzing).
* :mod:`~selforch_jax.runtime.pasta` — :class:`PASTAScheduler`: promised chunks decoded as
  parallel AR threads (stream-mode ``LayoutBuilder``), joined at ``<sync/>``.
* :mod:`~selforch_jax.runtime.sot` / :mod:`~selforch_jax.runtime.apar` — the Skeleton-of-Thought
  and APAR-style baselines on the same engine.
* :mod:`~selforch_jax.runtime.kv_policies` — :class:`PolicyScheduler` (the AR scheduler with a
  per-request KV policy and live-KV accounting) and the budget baselines: dense, StreamingLLM,
  H2O, paged H2O.
* :mod:`~selforch_jax.runtime.tip` — :class:`TIPScheduler` (register tags evict dead steps, each
  step on fresh pages) and :class:`RegisterKV` (the eviction bookkeeping, reusable).
"""

from selforch_jax.runtime.engine import Engine, bucket_size
from selforch_jax.runtime.kv_pool import ALIVE, DEAD, FREE, RESERVED, KVPool, PoolExhausted
from selforch_jax.runtime.mask import SegmentTable, sequence_mask, step_mask
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult, execute, run

__all__ = [
    "Engine", "bucket_size", "KVPool", "PoolExhausted", "FREE", "RESERVED", "ALIVE", "DEAD",
    "SegmentTable", "sequence_mask", "step_mask", "Scheduler", "StepPlan", "StepResult",
    "execute", "run",
]
