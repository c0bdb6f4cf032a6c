"""The SOL policy training run (``trainer = "sol"``; issue 22): teacher-forced episodes on the
engine (:class:`~selforch_jax.runtime.schedulers.sol.SOLEpisodeScheduler`), GRPO over K
counterfactual compute schedules per context (:mod:`selforch_jax.trainers.sol_grpo`), the policy
exported as a SOL adapter (:mod:`selforch_jax.sol_adapter`).

Each update: B windows of ``context_len + T + 1`` tokens of training text (chat-formatted GSM8K
train solutions / Alpaca outputs; evaluation sets are refused), a target budget sampled per
sequence (each axis uniform in [the grid's lowest value, 1], upstream's C_tok ~ U[0.1, 1],
C_pru ~ U[0.4, 1], C_q ~ U[0.3125, 1] for its grid), K rollouts at the rollout temperature, the
rewards, penalty and advantages of :mod:`~selforch_jax.trainers.sol_grpo`, one PPO step.
Every ``eval_every`` updates (and at the end) the greedy policy runs held-out training windows
at fixed targets: the budget tracking error ``|achieved - target|`` per axis
(:func:`budget_eval`). ``metrics.jsonl`` gets one record per update.
"""

from __future__ import annotations

import json
import os
import time

import ml_collections
import numpy as np

from selforch_jax import config_lib

ALLOWED_SOURCES = ("gsm8k", "alpaca")   # training splits only (never AlpacaEval / AIME / tests)


def sol_defaults() -> ml_collections.ConfigDict:
  """The ``sol`` section; upstream values (akhauriyash/SOL official configs) unless marked."""
  return ml_collections.ConfigDict(dict(
      grid="cpu",                 # upstream: "upstream" (10 x 13 x 12 = 1560 actions)
      sparsity="quest(8)",        # upstream quest, page 8
      context_len=96,             # upstream 512
      rollout_len=16,             # T, upstream 16
      rollouts=8,                 # K, upstream 16
      batch_size=4,               # B sequences per update
      gamma=0.85, tolerance=0.02, alpha="100,100,200", task_w_kl=0.0,   # w: 0 = LCE, 1 = DKL
      temperature=1.3, entropy_coef=0.05, clip_eps=0.2,
      lr=1e-4, grad_clip=2.0, weight_decay=0.0, ppo_epochs=1,
      d_model=128,                # upstream 512
      num_heads=4, num_layers=1, max_len=512,
      sources="gsm8k:2000,alpaca:400",
      eval_windows=8, eval_targets="0.5,0.8,8;0.75,0.9,12;1.0,0.7,8",
      eval_every=25, max_minutes=0.0,   # 0 = no wall-clock cap
      page_size=16, seed=0, adapter_out=""))


def defaults() -> ml_collections.ConfigDict:
  """Every key of a SOL training config."""
  return ml_collections.ConfigDict(dict(
      model=config_lib.model_defaults(), trainer="sol", sol=sol_defaults(),
      train=ml_collections.ConfigDict(dict(steps=100, log_every=1))))


def _alpha(text: str) -> np.ndarray:
  a = [float(x) for x in str(text).split(",")]
  if len(a) != 3 or min(a) < 0:
    raise ValueError(f"sol.alpha must be three numbers >= 0, got {text!r}")
  return np.array(a)


def parse_sources(text: str) -> list[tuple[str, int]]:
  """``"gsm8k:2000,alpaca:400"`` -> ``[(name, n)]``.

  Raises:
    ValueError: a malformed entry or a source other than :data:`ALLOWED_SOURCES`."""
  out = []
  for part in str(text).split(","):
    name, _, n = part.strip().partition(":")
    if name not in ALLOWED_SOURCES or not n.isdigit() or int(n) < 1:
      raise ValueError(f"sol.sources entry {part!r}: give name:N with name in "
                       f"{ALLOWED_SOURCES} (training text only; evaluation sets are refused)")
    out.append((name, int(n)))
  return out


def validate(config: ml_collections.ConfigDict) -> None:
  """Validate a SOL training config before any work. Raises ``config_lib.ConfigError``."""
  from selforch_jax.runtime.sol_actions import ActionGrid, parse_budget
  from selforch_jax.runtime.step import parse_sparsity
  config_lib.validate(config, defaults())
  config_lib.validate_model(config.model)
  s = config.sol
  try:
    ActionGrid.named(s.grid)
    parse_sparsity(s.sparsity)
    _alpha(s.alpha)
    parse_sources(s.sources)
    for t in s.eval_targets.split(";"):
      parse_budget(t)
  except ValueError as e:
    raise config_lib.ConfigError(f"sol: {e}") from None
  if min(s.context_len, s.rollout_len, s.rollouts, s.batch_size, s.eval_windows, s.d_model,
         s.num_heads, s.num_layers, s.ppo_epochs, config.train.steps) < 1:
    raise config_lib.ConfigError("sol sizes and train.steps must be >= 1")
  if s.rollout_len > s.max_len or not 0 <= s.task_w_kl <= 1 or not 0 < s.gamma <= 1:
    raise config_lib.ConfigError("sol: need rollout_len <= max_len, task_w_kl in [0, 1], "
                                 "gamma in (0, 1]")


