r"""Decode prompts with a model: ``python -m selforch_jax.decode --config=configs/X.py``.

Examples::

  python -m selforch_jax.decode --config=configs/smollm2_135m.py --prompt="Name three colors."
  python -m selforch_jax.decode --config=configs/smollm2_135m.py --prompts_file=my.jsonl \
      --workdir=out/run1 --config.sampling.temperature=0.7 --config.sampling.top_p=0.9
  python -m selforch_jax.decode --config=configs/demo.py --workdir=out/demo

Writes ``<workdir>/answers.jsonl`` (one row per prompt: id, prompt text, answer text,
token ids, per-token log-probs, finish reason) and ``<workdir>/summary.json``
(throughput: prefill ms, decode tokens/s, compile s). With ``config.pasta.adapter`` set (as in
``configs/demo.py``) also ``<workdir>/pasta.jsonl``: the adapter's model decoding AlpacaEval
prompts with PASTA and with AR (:func:`selforch_jax.decoding.run.run_pasta_part`), and a
``pasta`` block in the summary.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from selforch_jax import config_lib
from selforch_jax.decoding.run import run

_CONFIG = config_flags.DEFINE_config_file("config", None, "decode config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "out/decode", "where answers.jsonl and summary.json go")
_PROMPT = flags.DEFINE_string("prompt", "", "a single user prompt")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", "", "JSONL with messages/prompt/instruction/question")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/smollm2_135m.py")
  try:
    summary = run(config, _WORKDIR.value, _PROMPT.value, _PROMPTS_FILE.value)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  rows = [json.loads(l) for l in open(os.path.join(_WORKDIR.value, "answers.jsonl"))]
  for r in rows[:3]:
    print(f"\n### {r['id']}: {r['prompt'][:200]}\n{r['text'][:600]}")
  print("\n" + json.dumps(summary, indent=2))
  print(f"answers: {os.path.join(_WORKDIR.value, 'answers.jsonl')}")
  if "pasta" in summary:
    print_pasta(summary["pasta"], os.path.join(_WORKDIR.value, "pasta.jsonl"))


def print_pasta(block: dict, path: str) -> None:
  """Print the tagged output and final text of the first PASTA row that forked threads (else
  the first row), and one summary line."""
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(l) for l in f]
  r = next((r for r in rows if r["threads"]), rows[0])
  print(f"\n### PASTA {r['id']}: {r['prompt'][:200]}\n--- tagged output ({r['threads']} threads, "
        f"{r['rounds']} rounds):\n{r['raw'][:1500]}\n--- final text:\n{r['text'][:1500]}")
  b = block
  print(f"\nPASTA ({b['adapter']}): {b['n']} AlpacaEval prompts, {b['threads']} threads, "
        f"{b['tokens_per_forward']:.2f} tokens/forward, theoretical speedup "
        f"{b['theoretical_speedup']:.2f}x, wall AR/PASTA {b['wall_ratio_ar_over_pasta']:.2f}x "
        f"(geometric mean), parse rate {b['parse_rate']:.2f} "
        f"(strict {b['parse_rate_strict']:.2f}); {b['wall_s']:.0f} s")
  print(f"pasta rows: {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=config_lib.parse_flags)
