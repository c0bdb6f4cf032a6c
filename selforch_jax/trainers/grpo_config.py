"""The ``grpo`` config section (GRPO, Shao et al. 2024, DeepSeekMath §4.1).

Used by ``config.trainer == "grpo"`` (``python -m selforch_jax.train``); the batch size,
model, optimizer, mesh and step count come from the usual sections (``train.steps`` = rollout
batches; each runs ``grpo.inner_steps`` optimizer updates).
"""

from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder


def grpo_defaults() -> ml_collections.ConfigDict:
  """Keys of the ``grpo`` section.

  group_size: G responses sampled per prompt (>= 1; G = 1 gives zero advantages).
  prompts_per_step: prompts per rollout batch (the rollout batch is prompts x G sequences).
  max_new_tokens: response budget per rollout (tokens, the stop token included).
  temperature, top_k, top_p: rollout sampling (temperature 0 = greedy).
  clip_eps: PPO clip range epsilon of the ratio pi/pi_old (objective uses clip(ratio, 1-eps,
    1+eps)).
  kl_coef: beta of the k3 KL(pi || pi_ref) penalty (Schulman 2020 "Approximating KL").
  adv_eps: eps in A = (r - mean) / (std + eps).
  inner_steps: optimizer updates per rollout batch (mu in the paper); pi_old is frozen
    over them.
  reward: reward name in :mod:`selforch_jax.trainers.rewards` (e.g. "gsm8k").
  format_weight: weight of the format term added to the correctness reward.
  scheduler: rollout scheduler name (``runtime.registry``: "ar", "pasta", "tip").
  scheduler_kwargs: extra keyword options of that scheduler (a dict, e.g. TIP eviction).
  layout_mask: build the log-prob forward's attention mask with ``lang.build_layout`` on the
    rollout tokens (needed when the scheduler's tokens carry tags: PASTA / TIP); False =
    plain causal mask.
  num_pages, page_size: the rollout engine's KV pool.
  max_prompt_tokens: prompts longer than this are skipped.
  init_from: an SFT workdir whose checkpoint initialises the policy (and pi_ref; the run's
    saved model config is used, LoRA adapters kept); None = the ``model`` section's weights.
  dataset: prompt dataset name (``data.sources``: gsm8k, ...); split: its split.
  max_examples: read only the first N rows of the dataset file (None = all).
  shuffle_seed, seed: prompt order, rollout sampling seed.
  """
  return ml_collections.ConfigDict(dict(
      group_size=4, prompts_per_step=2, max_new_tokens=64, temperature=1.0, top_k=0, top_p=1.0,
      clip_eps=0.2, kl_coef=0.04, adv_eps=1e-4, inner_steps=2, reward="gsm8k",
      format_weight=0.1, scheduler="ar", scheduler_kwargs={}, layout_mask=False,
      num_pages=256, page_size=16, max_prompt_tokens=256, init_from=placeholder(str),
      dataset="gsm8k", split="train", max_examples=placeholder(int), shuffle_seed=0, seed=0))
