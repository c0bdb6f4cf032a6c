"""Prompt sources for the decode CLI: the repo's real datasets or a user's JSONL file.

A spec like ``"alpaca_eval:20,gsm8k:10"`` takes the first N rows of each dataset in
file order (a fixed, reproducible subset). A JSONL row may hold ``messages`` (a chat),
``prompt``, ``instruction`` or ``question``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from selforch_jax.data.sources import data_dir

# dataset name -> (relative file, field holding the user turn)
DATASETS = {
    "alpaca_eval": ("alpaca_eval/example_outputs.json", "instruction"),
    "gsm8k": ("gsm8k/test.jsonl", "question"),
}


def _read_rows(path: str) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    raise FileNotFoundError(f"prompt file not found: {path}")
  with open(path, encoding="utf-8") as f:
    if path.endswith(".json"):
      return json.load(f)
    rows = []
    for n, line in enumerate(f, 1):
      if line.strip():
        try:
          rows.append(json.loads(line))
        except json.JSONDecodeError as e:
          raise ValueError(f"{path}:{n} is not valid JSON: {e}") from None
    return rows


def row_to_messages(row: dict[str, Any], where: str = "row") -> list[dict[str, str]]:
  """Turn one JSON row into chat messages.

  Raises:
    ValueError: if the row has none of ``messages``, ``prompt``, ``instruction``, ``question``.
  """
  if "messages" in row:
    return list(row["messages"])
  for key in ("prompt", "instruction", "question"):
    if key in row:
      text = row[key]
      if row.get("input"):
        text = f"{text}\n\n{row['input']}"
      return [{"role": "user", "content": text}]
  raise ValueError(f"{where} has none of the fields messages/prompt/instruction/question")


def load_prompts(spec: str = "", prompts_file: str = "", prompt: str = "") -> list[dict[str, Any]]:
  """Collect prompts as ``{"id", "source", "messages", "reference"}`` dicts.

  Args:
    spec: comma-separated ``dataset:N`` items (datasets: ``alpaca_eval``, ``gsm8k``).
    prompts_file: a JSONL/JSON file of rows (see :func:`row_to_messages`).
    prompt: a single user prompt.

  Raises:
    ValueError: for an unknown dataset, a bad count, or an empty result.
    FileNotFoundError: for a missing file.
  """
  out: list[dict[str, Any]] = []
  for item in [s for s in spec.split(",") if s.strip()]:
    name, _, n = item.strip().partition(":")
    if name not in DATASETS:
      raise ValueError(f"unknown dataset {name!r} in inputs; known: {sorted(DATASETS)}")
    try:
      count = int(n) if n else None
    except ValueError:
      raise ValueError(f"bad count {n!r} for dataset {name!r} (want an integer)") from None
    rel, field = DATASETS[name]
    rows = _read_rows(os.path.join(data_dir(), rel))[:count]
    for i, row in enumerate(rows):
      ref = row.get("answer", row.get("output"))
      out.append({"id": f"{name}/{i}", "source": name,
                  "messages": [{"role": "user", "content": row[field]}], "reference": ref})
  if prompts_file:
    for i, row in enumerate(_read_rows(prompts_file)):
      out.append({"id": row.get("id", f"file/{i}"), "source": os.path.basename(prompts_file),
                  "messages": row_to_messages(row, f"{prompts_file} row {i}"),
                  "reference": row.get("reference")})
  if prompt:
    out.append({"id": "prompt/0", "source": "flag", "messages": [{"role": "user", "content": prompt}],
                "reference": None})
  if not out:
    raise ValueError("no prompts: give --prompt, --prompts_file or config.inputs")
  return out
