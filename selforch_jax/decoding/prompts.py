"""Prompt sources for the decode CLI: the repo's real datasets or a user's JSONL file.

A spec like ``"alpaca_eval:20,gsm8k:10"`` takes the first N rows of each dataset's test
file in file order (a fixed, reproducible subset), read and converted by
:mod:`selforch_jax.data.sources`. A user file row may hold ``messages`` (a chat),
``prompt``, ``instruction`` (+ ``input``) or ``question``.
"""

from __future__ import annotations

import os
from typing import Any

from selforch_jax.data import sources


def row_to_messages(row: dict[str, Any], where: str = "row") -> list[dict[str, str]]:
  """Turn one JSON row into chat messages.

  Raises:
    ValueError: if the row has none of ``messages``, ``prompt``, ``instruction``, ``question``.
  """
  if "messages" in row:
    return sources.chat_to_messages(row)["messages"]
  for key in ("prompt", "instruction", "question"):
    if key in row:
      return [{"role": "user", "content": sources.alpaca_prompt(row[key], row.get("input"))}]
  raise ValueError(f"{where} has none of the fields messages/prompt/instruction/question")


def load_prompts(spec: str = "", prompts_file: str = "", prompt: str = "") -> list[dict[str, Any]]:
  """Collect prompts as ``{"id", "source", "messages", "reference"}`` dicts.

  Args:
    spec: comma-separated ``dataset:N`` items (datasets of ``data.sources.DATASETS`` with a
      test file: ``alpaca_eval``, ``gsm8k``).
    prompts_file: a JSONL/JSON file of rows (see :func:`row_to_messages`).
    prompt: a single user prompt.

  Raises:
    ValueError: for an unknown dataset, a bad count, or an empty result.
    FileNotFoundError: for a missing file.
  """
  out: list[dict[str, Any]] = []
  for item in [s for s in spec.split(",") if s.strip()]:
    name, _, n = item.strip().partition(":")
    try:
      count = int(n) if n else None
    except ValueError:
      raise ValueError(f"bad count {n!r} for dataset {name!r} (want an integer)") from None
    try:
      examples = sources.load_examples(name, split="test", max_examples=count)
    except KeyError as e:
      raise ValueError(str(e).strip('"')) from None
    for i, ex in enumerate(examples):
      msgs, ref = sources.prompt_and_reference(ex)
      out.append({"id": f"{name}/{i}", "source": name, "messages": msgs, "reference": ref})
  if prompts_file:
    if not os.path.exists(prompts_file):
      raise FileNotFoundError(f"prompt file not found: {prompts_file}")
    for i, row in enumerate(sources.read_records(os.path.abspath(prompts_file))):
      out.append({"id": row.get("id", f"file/{i}"), "source": os.path.basename(prompts_file),
                  "messages": row_to_messages(row, f"{prompts_file} row {i}"),
                  "reference": row.get("reference")})
  if prompt:
    out.append({"id": "prompt/0", "source": "flag", "messages": [{"role": "user", "content": prompt}],
                "reference": None})
  if not out:
    if prompts_file:
      raise ValueError(f"no prompts: {prompts_file} has no rows")
    raise ValueError("no prompts: give --prompt, --prompts_file or config.inputs")
  return out
