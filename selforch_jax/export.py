r"""Export a training run, an adapter or a model to a Hugging Face directory (safetensors +
tokenizer), or a run's adapter.

  python -m selforch_jax.export --workdir=out/sft --out=out/sft_hf [--step=N | --round=R] [--dtype=float32]
  python -m selforch_jax.export --model=adapters/pasta_smollm2_135m --out=out/pasta_hf
  python -m selforch_jax.export --model=smollm2_gguf --out=out/smollm2_hf
  python -m selforch_jax.export --workdir=out/pasta_sft --out=out/pasta_adapter --adapter
  python -m selforch_jax.export --workdir=out/pasta_po_l4 --round=4 --out=out/l4_r4 --adapter

Restores the run's checkpoint (latest, ``--step``, or ``--round`` of a policy-optimization run,
whose checkpoints count optimizer steps) with the config saved in it, folds
LoRA adapters into the base weights, and writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files, so that
``transformers.AutoModelForCausalLM.from_pretrained(out)`` loads it and gives the same
logits (tested). With ``--adapter`` (LoRA runs only) it writes just the LoRA tensors and new
token rows with the base model spec (:mod:`selforch_jax.adapter`; a few MB), which
``eval.run.load_finetuned(out)`` loads.
"""

from __future__ import annotations

import sys

from absl import app, flags, logging

from selforch_jax import cli
from selforch_jax.trainers.restore import export_run

_WORKDIR = flags.DEFINE_string("workdir", None, "training run directory (holds checkpoints/)")
_MODEL = flags.DEFINE_string("model", None, "instead of --workdir: an adapter directory, "
                             "'smollm2_gguf', a .gguf file or an HF directory")
_OUT = flags.DEFINE_string("out", None, "output directory for the HF checkpoint")
_STEP = flags.DEFINE_integer("step", None, "checkpoint step (default: latest)")
_ROUND = flags.DEFINE_integer("round", None, "round of a policy-optimization run (BoNBoN / GRPO; "
                              "its checkpoint step is round x optimizer steps per round)")
_DTYPE = flags.DEFINE_string("dtype", "float32", "tensor dtype: float32, bfloat16 or float16")
_ADAPTER = flags.DEFINE_bool("adapter", False, "write only the LoRA adapter + new token rows "
                             "(selforch_jax.adapter) instead of the full merged model")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if bool(_WORKDIR.value) == bool(_MODEL.value) or not _OUT.value:
    cli.fail("give --out and one of --workdir (a training run) or --model (an adapter / model)")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if _STEP.value is not None and _ROUND.value is not None:
    print("error: give --step or --round, not both", file=sys.stderr)
    sys.exit(2)
  try:
    step = _STEP.value
    if _ROUND.value is not None:
      from selforch_jax.trainers.restore import round_step
      step = round_step(_WORKDIR.value, _ROUND.value)
    if _MODEL.value:
      if _ADAPTER.value or step is not None:
        raise ValueError("--adapter, --step and --round apply to --workdir runs, not --model")
      from selforch_jax.adapter import export_model
      out = export_model(_MODEL.value, _OUT.value, _DTYPE.value)
    elif _ADAPTER.value:
      if flags.FLAGS["dtype"].present:
        raise ValueError("--dtype does not apply to --adapter (adapter tensors are float32)")
      from selforch_jax.adapter import export_adapter
      out = export_adapter(_WORKDIR.value, _OUT.value, step)
    else:
      out = export_run(_WORKDIR.value, _OUT.value, step, _DTYPE.value)
  except (FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(f"exported to {out}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.flags_parser(
      __doc__, ["workdir", "model", "out", "step", "round", "dtype", "adapter"], config=False))
