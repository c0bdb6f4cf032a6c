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
* :mod:`~selforch_jax.runtime.step` — :class:`StepPlan` (queries, visibility, pool changes:
  free / rollback / evict / relabel / rewrite in place, scratch), :class:`ForwardSpec` (view,
  outputs, sparsity, activation bits; key / channel keep arrays), :class:`StepResult`.
* :mod:`~selforch_jax.runtime.scheduler` — :class:`Scheduler` (``next_step`` / ``on_step`` /
  ``on_exhausted``), :func:`execute`, :func:`run`: the one decode loop.
* :mod:`~selforch_jax.runtime.sampling` — :class:`SamplingParams` and the one sampler (greedy,
  temperature, top-k, top-p, min-p, seeds; token and log-prob).
* :mod:`~selforch_jax.runtime.generation` — :class:`GenerationResult`, stop conditions (EOS ids,
  stop strings, max new tokens, finish reasons), the context-length check.
* :mod:`~selforch_jax.runtime.registry` — ``register(name)``; :mod:`~selforch_jax.runtime.schedulers`
  — one module per system (``ar``, ``pasta``, ``sot``, ``apar``, ``tip``, ``kv_policies``:
  StreamingLLM / H2O) and :func:`~selforch_jax.runtime.schedulers.make_scheduler` by name.
* :mod:`~selforch_jax.runtime.oracle` — :func:`plan_groups`, :func:`replay`: feed an annotated
  sequence to the engine step by step (the train = decode oracle, DESIGN.md §2.2).
* :mod:`~selforch_jax.runtime.annotated` — random annotated sequences of every kind (tests,
  fuzzing).
"""

from selforch_jax.runtime.engine import Engine, bucket_size
from selforch_jax.runtime.kv_pool import ALIVE, DEAD, FREE, RESERVED, KVPool, PoolExhausted
from selforch_jax.runtime.mask import SegmentTable, sequence_mask, step_mask
from selforch_jax.runtime.scheduler import Scheduler, execute, run
from selforch_jax.runtime.step import ForwardSpec, StepPlan, StepResult

__all__ = [
    "Engine", "bucket_size", "KVPool", "PoolExhausted", "FREE", "RESERVED", "ALIVE", "DEAD",
    "SegmentTable", "sequence_mask", "step_mask", "Scheduler", "StepPlan", "StepResult",
    "execute", "run", "ForwardSpec",
]
