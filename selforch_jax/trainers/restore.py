"""Rebuild a training run's model from its Orbax checkpoint, and export it to HF format."""

from __future__ import annotations


def restore_run(workdir: str, step: int | None = None):
  """Rebuild a run's model from its checkpoint.

  Returns:
    ``(config, model, tokenizer, step)``; ``model`` still has its LoRA adapters.

  Raises:
    FileNotFoundError: if ``workdir`` has no checkpoint, or none at ``step`` (the message lists
      the steps kept).
  """
  import jax
  import ml_collections

  from selforch_jax import config_lib
  from selforch_jax import sharding as shd
  from selforch_jax.models.transformer import add_lora
  from selforch_jax.trainers.checkpoint import Checkpointer
  from selforch_jax.trainers.sft import SFTTrainer

  import os
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise FileNotFoundError(f"no checkpoint under {os.path.join(workdir, 'checkpoints')}")
  ckpt = Checkpointer(workdir, async_save=False)
  if ckpt.latest_step() is None:
    raise FileNotFoundError(f"no checkpoint under {ckpt.directory}")
  if step is not None and step not in ckpt.all_steps():
    kept = ckpt.all_steps()
    ckpt.close()
    raise FileNotFoundError(f"no checkpoint at step {step} under {ckpt.directory}; kept: {kept}")
  config = ml_collections.ConfigDict(ckpt.restore_config(step))
  mc = config.model
  cfg, model, tok = config_lib.load_model(mc)
  lora = mc.lora_rank > 0
  if lora:
    model = add_lora(model, mc.lora_rank, mc.lora_alpha, mc.lora_targets)
  mesh = shd.make_mesh(data=jax.device_count(), fsdp=1, tensor=1)
  trainer = SFTTrainer(model, mesh, config.optim, config.train.steps, lora=lora,
                       train_embed_rows_from=config.train.train_embed_rows_from)
  step = ckpt.restore(trainer, None, step)
  ckpt.close()
  return config, trainer.model(), tok, step


def steps_per_round(config) -> int | None:
  """Optimizer steps per loop step (a "round") of a policy-optimization run: ``grpo.inner_steps``
  or ``bonbon.updates_per_round`` (``trainers/po_run.py`` numbers checkpoints in optimizer steps
  and logs one metrics record per round); None for an SFT run (one step per step)."""
  trainer = config.get("trainer", "sft")
  if trainer == "grpo":
    return int(config.grpo.inner_steps)
  if trainer == "bonbon":
    return int(config.bonbon.updates_per_round)
  return None


def round_step(workdir: str, round_: int) -> int:
  """The checkpoint step of round ``round_`` (1-based) of the policy-optimization run ``workdir``.

  Raises:
    FileNotFoundError: ``workdir`` has no checkpoint, or none of that round (the message lists
      the rounds kept).
    ValueError: ``workdir`` is not a policy-optimization run, or ``round_ < 1``.
  """
  import os

  from selforch_jax.trainers.checkpoint import Checkpointer
  if round_ < 1:
    raise ValueError(f"round {round_} must be >= 1")
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise FileNotFoundError(f"no checkpoint under {os.path.join(workdir, 'checkpoints')}")
  ckpt = Checkpointer(workdir, async_save=False)
  try:
    steps = ckpt.all_steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint under {ckpt.directory}")
    import ml_collections
    per = steps_per_round(ml_collections.ConfigDict(ckpt.restore_config(steps[-1])))
  finally:
    ckpt.close()
  if per is None:
    raise ValueError(f"{workdir} is an SFT run (no rounds); give --step")
  if round_ * per not in steps:
    raise FileNotFoundError(f"{workdir} has no checkpoint of round {round_} (step "
                            f"{round_ * per}); rounds kept: {[s // per for s in steps]}")
  return round_ * per


def export_run(workdir: str, out: str, step: int | None = None, dtype: str = "float32") -> str:
  """Restore ``workdir``'s checkpoint, merge LoRA and write an HF directory to ``out``."""
  from selforch_jax.checkpoints.safetensors_io import export_hf
  from selforch_jax.models.transformer import merged_model

  _, model, tok, _ = restore_run(workdir, step)
  merged = merged_model(model)
  return export_hf(merged, merged.cfg, out, tokenizer=tok, dtype=dtype)
