"""The Planned Diffusion run pieces the shared training loop (:func:`selforch_jax.trainers.run.
train`) uses when ``config.trainer == "planned_diffusion"``: :func:`validate_pd`, :func:`build_pd`
(model + LoRA + tag rows, the synthetic cities cache or, with ``planned_diffusion.source="chat"``,
the converted PASTA chat records (:func:`~selforch_jax.data.planned_diffusion_data.
ensure_chat_pd_data`, ``pd_chat_train.jsonl`` in the workdir), the trainer, grain datasets, Orbax
checkpointer) and :func:`export_pd` (the LoRA + tag-row adapter at the end of a run,
:func:`selforch_jax.adapter.export_adapter`).

``planned_diffusion.ar_only`` is upstream's ``--autoregressive_only`` baseline: the same records
with the tags stripped (``data.strip_tags``), plain causal SFT (:class:`SFTTrainer`).
``planned_diffusion.pasta`` is PASTA SFT on the same task: the records without ``[PAD]``, PASTA's
mask (the builder's default layout), masked CE (:class:`SFTTrainer`; ``--config.runtime=pasta``).
"""

from __future__ import annotations

import os

import ml_collections

from selforch_jax import config_lib

CACHE_FILE = "cities_train.jsonl"
CHAT_CACHE_FILE = "pd_chat_train.jsonl"
SOURCES = ("cities", "chat")


def validate_pd(config: ml_collections.ConfigDict) -> None:
  """Value checks of the ``planned_diffusion`` section and the data it needs. Raises
  ``config_lib.ConfigError`` naming the key."""
  p, d = config.planned_diffusion, config.data
  if not 0.0 < p.eps < 1.0:
    raise config_lib.ConfigError(f"planned_diffusion.eps={p.eps} must be in (0, 1)")
  if not 0.0 <= p.suffix_p <= 1.0:
    raise config_lib.ConfigError(f"planned_diffusion.suffix_p={p.suffix_p} must be in [0, 1]")
  if p.suffix_p > 0 and (p.ar_only or p.pasta):
    raise config_lib.ConfigError("planned_diffusion.suffix_p > 0 needs the diffusion loss (not "
                                 "ar_only or pasta, which train with plain CE)")
  if p.source not in SOURCES:
    raise config_lib.ConfigError(f"planned_diffusion.source={p.source!r} must be one of "
                                 f"{SOURCES}")
  if p.source == "chat" and (p.no_topic or p.no_sync or p.pasta):
    raise config_lib.ConfigError("planned_diffusion.source='chat' has no no_topic, no_sync or "
                                 "pasta variant")
  if p.cities_n < 0:
    raise config_lib.ConfigError(f"planned_diffusion.cities_n={p.cities_n} must be >= 0 "
                                 "(0 = data.path holds the records)")
  if p.cities_n == 0 and not d.path:
    raise config_lib.ConfigError("planned_diffusion.cities_n=0 needs data.path (chat records)")
  if not config.model.tags:
    raise config_lib.ConfigError("planned_diffusion needs model.tags=True")
  if not d.annotated or d.packing or d.name != "chat":
    raise config_lib.ConfigError("planned_diffusion needs data.annotated=True, "
                                 "data.packing=False and data.name='chat'")
  if p.ar_only != bool(d.strip_tags):
    raise config_lib.ConfigError("planned_diffusion.ar_only (the AR-SFT baseline) goes with "
                                 "data.strip_tags=True, and only with it")
  if p.pasta and (p.ar_only or d.strip_tags or d.async_sees_full_plan
                  or d.chunk_bidirectional is not False or p.full_attention):
    raise config_lib.ConfigError("planned_diffusion.pasta needs PASTA's layout: "
                                 "data.async_sees_full_plan=False, data.chunk_bidirectional="
                                 "False, no strip_tags, ar_only or full_attention")
  if not (p.ar_only or p.pasta) and not (d.async_sees_full_plan
                                         and d.chunk_bidirectional is True):
    raise config_lib.ConfigError("planned_diffusion needs the Planned Diffusion layout: "
                                 "data.async_sees_full_plan=True, data.chunk_bidirectional=True")
  if p.ar_only and p.full_attention:
    raise config_lib.ConfigError("planned_diffusion.full_attention has no meaning with ar_only")
  if p.init_adapter and not config.model.lora_rank:
    raise config_lib.ConfigError("planned_diffusion.init_adapter (LoRA + tag rows) needs "
                                 "model.lora_rank > 0")
  if p.init_adapter and not os.path.isfile(os.path.join(p.init_adapter, "adapter_config.json")):
    raise config_lib.ConfigError(f"planned_diffusion.init_adapter={p.init_adapter!r} is not an "
                                 "adapter directory (no adapter_config.json)")


