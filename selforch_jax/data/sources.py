"""Data sources: JSON/JSONL readers, chat converters and grain random-access sources.

Every example that leaves this module is a dict with a ``"messages"`` list of
``{"role": str, "content": str}`` turns (the format of ``Tokenizer.apply_chat_template``),
plus optional metadata fields (``"answer"`` for gsm8k, ``"reference"`` / ``"dataset"`` for
alpaca_eval). Sources are list-backed and implement grain's ``RandomAccessDataSource``
protocol (``__len__`` / ``__getitem__``), so ``grain.MapDataset.source(src)`` accepts them.

Where the files are: :func:`data_dir` resolves the repository's ``data/`` folder (or the
``SELFORCH_DATA_DIR`` environment variable); see ``data/README.md`` for what is there.

Known datasets (``name`` -> split -> file under the data dir):

============  =====================================  ==========================================
name          files                                  converter
============  =====================================  ==========================================
gsm8k         gsm8k/train.jsonl, gsm8k/test.jsonl    :func:`gsm8k_to_messages`
alpaca        alpaca/alpaca_en_demo.json (train)     :func:`alpaca_to_messages`
alpaca_eval   alpaca_eval/gpt4_1106_preview_         :func:`alpaca_eval_to_messages` (prompt
              model_outputs.json (test)              only; GPT-4 output kept as ``reference``)
chat          any JSON/JSONL with ``messages``       :func:`chat_to_messages`
math500       math500/test.jsonl (test)              :func:`math500_to_messages`
aime          aime/aime_2024.jsonl (test),           :func:`aime_to_messages` (prompt only)
              aime/aime_2025.jsonl (split "2025")
synthetic_    synthetic_chain/{train,test}.jsonl     ``synthetic_chain.chain_to_messages``
chain         (generated, see its PROVENANCE)        (register-annotated solution)
synthetic_    synthetic_walk/{train,test}.jsonl      ``synthetic_chain.chain_to_messages``
walk          (generated, see its PROVENANCE)        (same row format)
============  =====================================  ==========================================
"""

from __future__ import annotations

import json
import os
import pathlib
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA_DIR_ENV = "SELFORCH_DATA_DIR"


def data_dir() -> pathlib.Path:
  """The folder that holds the project's data files.

  Returns ``$SELFORCH_DATA_DIR`` when that environment variable is set (read at call
  time), else ``<repo root>/data`` (the folder next to ``selforch_jax/``).
  The folder is not required to exist; readers raise ``FileNotFoundError`` when a
  file is missing.
  """
  env = os.environ.get(DATA_DIR_ENV)
  return pathlib.Path(env).expanduser() if env else _REPO_ROOT / "data"


#: ``data_dir()`` as resolved at import time; prefer calling :func:`data_dir`.
DATA_DIR = data_dir()


def resolve_path(path: str | os.PathLike) -> pathlib.Path:
  """An absolute path for ``path``: absolute paths unchanged, relative ones under :func:`data_dir`."""
  p = pathlib.Path(path).expanduser()
  return p if p.is_absolute() else data_dir() / p


# --- readers ---------------------------------------------------------------------------------
def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Read a JSON-lines file (one object per non-empty line).

  Args:
    path: absolute, or relative to :func:`data_dir`.

  Returns:
    The list of decoded rows, in file order.

  Raises:
    FileNotFoundError: if the file does not exist.
    ValueError: naming the file and line when a line is not valid JSON.
  """
  p = resolve_path(path)
  rows = []
  with open(p, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{lineno}: invalid JSON: {e}") from e
  return rows


def read_json(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Read a JSON file holding a list of objects (the Alpaca / AlpacaEval format).

  Raises:
    FileNotFoundError: if the file does not exist.
    ValueError: if the top-level value is not a list.
  """
  p = resolve_path(path)
  with open(p, encoding="utf-8") as f:
    data = json.load(f)
  if not isinstance(data, list):
    raise ValueError(f"{p}: expected a JSON list of records, got {type(data).__name__}")
  return data


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
  """Read ``.jsonl`` with :func:`read_jsonl`, anything else with :func:`read_json`."""
  return read_jsonl(path) if str(path).endswith(".jsonl") else read_json(path)


class ListSource:
  """A list-backed grain ``RandomAccessDataSource`` (``__len__``, ``__getitem__``).

  Elements are returned as stored (no copy), so downstream maps must not mutate them.
  """

  def __init__(self, records: Sequence[Any], name: str = "list"):
    self._records = list(records)
    self._name = name

  def __len__(self) -> int:
    return len(self._records)

  def __getitem__(self, index: int) -> Any:
    return self._records[index]

  def __repr__(self) -> str:
    return f"ListSource(name={self._name!r}, len={len(self)})"


