r"""A synthetic multi-step task with known dependence graphs, for TIP (issue 6, DESIGN.md §6).

Chained arithmetic over named variables, where many intermediate values die early::

  question:  a = 3. b = a + 4. c = 7. d = c * 2. e = b + d. What is e?
  solution:  a = 3
             b = a + 4 = 3 + 4 = 7
             c = 7
             d = c * 2 = 7 * 2 = 14
             e = b + d = 7 + 14 = 21
             #### 21

The question states every definition; the solution computes one variable per line (a **step**),
so a step needs exactly the steps that computed its operands: the **gold dependence graph**. The
final ``#### v`` step uses the queried (last) variable and is kept alive; registers come from
:func:`selforch_jax.lang.registers.linear_scan`. Operands are drawn from the ``window`` most recent
variables, so most values die a few steps after they are written, and some are never used.

Difficulty knobs (:class:`ChainSpec`): ``num_vars``, ``fan_in`` (max operands of an operation),
``max_value`` (every value stays in ``[0, max_value]``, small integers that a 135M model can add),
``p_const`` (share of constant definitions after the first), ``window``, ``num_registers`` K.

Files for the data pipeline (``DATASETS["synthetic_chain"]`` in :mod:`selforch_jax.data.sources`)::

  python -m selforch_jax.data.synthetic_chain --out=data/synthetic_chain

writes ``train.jsonl`` (2000 problems, seed 0) and ``test.jsonl`` (500 problems, seed 1) with the
default spec; each row holds ``question``, ``solution`` (dense), ``annotated`` (register tags),
``answer`` (int, as a string), ``uses`` (gold graph) and ``registers``.
"""

from __future__ import annotations

import dataclasses
import json
import string
from typing import Any

import numpy as np

from selforch_jax.lang.registers import linear_scan, tag_steps

__all__ = ["ChainSpec", "ChainProblem", "generate_problem", "generate_split", "evaluate_chain",
           "chain_to_messages", "SPLIT_SEEDS", "SPLIT_SIZES"]

SPLIT_SEEDS = {"train": 0, "test": 1}
SPLIT_SIZES = {"train": 2000, "test": 500}
_OPS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class ChainSpec:
  """Difficulty knobs of the synthetic chain task.

  Attributes:
    num_vars: variables (steps before the ``####`` step), 2..26.
    fan_in: max operands of an operation (1..3; an operation with one operand also has a constant).
    max_value: values stay in ``[0, max_value]`` (>= 9).
    p_const: probability that a definition after the first is a constant.
    window: operands come from the ``window`` most recent variables (>= 1).
    num_registers: K for the annotated solution (>= 1).

  Raises:
    ValueError: a knob out of range (naming it).
  """

  num_vars: int = 8
  fan_in: int = 2
  max_value: int = 50
  p_const: float = 0.3
  window: int = 3
  num_registers: int = 8

  def __post_init__(self):
    check_knobs(self, num_vars=2 <= self.num_vars <= 26, fan_in=1 <= self.fan_in <= 3,
                max_value=self.max_value >= 9, p_const=0 <= self.p_const < 1,
                window=self.window >= 1, num_registers=self.num_registers >= 1)


@dataclasses.dataclass(frozen=True)
class ChainProblem:
  """One generated problem.

  Attributes:
    names: variable names in definition order.
    defs: per variable, ``("const", value)`` or ``("op", operands: tuple[str|int, ...],
      ops: tuple[str, ...])`` (operands are variable names or int constants, applied left to right).
    values: per variable, its value (int).
    question, solution (dense, no tags), annotated (``<reg_k>`` tags), answer (int).
    uses: gold dependence graph over the steps (variables, then the ``####`` step).
    registers: per step, its register (None = merged, see :mod:`selforch_jax.lang.registers`).
  """

  names: tuple[str, ...]
  defs: tuple[tuple, ...]
  values: tuple[int, ...]
  question: str
  solution: str
  annotated: str
  answer: int
  uses: tuple[tuple[int, ...], ...]
  registers: tuple[int | None, ...]

  def to_row(self) -> dict[str, Any]:
    """JSON row (see the module docstring)."""
    return {"question": self.question, "solution": self.solution, "annotated": self.annotated,
            "answer": str(self.answer), "uses": [list(u) for u in self.uses],
            "registers": list(self.registers)}


def check_knobs(spec, **ok: bool) -> None:
  """Raises ``ValueError`` naming the first knob of ``spec`` (a task spec dataclass) whose check
  in ``ok`` (knob name -> in range) is False."""
  for name, good in ok.items():
    if not good:
      raise ValueError(f"{type(spec).__name__}.{name}={getattr(spec, name)!r} is out of range")


def _apply(a: int, op: str, b: int) -> int:
  return a + b if op == "+" else a - b if op == "-" else a * b


def evaluate_chain(defs, names) -> list[int]:
  """Values of the variables by evaluating the definitions left to right (independent of the
  generator's bookkeeping; tests use it to check the gold answer).

  Raises:
    KeyError: an operand names an undefined variable.
  """
  env: dict[str, int] = {}
  out = []
  for name, d in zip(names, defs):
    if d[0] == "const":
      v = int(d[1])
    else:
      operands, ops = d[1], d[2]
      val = lambda x: env[x] if isinstance(x, str) else int(x)  # noqa: E731
      v = val(operands[0])
      for op, x in zip(ops, operands[1:]):
        v = _apply(v, op, val(x))
    env[name] = v
    out.append(v)
  return out


