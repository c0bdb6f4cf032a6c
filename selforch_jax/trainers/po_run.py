r"""The policy-optimization runs behind ``python -m selforch_jax.train`` when
``config.trainer`` is ``"grpo"`` or ``"bonbon"``: prompts, rollouts, rewards / scores, updates,
metrics, Orbax checkpoints and resume, SIGTERM.

One loop step is one rollout batch (GRPO: ``grpo.prompts_per_step`` prompts x
``grpo.group_size`` samples, then ``grpo.inner_steps`` updates) or one round (BoNBoN:
``bonbon.prompts_per_round`` prompts x ``bonbon.num_samples``, best-vs-worst pairs, then
``bonbon.updates_per_round`` updates); ``train.steps`` counts loop steps and
``train.checkpoint_every`` is in loop steps. Checkpoints (``trainers/checkpoint.py``) hold the
policy, the optimizer, the optimizer step and the prompt iterator (grain); pi_ref is rebuilt
from the initial model on resume, and the rollout seed of loop step s is drawn from
``numpy.random.default_rng([seed, s])``,
so an interrupted and resumed run gives the same parameters as a straight one.

Examples (GRPO of SmolLM2-135M-Instruct with LoRA on GSM8K, CPU-sized; BoNBoN for PASTA)::

  python -m selforch_jax.train --config=configs/sft.py:model=smollm2_135m,lora_rank=8,steps=3 \
      --config.trainer=grpo --config.grpo.group_size=4 --config.grpo.prompts_per_step=2 \
      --config.grpo.max_new_tokens=96 --config.grpo.max_prompt_tokens=160 \
      --config.optim.warmup_steps=0 --workdir=out/grpo
  python -m selforch_jax.train --config=configs/pasta_po.py:init_from=out/pasta_sft \
      --workdir=out/pasta_po
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import zlib

import ml_collections
import numpy as np
from absl import logging

from selforch_jax import config_lib


def po_defaults(trainer: str = "grpo") -> ml_collections.ConfigDict:
  """A full training config (``trainers.run.defaults()``) with ``trainer`` set."""
  from selforch_jax.trainers.train_config import defaults
  c = defaults()
  c.trainer = trainer
  return c


from selforch_jax.trainers.train_config import validate_po  # noqa: E402,F401  (moved there)


def load_policy(config):
  """``(model, tokenizer, tag_vocab or None)``: the initial policy.

  From ``<trainer>.init_from`` (a training workdir: its checkpoint, LoRA adapters kept) or the
  ``model`` section; LoRA adapters of rank ``model.lora_rank`` are added when the model has
  none.

  Raises:
    config_lib.ConfigError: no tokenizer.
  """
  from selforch_jax.lang.tags import TagVocab
  from selforch_jax.models.transformer import add_lora
  s = config[config.trainer]
  mc = config.model
  if s.init_from:
    from selforch_jax.trainers.restore import restore_run
    saved, model, tok, _ = restore_run(s.init_from)
    tags, nreg = saved.model.get("tags", False), saved.model.get("num_registers", 8)
  else:
    _, model, tok = config_lib.load_model(mc)
    tags, nreg = mc.tags, mc.num_registers
  if tok is None:
    raise config_lib.ConfigError("policy optimization needs a tokenizer (model.tokenizer)")
  if mc.lora_rank > 0 and not model.cfg.lora_rank:
    model = add_lora(model, mc.lora_rank, mc.lora_alpha, mc.lora_targets, seed=config.train.seed)
  tv = TagVocab.from_tokenizer(tok, int(nreg)) if tags else None
  return model, tok, tv


def load_prompts(s, tok) -> tuple[list[list[int]], list, list[str]]:
  """``(prompt token ids, references, instructions)`` of ``s.dataset`` / ``s.split`` (chat
  template with the generation prompt; the instruction is the last user turn's text), prompts
  longer than ``s.max_prompt_tokens`` dropped.

  Raises:
    ValueError: no prompt is short enough, or ``s.quality == "judge"`` and an example has no
      reference answer to judge against.
  """
  from selforch_jax.data.sources import load_examples, prompt_and_reference
  prompts, refs, instructions = [], [], []
  for i, ex in enumerate(load_examples(s.dataset, split=s.split, max_examples=s.max_examples)):
    msgs, ref = prompt_and_reference(ex)
    ids = tok.encode_chat(msgs, add_generation_prompt=True)
    if len(ids) <= s.max_prompt_tokens:
      if s.get("quality") == "judge" and not ref:
        raise ValueError(f"{s.dataset}/{s.split} example {i} has no reference answer for the "
                         "judge (bonbon.quality='judge' scores each sample against it)")
      prompts.append(list(ids))
      refs.append(ref)
      instructions.append(msgs[-1]["content"])
  if not prompts:
    raise ValueError(f"no prompt of {s.dataset}/{s.split} has <= {s.max_prompt_tokens} tokens")
  return prompts, refs, instructions


def prompt_iterator(n: int, batch: int, seed: int):
  """A checkpointable grain iterator of ``int64 [batch]`` prompt indices (shuffled, repeated)."""
  import grain
  ds = grain.MapDataset.range(n).shuffle(seed=seed).repeat(None)
  return iter(ds.to_iter_dataset().batch(batch, drop_remainder=True))


def response_text(tok, ids, tv) -> str:
  """Plain text of a response (tags stripped, logical order with a tag vocab)."""
  if tv is not None:
    from selforch_jax.lang import assemble_text
    return assemble_text(ids, tv, tok, skip_special_tokens=True)
  return tok.decode(ids, skip_special_tokens=True)


def _sampling(s, seed: int):
  from selforch_jax.runtime.sampling import SamplingParams
  return SamplingParams(temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p),
                        seed=int(seed))


def _rollout(trainer, s, prompts, group, seed, stop_id, tv, pad_id):
  from selforch_jax.trainers.rollouts import bucket_len, sample, to_batch
  ro = sample(trainer.model(), prompts, max_new_tokens=int(s.max_new_tokens), stop_id=stop_id,
              scheduler=s.scheduler, group_size=group, sampling=_sampling(s, seed),
              num_pages=int(s.num_pages), page_size=int(s.page_size),
              scheduler_kwargs=s.scheduler_kwargs.to_dict(), tag_vocab=tv)
  # one row length for every batch (one compiled update): the longest prompt + response
  seq_len = bucket_len(int(s.max_prompt_tokens) + int(s.max_new_tokens) - 1)
  kw = s.scheduler_kwargs.to_dict()
  layout_kw = {k: kw[k] for k in ("cap", "length_unit") if k in kw}  # the runtime's chunk rules
  batch = to_batch(ro.prompts, ro.responses, seq_len, pad_id=pad_id,
                   tag_vocab=tv if s.layout_mask else None, **layout_kw)
  return ro, batch, layout_kw


def grpo_step(trainer, s, prompts, refs, step_seed, tok, tv) -> dict:
  """One GRPO rollout batch + ``inner_steps`` updates; returns the step's metrics."""
  from selforch_jax.trainers.grpo import group_advantages
  from selforch_jax.trainers.rewards import get_reward
  t0 = time.perf_counter()
  G = int(s.group_size)
  ro, batch, _ = _rollout(trainer, s, prompts, G, step_seed, tok.stop_ids[0], tv, tok.pad_id)
  reward = get_reward(s.reward)
  texts = [response_text(tok, r, tv) for r in ro.responses]
  rows_ref = [refs[i // G] for i in range(len(texts))]
  rewards = np.asarray([reward(t, ref, s.format_weight) for t, ref in zip(texts, rows_ref)])
  correct = np.asarray([get_reward("gsm8k_correct")(t, ref) for t, ref in zip(texts, rows_ref)]) \
      if s.reward.startswith("gsm8k") else np.full(len(texts), np.nan)
  adv = group_advantages(rewards.reshape(-1, G), s.adv_eps).reshape(-1)
  batch["advantages"] = adv
  t1 = time.perf_counter()
  ms = trainer.update(batch)
  t2 = time.perf_counter()
  last = ms[-1]
  return {"reward": float(rewards.mean()), "reward_std": float(rewards.std()),
          "accuracy": float(np.mean(correct)), "kl": float(np.mean([m["kl"] for m in ms])),
          "loss": float(np.mean([m["loss"] for m in ms])), "pg_loss": float(ms[0]["pg_loss"]),
          "clip_frac": float(np.mean([m["clip_frac"] for m in ms])),
          "grad_norm": float(last["grad_norm"]), "lr": float(last["lr"]),
          "response_tokens": float(ro.response_lengths().mean()),
          "finished_frac": float(np.mean([f == "stop" for f in ro.finish])),
          "zero_adv_groups": float(np.mean((adv.reshape(-1, G) == 0).all(1))),
          "rollout_s": t1 - t0, "update_s": t2 - t1, "step_time_s": t2 - t0,
          "batch_crc32": zlib.crc32(np.ascontiguousarray(batch["tokens"]).tobytes())}


def bonbon_round(trainer, s, prompts, refs, step_seed, tok, tv, judge=None,
                 instructions=None) -> dict:
  """One BoNBoN round: sample, score, pair, ``updates_per_round`` updates; returns metrics.

  ``judge`` (a :class:`~selforch_jax.eval.judges.PairwiseJudge`) and ``instructions`` (one per
  prompt) serve ``s.quality == "judge"``.

  Raises:
    TrainingError: no prompt of the round gave a qualifying pair.
  """
  from selforch_jax.trainers.bonbon import pair_batch, score, select_pairs, speedups
  from selforch_jax.trainers.logprobs import sequence_logprobs
  from selforch_jax.trainers.rewards import get_reward
  from selforch_jax.trainers.train_config import TrainingError
  t0 = time.perf_counter()
  N = int(s.num_samples)
  ro, rows, layout_kw = _rollout(trainer, s, prompts, N, step_seed, tok.stop_ids[0], tv,
                                 tok.pad_id)
  if s.quality == "judge" and (judge is None or instructions is None):
    raise ValueError("bonbon.quality='judge' needs judge= and instructions= (train_po passes "
                     "make_po_judge's judge)")
  ref_tok = trainer.logprobs(rows, reference=True)
  ref_seq = np.asarray(sequence_logprobs(ref_tok, rows["loss_mask"]))
  ntok = np.maximum(rows["loss_mask"].sum(-1), 1)
  if s.quality == "ref_nll":
    quality = ref_seq / ntok
  else:   # samples are prompt-major: sample i answers prompt i // N
    texts = [response_text(tok, r, tv) for r in ro.responses]
    if s.quality == "judge":
      from selforch_jax.eval.judges import pair_score
      quality = np.asarray([pair_score(judge, instructions[i // N], t, refs[i // N])
                            for i, t in enumerate(texts)])
    else:
      fn = get_reward(s.quality)
      quality = np.asarray([fn(t, refs[i // N], 0.0) for i, t in enumerate(texts)])
  sp = speedups(ro.prompts, ro.responses, tv, **layout_kw)
  sc = score(s.score, speedup=sp, quality=quality, lengths=ro.response_lengths(),
             quality_weight=float(s.quality_weight))
  triples = select_pairs(sc.reshape(-1, N), float(s.min_score_gap))
  if not triples:
    raise TrainingError(f"round at step {trainer.step}: no prompt gave a pair with a score gap "
                        f"(scores {sc.round(3).tolist()})")
  pairs = [(p * N + b, p * N + w) for p, b, w in triples]
  order = np.random.default_rng(step_seed).permutation(len(pairs))
  t1 = time.perf_counter()
  ms, k = [], 0
  for _ in range(int(s.updates_per_round)):
    take = [pairs[order[(k + j) % len(pairs)]] for j in range(int(s.pairs_per_step))]
    k += int(s.pairs_per_step)
    ms.append(trainer.train_step(pair_batch(rows, ref_seq, take)))
  t2 = time.perf_counter()
  best = np.asarray([sc[p * N + b] for p, b, _ in triples])
  return {"loss": float(np.mean([m["loss"] for m in ms])),
          "ipo": float(np.mean([m["ipo"] for m in ms])),
          "sft": float(np.mean([m["sft"] for m in ms])),
          "margin": float(ms[-1]["margin"]), "grad_norm": float(ms[-1]["grad_norm"]),
          "lr": float(ms[-1]["lr"]), "pairs": float(len(pairs)), "score": float(sc.mean()),
          "best_score": float(best.mean()), "speedup": float(sp.mean()),
          "quality": float(np.mean(quality)), "response_tokens": float(ro.response_lengths().mean()),
          "rollout_s": t1 - t0, "update_s": t2 - t1, "step_time_s": t2 - t0,
          **({"judge_unparsed": float(judge.unparsed)} if s.quality == "judge" else {})}


def build_po(config, workdir: str):
  """``(trainer, tokenizer, tag_vocab, (prompts, references, instructions), prompt iterator,
  checkpointer, optimizer steps per loop step)``."""
  from selforch_jax import sharding as shd
  from selforch_jax.trainers.bonbon import BonbonTrainer
  from selforch_jax.trainers.checkpoint import Checkpointer
  from selforch_jax.trainers.grpo import GRPOTrainer
  from selforch_jax.trainers.restore import steps_per_round
  s = config[config.trainer]
  model, tok, tv = load_policy(config)
  lora = bool(model.cfg.lora_rank)
  mesh = shd.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  common = dict(lora=lora, train_embed_rows_from=config.train.train_embed_rows_from,
                new_rows_lr_mult=config.train.new_rows_lr_mult)
  per = steps_per_round(config)
  if config.trainer == "grpo":
    trainer = GRPOTrainer(model, mesh, config.optim, config.train.steps * per, clip_eps=s.clip_eps,
                          kl_coef=s.kl_coef, inner_steps=per, **common)
    batch = int(s.prompts_per_step)
  else:
    trainer = BonbonTrainer(model, mesh, config.optim, config.train.steps * per, alpha=s.alpha,
                            tau=s.tau, **common)
    batch = int(s.prompts_per_round)
  prompts, refs, instructions = load_prompts(s, tok)
  it = prompt_iterator(len(prompts), batch, int(s.shuffle_seed))
  ckpt = Checkpointer(workdir, config.train.checkpoint_every, config.train.keep,
                      config.train.async_checkpoint)
  return trainer, tok, tv, (prompts, refs, instructions), it, ckpt, per


def make_po_judge(config):
  """The judge of ``bonbon.quality == "judge"`` (None otherwise): ``bonbon.judge`` through
  :func:`selforch_jax.eval.judges.make_judge`; the "local" backend runs the base weights of
  the ``model`` section (not the policy) on an engine of its own. The judge answers one probe
  pair here, so that a wrong url or model fails before any rollout.

  Raises:
    config_lib.ConfigError: the judge did not answer the probe (names the url and the error).
  """
  s = config[config.trainer]
  if config.trainer != "bonbon" or s.quality != "judge":
    return None
  from selforch_jax.eval.judges import LocalJudge, make_judge
  engine = tok = None
  if s.judge.backend == "local":
    from selforch_jax.runtime.build import make_engine
    _, base, tok = config_lib.load_model(config.model)
    # a judge reads one prompt of at most MAX_PROMPT_TOKENS and generates nothing
    engine = make_engine(base, LocalJudge.MAX_PROMPT_TOKENS, 0, page_size=int(s.page_size),
                         threads=1, check=False)
  judge = make_judge(s.judge, engine, tok)
  try:
    judge.prefer("Name a primary colour.", "Red.", "Blue.")
  except Exception as e:  # noqa: BLE001 - any failure of the endpoint is a config problem
    raise config_lib.ConfigError(
        f"bonbon.judge ({s.judge.backend} {s.judge.url} {s.judge.model}) did not answer a probe "
        f"pair: {type(e).__name__}: {e}") from e
  judge.unparsed = 0
  return judge


def train_po(config: ml_collections.ConfigDict, workdir: str, stop_at: int | None = None) -> dict:
  """Run (or resume) GRPO / BoNBoN. Returns a summary dict.

  Args:
    config: a training config with ``trainer`` "grpo" or "bonbon".
    workdir: run directory; a checkpoint there is resumed.
    stop_at: stop (with a checkpoint) after this many loop steps, as if interrupted.

  Raises:
    config_lib.ConfigError: a bad config (before any work).
    TrainingError: a non-finite loss, or a BoNBoN round without pairs.
  """
  import jax
  from tqdm import tqdm

  from selforch_jax.trainers.run import (
      MetricsWriter, TrainingError, catch_stop_signals, check_resume_config, validate)

  validate(config)
  if config.trainer not in ("grpo", "bonbon"):
    raise config_lib.ConfigError(f"train_po runs grpo or bonbon, not trainer={config.trainer!r}")
  check_resume_config(config, workdir)
  s = config[config.trainer]
  judge = make_po_judge(config)   # before build_po makes the workdir: a bad judge loses nothing
  trainer, tok, tv, (prompts, refs, instructions), it, ckpt, per = build_po(config, workdir)
  config_json = json.loads(config.to_json())
  if ckpt.latest_step() is not None:
    ckpt.restore(trainer, it)
    print(f"resumed from checkpoint at loop step {trainer.step // per}", file=sys.stderr)
  is_main = jax.process_index() == 0
  stop, old = catch_stop_signals(is_main)
  writer = MetricsWriter(workdir, enabled=is_main, start_step=trainer.step // per)
  step_fn = grpo_step if config.trainer == "grpo" else bonbon_round
  steps, last = config.train.steps, {}
  bar = tqdm(total=steps, initial=trainer.step // per, desc=config.trainer, unit="step",
             file=sys.stderr, disable=not is_main)
  try:
    while trainer.step // per < steps:
      loop = trainer.step // per
      if stop["signal"] is not None or (stop_at is not None and loop >= stop_at):
        break
      idx = next(it)
      seed = int(np.random.default_rng([int(s.seed), loop]).integers(2**31 - 1))
      kw = {} if judge is None else dict(judge=judge, instructions=[instructions[i] for i in idx])
      m = step_fn(trainer, s, [prompts[i] for i in idx], [refs[i] for i in idx], seed, tok, tv,
                  **kw)
      if not np.isfinite(m["loss"]) or not np.isfinite(m["grad_norm"]):
        ckpt.wait()
        raise TrainingError(f"non-finite loss / grad norm at loop step {loop + 1} ({m['loss']}, "
                            f"{m['grad_norm']}); last good checkpoint: {ckpt.latest_step()}")
      last = m
      if (loop + 1) % config.train.log_every == 0 or loop + 1 == steps:
        writer.write(loop + 1, m)
      bar.update(1)
      bar.set_postfix(loss=f"{m['loss']:.4f}")
      if (loop + 1) % config.train.checkpoint_every == 0:
        ckpt.save(trainer, it, config_json)
    if ckpt.latest_step() != trainer.step:
      ckpt.save(trainer, it, config_json, force=True)
    ckpt.wait()
  finally:
    bar.close()
    writer.close()
    for sig, handler in old.items():
      signal.signal(sig, handler)
  ckpt.close()
  logging.info("%s finished at loop step %d", config.trainer, trainer.step // per)
  return {"step": trainer.step // per, "optimizer_steps": trainer.step,
          "preempted": stop["signal"] is not None, "checkpoint": ckpt.directory, **last}
