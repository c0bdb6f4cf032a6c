r"""A synthetic long-trace task with a short prompt, for TIP's live-KV target (issue 6, DESIGN.md §6).

A walk: the question is one line, the solution is a long chain of steps where each value is
read only by the next step (its live range ends there; the tag two steps later evicts it)::

  question:  x0 = 5. Add 7 per step. What is x16 + 4?
  solution:  x1 = 5 + 7 = 12
             x2 = 12 + 7 = 19
             ...
             x16 = 110 + 7 = 117
             x16 + 4 = 117 + 4 = 121
             #### 121

Step ``k`` (``x{k+1}``) reads only step ``k-1`` (``x1`` reads ``x0`` from the question, which is
never evicted); the sum step reads the last ``x`` and the question's offset; ``#### v`` reads the
sum step and is kept alive. So two registers alternate along the walk, and TIP's live KV stays at
about the prompt plus two lines, while a dense cache grows with the whole trace. The offset
``+ c`` sits in the question only: a policy that drops the prompt's middle (StreamingLLM's
sinks + recent window) loses it by the last line. The synthetic chain task
(:mod:`selforch_jax.data.synthetic_chain`) states every definition in its prompt, which caps
the reduction there well below 50% (its reference annotations give about 18%). A first version of
this task wrapped the values modulo a number from the question; SmolLM2-135M did not learn the
wrap-around in 160 LoRA steps (dense 0.07, TIP 0.055 exact match, n=200), so the walk only adds.

The solution has ``steps + 2`` steps: the walk, the sum step and ``#### v``. The offset ``c`` is
drawn from 1..9. Knobs (:class:`WalkSpec`): ``min_steps`` / ``max_steps`` (walk length, drawn uniformly),
``max_start`` (``x0`` in ``[0, max_start]``), ``max_add`` (addend in
``[2, max_add]``), ``num_registers`` K.

Files for the data pipeline (``DATASETS["synthetic_walk"]``; rows in the same format as
``synthetic_chain``, so :func:`~selforch_jax.data.synthetic_chain.chain_to_messages` converts them)::

  python -m selforch_jax.data.synthetic_walk --out=data/synthetic_walk

writes ``train.jsonl`` (2000 problems, seed 0) and ``test.jsonl`` (500 problems, seed 1, none
of them a training question).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from selforch_jax.data.synthetic_chain import check_knobs
from selforch_jax.lang.registers import linear_scan, tag_steps

__all__ = ["WalkSpec", "generate_walk", "generate_walk_split", "walk_values", "SPLIT_SEEDS",
           "SPLIT_SIZES"]

SPLIT_SEEDS = {"train": 0, "test": 1}
SPLIT_SIZES = {"train": 2000, "test": 500}


@dataclasses.dataclass(frozen=True)
class WalkSpec:
  """Knobs of the walk task.

  Attributes:
    min_steps, max_steps: walk length range (inclusive, 2 <= min <= max).
    max_start: ``x0`` is drawn from ``[0, max_start]``.
    max_add: the addend is drawn from ``[2, max_add]`` (>= 2).
    num_registers: K for the annotated solution (>= 2: the walk keeps two steps live).

  Raises:
    ValueError: a knob out of range (naming it).
  """

  min_steps: int = 12
  max_steps: int = 16
  max_start: int = 60
  max_add: int = 9
  num_registers: int = 8

  def __post_init__(self):
    check_knobs(self, min_steps=2 <= self.min_steps <= self.max_steps,
                max_start=self.max_start >= 0, max_add=self.max_add >= 2,
                num_registers=self.num_registers >= 2)


def walk_values(start: int, add: int, steps: int) -> list[int]:
  """``[x0, x1, ..., x_steps]`` with ``x_{k+1} = x_k + add`` (the question's rule)."""
  return [start + k * add for k in range(steps + 1)]


def generate_walk(rng: np.random.Generator, spec: WalkSpec = WalkSpec()) -> dict[str, Any]:
  """One problem drawn with ``rng`` (deterministic given its state and ``spec``), as a row:
  ``question``, ``solution`` (dense), ``annotated`` (``<reg_k>`` tags), ``answer`` (string),
  ``uses`` (gold dependence graph over the steps) and ``registers`` (per step).
  """
  steps = int(rng.integers(spec.min_steps, spec.max_steps + 1))
  add = int(rng.integers(2, spec.max_add + 1))
  start = int(rng.integers(0, spec.max_start + 1))
  offset = int(rng.integers(1, 10))
  xs = walk_values(start, add, steps)
  question = f"x0 = {start}. Add {add} per step. What is x{steps} + {offset}?"
  # every line restates the addend, so a step needs only the step before it
  lines = [f"x{k} = {xs[k - 1]} + {add} = {xs[k]}\n" for k in range(1, steps + 1)]
  answer = xs[-1] + offset
  lines.append(f"x{steps} + {offset} = {xs[-1]} + {offset} = {answer}\n")
  lines.append(f"#### {answer}")
  uses = [()] + [(k - 1,) for k in range(1, steps + 1)] + [(steps,)]
  alloc = linear_scan(uses, spec.num_registers, keep=[steps + 1])
  return {"question": question, "solution": "".join(lines),
          "annotated": tag_steps(lines, alloc.registers), "answer": str(answer),
          "uses": [list(u) for u in uses], "registers": list(alloc.registers)}


def generate_walk_split(n: int, seed: int, spec: WalkSpec = WalkSpec(),
                        exclude: frozenset[str] | set[str] = frozenset()) -> list[dict[str, Any]]:
  """``n`` rows with distinct questions, none in ``exclude``, drawn from
  ``np.random.default_rng(seed)`` (same arguments, same rows). The task has a small space
  (about 22k questions by default), so the test split excludes the training questions.

  Raises:
    ValueError: fewer than ``n`` new questions turned up in ``100 * n`` draws (the spec's
      space is too small).
  """
  rng = np.random.default_rng(seed)
  rows, seen = [], set(exclude)
  for _ in range(100 * n):
    if len(rows) == n:
      break
    row = generate_walk(rng, spec)
    if row["question"] not in seen:
      seen.add(row["question"])
      rows.append(row)
  if len(rows) < n:
    raise ValueError(f"only {len(rows)} of {n} distinct new questions in {100 * n} draws: "
                     "widen the WalkSpec")
  return rows


def main(argv=None) -> None:
  """Write ``train.jsonl`` / ``test.jsonl`` of the default spec (module docstring command)."""
  import argparse
  import os

  ap = argparse.ArgumentParser(description=main.__doc__)
  ap.add_argument("--out", default="data/synthetic_walk")
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  train = generate_walk_split(SPLIT_SIZES["train"], SPLIT_SEEDS["train"])
  test = generate_walk_split(SPLIT_SIZES["test"], SPLIT_SEEDS["test"],
                             exclude={r["question"] for r in train})
  for split, rows in (("train", train), ("test", test)):
    with open(os.path.join(a.out, f"{split}.jsonl"), "w") as f:
      for row in rows:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