def _expr(operands, ops) -> str:
  """Left-to-right evaluation written with parentheses: ``(a + b) * c``."""
  out = str(operands[0])
  for k, (op, x) in enumerate(zip(ops, operands[1:])):
    out = f"({out} {op} {x})" if k < len(ops) - 1 else f"{out} {op} {x}"
  return out


def generate_problem(rng: np.random.Generator, spec: ChainSpec = ChainSpec()) -> ChainProblem:
  """One problem drawn with ``rng`` (deterministic given its state and ``spec``).

  Each operation draws 1..fan_in distinct variable operands from the window (plus one constant
  when it has a single variable operand) and, operand by operand, an operator that keeps the
  running value in ``[0, max_value]`` (``+`` / ``-`` / ``*`` where they fit; ``-`` always fits when
  the running value is at least the operand, else ``+`` with a smaller constant is used).
  The last variable is always an operation (the queried value depends on earlier steps).
  """
  names = tuple(string.ascii_lowercase[:spec.num_vars])
  hi = spec.max_value
  defs, values, uses = [], [], []
  for j, name in enumerate(names):
    last = j == spec.num_vars - 1
    if j == 0 or (not last and rng.random() < spec.p_const):
      v = int(rng.integers(1, 10))
      defs.append(("const", v))
      values.append(v)
      uses.append(())
      continue
    lo = max(0, j - spec.window)
    k = int(rng.integers(1, min(spec.fan_in, j - lo) + 1))
    picked = sorted(int(i) for i in rng.choice(np.arange(lo, j), size=k, replace=False))
    operands: list[Any] = [names[i] for i in picked]
    vals = [values[i] for i in picked]
    if k == 1:
      c = int(rng.integers(1, 10))
      operands.append(c)
      vals.append(c)
    acc, ops, kept = vals[0], [], [operands[0]]
    for name_or_c, x in zip(operands[1:], vals[1:]):
      fits = [op for op in _OPS if 0 <= _apply(acc, op, x) <= hi
              and not (op == "*" and (x <= 1 or acc <= 1))]
      if not fits:  # acc < x and acc + x > max_value: leave this operand out
        continue
      op = str(rng.choice(fits))
      ops.append(op)
      kept.append(name_or_c)
      acc = _apply(acc, op, x)
    if not ops:  # a lone variable: add a constant that fits (value 0 + c, or v - c)
      c = int(rng.integers(1, 10))
      op = "+" if acc + c <= hi else "-"
      ops.append(op)
      kept.append(c)
      acc = _apply(acc, op, c)
    operands = kept
    picked = [i for i in picked if names[i] in kept]
    defs.append(("op", tuple(operands), tuple(ops)))
    values.append(acc)
    uses.append(tuple(picked))
  assert values == evaluate_chain(defs, names)
  q_defs = [f"{n} = {d[1]}." if d[0] == "const" else f"{n} = {_expr(d[1], d[2])}."
            for n, d in zip(names, defs)]
  question = " ".join(q_defs) + f" What is {names[-1]}?"
  steps = []
  for n, d, v in zip(names, defs, values):
    if d[0] == "const":
      steps.append(f"{n} = {v}\n")
    else:
      shown = [values[names.index(x)] if isinstance(x, str) else x for x in d[1]]
      steps.append(f"{n} = {_expr(d[1], d[2])} = {_expr(shown, d[2])} = {v}\n")
  steps.append(f"#### {values[-1]}")
  all_uses = uses + [(spec.num_vars - 1,)]
  alloc = linear_scan(all_uses, spec.num_registers, keep=[spec.num_vars])
  return ChainProblem(names=names, defs=tuple(defs), values=tuple(values), question=question,
                      solution="".join(steps), annotated=tag_steps(steps, alloc.registers),
                      answer=values[-1], uses=tuple(tuple(u) for u in all_uses),
                      registers=alloc.registers)


def generate_split(n: int, seed: int, spec: ChainSpec = ChainSpec()) -> list[ChainProblem]:
  """``n`` problems from ``np.random.default_rng(seed)`` (same arguments, same problems)."""
  rng = np.random.default_rng(seed)
  return [generate_problem(rng, spec) for _ in range(n)]


def chain_to_messages(row: dict[str, Any]) -> dict[str, Any]:
  """Data-pipeline converter of a ``synthetic_chain`` row: user = question, assistant = the
  register-annotated solution (``data.strip_tags`` gives the dense baseline), ``answer`` = the
  final value.

  Raises:
    KeyError: a row without ``question``, ``annotated`` or ``answer``.
  """
  return {"messages": [{"role": "user", "content": row["question"]},
                       {"role": "assistant", "content": row["annotated"]}],
          "answer": str(row["answer"])}


def main(argv=None) -> None:
  """Write ``train.jsonl`` / ``test.jsonl`` of the default spec (module docstring command)."""
  import argparse
  import os

  ap = argparse.ArgumentParser(description=main.__doc__)
  ap.add_argument("--out", default="data/synthetic_chain")
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  for split, seed in SPLIT_SEEDS.items():
    with open(os.path.join(a.out, f"{split}.jsonl"), "w") as f:
      for p in generate_split(SPLIT_SIZES[split], seed):
        f.write(json.dumps(p.to_row()) + "\n")


if __name__ == "__main__":
  main()
