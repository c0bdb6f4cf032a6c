"""Planned Diffusion training data for the synthetic cities task (issue 21): chat JSONL records
whose assistant turn is the tagged answer (:func:`selforch_jax.data.synthetic_cities.annotate`:
one promise and one chunk per city, then ``<sync/>``), with upstream's stochastic padding
(planned-diffusion ``train/pad.py``: 0-10 ``[PAD]`` tokens, uniform, appended inside every chunk
before ``</async>``; ``pad=False`` leaves it out: PASTA's records of the same task, whose chunks
are decoded autoregressively and end at ``</async>``) and the ablations of upstream's trainer:
``no_topic`` (every topic becomes ``topic k``, ``--ablate_topic``) and ``no_sync`` (no
``<sync/>``: the round ends the answer, ``--ablate_sync``).

Padding is drawn once per record from ``(seed, index)`` (upstream draws it per sample in its
collator); the record set is a pure function of its arguments, so the cache file is rebuilt
only when they change (:func:`ensure_cities_data`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from selforch_jax.data import synthetic_cities
from selforch_jax.lang.tags import ASYNC_CLOSE, PAD, PROMISE_CLOSE, PROMISE_OPEN, SYNC

__all__ = ["cities_records", "ensure_cities_data", "MAX_PAD"]

MAX_PAD = 10   # upstream: randint(0, 11)


def _tagged(example: dict[str, Any], count_tokens: Callable[[str], int], rng: np.random.Generator,
            no_topic: bool, no_sync: bool, pad: bool = True) -> str:
  text = synthetic_cities.annotate(example, count_tokens)
  if pad:
    text = text.replace(ASYNC_CLOSE, "\0")
    parts = text.split("\0")
    text = "".join(p + (PAD * int(rng.integers(0, MAX_PAD + 1)) + ASYNC_CLOSE
                        if i < len(parts) - 1 else "") for i, p in enumerate(parts))
  if no_topic:
    k = iter(range(1, 1000))
    text = re.sub(re.escape(PROMISE_OPEN) + r" (\S+) (\d+) " + re.escape(PROMISE_CLOSE),
                  lambda m: f"{PROMISE_OPEN} topic {next(k)} {m.group(2)} {PROMISE_CLOSE}", text)
  if no_sync:
    text = text.replace(SYNC, "")
  return text


def cities_records(n: int, seed: int, count_tokens: Callable[[str], int], *, min_k: int = 2,
                   max_k: int = 6, no_topic: bool = False, no_sync: bool = False,
                   pad: bool = True) -> list[dict[str, Any]]:
  """n chat records ``{"messages": [user, assistant], "cities": [...], "annotated": True}``.

  Args:
    n: examples (:func:`~selforch_jax.data.synthetic_cities.generate_split` with ``seed``).
    seed: split seed; the padding uses ``(seed, index)``.
    count_tokens: the tokenizer's token count of a string (promise lengths).
    min_k, max_k: cities per example.
    no_topic, no_sync: upstream's ablations (module docstring).
    pad: the 0-10 ``[PAD]`` per chunk (False: PASTA's records, the plain annotated answer).
  """
  out = []
  for i, ex in enumerate(synthetic_cities.generate_split(n, seed, min_k, max_k)):
    rng = np.random.default_rng([seed, i])
    out.append({"messages": [{"role": "user", "content": ex["prompt"]},
                             {"role": "assistant",
                              "content": _tagged(ex, count_tokens, rng, no_topic, no_sync,
                                                 pad)}],
                "cities": ex["cities"], "annotated": True})
  return out


def ensure_cities_data(path: str, count_tokens: Callable[[str], int], *, n: int, seed: int,
                       no_topic: bool = False, no_sync: bool = False, pad: bool = True) -> str:
  """Write :func:`cities_records` to ``path`` (JSONL, one record a line) unless a file made
  with the same arguments is there (``<path>.meta.json``); returns ``path``.

  Raises:
    ValueError: ``n < 1``.
  """
  if n < 1:
    raise ValueError(f"ensure_cities_data: n must be >= 1, got {n}")
  meta = {"n": int(n), "seed": int(seed), "no_topic": bool(no_topic), "no_sync": bool(no_sync),
          "source": "selforch_jax.data.synthetic_cities"}
  if not pad:
    meta["pad"] = False
  mpath = path + ".meta.json"
  if os.path.exists(path) and os.path.exists(mpath):
    with open(mpath, encoding="utf-8") as f:
      if json.load(f) == meta:
        return path
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  rows = cities_records(n, seed, count_tokens, no_topic=no_topic, no_sync=no_sync, pad=pad)
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  with open(mpath, "w", encoding="utf-8") as f:
    json.dump(meta, f)
  return path
