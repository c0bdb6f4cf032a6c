"""The training run behind ``python -m selforch_jax.train``: config schema, validation,
the loop (metrics, eval, checkpoints, resume, SIGTERM, NaN stop).

Kept apart from the absl entry point so that config files can import :func:`defaults`
without defining flags twice.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib

import ml_collections
from absl import logging

from selforch_jax import config_lib


from selforch_jax.trainers.train_config import TRAINERS, TrainingError, defaults  # noqa: F401


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Validate a training config before any work. Raises ``config_lib.ConfigError``."""
  from selforch_jax import sharding as shd
  from selforch_jax.data.pipeline import DataConfig

  if config.get("trainer") == "sol":   # SOL's compute policy: its own schema and loop
    from selforch_jax.trainers.sol_run import validate as validate_sol
    validate_sol(config)
    return
  config_lib.validate(config, defaults())
  config_lib.validate_model(config.model)
  if config.trainer not in TRAINERS:
    raise config_lib.ConfigError(f"trainer={config.trainer!r} must be one of {TRAINERS}")
  if config.trainer in ("grpo", "bonbon"):
    from selforch_jax.trainers.train_config import validate_po
    validate_po(config)
  if config.trainer == "orthrus":
    from selforch_jax.trainers.orthrus_run import validate_orthrus
    validate_orthrus(config)
  if config.trainer == "planned_diffusion":
    from selforch_jax.trainers.planned_diffusion_run import validate_pd
    validate_pd(config)
  from selforch_jax.data.sources import DATASETS
  try:
    DataConfig.from_any(config.data)
  except (ValueError, TypeError) as e:
    raise config_lib.ConfigError(f"data: {e}") from None
  if config.data.name not in DATASETS:
    raise config_lib.ConfigError(f"data.name={config.data.name!r} is unknown; known: {sorted(DATASETS)}")
  if config.data.annotated and not config.model.tags:
    raise config_lib.ConfigError("data.annotated=True needs model.tags=True (the tokenizer and "
                                 "model need the orchestration tags)")
  if config.data.annotator:
    from selforch_jax.lang import annotators
    if config.data.annotator not in annotators.annotator_names():
      raise config_lib.ConfigError(f"data.annotator={config.data.annotator!r} is unknown; known: "
                                   f"{annotators.annotator_names()}")
  if config.train.new_rows_lr_mult <= 0:
    raise config_lib.ConfigError(f"train.new_rows_lr_mult={config.train.new_rows_lr_mult} must be > 0")
  if config.train.steps < 1:
    raise config_lib.ConfigError(f"train.steps={config.train.steps} must be >= 1")
  if config.optim.grad_accum < 1 or config.data.batch_size % config.optim.grad_accum:
    raise config_lib.ConfigError(
        f"data.batch_size={config.data.batch_size} must be a multiple of "
        f"optim.grad_accum={config.optim.grad_accum}")
  o = config.optim
  for key, ok in (("lr", o.lr > 0), ("warmup_steps", o.warmup_steps >= 0),
                  ("end_lr_frac", 0 <= o.end_lr_frac <= 1), ("weight_decay", o.weight_decay >= 0),
                  ("b1", 0 <= o.b1 < 1), ("b2", 0 <= o.b2 < 1), ("eps", o.eps > 0),
                  ("clip_norm", o.clip_norm >= 0)):
    if not ok:
      raise config_lib.ConfigError(f"optim.{key}={o[key]!r} is out of range")
  if config.optim.schedule not in ("cosine", "linear", "constant"):
    raise config_lib.ConfigError(f"optim.schedule={config.optim.schedule!r} must be cosine, "
                                 "linear or constant")
  try:
    d, f, t = shd.mesh_shape(config.mesh.data, config.mesh.fsdp, config.mesh.tensor, num_devices)
  except shd.MeshError as e:
    raise config_lib.ConfigError(f"mesh: {e}") from None
  import jax
  nproc = jax.process_count()
  if config.data.batch_size % (d * f) or (config.data.batch_size // nproc) * nproc != config.data.batch_size:
    raise config_lib.ConfigError(
        f"data.batch_size={config.data.batch_size} must be divisible by the batch mesh axes "
        f"data x fsdp = {d * f} and by the {nproc} processes")


def catch_stop_signals(verbose: bool) -> tuple[dict, dict]:
  """Make SIGTERM / SIGINT (Ctrl-C) request a checkpoint and a clean stop after the current step.

  Returns ``(stop, old_handlers)``: ``stop["signal"]`` becomes the signal number when one arrives
  (the loop checks it); restore with ``signal.signal(sig, h) for sig, h in old_handlers.items()``.
  A second Ctrl-C raises KeyboardInterrupt at once. ``verbose`` prints what Ctrl-C does.
  """
  stop = {"signal": None}

  def on_term(signum, frame):
    if stop["signal"] is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt  # a second Ctrl-C stops at once
    stop["signal"] = signum
    if verbose and signum == signal.SIGINT:
      print("\ninterrupted: saving a checkpoint after this step (Ctrl-C again to abort)",
            file=sys.stderr)

  return stop, {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGINT)}


