r"""Decode prompts with a model: ``python -m selforch_jax.decode --config=configs/X.py``.

Examples::

  python -m selforch_jax.decode --config=configs/smollm2_135m.py --prompt="Name three colors."
  python -m selforch_jax.decode --config=configs/smollm2_135m.py --prompts_file=my.jsonl \
      --workdir=out/run1 --config.sampling.temperature=0.7 --config.sampling.top_p=0.9
  python -m selforch_jax.decode --config=configs/demo.py --workdir=out/demo

Every runtime: ``--config.runtime=NAME`` (``--help`` lists the names: ar, pasta, tip, sot, apar,
streaming_llm, h2o, ptd, pld, lookahead and the later systems), ``--config.adapter=DIR`` for a fine-tuned adapter (pasta defaults to
``adapters/pasta_smollm2_135m``; tip needs one). With a single ``--prompt`` the answer is streamed
to the terminal as it is decoded, then its figures; ``--prompts_file`` decodes many.

Writes ``<workdir>/answers.jsonl`` (one row per prompt: id, prompt, ``text``, ``token_ids``,
log-probs, ``finish_reason``, ``forwards``, ``tokens_per_forward``, ``wall_s`` and the runtime's
own figures; PASTA / TIP rows carry ``raw``, the tagged output) and ``<workdir>/summary.json``. With ``config.pasta.adapter`` set (as in
``configs/demo.py``) also ``<workdir>/pasta.jsonl``: the adapter's model decoding AlpacaEval
prompts with PASTA and with AR (:func:`selforch_jax.decoding.run.run_pasta_part`), and a
``pasta`` block in the summary.

``--config.trace=out/trace.html`` (or ``.png`` / ``.json``) draws every engine step of the decode
as a timeline (tokens coloured by thread / register / point, forks, joins, evictions marked;
:mod:`selforch_jax.trace_render`).

``--help`` lists every config key with its default. Errors (a missing config file, an unknown
key, a bad workdir, an empty prompt, an unknown runtime, a missing adapter, a prompt longer than
the context, ...) print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from selforch_jax import cli, config_lib
from selforch_jax.cli import fail
from selforch_jax.decoding.run import help_text, run

_CONFIG = config_flags.DEFINE_config_file("config", None, "decode config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "out/decode", "where answers.jsonl and summary.json go")
_PROMPT = flags.DEFINE_string("prompt", "", "a single user prompt (streamed to the terminal)")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", "", "JSONL with messages/prompt/instruction/question")

SHOW_ANSWERS = 3      # answers printed at the end of a run of many prompts
SHOW_CHARS = 2000     # longer printed texts are cut, saying so


parse_flags = cli.flags_parser(__doc__, ["config", "workdir", "prompt", "prompts_file"],
                               keys_help=help_text)


def clip(text: str, n: int, where: str) -> str:
  """``text``, or its first ``n`` characters and a note saying it was cut and where the whole
  text is."""
  if len(text) <= n:
    return text
  return f"{text[:n]}\n[... cut at {n} of {len(text)} characters; the whole text is in {where}]"


def main(argv):
  from absl import logging

  from selforch_jax.api import ApiError
  logging.set_verbosity(logging.WARNING)   # no INFO lines (e.g. JAX's backend probe) on stderr
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  if config is None:
    fail("--config is required, e.g. --config=configs/smollm2_135m.py")
  prompt = _PROMPT.value
  try:
    summary = run(config, _WORKDIR.value, prompt, _PROMPTS_FILE.value, stream=sys.stdout)
  except (config_lib.ConfigError, ApiError, FileNotFoundError, ValueError, OSError) as e:
    fail(e)
  path = os.path.join(_WORKDIR.value, "answers.jsonl")
  rows = [json.loads(l) for l in open(path, encoding="utf-8")]
  if len(rows) > 1:
    from selforch_jax.decoding.run import figures_line
    for r in rows[:SHOW_ANSWERS]:
      print(f"\n### {r['id']}: {clip(r['prompt'], 300, path)}\n{clip(r['text'], SHOW_CHARS, path)}"
            f"\n{figures_line(r)}")
    if len(rows) > SHOW_ANSWERS:
      print(f"\n({len(rows) - SHOW_ANSWERS} more answers in {path})")
  short = {k: v for k, v in summary.items() if k not in ("config", "pasta")}
  print("\n" + json.dumps(short, indent=2))
  print(f"answers: {path}")
  if summary.get("trace"):
    print(f"trace: {summary['trace']}")
  if "pasta" in summary:
    print_pasta(summary["pasta"], os.path.join(_WORKDIR.value, "pasta.jsonl"))


def print_pasta(block: dict, path: str) -> None:
  """Print the tagged output and final text of the first PASTA row that forked threads (else
  the first row), whole or marked where cut, and one summary line."""
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(l) for l in f]
  r = next((r for r in rows if r["threads"]), rows[0])
  print(f"\n### PASTA {r['id']}: {clip(r['prompt'], 300, path)}\n--- tagged output "
        f"({r['threads']} threads, {r['rounds']} rounds, finish {r['finish_reason']}):\n"
        f"{clip(r['raw'], SHOW_CHARS, path)}\n--- final text:\n{clip(r['text'], SHOW_CHARS, path)}")
  b = block
  print(f"\nPASTA ({b['adapter']}): {b['n']} AlpacaEval prompts, {b['threads']} threads, "
        f"{b['tokens_per_forward']:.2f} tokens/forward, theoretical speedup "
        f"{b['theoretical_speedup']:.2f}x, wall AR/PASTA {b['wall_ratio_ar_over_pasta']:.2f}x "
        f"(geometric mean), parse rate {b['parse_rate']:.2f} "
        f"(strict {b['parse_rate_strict']:.2f}); {b['wall_s']:.0f} s")
  print(f"pasta rows: {path}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
