r"""``python -m selforch_jax.eval --config=configs/eval_gsm8k.py --workdir=DIR``.

Exact-match accuracy (bootstrap 95% CI, n) of the base model and, with
``--config.finetuned=<training workdir or HF dir>``, of the fine-tuned model on the same
fixed subset, in one run. Writes ``DIR/eval_results.json`` and ``DIR/answers_*.jsonl``.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from selforch_jax import cli, config_lib
from selforch_jax.eval.run import run

_CONFIG = config_flags.DEFINE_config_file("config", None, "eval config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "out/eval", "output directory")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("--config is required, e.g. --config=configs/eval_gsm8k.py")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  try:
    if _CONFIG.value.get("kind") == "tip":   # configs/eval_tip.py: TIP vs KV-budget baselines
      from selforch_jax.eval import tip
      out = tip.run(_CONFIG.value, _WORKDIR.value)
      print(tip.summary(out))
      return
    if _CONFIG.value.get("kind") == "pasta":   # configs/eval_pasta.py: PASTA vs AR, SoT, APAR
      from selforch_jax.eval import pasta
      out = pasta.run(_CONFIG.value, _WORKDIR.value)
      print(pasta.summary(out))
      return
    out = run(_CONFIG.value, _WORKDIR.value)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)
  except (FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  for name, m in out["models"].items():
    print(f"{name:10s} {out['dataset']} exact match: {m['accuracy_str']}")
  if "finetuned_minus_base" in out:
    print(f"finetuned - base: {out['finetuned_minus_base']['str']}")
  print(json.dumps({k: v for k, v in out.items() if k != "models"}, indent=2))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(__doc__, ["config", "workdir"]))
