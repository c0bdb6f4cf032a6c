r"""TIP register annotation of GSM8K worked solutions (rule-based; DESIGN.md §6).

A GSM8K solution is lines; each line is one **step** (a blank line joins the step before it, the
``#### N`` line is the last step). Values flow by number:

* a step **produces** the results ``c`` of its calculator annotations ``<<expr=c>>``, and the
  numbers of its text outside annotations that appear neither in the question nor as an earlier
  step's product (mental arithmetic, e.g. "3 dozen is 36 eggs");
* a step **uses** every number of its annotation expressions and of its text, except its own
  results; the ``#### N`` step uses N;
* a used value comes from the **latest** earlier step that produced it (reaching definition).
  A value that an earlier step produced and that the question also states counts as a use of the
  step (conservative: the step stays live longer; a wrong eviction would cost accuracy, a missed
  one only memory).

Numbers compare by exact value (``1,000`` = ``1000``, ``0.50`` = ``.5``; signs ignored). The graph
goes to :func:`selforch_jax.lang.registers.linear_scan` with the final ``####`` step kept alive.

The annotation report on a whole split: ``python -m selforch_jax.lang.annotators.tip_report``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from selforch_jax.lang.annotators.base import Annotation, Annotator, register
from selforch_jax.lang.registers import RegisterPressureError, linear_scan, tag_steps
from selforch_jax.lang.tags import DEFAULT_NUM_REGISTERS

__all__ = ["TipGSM8KAnnotator", "split_steps", "step_values", "gsm8k_dependences", "numbers_in"]

_CALC = re.compile(r"<<([^<>]*)>>")
_NUM = re.compile(r"\d+(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+")
_FINAL = re.compile(r"^\s*####\s*(.*)$")


def numbers_in(text: str) -> set[Fraction]:
  """The exact values of the unsigned decimal numbers written in ``text`` (``"1,000"`` ->
  1000, ``"$0.50"`` -> 1/2)."""
  return {Fraction(m.group(0).replace(",", "")) for m in _NUM.finditer(text)}


def split_steps(solution: str) -> list[str]:
  """Lines of ``solution`` with their newlines, a blank line joined to the line before it.

  ``"".join(split_steps(s)) == s`` for every string.
  """
  steps: list[str] = []
  for line in solution.splitlines(keepends=True):
    if steps and not line.strip():
      steps[-1] += line
    else:
      steps.append(line)
  return steps


def step_values(step: str) -> tuple[set[Fraction], set[Fraction], set[Fraction]]:
  """``(results, expression numbers, text numbers)`` of one step: the calculator results, the
  numbers inside annotation expressions, and the numbers of the text outside annotations."""
  results, expr = set(), set()
  for m in _CALC.finditer(step):
    lhs, eq, rhs = m.group(1).rpartition("=")
    if eq:
      results |= numbers_in(rhs)
      expr |= numbers_in(lhs)
    else:
      expr |= numbers_in(m.group(1))
  text = numbers_in(_CALC.sub(" ", step))
  return results, expr, text


def gsm8k_dependences(question: str, steps: list[str]) -> tuple[list[set[int]], int | None]:
  """The dependence graph of a solution's steps (module docstring rules).

  Returns:
    ``(uses, final)``: ``uses[j]`` = earlier steps step j reads; ``final`` = index of the
    ``#### N`` step (None if there is none).
  """
  given = numbers_in(question)
  producer: dict[Fraction, int] = {}
  uses: list[set[int]] = []
  final = None
  for j, step in enumerate(steps):
    m = _FINAL.match(step)
    if m:
      final = j
      vals = numbers_in(m.group(1))
      uses.append({producer[v] for v in vals if v in producer})
      continue
    results, expr, text = step_values(step)
    used = expr | (text - results)
    uses.append({producer[v] for v in used if v in producer})
    made = results | {v for v in text - results - expr if v not in given and v not in producer}
    for v in made:
      producer[v] = j
  return uses, final


@register("tip_gsm8k")
class TipGSM8KAnnotator(Annotator):
  """GSM8K solution -> the same solution with a ``<reg_k>`` tag starting each step.

  Args:
    num_registers: K (``model.num_registers`` of the run), >= 1.
    spill: ``"merge"`` or ``"reject"`` (see :mod:`selforch_jax.lang.registers`).

  ``annotate`` returns ``Annotation(None, info={"rejected": reason})`` for a response without a
  ``#### N`` line or (``spill="reject"``) with more than K live steps; else the annotated text and
  ``info``: ``steps``, ``uses`` (the graph), ``registers``, ``max_live`` (graph pressure),
  ``peak_resident`` / ``mean_resident`` (steps not yet killed, over the steps), ``evicted``
  (killed step indices), ``merged`` (spilled steps), ``step_chars`` (characters per step).

  Raises:
    ValueError: K < 1 or an unknown ``spill`` (construction only).
  """

  name = "tip_gsm8k"

  def __init__(self, num_registers: int = DEFAULT_NUM_REGISTERS, spill: str = "merge"):
    if num_registers < 1:
      raise ValueError(f"num_registers must be >= 1, got {num_registers}")
    if spill not in ("merge", "reject"):
      raise ValueError(f"spill={spill!r} must be 'merge' or 'reject'")
    self.num_registers = int(num_registers)
    self.spill = spill

  def annotate(self, prompt: str, response: str) -> Annotation:
    steps = split_steps(response or "")
    uses, final = gsm8k_dependences(prompt or "", steps)
    if final is None:
      return Annotation(None, info={"rejected": "no '#### N' final answer line"})
    return annotate_with_graph(steps, uses, final, self.num_registers, self.spill)


def annotate_with_graph(steps: list[str], uses: list[set[int]], final: int,
                        num_registers: int, spill: str = "merge") -> Annotation:
  """Allocate registers for a given graph and tag the steps (shared by the TIP annotators).

  Steps after ``final`` are kept too. Never raises on register pressure: returns
  ``Annotation(None, info={"rejected": ...})``.
  """
  keep = range(final, len(steps))
  try:
    alloc = linear_scan(uses, num_registers, keep=keep, spill=spill)
  except RegisterPressureError as e:
    return Annotation(None, info={"rejected": str(e), "steps": len(steps)})
  res = alloc.resident
  info: dict[str, Any] = {
    "steps": len(steps), "uses": [sorted(u) for u in uses], "registers": list(alloc.registers),
    "max_live": alloc.max_live, "peak_resident": max(res, default=0),
    "mean_resident": sum(res) / max(len(res), 1), "evicted": list(alloc.evicted),
    "merged": list(alloc.merged), "step_chars": [len(s) for s in steps],
  }
  return Annotation(tag_steps(steps, alloc.registers), info=info)