def windows(tok, sources, length: int, seed: int = 0, split: str = "train") -> np.ndarray:
  """int32 ``[n, length]`` token windows of chat-formatted examples (question + reference
  answer) of ``sources`` ``[(name, rows)]``; each example longer than ``length`` gives one window
  ending at a random point of it (numpy ``default_rng(seed)``), shorter ones are skipped."""
  from selforch_jax.data.sources import load_examples
  rng = np.random.default_rng(seed)
  out = []
  for name, n in sources:
    for ex in load_examples(name, split=split, max_examples=n):
      ids = tok.encode_chat(ex["messages"], add_generation_prompt=False)
      if len(ids) >= length:
        end = int(rng.integers(length, len(ids) + 1))
        out.append(ids[end - length:end])
  if not out:
    raise ValueError(f"no example of {sources} has {length} tokens")
  return np.asarray(out, np.int32)


def sample_targets(rng, grid, n: int) -> np.ndarray:
  """float ``[n, 3]`` targets, each axis uniform in [the grid's lowest usage, 1]."""
  lo = grid.low()
  return lo + (1 - lo) * rng.random((n, 3))


def run_episodes(engine, policy, grid, seqs, targets, s, *, rollouts: int, greedy: bool,
                 seed: int, record: bool):
  """Run SOL episodes of ``seqs [B, Lc + T + 1]`` at ``targets [B, 3]`` (repeated over the K
  rollouts); returns ``(episode scheduler, controller)``."""
  from flax import nnx

  from selforch_jax.runtime.scheduler import run_job
  from selforch_jax.runtime.schedulers.sol import SOLEpisodeScheduler
  from selforch_jax.runtime.sol_control import BudgetController
  embed = nnx.merge(engine.graphdef, engine.state).embed[...]
  ctl = BudgetController(policy, grid, np.repeat(targets, rollouts, axis=0), s.rollout_len, embed,
                         temperature=1.0 if greedy else s.temperature, greedy=greedy, seed=seed,
                         record=record)
  ep = SOLEpisodeScheduler(seqs, s.context_len, ctl, grid, s.sparsity, rollouts=rollouts,
                           reference=s.task_w_kl > 0)
  run_job(engine, ep)
  return ep, ctl


def budget_eval(engine, policy, grid, seqs, s) -> dict:
  """The greedy policy on ``seqs`` at every ``sol.eval_targets``: mean ``|achieved - target|``
  per axis (usage units) and the mean teacher-forced log-prob."""
  from selforch_jax.runtime.sol_actions import parse_budget
  errs, lps = [], []
  for t in s.eval_targets.split(";"):
    tg = np.tile(parse_budget(t), (len(seqs), 1))
    ep, ctl = run_episodes(engine, policy, grid, seqs, tg, s, rollouts=1, greedy=True, seed=0,
                           record=False)
    errs.append(np.abs(ctl.achieved() - tg).mean(0))
    lps.append(float(ep.logp.mean()))
  e = np.mean(errs, 0)
  return dict(eval_budget_error=float(e.mean()), eval_error_kappa=float(e[0]),
              eval_error_rho=float(e[1]), eval_error_bits=float(e[2]),
              eval_logp=float(np.mean(lps)))


def episode_batch(ep, ctl, targets, s, alpha) -> tuple[dict, dict]:
  """The PPO replay batch and metrics of one training episode batch."""
  from selforch_jax.trainers.sol_grpo import budget_gaps, budget_penalty, discounted_returns, \
      sol_advantages
  B, K, T = ep.logp.shape
  r = (1 - s.task_w_kl) * ep.logp - s.task_w_kl * ep.kl
  G = discounted_returns(r, s.gamma)
  tg = np.repeat(targets, K, axis=0).reshape(B, K, 3)
  pen = budget_penalty(ep.usage, ep.eff, tg, alpha, s.tolerance)
  A = sol_advantages(G - pen[..., None], ep.eff)
  log = ctl.log
  stack = lambda k: np.stack([x[k] for x in log], 1)   # noqa: E731  [N, T, ...]
  batch = dict(h_prev=stack("h_prev"), emb=stack("emb"), scalars=stack("scalars"),
               prev_action=stack("prev_action"), action=stack("action"),
               old_logp=stack("logp"), advantages=A.reshape(B * K, T), mask=stack("eff"))
  gaps = np.abs(budget_gaps(ep.usage, ep.eff, tg))
  return batch, dict(reward=float(r.mean()), penalty=float(pen.mean()),
                     budget_error=float(gaps.mean()), error_kappa=float(gaps[..., 0].mean()),
                     error_rho=float(gaps[..., 1].mean()), error_bits=float(gaps[..., 2].mean()))