def data_section(config, workdir: str) -> dict:
  """The data config the run reads: ``data.path``, or the cities cache in the workdir."""
  d = config.data.to_dict()
  if config.planned_diffusion.cities_n > 0:
    cache = CHAT_CACHE_FILE if config.planned_diffusion.source == "chat" else CACHE_FILE
    d["path"] = d["path"] or os.path.join(os.path.abspath(workdir), cache)
  return d


def build_pd(config, workdir: str):
  """Build (trainer, tokenizer, train dataset, eval dataset or None, checkpointer), as
  :func:`selforch_jax.trainers.run.build` does for SFT; the cities records are written first
  (:func:`~selforch_jax.data.planned_diffusion_data.ensure_cities_data`)."""
  from selforch_jax import sharding as shd
  from selforch_jax.adapter import load_adapter_weights
  from selforch_jax.data.pipeline import make_dataset
  from selforch_jax.data.planned_diffusion_data import ensure_chat_pd_data, ensure_cities_data
  from selforch_jax.lang.tags import TagVocab
  from selforch_jax.models.transformer import add_lora
  from selforch_jax.trainers.checkpoint import Checkpointer
  from selforch_jax.trainers.planned_diffusion import PlannedDiffusionTrainer
  from selforch_jax.trainers.sft import SFTTrainer

  mc, p = config.model, config.planned_diffusion
  _, model, tok = config_lib.load_model(mc)
  if tok is None:
    raise config_lib.ConfigError("training needs a tokenizer: set model.tokenizer or use GGUF/HF "
                                 "weights")
  data = data_section(config, workdir)
  if p.cities_n > 0 and p.source == "chat":
    ensure_chat_pd_data(data["path"], lambda s: len(tok.encode(s)), seed=int(p.cities_seed),
                        pad=not p.pasta)
  elif p.cities_n > 0:
    ensure_cities_data(data["path"], lambda s: len(tok.encode(s)), n=int(p.cities_n),
                       seed=int(p.cities_seed), no_topic=bool(p.no_topic),
                       no_sync=bool(p.no_sync), pad=not p.pasta)
  lora = mc.lora_rank > 0
  if lora:
    model = add_lora(model, mc.lora_rank, mc.lora_alpha, mc.lora_targets, seed=config.train.seed)
    if p.init_adapter:          # continue from a committed adapter (a checkpoint overrides it)
      load_adapter_weights(model, p.init_adapter)
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  kw = dict(lora=lora, train_embed_rows_from=config.train.train_embed_rows_from,
            new_rows_lr_mult=config.train.new_rows_lr_mult)
  if p.ar_only or p.pasta:
    trainer = SFTTrainer(model, mesh, config.optim, config.train.steps, masked=True, **kw)
  else:
    trainer = PlannedDiffusionTrainer(model, mesh, config.optim, config.train.steps,
                                      tag_vocab=TagVocab.from_tokenizer(tok), eps=float(p.eps),
                                      ar_over_t=bool(p.ar_over_t),
                                      full_attention=bool(p.full_attention),
                                      seed=config.train.seed, suffix_p=float(p.suffix_p),
                                      **kw)
  train_ds = make_dataset(data, tok, "train", config.data.shuffle_seed)
  eval_ds = None
  if config.train.eval_every > 0:
    eval_ds = make_dataset(data | {"num_epochs": 1, "shuffle": False}, tok, "eval")
  ckpt = Checkpointer(workdir, config.train.checkpoint_every, config.train.keep,
                      config.train.async_checkpoint)
  return trainer, tok, train_ds, eval_ds, ckpt


def export_pd(config, workdir: str) -> str:
  """Write the run's adapter (``planned_diffusion.adapter_out``, default ``<workdir>/adapter``)
  from its last checkpoint; returns its directory."""
  from selforch_jax.adapter import export_adapter
  out = config.planned_diffusion.adapter_out or os.path.join(workdir, "adapter")
  return export_adapter(workdir, out)