# --- converters to chat messages ---------------------------------------------------------------
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$")


def gsm8k_final_answer(answer: str) -> str:
  """The final answer of a gsm8k solution: the text after the last ``####``, commas removed.

  Raises:
    ValueError: if the solution has no ``#### N`` line.
  """
  m = _GSM8K_FINAL.search(answer.strip().splitlines()[-1] if answer.strip() else "")
  if m is None:
    raise ValueError(f"gsm8k answer has no '#### N' final line: {answer[-80:]!r}")
  return m.group(1).replace(",", "")


def gsm8k_to_messages(row: Mapping[str, Any]) -> dict[str, Any]:
  """gsm8k row ``{question, answer}`` -> ``{"messages": [user, assistant], "answer": str}``.

  The assistant turn is the full worked solution, calculator annotations ``<<a*b=c>>`` and
  the final ``#### N`` line included (unchanged); ``"answer"`` is ``N`` as a string.

  Raises:
    KeyError: if ``question`` or ``answer`` is missing.
    ValueError: if the solution has no ``#### N`` line.
  """
  return {
      "messages": [
          {"role": "user", "content": row["question"]},
          {"role": "assistant", "content": row["answer"]},
      ],
      "answer": gsm8k_final_answer(row["answer"]),
  }


def alpaca_prompt(instruction: str, input_text: str | None = None) -> str:
  """The user turn of an Alpaca example: the instruction, then a blank line and the input if any."""
  instruction = instruction.strip()
  if input_text and input_text.strip():
    return f"{instruction}\n\n{input_text.strip()}"
  return instruction


def alpaca_to_messages(row: Mapping[str, Any]) -> dict[str, Any]:
  """Alpaca row ``{instruction, input?, output}`` -> ``{"messages": [user, assistant]}``.

  The user turn is :func:`alpaca_prompt` (instruction, plus ``"\\n\\n" + input`` when the
  input is non-empty); the assistant turn is ``output`` unchanged.

  Raises:
    KeyError: if ``instruction`` or ``output`` is missing.
  """
  return {
      "messages": [
          {"role": "user", "content": alpaca_prompt(row["instruction"], row.get("input"))},
          {"role": "assistant", "content": row["output"]},
      ]
  }


def alpaca_eval_to_messages(row: Mapping[str, Any]) -> dict[str, Any]:
  """AlpacaEval row -> a prompt-only example ``{"messages": [user], "reference", "dataset"}``.

  Only the instruction becomes a message (these are evaluation prompts: generate with
  ``add_generation_prompt=True``); the file's ``output`` is kept as ``"reference"`` for
  judges and never becomes an assistant turn, so AlpacaEval cannot leak into SFT data.

  Raises:
    KeyError: if ``instruction`` is missing.
  """
  return {
      "messages": [{"role": "user", "content": row["instruction"]}],
      "reference": row.get("output"),
      "dataset": row.get("dataset"),
  }


def chat_to_messages(row: Mapping[str, Any]) -> dict[str, Any]:
  """A row that already has ``messages`` (list of ``{role, content}``): validated and returned.

  Raises:
    KeyError: if ``messages`` is missing.
    ValueError: if a turn lacks a string ``role`` or ``content``.
  """
  msgs = row["messages"]
  for i, m in enumerate(msgs):
    if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      raise ValueError(f"message {i} needs string 'role' and 'content': {m!r}")
  return dict(row)


def prompt_and_reference(example: Mapping[str, Any]) -> tuple[list[dict[str, str]], Any]:
  """Split a converted example for generation: ``(messages before the last assistant turn,
  reference)``; the reference is the example's ``"reference"`` field, else that assistant
  turn's content (e.g. a GSM8K worked solution), else None."""
  msgs = list(example["messages"])
  if msgs and msgs[-1]["role"] == "assistant":
    return msgs[:-1], example.get("reference", msgs[-1]["content"])
  return msgs, example.get("reference")


def math500_to_messages(row: Mapping[str, Any]) -> dict[str, Any]:
  """MATH-500 row ``{problem, solution, answer, ...}`` -> ``{"messages": [user, assistant],
  "answer", "reference"}``: the worked solution (ending in ``\\boxed{}``) is the assistant turn;
  ``reference`` is the bare ``answer`` (for :func:`selforch_jax.eval.answers.is_correct`).

  Raises:
    KeyError: if ``problem`` or ``answer`` is missing.
  """
  return {
      "messages": [{"role": "user", "content": row["problem"]},
                   {"role": "assistant", "content": row.get("solution") or row["answer"]}],
      "answer": str(row["answer"]),
      "reference": str(row["answer"]),
  }


