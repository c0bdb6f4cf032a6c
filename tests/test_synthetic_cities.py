"""Synthetic cities task: seeded generation, annotation, exact-match scoring."""

import pytest

from selforch_jax.data.synthetic_cities import (
  annotate, city_sentence, generate_split, score_answer,
)


def test_seeded_and_k_range():
  a, b = generate_split(50, seed=3), generate_split(50, seed=3)
  assert a == b and a != generate_split(50, seed=4)
  ks = {len(e["cities"]) for e in a}
  assert ks <= set(range(2, 7)) and len(ks) > 2
  for e in a:
    for c in e["cities"]:
      assert c["name"] in e["prompt"] and str(c["year"]) in e["prompt"]


def test_score_answer():
  e = generate_split(1, seed=0)[0]
  assert score_answer(e, e["answer"])["answer_correct"]
  wrong = e["answer"].replace(str(e["cities"][0]["year"]), "1")
  s = score_answer(e, wrong)
  assert not s["answer_correct"] and s["items_correct"] == s["items"] - 1


def test_annotate_one_promise_and_chunk_per_city():
  e = generate_split(1, seed=1)[0]
  tagged = annotate(e, lambda s: len(s.split()))
  k = len(e["cities"])
  assert tagged.count("<promise>") == k == tagged.count("<async>") and tagged.endswith("<sync/>")
  assert all(city_sentence(c) in tagged for c in e["cities"])


def test_bad_k():
  with pytest.raises(ValueError, match="min_k"):
    generate_split(1, seed=0, min_k=3, max_k=2)