def train_sol(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Train the SOL policy (module docstring); writes ``metrics.jsonl`` and the adapter
  (``sol.adapter_out`` or ``<workdir>/adapter``); returns the summary.

  Raises:
    ConfigError: a bad config (before any model loads).
  """
  from selforch_jax.models.sol_policy import SolPolicyConfig, init_policy
  from selforch_jax.runtime.engine import Engine
  from selforch_jax.runtime.sol_actions import ActionGrid
  from selforch_jax.sol_adapter import export_sol_adapter
  from selforch_jax.trainers.sol_grpo import SOLPolicyTrainer

  validate(config)
  s = config.sol
  os.makedirs(workdir, exist_ok=True)
  _, model, tok = config_lib.load_model(config.model)
  if tok is None:
    raise config_lib.ConfigError("SOL training needs a tokenizer (model.tokenizer)")
  grid = ActionGrid.named(s.grid)
  pcfg = SolPolicyConfig(lm_dim=model.cfg.hidden_size, num_actions=grid.num_actions,
                         d_model=s.d_model, num_heads=s.num_heads, num_layers=s.num_layers,
                         max_len=s.max_len)
  policy = init_policy(pcfg, seed=s.seed)
  trainer = SOLPolicyTrainer(policy, lr=s.lr, weight_decay=s.weight_decay, grad_clip=s.grad_clip,
                             clip_eps=s.clip_eps, entropy_coef=s.entropy_coef,
                             temperature=s.temperature)
  L = s.context_len + s.rollout_len + 1
  data = windows(tok, parse_sources(s.sources), L, seed=s.seed)
  rng = np.random.default_rng(s.seed)
  order = rng.permutation(len(data))
  held = data[order[:s.eval_windows]]          # held-out training windows: the budget eval
  train_rows = order[s.eval_windows:]
  alpha = _alpha(s.alpha)
  B, K, T = s.batch_size, s.rollouts, s.rollout_len
  per_seq = -(-s.context_len // s.page_size) + (K + 1) * -(-T // s.page_size)
  engine = Engine(model, num_pages=max(B, s.eval_windows) * per_seq + 4, page_size=s.page_size,
                  attention="reference")
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  t0 = time.perf_counter()
  first = budget_eval(engine, policy, grid, held, s)
  records = [dict(step=0, **first, wall_s=0.0)]
  with open(metrics_path, "w") as f:
    f.write(json.dumps(records[0]) + "\n")
    pos = 0
    for step in range(1, config.train.steps + 1):
      if pos + B > len(train_rows):
        rng.shuffle(train_rows)
        pos = 0
      seqs = data[train_rows[pos:pos + B]]
      pos += B
      targets = sample_targets(rng, grid, B)
      ep, ctl = run_episodes(engine, policy, grid, seqs, targets, s, rollouts=K, greedy=False,
                             seed=s.seed * 100003 + step, record=True)
      batch, m = episode_batch(ep, ctl, targets, s, alpha)
      for _ in range(s.ppo_epochs):
        upd = trainer.update(batch)
      m.update(upd)
      rec = dict(step=step, **m, wall_s=round(time.perf_counter() - t0, 2))
      stop = s.max_minutes > 0 and time.perf_counter() - t0 > 60 * s.max_minutes
      if step % s.eval_every == 0 or step == config.train.steps or stop:
        rec.update(budget_eval(engine, policy, grid, held, s))
      records.append(rec)
      f.write(json.dumps(rec) + "\n")
      f.flush()
      if stop:
        break
  last = next(r for r in reversed(records) if "eval_budget_error" in r)
  out = s.adapter_out or os.path.join(workdir, "adapter")
  summary = dict(steps=records[-1]["step"], wall_s=round(time.perf_counter() - t0, 1),
                 eval_budget_error_start=first["eval_budget_error"],
                 eval_budget_error_end=last["eval_budget_error"],
                 eval_logp_start=first["eval_logp"], eval_logp_end=last["eval_logp"])
  export_sol_adapter(policy, grid, s.sparsity, config.model.to_dict(), out,
                     source={"workdir": workdir, "step": records[-1]["step"]},
                     training={"sol": s.to_dict(), "train": config.train.to_dict()},
                     metrics=dict(first=first, last=last, summary=summary))
  summary["adapter"] = out
  return summary
