"""Rebuild a training run's model from its Orbax checkpoint, and export it to HF format."""

from __future__ import annotations


def restore_run(workdir: str, step: int | None = None):
  """Rebuild a run's model from its checkpoint.

  Returns:
    ``(config, model, tokenizer, step)``; ``model`` still has its LoRA adapters.

  Raises:
    FileNotFoundError: if ``workdir`` has no checkpoint.
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


def export_run(workdir: str, out: str, step: int | None = None, dtype: str = "float32") -> str:
  """Restore ``workdir``'s checkpoint, merge LoRA and write an HF directory to ``out``."""
  from selforch_jax.checkpoints.safetensors_io import export_hf
  from selforch_jax.models.transformer import merged_model

  _, model, tok, _ = restore_run(workdir, step)
  merged = merged_model(model)
  return export_hf(merged, merged.cfg, out, tokenizer=tok, dtype=dtype)
