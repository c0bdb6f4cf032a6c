"""TIP register allocation: dependence graph -> live ranges -> ``<reg_k>`` tags (DESIGN.md §3, §6).

A reasoning text is a list of **steps** ``0..n-1``. Its **dependence graph** is ``uses[j]``, the
set of earlier steps ``i < j`` whose content step ``j`` reads. In the language a step starts at its
``<reg_k>`` tag and runs to the next register tag (:mod:`selforch_jax.lang.parser`); writing
``<reg_k>`` again kills the step register k held, and the killing tag does not see it. So step
``i`` may be killed by the tag of step ``j`` only when no step ``>= j`` uses ``i``.

Rules (pure functions, no tokenizer; used by the GSM8K and LLM annotators and the synthetic task):

* **Live range** of step i: ``[i, last_use(i)]`` with ``last_use(i) = max(j : i in uses[j])``;
  a step no later step uses dies right after it is written (``last_use(i) = i``: the next step may
  already reuse its register). Steps in ``keep`` (the final answer) never die:
  ``last_use = n`` (:data:`FOREVER` relative to the text).
* **Linear scan** (Poletto & Sarkar, "Linear scan register allocation", TOPLAS 1999): visit the
  steps in order; before step s, every active interval that ended (``last_use < s``) frees its
  register; step s takes a free register. Which free register: one that still **holds a dead
  step** (the one that died earliest, then the lowest index), so that the tag kills it and the
  runtime evicts it; a never-used register only when no register holds a dead step. (Choosing a
  fresh register first would kill nothing while fresh registers last.)
* **Spill** (all K registers hold live steps when step s starts): TIP has no memory to spill to,
  so with ``spill="merge"`` (default) step s gets **no tag**: by the language's step rule its text
  continues the previous step, which becomes one step of both (live range = the union, so it
  stays live until both are dead). This never adds register pressure and never kills a live step.
  With ``spill="reject"`` the allocation fails (:class:`RegisterPressureError`) and annotators
  return no annotation.

Invariant checked by :func:`check_allocation`: no step is killed before its last use, no ``keep``
step is ever killed, and (with ``merge``) the first step has a tag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from selforch_jax.lang.tags import register_tag

__all__ = ["Allocation", "RegisterPressureError", "normalize_uses", "last_uses", "max_live",
           "linear_scan", "kills", "resident_counts", "check_allocation", "tag_steps"]


class RegisterPressureError(ValueError):
  """More than K steps are live at once and the spill rule is ``"reject"``."""


@dataclasses.dataclass(frozen=True)
class Allocation:
  """A register allocation of n steps.

  Attributes:
    registers: ``registers[s]`` is the register k of step s (its text starts with ``<reg_k>``), or
      None when step s was spilled (merged into the step before it: no tag).
    last_use: ``last_use[s]``: the last step that uses step s (s itself if none; n if kept).
    killed_by: ``killed_by[s]``: the step whose tag kills step s, or None (never killed).
    merged: the spilled steps (``registers[s] is None``), ascending.
    max_live: the dependence graph's register pressure: the most steps live at once
      (``max_s #{i <= s <= last_use(i)}``), before any merging.
    resident: ``resident[s]``: steps not yet killed while step s runs (itself included) under
      these tags: the TIP runtime's live step count.
    num_registers: K.
  """

  registers: tuple[int | None, ...]
  last_use: tuple[int, ...]
  killed_by: tuple[int | None, ...]
  merged: tuple[int, ...]
  max_live: int
  resident: tuple[int, ...]
  num_registers: int

  @property
  def evicted(self) -> tuple[int, ...]:
    """Steps killed by a later tag, ascending."""
    return tuple(s for s, k in enumerate(self.killed_by) if k is not None)


def normalize_uses(uses: Sequence[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
  """Validate a dependence graph and return it as sorted tuples without duplicates.

  Args:
    uses: ``uses[j]`` = steps read by step j (ints).

  Raises:
    ValueError: a use that is not an earlier step (``i < 0`` or ``i >= j``), naming it.
  """
  out = []
  for j, u in enumerate(uses):
    s = sorted({int(i) for i in u})
    for i in s:
      if not 0 <= i < j:
        raise ValueError(f"step {j} uses step {i}: a step can only use earlier steps")
    out.append(tuple(s))
  return tuple(out)


def last_uses(uses: Sequence[Iterable[int]], keep: Iterable[int] = ()) -> tuple[int, ...]:
  """``last_use[i]`` of every step (see the module docstring): max user, else i; n for ``keep``.

  Raises:
    ValueError: invalid ``uses`` (:func:`normalize_uses`) or a ``keep`` index out of range.
  """
  uses = normalize_uses(uses)
  n = len(uses)
  end = list(range(n))
  for j, u in enumerate(uses):
    for i in u:
      end[i] = max(end[i], j)
  for i in keep:
    if not 0 <= int(i) < n:
      raise ValueError(f"keep step {i} is not a step (n={n})")
    end[int(i)] = n
  return tuple(end)


def max_live(last_use: Sequence[int]) -> int:
  """Register pressure of live ranges ``[i, last_use[i]]``: ``max_s #{i <= s <= last_use[i]}``
  (0 for no steps)."""
  n = len(last_use)
  return max((sum(1 for i in range(s + 1) if last_use[i] >= s) for s in range(n)), default=0)


def kills(registers: Sequence[int | None]) -> tuple[int | None, ...]:
  """What the tags do (the parser's rule, without tokens): ``killed_by[s]`` for each step.

  A tagged step s with register k kills every step of the group register k held (a tagged step
  plus the untagged steps that follow it). Untagged steps before the first tag belong to no
  register and are never killed.

  Args:
    registers: per step, its register or None (no tag).

  Returns:
    ``killed_by``: per step, the index of the killing step, or None.
  """
  killed_by: list[int | None] = [None] * len(registers)
  held: dict[int, list[int]] = {}
  current: list[int] | None = None
  for s, r in enumerate(registers):
    if r is None:
      if current is not None:
        current.append(s)
      continue
    for i in held.get(int(r), ()):
      killed_by[i] = s
    current = [s]
    held[int(r)] = current
  return tuple(killed_by)


def resident_counts(killed_by: Sequence[int | None]) -> tuple[int, ...]:
  """``resident[s] = #{i <= s : killed_by[i] is None or killed_by[i] > s}``."""
  return tuple(sum(1 for i in range(s + 1) if killed_by[i] is None or killed_by[i] > s)
               for s in range(len(killed_by)))


def linear_scan(uses: Sequence[Iterable[int]], num_registers: int, *, keep: Iterable[int] = (),
                spill: str = "merge") -> Allocation:
  """Allocate ``num_registers`` registers to the steps by linear scan (module docstring rules).

  Args:
    uses: the dependence graph, ``uses[j]`` = earlier steps step j reads.
    num_registers: K >= 1.
    keep: steps that must never be killed (the final answer).
    spill: ``"merge"`` (an unallocatable step joins the previous step, untagged) or ``"reject"``.

  Returns:
    :class:`Allocation`.

  Raises:
    ValueError: K < 1, an unknown ``spill``, invalid ``uses``/``keep``.
    RegisterPressureError: ``spill="reject"`` and more than K steps are live at some step.
  """
  if num_registers < 1:
    raise ValueError(f"num_registers must be >= 1, got {num_registers}")
  if spill not in ("merge", "reject"):
    raise ValueError(f"spill={spill!r} must be 'merge' or 'reject'")
  end = last_uses(uses, keep)
  n = len(end)
  registers: list[int | None] = [None] * n
  group_of: list[int] = [0] * n
  group_end: list[int] = []      # per group: last use over its members
  active: dict[int, int] = {}    # register -> group holding a live step
  dead: dict[int, int] = {}      # register -> step at which its (dead) group's last use was
  fresh = list(range(num_registers))
  merged = []
  for s in range(n):
    for r, g in list(active.items()):
      if group_end[g] < s:
        del active[r]
        dead[r] = group_end[g]
    if dead:
      r = min(dead, key=lambda k: (dead[k], k))
      del dead[r]
    elif fresh:
      r = fresh.pop(0)
    else:  # every register holds a live step
      if spill == "reject":
        raise RegisterPressureError(
          f"step {s}: all {num_registers} registers hold live steps "
          f"(register pressure {max_live(end)} > K={num_registers})")
      g = group_of[s - 1]
      group_end[g] = max(group_end[g], end[s])
      group_of[s] = g
      merged.append(s)
      continue
    registers[s] = r
    group_of[s] = len(group_end)
    group_end.append(end[s])
    active[r] = group_of[s]
  killed_by = kills(registers)
  return Allocation(registers=tuple(registers), last_use=end, killed_by=killed_by,
                    merged=tuple(merged), max_live=max_live(end),
                    resident=resident_counts(killed_by), num_registers=int(num_registers))


def check_allocation(uses: Sequence[Iterable[int]], registers: Sequence[int | None],
                     keep: Iterable[int] = (), num_registers: int | None = None) -> list[str]:
  """Violations of the TIP invariant by a tag assignment (empty list = valid).

  Checks: every step j that uses step i runs before i is killed (``j < killed_by[i]``); no
  ``keep`` step is killed; registers lie in ``[0, K)`` when K is given; the first step is tagged.
  """
  uses = normalize_uses(uses)
  if len(registers) != len(uses):
    return [f"{len(registers)} registers for {len(uses)} steps"]
  errs = []
  if registers and registers[0] is None:
    errs.append("step 0 has no register tag")
  if num_registers is not None:
    errs += [f"step {s}: register {r} outside [0, {num_registers})"
             for s, r in enumerate(registers) if r is not None and not 0 <= r < num_registers]
  killed_by = kills(registers)
  for j, u in enumerate(uses):
    for i in u:
      if killed_by[i] is not None and killed_by[i] <= j:
        errs.append(f"step {i} is killed by step {killed_by[i]} but step {j} uses it")
  errs += [f"kept step {i} is killed by step {killed_by[i]}" for i in keep
           if killed_by[int(i)] is not None]
  return errs


def tag_steps(steps: Sequence[str], registers: Sequence[int | None]) -> str:
  """The annotated text: each tagged step prefixed by its ``<reg_k>``, untagged steps as they are.

  Removing the tags gives ``"".join(steps)`` back.

  Raises:
    ValueError: ``steps`` and ``registers`` differ in length.
  """
  if len(steps) != len(registers):
    raise ValueError(f"{len(steps)} steps but {len(registers)} registers")
  return "".join(s if r is None else register_tag(r) + s for s, r in zip(steps, registers))
