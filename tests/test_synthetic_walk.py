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
QUESTION = re.compile(r"x0 = (\d+)\. Add (\d+) per step\. What is x(\d+) \+ (\d+)\?")
LINE = re.compile(r"x(\d+) = (\d+) \+ (\d+) = (\d+)")


def test_same_seed_same_rows_other_seed_differs():
  assert generate_walk_split(30, 3) == generate_walk_split(30, 3)
  other = generate_walk_split(30, 4)
  assert sum(a != b for a, b in zip(generate_walk_split(30, 3), other)) > 25


@pytest.mark.parametrize("spec", [WalkSpec(), WalkSpec(min_steps=3, max_steps=5, max_start=20,
                                                       max_add=2, num_registers=2)])
def test_gold_answers_lines_and_tags(spec):
  for row in generate_walk_split(200, 7, spec):
    start, add, steps, offset = map(int, QUESTION.fullmatch(row["question"]).groups())
    assert spec.min_steps <= steps <= spec.max_steps and 0 <= start <= spec.max_start
    assert 2 <= add <= spec.max_add and 1 <= offset <= 9
    x = start
    for _ in range(steps):                       # the rule, independently of the generator
      x += add
    assert row["answer"] == str(x + offset) and x == walk_values(start, add, steps)[-1]
    lines = row["solution"].split("\n")
    assert len(lines) == steps + 2 and lines[-1] == f"#### {x + offset}"
    assert lines[-2] == f"x{steps} + {offset} = {x} + {offset} = {x + offset}"
    prev = start
    for k, line in enumerate(lines[:steps], 1):  # each line reads the previous value only
      m = LINE.fullmatch(line)
      assert m and int(m[1]) == k and int(m[2]) == prev and int(m[3]) == add   # addend restated
      assert int(m[4]) == prev + add
      prev = int(m[4])
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
    WalkSpec(max_add=1)
  with pytest.raises(ValueError, match="max_start"):
    WalkSpec(max_start=-1)
  with pytest.raises(ValueError, match="num_registers"):
    WalkSpec(num_registers=1)


def test_dataset_files_match_the_generator_and_load():
  train = [json.loads(l) for l in (REPO / "data/synthetic_walk/train.jsonl").open()]
  rows = [json.loads(l) for l in (REPO / "data/synthetic_walk/test.jsonl").open()]
  assert train == generate_walk_split(SPLIT_SIZES["train"], SPLIT_SEEDS["train"])
  assert rows == generate_walk_split(SPLIT_SIZES["test"], SPLIT_SEEDS["test"],
                                     exclude={r["question"] for r in train})
  ex = load_examples("synthetic_walk", split="test", max_examples=3)
  assert ex[0]["messages"][0]["content"] == rows[0]["question"]
  assert ex[0]["messages"][1]["content"] == rows[0]["annotated"]
  assert ex[0]["answer"] == rows[0]["answer"]
  train_q = {r["question"] for r in train}
  assert len(train_q) == len(train) and len({r["question"] for r in rows}) == len(rows)
  assert not any(r["question"] in train_q for r in rows)   # no test question is a training one


def test_a_space_too_small_for_n_distinct_questions_fails_clearly():
  tiny = WalkSpec(min_steps=2, max_steps=2, max_start=0, max_add=2)   # 9 questions in all
  assert len(generate_walk_split(9, 0, tiny)) == 9
  with pytest.raises(ValueError, match="distinct new questions"):
    generate_walk_split(10, 0, tiny)