def tb_tag(key: str) -> str:
  """TensorBoard tag of a metric key: ``eval_loss`` -> ``eval/loss``, ``loss`` -> ``train/loss``,
  ``lr`` -> ``train/lr``; a key that already has a ``/`` is kept."""
  if "/" in key:
    return key
  if key.startswith("eval_"):
    return "eval/" + key[len("eval_"):]
  return "train/" + key


class MetricsWriter:
  """Metrics to ``metrics.jsonl`` and, when tensorboardX is installed (``pip install -e
  .[tensorboard]``), TensorBoard event files in ``<workdir>/tb`` under namespaced tags
  (:func:`tb_tag`: ``train/loss``, ``train/lr``, ``eval/loss``, ...), on process 0."""

  def __init__(self, workdir: str, enabled: bool = True, start_step: int = 0):
    """Rows of steps after ``start_step`` (left by an interrupted run that is now resumed
    from an earlier checkpoint) are dropped, so every step appears once."""
    self.enabled = enabled
    self.tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, "metrics.jsonl")
      if os.path.exists(path):
        with open(path) as f:
          keep = [l for l in f if l.strip() and json.loads(l).get("step", 0) <= start_step]
        with open(path, "w") as f:
          f.writelines(keep)
      self.f = open(path, "a")
      try:
        from tensorboardX import SummaryWriter
      except ImportError:
        logging.info("tensorboardX not installed (pip install -e .[tensorboard]): metrics.jsonl only")
      else:
        self.tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    self.f.write(json.dumps({"step": step, **metrics}) + "\n")
    self.f.flush()
    if self.tb is None:
      return
    for k, v in metrics.items():
      if isinstance(v, (int, float)) and not isinstance(v, bool):
        self.tb.add_scalar(tb_tag(k), v, step)
    self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.f.close()
      if self.tb is not None:
        self.tb.close()


