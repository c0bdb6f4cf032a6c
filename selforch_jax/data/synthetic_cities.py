"""A checkable parallel task for Planned Diffusion / PASTA (issue 21): k independent cities.

The prompt lists k = 2..6 fictional cities with seeded random attributes (country, river,
founding year, population); the answer describes each city in one fixed-form sentence, in prompt
order. Every city is one promise and one chunk in the annotated form::

  prompt:  Describe each city. Velora: country Marand, river Tesk, founded 1412, population 38200.
           Quenbar: ...
  answer:  Velora is a city in Marand on the river Tesk, founded in 1412, with 38200 people.
           Quenbar is ...

Exact-match scoring (:func:`score_answer`): an item is correct iff its sentence appears verbatim
in the (de-tagged) answer; an answer is correct iff all its items are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from selforch_jax.lang.tags import (
  ASYNC_CLOSE, ASYNC_OPEN, PROMISE_CLOSE, PROMISE_OPEN, SYNC, TOKENS_PER_UNIT,
)

__all__ = ["city_sentence", "generate_example", "generate_split", "annotate", "score_answer"]

_SYL = ("ve", "lo", "ra", "quen", "bar", "tes", "ka", "mar", "and", "ori", "sel", "dun", "pha",
        "zim", "tor", "ul", "ny", "gal", "bre", "hos")


def _name(rng: np.random.Generator, parts: int) -> str:
  return "".join(rng.choice(_SYL) for _ in range(parts)).capitalize()


def city_sentence(city: dict[str, Any]) -> str:
  """The fixed-form answer sentence of one city dict (keys name, country, river, year, pop)."""
  return (f"{city['name']} is a city in {city['country']} on the river {city['river']}, "
          f"founded in {city['year']}, with {city['pop']} people.")


def generate_example(rng: np.random.Generator, min_k: int = 2, max_k: int = 6) -> dict[str, Any]:
  """One example: {"prompt", "answer", "cities"} with k ~ U{min_k..max_k} distinct cities.

  Raises:
    ValueError: not 1 <= min_k <= max_k.
  """
  if not 1 <= min_k <= max_k:
    raise ValueError(f"generate_example: need 1 <= min_k <= max_k, got {min_k}, {max_k}")
  k = int(rng.integers(min_k, max_k + 1))
  cities, names = [], set()
  while len(cities) < k:
    name = _name(rng, 3)
    if name in names:
      continue
    names.add(name)
    cities.append({"name": name, "country": _name(rng, 2), "river": _name(rng, 2),
                   "year": int(rng.integers(800, 2000)), "pop": int(rng.integers(1, 999)) * 100})
  facts = " ".join(f"{c['name']}: country {c['country']}, river {c['river']}, founded {c['year']}, "
                   f"population {c['pop']}." for c in cities)
  return {"prompt": f"Describe each city. {facts}",
          "answer": " ".join(city_sentence(c) for c in cities), "cities": cities}


def generate_split(n: int, seed: int, min_k: int = 2, max_k: int = 6) -> list[dict[str, Any]]:
  """n examples from ``np.random.default_rng(seed)`` (train and eval use different seeds)."""
  rng = np.random.default_rng(seed)
  return [generate_example(rng, min_k, max_k) for _ in range(n)]


def annotate(example: dict[str, Any], count_tokens: Callable[[str], int]) -> str:
  """The tagged answer: one promise per city (topic = name, length in units of
  TOKENS_PER_UNIT tokens, rounded up), one chunk per city, then ``<sync/>``.

  Args:
    example: from :func:`generate_example`.
    count_tokens: the tokenizer's token count of a string.
  """
  plan, chunks = [], []
  for c in example["cities"]:
    s = city_sentence(c)
    units = max(1, math.ceil(count_tokens(" " + s) / TOKENS_PER_UNIT))
    plan.append(f"{PROMISE_OPEN} {c['name']} {units} {PROMISE_CLOSE}")
    chunks.append(f"{ASYNC_OPEN} {s}{ASYNC_CLOSE}")
  return "".join(plan) + "".join(chunks) + SYNC


def score_answer(example: dict[str, Any], answer: str) -> dict[str, Any]:
  """Exact match: {"items_correct", "items", "answer_correct"} for a de-tagged answer string."""
  hits = [city_sentence(c) in answer for c in example["cities"]]
  return {"items_correct": int(sum(hits)), "items": len(hits), "answer_correct": all(hits)}
