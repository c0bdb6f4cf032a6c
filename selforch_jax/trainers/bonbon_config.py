"""The ``bonbon`` config section: iterated best-vs-worst preference optimization with an IPO
loss plus an SFT term (BoNBoN, Gui et al. 2024; IPO, Azar et al. 2023; PASTA paper §4).

Used by ``config.trainer == "bonbon"``; ``train.steps`` = sampling rounds (each re-samples
with the updated policy, then runs ``updates_per_round`` optimizer steps on its pairs).
"""

from __future__ import annotations

import ml_collections
from ml_collections.config_dict import placeholder


def bonbon_defaults() -> ml_collections.ConfigDict:
  """Keys of the ``bonbon`` section.

  num_samples: N responses sampled per prompt (>= 2; best and worst form the pair).
  prompts_per_round: prompts sampled per round.
  updates_per_round: optimizer steps per round (batches of ``pairs_per_step`` pairs drawn
    cyclically from the round's pairs, in a seeded random order).
  pairs_per_step: preference pairs per optimizer step (the batch).
  max_new_tokens, temperature, top_k, top_p: sampling.
  alpha: weight of the SFT term (mean NLL per token of the best response).
  tau: IPO regularisation; the target margin is 1 / (2 tau).
  score: score name in :mod:`selforch_jax.trainers.bonbon` ("pasta": theoretical speedup +
    lambda * quality; "quality": quality only; "length": -tokens, for tests).
  quality_weight: lambda of the "pasta" score.
  quality: "ref_nll" (judge-free: minus the mean per-token NLL of the response under the
    reference model), "judge" (the pairwise judge's score in [0, 1] of the response against
    the dataset's reference answer, both orders averaged: :func:`selforch_jax.eval.judges.
    pair_score`; the PASTA paper's quality term) or a reward name, e.g. "gsm8k" (exact match).
  judge: the judge of quality="judge" (as the PASTA eval's ``judge`` section): backend
    "openai" (any OpenAI-compatible ``url`` / ``model``, key in ``$api_key_env``) or "local"
    (the base weights of the ``model`` section through our engine).
  min_score_gap: pairs whose best and worst scores differ by less are dropped.
  scheduler, scheduler_kwargs, layout_mask, num_pages, page_size, max_prompt_tokens,
  init_from, dataset, split, max_examples, shuffle_seed, seed: as in ``grpo_defaults()``.
  """
  return ml_collections.ConfigDict(dict(
      num_samples=4, prompts_per_round=4, updates_per_round=2, pairs_per_step=2, max_new_tokens=64,
      temperature=1.0, top_k=0, top_p=1.0, alpha=1.0, tau=0.1, score="pasta",
      quality_weight=1.0, quality="ref_nll", min_score_gap=0.0, scheduler="ar",
      scheduler_kwargs={}, layout_mask=False, num_pages=256, page_size=16,
      max_prompt_tokens=256, init_from=placeholder(str), dataset="gsm8k", split="train",
      max_examples=placeholder(int), shuffle_seed=0, seed=0,
      judge=dict(backend="", url="", model="", api_key_env="OPENAI_API_KEY")))