def build(config, workdir: str):
  """Build (trainer, tokenizer, train dataset, eval dataset or None, checkpointer)."""
  from selforch_jax import sharding as shd
  from selforch_jax.data.pipeline import make_dataset
  from selforch_jax.models.transformer import add_lora
  from selforch_jax.trainers.checkpoint import Checkpointer
  from selforch_jax.trainers.sft import SFTTrainer

  if config.trainer == "orthrus":
    from selforch_jax.trainers.orthrus_run import build_orthrus
    return build_orthrus(config, workdir)
  if config.trainer == "planned_diffusion":
    from selforch_jax.trainers.planned_diffusion_run import build_pd
    return build_pd(config, workdir)
  mc = config.model
  cfg, model, tok = config_lib.load_model(mc)
  if tok is None:
    raise config_lib.ConfigError("training needs a tokenizer: set model.tokenizer or use GGUF/HF weights")
  lora = mc.lora_rank > 0
  if lora:
    model = add_lora(model, mc.lora_rank, mc.lora_alpha, mc.lora_targets, seed=config.train.seed)
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  trainer = SFTTrainer(model, mesh, config.optim, config.train.steps, lora=lora,
                       train_embed_rows_from=config.train.train_embed_rows_from,
                       masked=bool(config.data.annotated),
                       new_rows_lr_mult=config.train.new_rows_lr_mult)
  train_ds = make_dataset(config.data, tok, "train", config.data.shuffle_seed)
  eval_ds = None
  if config.train.eval_every > 0:
    eval_cfg = config.data.to_dict() | {"num_epochs": 1, "shuffle": False}
    eval_ds = make_dataset(eval_cfg, tok, "eval")
  ckpt = Checkpointer(workdir, config.train.checkpoint_every, config.train.keep,
                      config.train.async_checkpoint)
  return trainer, tok, train_ds, eval_ds, ckpt


RESUME_SECTIONS = ("model", "data")  # must match the checkpoint's config to resume
# execution details that do not change the parameters or the batches
RESUME_MAY_CHANGE = ("data.num_threads", "data.prefetch_buffer_size", "model.remat", "model.dtype")


def resume_diffs(saved: dict, now: dict) -> list[str]:
  """The ``RESUME_SECTIONS`` keys where two configs (``ConfigDict.to_json`` dicts) differ, as
  ``"data.seq_len: checkpoint 64, now 128"`` lines. A key only one side has (added to
  :func:`defaults` after the checkpoint was written, or dropped since) counts as its default
  value, so a checkpoint written before a new key existed resumes while that key keeps its
  default; ``RESUME_MAY_CHANGE`` keys never count."""
  base = json.loads(defaults().to_json())
  diffs = []
  for sect in RESUME_SECTIONS:
    a, b, d = saved.get(sect, {}), now.get(sect, {}), base.get(sect, {})
    for k in sorted(set(a) | set(b)):
      va, vb = a.get(k, d.get(k)), b.get(k, d.get(k))
      if va != vb and f"{sect}.{k}" not in RESUME_MAY_CHANGE:
        diffs.append(f"{sect}.{k}: checkpoint {va!r}, now {vb!r}")
  return diffs


def check_resume_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Refuse to resume a checkpoint written with a different model or data config.

  ``optim``, ``train`` (e.g. more steps) and ``mesh`` may change between runs.

  Raises:
    config_lib.ConfigError: listing the keys that differ, before any model is loaded.
  """
  from selforch_jax.trainers.checkpoint import Checkpointer
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    return
  ck = Checkpointer(workdir, async_save=False)
  try:
    if ck.latest_step() is None:
      return
    saved = ck.restore_config()
  finally:
    ck.close()
  diffs = resume_diffs(saved, json.loads(config.to_json()))
  if diffs:
    raise config_lib.ConfigError(
        f"{workdir} holds a checkpoint of a different run; resuming it needs the same model and "
        f"data config (use another --workdir to start fresh). Differences: " + "; ".join(diffs))


def local_rows(batch: dict, process_index: int, process_count: int) -> dict:
  """This process's slice of a global batch (rows split evenly across processes)."""
  if process_count == 1:
    return batch
  B = next(iter(batch.values())).shape[0]
  n = B // process_count
  return {k: v[process_index * n:(process_index + 1) * n] for k, v in batch.items()}


