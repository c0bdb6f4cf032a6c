"""The Orthrus run pieces the shared training loop (:func:`selforch_jax.trainers.run.train`) uses
when ``config.trainer == "orthrus"``: :func:`validate_orthrus`, :func:`build_orthrus` (model +
diffusion view + mask row, the continuation cache, the trainer, grain datasets, Orbax
checkpointer) and :func:`export_orthrus` (the adapter at the end of a run)."""

from __future__ import annotations

import os

import ml_collections

from selforch_jax import config_lib
from selforch_jax.trainers.orthrus import DENOISE, LOSSES


def validate_orthrus(config: ml_collections.ConfigDict) -> None:
  """Value checks of the ``orthrus`` section. Raises ``config_lib.ConfigError`` naming the key."""
  from selforch_jax.trainers.orthrus_data import parse_sources
  o = config.orthrus
  if o.block_size < 2:
    raise config_lib.ConfigError(f"orthrus.block_size={o.block_size} must be >= 2")
  if o.loss not in LOSSES:
    raise config_lib.ConfigError(f"orthrus.loss={o.loss!r} must be one of {LOSSES}")
  if o.denoise not in DENOISE:
    raise config_lib.ConfigError(f"orthrus.denoise={o.denoise!r} must be one of {DENOISE}")
  if o.view_rank < 0:
    raise config_lib.ConfigError(f"orthrus.view_rank={o.view_rank} must be >= 0 (0 = full view)")
  if o.max_new_tokens < 1:
    raise config_lib.ConfigError(f"orthrus.max_new_tokens={o.max_new_tokens} must be >= 1")
  if config.model.lora_rank:
    raise config_lib.ConfigError("orthrus trains the diffusion view only: set model.lora_rank=0")
  if config.data.packing:
    raise config_lib.ConfigError("orthrus needs one example per row: set data.packing=False")
  if o.sources:
    if config.data.name != "chat" or not config.data.path:
      raise config_lib.ConfigError("orthrus.sources (generated continuations) needs "
                                   "data.name='chat' and data.path=the cache file")
    try:
      parse_sources(o.sources)
    except ValueError as e:
      raise config_lib.ConfigError(str(e)) from None
  if config.data.seq_len < o.block_size + 1:
    raise config_lib.ConfigError(f"data.seq_len={config.data.seq_len} must exceed "
                                 f"orthrus.block_size={o.block_size}")


def build_orthrus(config, workdir: str):
  """Build (trainer, tokenizer, train dataset, eval dataset or None, checkpointer), as
  :func:`selforch_jax.trainers.run.build` does for SFT. The continuation cache
  (``data.path``) is written first when ``orthrus.sources`` is set and the cache is missing or
  was made for another request (:func:`~selforch_jax.trainers.orthrus_data.ensure_distill_data`,
  decoded by the base model before the view is added)."""
  from selforch_jax import sharding as shd
  from selforch_jax.data.pipeline import make_dataset
  from selforch_jax.data.sources import resolve_path
  from selforch_jax.models.orthrus import add_orthrus, add_view_delta
  from selforch_jax.trainers.checkpoint import Checkpointer
  from selforch_jax.trainers.orthrus import OrthrusTrainer
  from selforch_jax.trainers.orthrus_data import ensure_distill_data, parse_sources

  mc, o = config.model, config.orthrus
  _, model, tok = config_lib.load_model(mc)
  if tok is None:
    raise config_lib.ConfigError("training needs a tokenizer: set model.tokenizer or use GGUF/HF "
                                 "weights")
  if o.sources:
    ensure_distill_data(str(resolve_path(config.data.path)), model, tok, mc.to_dict(),
                        parse_sources(o.sources), int(o.max_new_tokens),
                        int(o.gen_batch_size))
  model, mask_id = add_orthrus(model, tok)
  if o.view_rank:
    add_view_delta(model, int(o.view_rank), seed=config.train.seed)
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  trainer = OrthrusTrainer(model, mesh, config.optim, config.train.steps,
                           block_size=int(o.block_size), mask_id=mask_id, loss=o.loss,
                           low_rank=bool(o.view_rank), seed=config.train.seed,
                           denoise=o.denoise)
  train_ds = make_dataset(config.data, tok, "train", config.data.shuffle_seed)
  eval_ds = None
  if config.train.eval_every > 0:
    eval_cfg = config.data.to_dict() | {"num_epochs": 1, "shuffle": False}
    eval_ds = make_dataset(eval_cfg, tok, "eval")
  ckpt = Checkpointer(workdir, config.train.checkpoint_every, config.train.keep,
                      config.train.async_checkpoint)
  return trainer, tok, train_ds, eval_ds, ckpt


def export_orthrus(config, trainer, tok, workdir: str) -> str:
  """Write the run's adapter (``orthrus.adapter_out``, default ``<workdir>/adapter``) with
  :func:`selforch_jax.adapter.export_view_adapter`; returns its directory."""
  from selforch_jax.adapter import _last_metrics, export_view_adapter
  out = config.orthrus.adapter_out or os.path.join(workdir, "adapter")
  training = {k: config[k].to_dict() for k in ("data", "optim", "train", "orthrus")}
  return export_view_adapter(trainer.current_model(), tok, out, config.model.to_dict(),
                             block_size=int(config.orthrus.block_size),
                             source={"workdir": workdir, "step": int(trainer.step)},
                             training=training, metrics=_last_metrics(workdir, trainer.step))
