"""The training config's schema and the pieces both training loops share: :func:`defaults`,
:data:`TRAINERS`, :class:`TrainingError`, and :func:`validate_po` (the GRPO / BoNBoN value
checks).

:mod:`selforch_jax.trainers.run` (SFT; its ``validate`` calls :func:`validate_po`) and
:mod:`selforch_jax.trainers.po_run` (GRPO / BoNBoN) both import this module, so neither imports
the other for these (``po_run`` imports ``run``'s loop helpers; ``run`` imports nothing of
``po_run``): no import cycle.
"""

from __future__ import annotations

import os

import ml_collections

from selforch_jax import config_lib

__all__ = ["TrainingError", "defaults", "TRAINERS", "validate_po"]


class TrainingError(RuntimeError):
  """Training stopped (e.g. a non-finite loss)."""


def defaults() -> ml_collections.ConfigDict:
  """Every key of a training config with its default (types are checked against these)."""
  from ml_collections.config_dict import placeholder

  from selforch_jax.trainers.optim import optim_defaults

  model = config_lib.model_defaults()
  data = ml_collections.ConfigDict(dict(
      name="gsm8k", path=placeholder(str), split="train", eval_fraction=0.0, eval_split_seed=0,
      eval_path=placeholder(str), seq_len=256, batch_size=8, packing=True,
      num_packing_bins=placeholder(int), shuffle=True, shuffle_seed=0, num_epochs=placeholder(int),
      max_examples=placeholder(int), annotated_repeats=1, drop_remainder=True, num_threads=2,
      prefetch_buffer_size=16,
      annotated=False, annotator=placeholder(str), annotator_args=ml_collections.ConfigDict(),
      strip_tags=False, async_sees_full_plan=False, chunk_bidirectional=False))
  train = ml_collections.ConfigDict(dict(
      steps=100, log_every=1, eval_every=0, eval_batches=4, checkpoint_every=50, keep=3,
      async_checkpoint=True, train_embed_rows_from=-1, new_rows_lr_mult=1.0, seed=0))
  mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
  from selforch_jax.trainers.bonbon_config import bonbon_defaults
  from selforch_jax.trainers.grpo_config import grpo_defaults
  # Orthrus (trainers/orthrus.py): diffusion block, loss (kl | ce), view_rank (0 = full view
  # copies, else a low-rank delta), the continuation cache's sources ("gsm8k:96,alpaca:32"; ""
  # = data.path is given), its token budget and batch, where the adapter goes, and denoise
  # (single | multi: MDLM-style partially revealed blocks, trainers/orthrus.py)
  orthrus = ml_collections.ConfigDict(dict(
      block_size=8, loss="kl", view_rank=16, sources="", max_new_tokens=128, gen_batch_size=16,
      adapter_out="", denoise="single"))
  # Planned Diffusion (trainers/planned_diffusion.py): t's lower end, upstream's AR/t flag, dense
  # attention inside a round, the synthetic cities records written to the workdir (cities_n
  # examples of seed cities_seed; 0 = data.path), upstream's ablations, where the adapter goes;
  # pasta: PASTA SFT on the same records (no [PAD], PASTA's mask, plain masked CE);
  # init_adapter: an adapter directory whose LoRA + tag rows the run starts from ("" = none);
  # source: "cities" (the synthetic records above) or "chat" (data/pasta/train.jsonl converted by
  # data/planned_diffusion_data.chat_pd_records, written to the workdir when cities_n > 0);
  # suffix_p: the share of rows with semi-autoregressive noise (a masked suffix of every chunk)
  planned_diffusion = ml_collections.ConfigDict(dict(
      eps=1e-3, ar_over_t=False, full_attention=False, ar_only=False, no_topic=False,
      no_sync=False, cities_n=2000, cities_seed=0, adapter_out="", pasta=False,
      init_adapter="", source="cities", suffix_p=0.0))
  # trainer: "sft" / "orthrus" / "planned_diffusion" (this module's loop), "grpo" or "bonbon"
  # (trainers/po_run.py)
  return ml_collections.ConfigDict(dict(model=model, data=data, optim=optim_defaults(),
                                        train=train, mesh=mesh, trainer="sft",
                                        grpo=grpo_defaults(), bonbon=bonbon_defaults(),
                                        orthrus=orthrus, planned_diffusion=planned_diffusion))