def train(config: ml_collections.ConfigDict, workdir: str, stop_at: int | None = None) -> dict:
  """Run (or resume) training. Returns a summary dict (final step, last loss, ...).

  Args:
    config: a validated-on-entry training config (see :func:`defaults`).
    workdir: run directory; an existing checkpoint there is resumed.
    stop_at: stop (with a checkpoint) once this step is reached, as if interrupted; the
      schedule still follows ``train.steps``.

  Raises:
    config_lib.ConfigError: a bad config (before any work).
    TrainingError: a non-finite loss (the last good checkpoint is kept).
  """
  import itertools

  import jax
  import numpy as np
  from tqdm import tqdm

  validate(config)
  check_resume_config(config, workdir)
  is_main = jax.process_index() == 0
  trainer, tok, train_ds, eval_ds, ckpt = build(config, workdir)
  data_iter = iter(train_ds)
  config_json = json.loads(config.to_json())
  start = 0
  if ckpt.latest_step() is not None:
    start = ckpt.restore(trainer, data_iter)
    logging.info("resumed from step %d in %s", start, ckpt.directory)
    if is_main:
      print(f"resumed from checkpoint at step {start}", file=sys.stderr)
  stop, old = catch_stop_signals(is_main)
  writer = MetricsWriter(workdir, enabled=is_main, start_step=start)
  pid, nproc = jax.process_index(), jax.process_count()
  last = {}
  steps = config.train.steps
  def run_eval():
    return trainer.eval_loss(local_rows(b, pid, nproc)
                             for b in itertools.islice(iter(eval_ds), config.train.eval_batches))

  if eval_ds is not None and start == 0:  # the starting model's eval loss, for comparison
    writer.write(0, run_eval())
  bar = tqdm(total=steps, initial=start, desc="train", unit="step", file=sys.stderr,
             disable=not is_main)
  try:
    while trainer.step < steps:
      if stop["signal"] is not None or (stop_at is not None and trainer.step >= stop_at):
        break
      try:
        batch = next(data_iter)
      except StopIteration:
        logging.info("data exhausted at step %d", trainer.step)
        break
      t0 = time.perf_counter()
      m = trainer.train_step(local_rows(batch, pid, nproc))
      dt = time.perf_counter() - t0
      if not np.isfinite(m["loss"]) or not np.isfinite(m["grad_norm"]):
        ckpt.wait()
        what = "loss" if not np.isfinite(m["loss"]) else "gradient norm"
        last_ck = ckpt.latest_step()
        where = (f"last good checkpoint: step {last_ck} in {ckpt.directory}" if last_ck is not None
                 else "no checkpoint was saved yet")
        raise TrainingError(
            f"non-finite {what} at step {trainer.step} (loss {m['loss']}, grad norm "
            f"{m['grad_norm']}); stopped, {where}")
      real = batch["segment_ids"].astype(bool) if "segment_ids" in batch else batch["valid"]
      m["tokens_per_s"] = float(real.sum()) / dt
      m["step_time_s"] = dt
      m["batch_crc32"] = zlib.crc32(np.ascontiguousarray(batch["tokens"]).tobytes())
      last = m
      if trainer.step % config.train.log_every == 0 or trainer.step == steps:
        writer.write(trainer.step, m)
      if eval_ds is not None and trainer.step % config.train.eval_every == 0:
        ev = run_eval()
        writer.write(trainer.step, ev)
        last.update(ev)
      bar.update(1)
      bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}")
      ckpt.maybe_save(trainer, data_iter, config_json)
    # final / preemption checkpoint
    if ckpt.latest_step() != trainer.step:
      ckpt.save(trainer, data_iter, config_json, force=True)
    ckpt.wait()
  finally:
    bar.close()
    writer.close()
    for sig, handler in old.items():
      signal.signal(sig, handler)
  ckpt.close()
  summary = {"step": trainer.step, "preempted": stop["signal"] is not None,
             "checkpoint": ckpt.directory, **{k: v for k, v in last.items()}}
  if config.trainer == "orthrus" and is_main:
    from selforch_jax.trainers.orthrus_run import export_orthrus
    summary["adapter"] = export_orthrus(config, trainer, tok, workdir)
  if config.trainer == "planned_diffusion" and is_main and config.model.lora_rank:
    from selforch_jax.trainers.planned_diffusion_run import export_pd
    summary["adapter"] = export_pd(config, workdir)
  return summary


