r"""A synthetic long-trace task with a short prompt, for TIP's live-KV target (issue 6, DESIGN.md §6).

A modular walk: the question is one line, the solution is a long chain of steps where each value
dies as soon as the next one is written::

  question:  x0 = 5. Add 7 per step, mod 30. What is x16 + 4?
  solution:  x1 = 5 + 7 = 12
             x2 = 12 + 7 = 19
             ...
             x4 = 26 + 7 = 33 - 30 = 3
             ...
             x16 + 4 = 13 + 4 = 17
             #### 17

Step ``k`` (``x{k+1}``) reads only step ``k-1`` (``x1`` reads ``x0`` from the question, which is
never evicted); the sum step reads the last ``x`` and the question's offset; ``#### v`` reads the
sum step and is kept alive. So two registers alternate along the walk, and TIP's live KV stays at
about the prompt plus two lines, while a dense cache grows with the whole trace. The offset
``+ c`` sits in the question only: a policy that drops the prompt's middle (StreamingLLM's
sinks + recent window) loses it by the last line. The synthetic chain task
(:mod:`selforch_jax.data.synthetic_chain`) states every definition in its prompt, which caps
the reduction there well below 50% (its reference annotations give about 18%).

Knobs (:class:`WalkSpec`): ``min_steps`` / ``max_steps`` (walk length, drawn uniformly),
``min_modulus`` / ``max_modulus`` (values stay in ``[0, modulus)``), ``max_add`` (addend in
``[2, max_add]``), ``num_registers`` K.

Files for the data pipeline (``DATASETS["synthetic_walk"]``; rows in the same format as
``synthetic_chain``, so :func:`~selforch_jax.data.synthetic_chain.chain_to_messages` converts them)::

  python -m selforch_jax.data.synthetic_walk --out=data/synthetic_walk

writes ``train.jsonl`` (2000 problems, seed 0) and ``test.jsonl`` (500 problems, seed 1).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

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
    min_modulus, max_modulus: modulus range (inclusive, 10 <= min <= max <= 99).
    max_add: the addend is drawn from ``[2, max_add]`` (2 <= max_add < min_modulus).
    num_registers: K for the annotated solution (>= 2: the walk keeps two steps live).

  Raises:
    ValueError: a knob out of range (naming it).
  """

  min_steps: int = 12
  max_steps: int = 16
  min_modulus: int = 20
  max_modulus: int = 60
  max_add: int = 9
  num_registers: int = 8

  def __post_init__(self):
    for name, ok in (("min_steps", 2 <= self.min_steps <= self.max_steps),
                     ("min_modulus", 10 <= self.min_modulus <= self.max_modulus <= 99),
                     ("max_add", 2 <= self.max_add < self.min_modulus),
                     ("num_registers", self.num_registers >= 2)):
      if not ok:
        raise ValueError(f"WalkSpec.{name}={getattr(self, name)!r} is out of range")


def walk_values(start: int, add: int, modulus: int, steps: int) -> list[int]:
  """``[x0, x1, ..., x_steps]`` with ``x_{k+1} = (x_k + add) mod modulus`` (the question's rule;
  tests check the generated solutions against it)."""
  xs = [start]
  for _ in range(steps):
    xs.append((xs[-1] + add) % modulus)
  return xs


def generate_walk(rng: np.random.Generator, spec: WalkSpec = WalkSpec()) -> dict[str, Any]:
  """One problem drawn with ``rng`` (deterministic given its state and ``spec``), as a row:
  ``question``, ``solution`` (dense), ``annotated`` (``<reg_k>`` tags), ``answer`` (string),
  ``uses`` (gold dependence graph over the steps) and ``registers`` (per step).
  """
  steps = int(rng.integers(spec.min_steps, spec.max_steps + 1))
  modulus = int(rng.integers(spec.min_modulus, spec.max_modulus + 1))
  add = int(rng.integers(2, spec.max_add + 1))
  start = int(rng.integers(0, modulus))
  offset = int(rng.integers(1, 10))
  xs = walk_values(start, add, modulus, steps)
  question = f"x0 = {start}. Add {add} per step, mod {modulus}. What is x{steps} + {offset}?"
  lines = []
  for k in range(1, steps + 1):
    s = xs[k - 1] + add
    wrap = f" - {modulus} = {xs[k]}" if s >= modulus else ""
    lines.append(f"x{k} = {xs[k - 1]} + {add} = {s}{wrap}\n")
  answer = xs[-1] + offset
  lines.append(f"x{steps} + {offset} = {xs[-1]} + {offset} = {answer}\n")
  lines.append(f"#### {answer}")
  uses = [()] + [(k - 1,) for k in range(1, steps + 1)] + [(steps,)]
  alloc = linear_scan(uses, spec.num_registers, keep=[steps + 1])
  return {"question": question, "solution": "".join(lines),
          "annotated": tag_steps(lines, alloc.registers), "answer": str(answer),
          "uses": [list(u) for u in uses], "registers": list(alloc.registers)}


def generate_walk_split(n: int, seed: int, spec: WalkSpec = WalkSpec()) -> list[dict[str, Any]]:
  """``n`` rows from ``np.random.default_rng(seed)`` (same arguments, same rows)."""
  rng = np.random.default_rng(seed)
  return [generate_walk(rng, spec) for _ in range(n)]


def main(argv=None) -> None:
  """Write ``train.jsonl`` / ``test.jsonl`` of the default spec (module docstring command)."""
  import argparse
  import os

  ap = argparse.ArgumentParser(description=main.__doc__)
  ap.add_argument("--out", default="data/synthetic_walk")
  a = ap.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  for split, seed in SPLIT_SEEDS.items():
    with open(os.path.join(a.out, f"{split}.jsonl"), "w") as f:
      for row in generate_walk_split(SPLIT_SIZES[split], seed):
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
  main()
