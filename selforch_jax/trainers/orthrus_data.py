"""Orthrus's distillation data: the model's own greedy continuations of training prompts,
decoded by the engine (``runtime/``, AR, greedy), cached as a chat JSONL with provenance.

Sources are training splits only (GSM8K train, Alpaca; MATH train when present): never the
AlpacaEval or AIME prompts the evaluation uses (:data:`FORBIDDEN`). Each row is ``{"messages":
[user turn, assistant = the decoded text], "source", "row", "completion_ids", "finish"}``, read
back by the ``chat`` dataset (``data.name="chat"``, ``data.path=...``); the sidecar
``<file>.provenance.json`` records the model section, sources, rows, token budget, the decoding
(engine AR greedy) and the git commit. A file whose provenance matches the request is reused.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from typing import Any, Sequence

from selforch_jax.data.sources import load_examples
from selforch_jax.runtime.build import make_engine
from selforch_jax.runtime.generation import eos_ids
from selforch_jax.runtime.schedulers import ar

FORBIDDEN = ("alpaca_eval", "aime", "math500", "mt_bench")
TRAIN_SOURCES = ("gsm8k", "alpaca")


def parse_sources(spec: str) -> list[tuple[str, int]]:
  """``"gsm8k:96,alpaca:32"`` (or ``+`` between entries, for a config argument) ->
  ``[("gsm8k", 96), ("alpaca", 32)]`` (the first N train rows of each).

  Raises:
    ValueError: a malformed entry, a non-training source (:data:`FORBIDDEN`) or an unknown one.
  """
  out = []
  for part in [p for p in re.split(r"[,+]", str(spec)) if p.strip()]:
    name, _, n = part.strip().partition(":")
    if name in FORBIDDEN:
      raise ValueError(f"orthrus data: {name!r} is an evaluation set, never training data")
    if name not in TRAIN_SOURCES:
      raise ValueError(f"orthrus data: unknown source {name!r}; known: {TRAIN_SOURCES}")
    if not n.isdigit() or int(n) < 1:
      raise ValueError(f"orthrus data: {part!r} must be NAME:N with N >= 1")
    out.append((name, int(n)))
  if not out:
    raise ValueError("orthrus data: no sources given (e.g. 'gsm8k:96,alpaca:32')")
  return out


def _git_commit() -> str:
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def ensure_distill_data(path: str, model, tokenizer, model_section: dict,
                        sources: Sequence[tuple[str, int]], max_new_tokens: int,
                        batch_size: int = 16) -> str:
  """Write (or reuse) the continuation cache at ``path``; returns ``path``.

  Args:
    path: the JSONL to write; ``path + ".provenance.json"`` beside it.
    model / tokenizer: the AR model (its base view decodes) and its tokenizer.
    model_section: recorded in the provenance (what model wrote the data).
    sources: ``[(name, n)]`` training sources (:func:`parse_sources`).
    max_new_tokens: continuation budget. batch_size: prompts per engine job.

  Raises:
    ValueError: a forbidden or unknown source (:func:`parse_sources`).
  """
  for name, _ in sources:
    parse_sources(f"{name}:1")
  want = {"model": dict(model_section), "sources": [list(s) for s in sources],
          "max_new_tokens": int(max_new_tokens), "decoding": "selforch_jax engine, ar, greedy"}
  prov = path + ".provenance.json"
  if os.path.exists(path) and os.path.exists(prov):
    with open(prov) as f:
      have = json.load(f)
    if all(have.get(k) == v for k, v in want.items()):
      return path
  items: list[tuple[str, int, list[dict[str, Any]]]] = []
  for name, n in sources:
    for i, ex in enumerate(load_examples(name, split="train", max_examples=n)):
      user = [m for m in ex["messages"] if m["role"] != "assistant"]
      items.append((name, i, user))
  stops = eos_ids(tokenizer)
  encoded = [tokenizer.encode_chat(u, add_generation_prompt=True) for _, _, u in items]
  # one engine (one pool size: every job reuses the compiled steps) for the longest prompt
  eng = make_engine(model, [max(len(p) for p in encoded)] * min(batch_size, len(items)),
                    max_new_tokens)
  rows = []
  for b in range(0, len(items), batch_size):
    chunk = items[b:b + batch_size]
    res = ar.generate(eng, encoded[b:b + batch_size], max_new_tokens=max_new_tokens,
                      stop_ids=stops)
    for (name, i, user), r in zip(chunk, res):
      text = tokenizer.decode(list(r.token_ids), skip_special_tokens=True)
      rows.append({"messages": user + [{"role": "assistant", "content": text}], "source": name,
                   "row": i, "completion_ids": list(map(int, r.token_ids)),
                   "finish": r.finish_reason})
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  with open(prov, "w") as f:
    json.dump(want | {"rows": len(rows), "git_commit": _git_commit(),
                      "created": datetime.datetime.now(datetime.timezone.utc).isoformat()},
              f, indent=2)
  return path