def aime_to_messages(row: Mapping[str, Any]) -> dict[str, Any]:
  """AIME row ``{id, problem, answer: int}`` -> a prompt-only example ``{"messages": [user],
  "answer", "reference"}`` (no worked solution: evaluation only).

  Raises:
    KeyError: if ``problem`` or ``answer`` is missing.
  """
  return {"messages": [{"role": "user", "content": row["problem"]}],
          "answer": str(row["answer"]), "reference": str(row["answer"]), "id": row.get("id")}


def _synthetic_chain_to_messages(row: Mapping[str, Any]) -> dict[str, Any]:
  from selforch_jax.data.synthetic_chain import chain_to_messages
  return chain_to_messages(row)


# name -> (converter, {split: default file under data_dir()})
DATASETS: dict[str, tuple[Callable[[Mapping[str, Any]], dict[str, Any]], dict[str, str]]] = {
    "gsm8k": (gsm8k_to_messages, {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"}),
    "alpaca": (alpaca_to_messages, {"train": "alpaca/alpaca_en_demo.json"}),
    "alpaca_eval": (alpaca_eval_to_messages,
                    {"test": "alpaca_eval/gpt4_1106_preview_model_outputs.json"}),
    "chat": (chat_to_messages, {}),
    "math500": (math500_to_messages, {"test": "math500/test.jsonl"}),
    "aime": (aime_to_messages, {"test": "aime/aime_2024.jsonl", "2025": "aime/aime_2025.jsonl"}),
    # TIP's synthetic task: assistant = the register-annotated solution (data.strip_tags: dense)
    "synthetic_chain": (_synthetic_chain_to_messages,
                        {"train": "synthetic_chain/train.jsonl", "test": "synthetic_chain/test.jsonl"}),
    # TIP's long-trace task (short prompt; rows in the synthetic_chain format)
    "synthetic_walk": (_synthetic_chain_to_messages,
                       {"train": "synthetic_walk/train.jsonl", "test": "synthetic_walk/test.jsonl"}),
}


def default_path(name: str, split: str) -> pathlib.Path:
  """The default file of dataset ``name`` for ``split`` (``"train"`` or ``"test"``).

  Raises:
    KeyError: for an unknown dataset name.
    ValueError: if the dataset has no file for that split (e.g. alpaca has no test file;
      use a held-out fraction instead).
  """
  if name not in DATASETS:
    raise KeyError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}")
  files = DATASETS[name][1]
  if split not in files:
    raise ValueError(f"dataset {name!r} has no default file for split {split!r} "
                     f"(has: {sorted(files)}); pass a path")
  return resolve_path(files[split])


def load_examples(name: str, path: str | os.PathLike | None = None, split: str = "train",
                  max_examples: int | None = None) -> list[dict[str, Any]]:
  """Read a dataset file and convert every row to a chat example.

  Args:
    name: a key of :data:`DATASETS` (``gsm8k``, ``alpaca``, ``alpaca_eval``, ``chat``).
    path: file to read (absolute or relative to :func:`data_dir`); ``None`` uses
      :func:`default_path` ``(name, split)``.
    split: used only to pick the default file.
    max_examples: keep the first N rows of the file (before any shuffling).

  Returns:
    A list of dicts with ``"messages"`` (see the converters).

  Raises:
    KeyError / ValueError: as :func:`default_path` and the converters;
    FileNotFoundError: if the file is missing.
  """
  if name not in DATASETS:
    raise KeyError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}")
  convert = DATASETS[name][0]
  p = resolve_path(path) if path is not None else default_path(name, split)
  rows = read_records(p)
  if max_examples is not None:
    rows = rows[:max_examples]
  return [convert(r) for r in rows]


def heldout_split(n: int, eval_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Deterministic train / held-out index split of ``range(n)``.

  A seeded permutation (``np.random.default_rng(seed)``) puts ``round(n * eval_fraction)``
  indices in the held-out set; both index arrays are returned sorted (file order). The
  split depends only on ``(n, eval_fraction, seed)``, never on the shuffle seed.

  Returns:
    ``(train_idx, eval_idx)``, int64 arrays.

  Raises:
    ValueError: if ``eval_fraction`` is not in ``[0, 1)``.
  """
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
  k = int(round(n * eval_fraction))
  perm = np.random.default_rng(seed).permutation(n)
  return np.sort(perm[k:]), np.sort(perm[:k])


def make_source(records: Iterable[Any], name: str = "list") -> ListSource:
  """Wrap records in a :class:`ListSource` (for ``grain.MapDataset.source``)."""
  return ListSource(list(records), name=name)
