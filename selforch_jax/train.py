r"""Train: ``python -m selforch_jax.train --config=configs/X.py[:args] --workdir=DIR``.

Example (LoRA SFT of the real SmolLM2-135M-Instruct on GSM8K, CPU-sized)::

  python -m selforch_jax.train --config=configs/sft.py:model=smollm2_135m,data=gsm8k \
      --config.optim.lr=1e-4 --workdir=out/sft

The config is validated before any work starts (unknown key, wrong type, impossible
mesh -> a clear error naming the key). A workdir that holds a checkpoint resumes from
it (model, optimizer, step, data iterator). SIGTERM (TPU preemption) saves a checkpoint
and exits 0. A NaN/Inf loss stops the run with exit code 1 and leaves the last good
checkpoint intact. Metrics go to the console, ``<workdir>/metrics.jsonl`` and
TensorBoard event files in ``<workdir>/tb``.

``config.trainer`` picks the run: ``"sft"`` (default), ``"grpo"`` or ``"bonbon"`` (policy
optimization, :mod:`selforch_jax.trainers.po_run`; settings in ``config.grpo`` /
``config.bonbon``), or ``"sol"`` (SOL's compute policy, :mod:`selforch_jax.trainers.sol_run`;
``configs/sol.py``).

Multi-host: ``--distributed`` calls ``jax.distributed.initialize()`` (TPU pods detect
everything); on CPU/GPU clusters pass ``--coordinator_address``, ``--num_processes`` and
``--process_id``.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from selforch_jax import cli, config_lib
from selforch_jax.trainers.run import TrainingError, train

_CONFIG = config_flags.DEFINE_config_file("config", None, "training config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (checkpoints, metrics)")
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize()")
_COORD = flags.DEFINE_string("coordinator_address", None, "host:port of process 0")
_NPROC = flags.DEFINE_integer("num_processes", None, "number of processes")
_PID = flags.DEFINE_integer("process_id", None, "this process's id")


def init_distributed() -> None:
  """``jax.distributed.initialize`` from the flags (CPU uses gloo collectives)."""
  import jax
  if _COORD.value or _DISTRIBUTED.value:
    if _COORD.value:
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
      jax.distributed.initialize(_COORD.value, _NPROC.value, _PID.value)
    else:
      jax.distributed.initialize()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None or _WORKDIR.value is None:
    raise app.UsageError("--config and --workdir are required")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
  init_distributed()
  try:
    if _CONFIG.value.get("trainer", "sft") in ("grpo", "bonbon"):
      from selforch_jax.trainers.po_run import train_po
      summary = train_po(_CONFIG.value, _WORKDIR.value)
    elif _CONFIG.value.get("trainer", "sft") == "sol":   # the compute policy (sol_run.py)
      from selforch_jax.trainers.sol_run import train_sol
      summary = train_sol(_CONFIG.value, _WORKDIR.value)
    else:
      summary = train(_CONFIG.value, _WORKDIR.value)
  except config_lib.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)
  except TrainingError as e:
    print(f"training stopped: {e}", file=sys.stderr)
    sys.exit(1)
  print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(
      __doc__, ["config", "workdir", "distributed", "coordinator_address", "num_processes",
                "process_id"]))
