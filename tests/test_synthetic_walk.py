"""The synthetic walk task (selforch_jax.data.synthetic_walk): determinism, gold answers and every
line's arithmetic checked by re-reading the text, the two-register allocation, dataset files."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from selforch_jax.data.sources import load_examples
from selforch_jax.data.synthetic_walk import (
  SPLIT_SEEDS, SPLIT_SIZES, WalkSpec, generate_walk_split, walk_values,
)
from selforch_jax.lang.registers import check_allocation, kills

REPO = pathlib.Path(__file__).resolve().parents[1]
QUESTION = re.compile(r"x0 = (\d+)\. Add (\d+) per step, mod (\d+)\. What is x(\d+) \+ (\d+)\?")
LINE = re.compile(r"x(\d+) = (\d+) \+ (\d+) = (\d+)(?: - (\d+) = (\d+))?")


def test_same_seed_same_rows_other_seed_differs():
  assert generate_walk_split(30, 3) == generate_walk_split(30, 3)
  other = generate_walk_split(30, 4)
  assert sum(a != b for a, b in zip(generate_walk_split(30, 3), other)) > 25


@pytest.mark.parametrize("spec", [WalkSpec(), WalkSpec(min_steps=3, max_steps=5, min_modulus=10,
                                                       max_modulus=12, max_add=9, num_registers=2)])
def test_gold_answers_lines_and_tags(spec):
  for row in generate_walk_split(200, 7, spec):
    start, add, mod, steps, offset = map(int, QUESTION.fullmatch(row["question"]).groups())
    assert spec.min_steps <= steps <= spec.max_steps and spec.min_modulus <= mod <= spec.max_modulus
    x = start
    for _ in range(steps):                       # the rule, independently of the generator
      x = x + add - mod if x + add >= mod else x + add
    assert row["answer"] == str(x + offset) and x == walk_values(start, add, mod, steps)[-1]
    lines = row["solution"].split("\n")
    assert len(lines) == steps + 2 and lines[-1] == f"#### {x + offset}"
    assert lines[-2] == f"x{steps} + {offset} = {x} + {offset} = {x + offset}"
    prev = start
    for k, line in enumerate(lines[:steps], 1):  # each line reads the previous value only
      m = LINE.fullmatch(line)
      assert m and int(m[1]) == k and int(m[2]) == prev and int(m[3]) == add
      assert int(m[4]) == prev + add
      prev = int(m[6]) if m[5] else int(m[4])
      assert (m[5] is not None) == (prev + mod == int(m[4])) and 0 <= prev < mod
    assert re.sub(r"<reg_\d+>", "", row["annotated"]) == row["solution"]
    assert row["uses"] == [[]] + [[k] for k in range(steps + 1)]
    assert check_allocation(row["uses"], row["registers"], keep=[steps + 1],
                            num_registers=spec.num_registers) == []
    # two registers alternate: the tag of step i + 2 kills step i; the last two are never killed
    assert set(row["registers"]) == {0, 1}
    assert list(kills(row["registers"])) == [i + 2 for i in range(steps)] + [None, None]


def test_spec_validation():
  with pytest.raises(ValueError, match="min_steps"):
    WalkSpec(min_steps=10, max_steps=5)
  with pytest.raises(ValueError, match="max_add"):
    WalkSpec(max_add=30)
  with pytest.raises(ValueError, match="num_registers"):
    WalkSpec(num_registers=1)


def test_dataset_files_match_the_generator_and_load():
  for split, seed in SPLIT_SEEDS.items():
    rows = [json.loads(l) for l in (REPO / f"data/synthetic_walk/{split}.jsonl").open()]
    assert len(rows) == SPLIT_SIZES[split]
    assert rows[:20] == generate_walk_split(20, seed)
  ex = load_examples("synthetic_walk", split="test", max_examples=3)
  assert ex[0]["messages"][0]["content"] == rows[0]["question"]
  assert ex[0]["messages"][1]["content"] == rows[0]["annotated"]
  assert ex[0]["answer"] == rows[0]["answer"]
  train_q = {json.loads(l)["question"] for l in (REPO / "data/synthetic_walk/train.jsonl").open()}
  assert sum(r["question"] in train_q for r in rows) < 5
