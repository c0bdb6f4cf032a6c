"""Replay an annotated sequence through the engine: the runtime side of the train = decode
oracle (DESIGN.md §2.2).

A layout (from the lang mask builder, or built by hand) gives, for N tokens: ``positions``,
``segment_ids``, ``visible [G, G]``, ``bidir [G]`` and ``kill_at`` (token i is dead for
queries at index ``>= kill_at[i]``). The training forward runs all N tokens at once with
the mask :func:`~selforch_jax.runtime.mask.sequence_mask`; :func:`replay` feeds the same
tokens to an :class:`~selforch_jax.runtime.engine.Engine` a few per step, in any order that
respects the dependencies (:func:`plan_groups`), one page-table owner per segment (threads
interleave in the pool), bidirectional segments as one step each, and evicts every token as
soon as no query left can see it. Both must give the same logits.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.mask import sequence_mask


def _units(segments: np.ndarray, bidir: np.ndarray) -> list[np.ndarray]:
  """Indices grouped into atomic units: one token, or a whole bidirectional segment."""
  units, seen = [], set()
  for i, s in enumerate(segments):
    if bidir[s]:
      if s in seen:
        continue
      seen.add(int(s))
      units.append(np.flatnonzero(segments == s))
    else:
      units.append(np.asarray([i]))
  return units


def plan_groups(segments, visible, bidir, kill_at=None, *, rng: np.random.Generator | None = None,
                max_group: int = 4, order: str = "index") -> list[np.ndarray]:
  """Split N token indices into engine steps that respect the layout's dependencies.

  A query may run once every key it sees is written (earlier or in the same step), and once
  every token it must *not* see because of ``kill_at`` can be evicted (every query that
  still sees it has run in an earlier step). A bidirectional segment is one unit.

  Args:
    segments, visible, bidir, kill_at: the layout (see module docstring).
    rng: random step sizes in ``[1, max_group]`` (units never split); None = max_group.
    max_group: largest step (a bigger unit makes a bigger step).
    order: ``"index"`` (tokens in sequence order) or ``"threads"`` (round-robin over the
      segments that are ready: parallel threads decode interleaved).

  Returns:
    Steps, each an int array of token indices, ascending; together a partition of
    ``range(N)``.

  Raises:
    ValueError: ``kill_at[i] <= i``, or no token can run (a dependency on a later token).
  """
  seg = np.asarray(segments, np.int64)
  n = seg.shape[0]
  bidir = np.asarray(bidir, bool)
  kill = np.full(n, n + 1, np.int64) if kill_at is None else np.asarray(kill_at, np.int64)
  if np.any(kill <= np.arange(n)):
    raise ValueError("kill_at[i] must be > i (a token sees itself)")
  nokill = sequence_mask(seg, visible, bidir)
  tmask = nokill & (np.arange(n)[:, None] < kill[None, :])
  # readers_before[k]: queries that see k and come before its kill point
  fed = np.zeros(n, bool)
  units = _units(seg, bidir)
  unit_of = np.empty(n, np.int64)
  for u, idx in enumerate(units):
    unit_of[idx] = u
  done_units = np.zeros(len(units), bool)

  def ready(idx: np.ndarray, in_step: np.ndarray) -> bool:
    avail = fed | in_step
    avail[idx] = True
    for q in idx:
      if not np.all(avail[tmask[q]]):
        return False
      gone = np.flatnonzero(nokill[q] & (kill <= q))  # keys q must not see
      for k in gone:
        readers = np.flatnonzero(nokill[:, k] & (np.arange(n) < kill[k]))
        if not np.all(fed[readers]):
          return False
    return True

  steps = []
  while not fed.all():
    target = max_group if rng is None else int(rng.integers(1, max_group + 1))
    in_step = np.zeros(n, bool)
    todo = [u for u in range(len(units)) if not done_units[u]]
    if order == "threads":  # next unit of each segment, round-robin, then the rest
      firsts, rest, seen = [], [], set()
      for u in todo:
        s = int(seg[units[u][0]])
        (rest if s in seen else firsts).append(u)
        seen.add(s)
      todo = firsts + rest
    elif order != "index":
      raise ValueError(f"order must be 'index' or 'threads', got {order!r}")
    size = 0
    for u in todo:
      idx = units[u]
      if size and size + idx.size > target:
        continue
      if ready(idx, in_step):
        in_step[idx] = True
        done_units[u] = True
        size += idx.size
      if size >= target:
        break
    if size == 0:
      raise ValueError("no token can run: the layout has a dependency on a later token")
    fed |= in_step
    steps.append(np.flatnonzero(in_step))
  return steps


def replay(engine: Engine, tokens, positions, segments, visible, bidir, kill_at=None, *,
           groups: Sequence[np.ndarray] | None = None, owner_base: int = 0,
           live_trace: list | None = None) -> np.ndarray:
  """Feed one annotated sequence to ``engine`` step by step; return every token's logits.

  Args:
    engine: an :class:`Engine` with room for the sequence's live tokens.
    tokens, positions, segments: int ``[N]``; visible: bool ``[G, G]``; bidir: bool ``[G]``;
      kill_at: optional int ``[N]`` (see module docstring).
    groups: the steps (:func:`plan_groups`); default ``plan_groups(..., max_group=4)``.
    owner_base: token i's slot belongs to owner ``owner_base + segments[i]``.
    live_trace: if a list, ``(step, live_tokens, released_pages)`` is appended per step.

  Returns:
    float32 ``[N, V]``: row i = the engine's logits for query i. The pool still holds
    the sequence afterwards (free it with ``engine.pool.free_owner``).

  Raises:
    PoolExhausted: the pool cannot hold the live tokens.
    ValueError: bad groups (not a partition, or a key not written before its query).
  """
  tokens = np.asarray(tokens, np.int32)
  positions = np.asarray(positions, np.int32)
  seg = np.asarray(segments, np.int64)
  n = tokens.shape[0]
  kill = np.full(n, n + 1, np.int64) if kill_at is None else np.asarray(kill_at, np.int64)
  if n == 0:
    return np.zeros((0, engine.cfg.vocab_size), np.float32)
  if groups is None:
    groups = plan_groups(seg, visible, bidir, kill, max_group=4)
  allidx = np.sort(np.concatenate([np.asarray(g) for g in groups]))
  if not np.array_equal(allidx, np.arange(n)):
    raise ValueError("groups must partition range(N)")
  nokill = sequence_mask(seg, visible, bidir)
  slot_of = np.full(n, -1, np.int64)
  evicted = np.zeros(n, bool)
  fed = np.zeros(n, bool)
  out = None
  for s, g in enumerate(groups):
    g = np.asarray(g, np.int64)
    pending = ~fed
    pending[g] = True
    # evict every written token that no pending query may still see
    ar = np.arange(n)
    still_needed = (nokill[pending] & (ar[pending][:, None] < kill[None, :])).any(axis=0)
    ev = np.flatnonzero(fed & ~evicted & ~still_needed)
    released = engine.pool.evict(slot_of[ev]) if ev.size else []
    evicted[ev] = True
    logits, slots = engine.run_step(tokens[g], positions[g], seg[g], owner_base + seg[g],
                                    visible, bidir, orders=g)
    slot_of[g] = slots
    fed[g] = True
    lg = np.asarray(logits)
    if out is None:
      out = np.zeros((n, lg.shape[-1]), np.float32)
    out[g] = lg
    if live_trace is not None:
      live_trace.append((s, engine.pool.live_tokens, released))
  return out