TRAINERS = ("sft", "grpo", "bonbon", "orthrus", "planned_diffusion")


def validate_po(config: ml_collections.ConfigDict) -> None:
  """Value checks of the ``grpo`` / ``bonbon`` section in use (types are checked by
  ``trainers.run.validate``). Raises ``config_lib.ConfigError`` naming the key."""
  from selforch_jax.data.sources import DATASETS
  from selforch_jax.runtime.schedulers import available
  from selforch_jax.trainers.bonbon import SCORES
  from selforch_jax.trainers.rewards import reward_names

  name = config.trainer
  s = config[name]
  checks = [("max_new_tokens", s.max_new_tokens >= 1), ("temperature", s.temperature >= 0),
            ("top_k", s.top_k >= 0), ("top_p", 0 < s.top_p <= 1), ("num_pages", s.num_pages >= 1),
            ("page_size", s.page_size >= 1), ("max_prompt_tokens", s.max_prompt_tokens >= 1)]
  if name == "grpo":
    checks += [("group_size", s.group_size >= 1), ("prompts_per_step", s.prompts_per_step >= 1),
               ("clip_eps", s.clip_eps > 0), ("kl_coef", s.kl_coef >= 0),
               ("adv_eps", s.adv_eps >= 0), ("inner_steps", s.inner_steps >= 1)]
  else:
    checks += [("num_samples", s.num_samples >= 2), ("prompts_per_round", s.prompts_per_round >= 1),
               ("updates_per_round", s.updates_per_round >= 1),
               ("pairs_per_step", s.pairs_per_step >= 1), ("alpha", s.alpha >= 0),
               ("tau", s.tau > 0), ("min_score_gap", s.min_score_gap >= 0)]
  for key, ok in checks:
    if not ok:
      raise config_lib.ConfigError(f"{name}.{key}={s[key]!r} is out of range")
  if name == "grpo" and s.reward not in reward_names():
    raise config_lib.ConfigError(f"grpo.reward={s.reward!r} is unknown; known: {reward_names()}")
  if name == "bonbon":
    if s.score not in SCORES:
      raise config_lib.ConfigError(f"bonbon.score={s.score!r} must be one of {SCORES}")
    if s.quality not in ("ref_nll", "judge") and s.quality not in reward_names():
      raise config_lib.ConfigError(f"bonbon.quality={s.quality!r} must be 'ref_nll', 'judge' or a "
                                   f"reward: {reward_names()}")
    from selforch_jax.eval.judges import config_error
    bad_judge = config_error(s.judge, "bonbon.judge")
    if bad_judge:
      raise config_lib.ConfigError(bad_judge)
    if s.quality == "judge" and s.judge.backend in ("", "none"):
      raise config_lib.ConfigError("bonbon.quality='judge' needs bonbon.judge.backend ('openai' "
                                   "with bonbon.judge.url and bonbon.judge.model, or 'local')")
  if s.scheduler not in available():
    raise config_lib.ConfigError(f"{name}.scheduler={s.scheduler!r} is not registered; "
                                 f"registered: {available()}")
  if s.dataset not in DATASETS:
    raise config_lib.ConfigError(f"{name}.dataset={s.dataset!r} is unknown; known: {sorted(DATASETS)}")
  if s.layout_mask and not config.model.tags and not s.init_from:
    raise config_lib.ConfigError(f"{name}.layout_mask=True needs model.tags=True (or an init_from "
                                 "run trained with tags)")
  if config.optim.grad_accum != 1:
    raise config_lib.ConfigError("policy optimization needs optim.grad_accum=1")
  init = s.init_from
  if init and "://" not in init and not os.path.isdir(os.path.join(init, "checkpoints")):
    raise config_lib.ConfigError(
        f"{name}.init_from={init!r} is not a training workdir (no {init}/checkpoints): run the SFT "
        "stage first (e.g. python -m selforch_jax.train --config=configs/tip.py:sft "
        "--workdir=out/tip_sft, or configs/pasta.py:sft --workdir=out/pasta_sft), or set "
        f"{name}.init_from='' to start from the model weights")
