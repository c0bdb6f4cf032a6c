"""BoNBoN / IPO iterated preference optimization (PASTA paper §4; Gui et al. 2024 "BoNBoN
Alignment"; Azar et al. 2023 "A General Theoretical Paradigm to Understand Learning from Human
Preferences", IPO).

Each round samples N responses per prompt with the current policy (a named scheduler), scores
them, and pairs the best (y_w) with the worst (y_l) response of each prompt. The loss of a pair
against the reference policy pi_ref (the initial model) is

  alpha * SFT(y_w) + (h - 1 / (2 tau))^2,
  h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)),

with SFT(y_w) = the mean per-token NLL of y_w under pi and log pi(y) the sum of the response
tokens' log-probs (the layout mask of the rollout in the forward). The batch loss is the mean
over pairs.

Scores (:data:`SCORES`), for a response with layout ``lay`` after a prompt of ``n`` tokens:

* ``"pasta"``: ``theoretical_speedup + lambda * quality`` (the PASTA paper's score: speedup from
  the response's attention structure, plus quality);
* ``"quality"``: ``quality``; ``"length"``: ``-len(response)`` (tests, sanity runs).

``theoretical_speedup`` = response tokens / critical-path decode steps, where a response token's
depth is 1 + the largest depth of the earlier tokens it would see (the layout's visibility
without evictions; prompt tokens have depth 0, prefilled at once); a plain AR response scores 1,
PASTA threads that run in parallel score more. ``quality`` (judge-free, "ref_nll"): minus the
mean per-token NLL of the response under pi_ref; ("judge") the pairwise judge's score in [0, 1]
against the prompt's reference answer (:func:`selforch_jax.eval.judges.pair_score`); or
("gsm8k") the exact-match reward.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from selforch_jax.trainers.logprobs import sequence_logprobs, token_logprobs
from selforch_jax.trainers.policy import PolicyTrainer

SCORES = ("pasta", "quality", "length")


def ipo_loss(pol_w, ref_w, pol_l, ref_l, tau: float):
  """IPO loss per pair: ``(h - 1/(2 tau))^2`` with ``h`` as in the module docstring.

  Args:
    pol_w, ref_w, pol_l, ref_l: float ``[P]`` sequence log-probs of the chosen (w) and rejected
      (l) responses under pi and pi_ref.
    tau: > 0.

  Returns:
    float ``[P]``.
  """
  h = (pol_w - ref_w) - (pol_l - ref_l)
  return (h - 1.0 / (2.0 * tau)) ** 2


def select_pairs(scores, min_gap: float = 0.0) -> list[tuple[int, int, int]]:
  """Best-vs-worst pairs.

  Args:
    scores: float ``[P, N]`` scores of N responses to each of P prompts.
    min_gap: a pair needs ``best - worst > 0`` and ``>= min_gap``.

  Returns:
    ``(prompt, best, worst)`` triples (indices into the N responses; ties go to the first
    highest and the first lowest response); prompts without a qualifying pair are skipped.

  Raises:
    ValueError: ``scores`` not 2-D or not finite.
  """
  s = np.asarray(scores, np.float64)
  if s.ndim != 2 or not np.isfinite(s).all():
    raise ValueError(f"scores must be a finite [prompts, samples] array, got shape {s.shape}")
  out = []
  for p in range(s.shape[0]):
    b, w = int(np.argmax(s[p])), int(np.argmin(s[p]))
    gap = s[p, b] - s[p, w]
    if gap > 0 and gap >= min_gap:
      out.append((p, b, w))
  return out


def theoretical_speedup(visible_tokens: np.ndarray, n_prompt: int) -> float:
  """Response tokens / critical-path decode steps (see the module docstring).

  Args:
    visible_tokens: bool ``[N, N]`` token visibility without evictions (query x key), e.g.
      ``runtime.mask.sequence_mask(lay.segment_ids, lay.visible, lay.bidir)``; only earlier
      keys count.
    n_prompt: tokens of the prompt (depth 0).

  Returns:
    float >= 1 for a non-empty response (1.0 for an empty one).
  """
  m = np.asarray(visible_tokens, bool)
  N = m.shape[0]
  if N <= n_prompt:
    return 1.0
  depth = np.zeros(N, np.int64)
  for i in range(n_prompt, N):
    seen = depth[:i][m[i, :i]]
    depth[i] = 1 + (int(seen.max()) if seen.size else 0)
  return float((N - n_prompt) / max(int(depth[n_prompt:].max()), 1))


def speedups(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
             tag_vocab=None, **layout_kw) -> np.ndarray:
  """:func:`theoretical_speedup` of each prompt + response (``lang.build_layout`` with the tag
  vocab, ``eos_ids=()`` and ``layout_kw`` such as the scheduler's ``cap`` / ``length_unit``;
  1.0 each without a tag vocab): float ``[B]``."""
  if tag_vocab is None:
    return np.ones(len(prompts))
  from selforch_jax.lang import build_layout
  from selforch_jax.runtime.mask import sequence_mask
  out = []
  for p, r in zip(prompts, responses):
    lay = build_layout(np.asarray(list(p) + list(r), np.int64), tag_vocab, eos_ids=(),
                       **layout_kw)
    out.append(theoretical_speedup(sequence_mask(lay.segment_ids, lay.visible, lay.bidir), len(p)))
  return np.asarray(out)


def score(name: str, *, speedup, quality, lengths, quality_weight: float) -> np.ndarray:
  """Scores of responses (float ``[B]``) from per-response ``speedup``, ``quality`` and
  ``lengths`` (each ``[B]``); see the module docstring.

  Raises:
    KeyError: unknown ``name``.
  """
  if name == "pasta":
    return np.asarray(speedup, np.float64) + quality_weight * np.asarray(quality, np.float64)
  if name == "quality":
    return np.asarray(quality, np.float64)
  if name == "length":
    return -np.asarray(lengths, np.float64)
  raise KeyError(f"unknown score {name!r}; known: {SCORES}")


def pair_batch(rows: Mapping[str, np.ndarray], ref_seq_logp: np.ndarray,
               pairs: Sequence[tuple[int, int]]) -> dict[str, np.ndarray]:
  """A BoNBoN batch: rows ``[w0, l0, w1, l1, ...]`` taken from ``rows`` (each ``[B, ...]``)
  for ``pairs`` of (winner row, loser row), with their ``ref_seq_logp`` ``[2P]``."""
  idx = np.asarray([i for pair in pairs for i in pair], np.int64)
  out = {k: np.asarray(v)[idx] for k, v in rows.items()
         if k in ("tokens", "targets", "loss_mask", "positions", "mask")}
  out["ref_seq_logp"] = np.asarray(ref_seq_logp, np.float32)[idx]
  return out


class BonbonTrainer(PolicyTrainer):
  """IPO + SFT updates on best-vs-worst pairs.

  Args:
    model, mesh, optim, total_steps, lora, train_embed_rows_from: as
      :class:`~selforch_jax.trainers.sft.SFTTrainer`.
    alpha: SFT weight (>= 0); tau: IPO regulariser (> 0).

  Batch (:func:`pair_batch`): ``tokens, targets, loss_mask, positions`` int32 ``[2P, T]``,
  ``mask`` bool ``[2P, T, T]``, ``ref_seq_logp`` float32 ``[2P]``; rows alternate winner,
  loser.

  Raises:
    ValueError: ``tau <= 0`` or ``alpha < 0``.
  """

  batch_ranks = {"tokens": 2, "targets": 2, "loss_mask": 2, "positions": 2, "mask": 3,
                 "ref_seq_logp": 1}

  def __init__(self, model, mesh, optim, total_steps: int, *, alpha: float = 1.0,
               tau: float = 0.1, **kw):
    if tau <= 0 or alpha < 0:
      raise ValueError(f"BoNBoN needs tau > 0 and alpha >= 0, got tau={tau}, alpha={alpha}")
    self.alpha, self.tau = float(alpha), float(tau)
    super().__init__(model, mesh, optim, total_steps, **kw)

  def loss_terms(self, params, frozen, batch):
    lp = token_logprobs(self.merge(params, frozen), batch)
    seq = sequence_logprobs(lp, batch["loss_mask"])
    ref = batch["ref_seq_logp"]
    ipo = ipo_loss(seq[0::2], ref[0::2], seq[1::2], ref[1::2], self.tau)
    n_w = jnp.maximum(jnp.sum(batch["loss_mask"][0::2].astype(jnp.float32), -1), 1.0)
    sft = -seq[0::2] / n_w
    margin = (seq[0::2] - ref[0::2]) - (seq[1::2] - ref[1::2])
    aux = {"count": jnp.float32(ipo.shape[0]), "ipo": jnp.sum(ipo), "sft": jnp.sum(sft),
           "margin": jnp.sum(margin)}
    return jnp.sum(self.alpha * sft + ipo), aux
