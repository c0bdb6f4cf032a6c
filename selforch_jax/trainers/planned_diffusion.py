"""The Planned Diffusion trainer (issue 21; planned-diffusion ``train/sft_trainer.py``): one model
learns the AR plan and the masked-diffusion chunks with the joint loss of
:mod:`selforch_jax.trainers.planned_diffusion_loss`.

Rows are the annotated rows of :mod:`selforch_jax.data.annotated` built with the Planned
Diffusion layout (``async_sees_full_plan=True, chunk_bidirectional=True``: the mask the scheduler
decodes with). On the host (:func:`pd_row_masks`) each row's positions are classed:

* chunk content (between ``<async>`` and ``</async>``, ``[PAD]`` included): replaced by
  ``<|mask|>`` with probability t inside the step (:func:`noise_chunks`, t ~ U(eps, 1) per row);
  row j-1 predicts chunk token j (the Dream shift, as the runtime reads it); only masked
  targets carry the (1/t)-weighted diffusion CE;
* AR rows: the trained assistant rows outside chunks (plan, control tags, ``<sync/>``, what
  follows), i.e. ``loss_mask`` without the rows inside a chunk (upstream: ``</async>`` and the
  chunk rows carry no AR label) and without the row after ``</async>`` (the runtime writes that
  token);
* prompt rows: no loss.

``suffix_p`` > 0 trains semi-autoregressive noise too (a row masks the last ``ceil(t * length)``
tokens of each chunk with probability ``suffix_p``, each weighted by the chunk's masked fraction;
:func:`~selforch_jax.trainers.planned_diffusion_loss.noise_chunks`): the states of a chunk
decoded left to right (per chunk; the scheduler moves every chunk by one token a step). Evaluation
keeps the i.i.d. noise (``eval_loss``, ``eval_diff_ce`` comparable across runs) and, when
``suffix_p`` > 0, also reports ``eval_suffix_diff_ce`` (every row suffix-masked).

``full_attention`` (upstream's dense-attention ablation): the chunks of a round see each other
too (:func:`~selforch_jax.lang.planned_diffusion.dense_round_mask`; the scheduler's
``full_attention`` option decodes the same way).
The noise draw of a step comes from ``(seed, step)`` (a resumed run draws the same); the noise
of evaluation batch j comes from ``(seed, EVAL_NOISE, j)`` whatever the step, so eval losses at
different steps are of the same noisy inputs (t and the masked positions) and comparable.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.lang.planned_diffusion import dense_round_mask
from selforch_jax.lang.tags import TagVocab
from selforch_jax.trainers.planned_diffusion_loss import joint_loss, noise_chunks
from selforch_jax.trainers.sft import SFTTrainer

__all__ = ["PlannedDiffusionTrainer", "pd_row_masks", "PD_BATCH_KEYS"]

PD_BATCH_KEYS = ("tokens", "targets", "positions", "mask", "ar_mask", "chunk_input", "noise_key")
EVAL_NOISE = 0x6576616C   # the eval noise stream's salt (never a training step)


def pd_row_masks(tokens: np.ndarray, targets: np.ndarray, loss_mask: np.ndarray,
                 tv: TagVocab) -> dict[str, np.ndarray]:
  """Host-side classes of annotated rows (module docstring).

  Args:
    tokens, targets, loss_mask: int ``[B, T]`` annotated rows (``targets[t] = tokens[t+1]``).
    tv: the tag vocab.

  Returns:
    ``{"chunk_input": bool [B, T]`` (input positions holding chunk content), ``"ar_mask": bool
    [B, T]`` (AR loss rows)}``.
  """
  tokens, targets = np.asarray(tokens), np.asarray(targets)
  lm = np.asarray(loss_mask).astype(bool)
  opens = np.cumsum(tokens == tv.async_open, axis=1)
  closes = np.cumsum(tokens == tv.async_close, axis=1)
  inside = (opens - closes) > 0                                   # after <async>, to </async>
  chunk_input = inside & (tokens != tv.async_open)
  ar = lm & ~inside & (tokens != tv.async_close)
  return {"chunk_input": chunk_input, "ar_mask": ar}


class PlannedDiffusionTrainer(SFTTrainer):
  """:class:`SFTTrainer` with the Planned Diffusion joint loss (module docstring).

  Args:
    model, mesh, optim, total_steps, lora, train_embed_rows_from, new_rows_lr_mult, rules: as
      :class:`SFTTrainer`.
    tag_vocab: the model's tags. eps: t's lower end. ar_over_t: upstream's AR/t (default off,
      the paper's formula). full_attention: chunks of a round see each other. seed: noise.
    suffix_p: the share of training rows with semi-autoregressive noise (module docstring).

  Batches: annotated rows (``tokens, targets, loss_mask, positions, mask``); :meth:`put_batch`
  adds ``ar_mask``, ``chunk_input`` and ``noise_key``.

  Raises:
    ValueError: as :class:`SFTTrainer`; eps outside (0, 1); suffix_p outside [0, 1].
  """

  def __init__(self, model, mesh, optim, total_steps: int, *, tag_vocab: TagVocab,
               eps: float = 1e-3, ar_over_t: bool = False, full_attention: bool = False,
               seed: int = 0, suffix_p: float = 0.0, **kw):
    if not 0.0 < eps < 1.0:
      raise ValueError(f"eps must be in (0, 1), got {eps}")
    if not 0.0 <= suffix_p <= 1.0:
      raise ValueError(f"suffix_p must be in [0, 1], got {suffix_p}")
    self.tv, self.eps, self.ar_over_t = tag_vocab, float(eps), bool(ar_over_t)
    self.suffix_p = float(suffix_p)
    self.full_attention, self.seed = bool(full_attention), int(seed)
    super().__init__(model, mesh, optim, total_steps, masked=True, batch_keys=PD_BATCH_KEYS, **kw)

  def terms(self, params, frozen, batch, suffix_p: float | None = None) -> dict[str, jax.Array]:
    """Sums over the batch: ``loss_sum`` (the joint loss times its normaliser), ``tokens``,
    ``ar_sum`` / ``ar_n`` (AR CE), ``diff_sum`` / ``diff_n`` (CE on masked chunk targets), with
    ``suffix_p`` (default: the trainer's) rows of semi-autoregressive noise."""
    model = nnx.merge(self.graphdef, params, frozen)
    key = jax.random.wrap_key_data(batch["noise_key"][0])
    chunk_in = batch["chunk_input"].astype(bool)
    sp = self.suffix_p if suffix_p is None else suffix_p
    noisy, masked_in, _, rate = noise_chunks(key, batch["tokens"], chunk_in, self.tv.mask,
                                             self.eps, sp)
    logits, _ = model(noisy, batch["positions"], batch["mask"])
    pad = jnp.zeros_like(chunk_in[:, :1])
    chunk_tgt = jnp.concatenate([chunk_in[:, 1:], pad], axis=1)     # row t predicts token t+1
    masked = jnp.concatenate([masked_in[:, 1:], pad], axis=1) & chunk_tgt
    t = jnp.concatenate([rate[:, 1:], rate[:, -1:]], axis=1)     # each target's rate
    ar = batch["ar_mask"].astype(bool)
    loss, m = joint_loss(logits, batch["targets"], ar, masked, chunk_tgt, t, self.ar_over_t)
    n_ar = jnp.sum(ar.astype(jnp.float32))
    n_diff = jnp.sum(masked.astype(jnp.float32))
    return {"loss_sum": loss * m["tokens"], "tokens": m["tokens"], "ar_sum": m["ar_ce"] * n_ar,
            "ar_n": n_ar, "diff_sum": m["diff_ce"] * n_diff, "diff_n": n_diff}

  def loss_terms(self, params, frozen, batch):
    t = self.terms(params, frozen, batch)
    return t["loss_sum"], t["tokens"]

  def _eval_step(self, params, frozen, batch):
    out = self.terms(params, frozen, batch, 0.0)
    if self.suffix_p > 0.0:
      sfx = self.terms(params, frozen, batch, 1.0)
      out |= {"sfx_diff_sum": sfx["diff_sum"], "sfx_diff_n": sfx["diff_n"]}
    return out

  def put_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Annotated rows -> the trainer's batch (host classes, dense rounds, the step's key)."""
    b = dict(batch)
    if "ar_mask" not in b:
      b.update(pd_row_masks(b["tokens"], b["targets"], b["loss_mask"], self.tv))
    if self.full_attention:
      b["mask"] = dense_round_mask(b["tokens"], b["mask"], self.tv)
    if "noise_key" not in b:
      b["noise_key"] = self.noise_key(self.step, np.asarray(b["tokens"]).shape[0])
    b["ar_mask"] = np.asarray(b["ar_mask"], np.int32)
    b["chunk_input"] = np.asarray(b["chunk_input"], np.int32)
    return super().put_batch(b)

  def noise_key(self, step: int, rows: int, stream: int | None = None) -> np.ndarray:
    """The noise key of a batch: uint32 ``[rows, 2]`` (the same key on every row; the step
    reads row 0), from ``(seed, step)``, or ``(seed, stream, step)`` for another stream."""
    key = jax.random.PRNGKey(self.seed)
    if stream is not None:
      key = jax.random.fold_in(key, stream)
    key = jax.random.key_data(jax.random.fold_in(key, int(step)))
    return np.tile(np.asarray(key, np.uint32)[None], (int(rows), 1))

  def eval_loss(self, batches) -> dict[str, float]:
    """``eval_loss`` (joint, per loss token), ``eval_ar_ce``, ``eval_diff_ce`` (and with
    ``suffix_p`` > 0 ``eval_suffix_diff_ce``) over the batches; batch j's noise is ``(seed,
    EVAL_NOISE, j)`` at every step (module docstring)."""
    tot: dict[str, float] = {}
    for j, b in enumerate(batches):
      b = dict(b)
      b.setdefault("noise_key", self.noise_key(j, np.asarray(b["tokens"]).shape[0], EVAL_NOISE))
      m = jax.device_get(self._eval(self.params, self.frozen, self.put_batch(b)))
      for k, v in m.items():
        tot[k] = tot.get(k, 0.0) + float(v)
    out = {} if self.suffix_p == 0.0 else {"eval_suffix_diff_ce": (
        tot.get("sfx_diff_sum", 0.0) / max(tot.get("sfx_diff_n", 0.0), 1.0))}
    return out | {"eval_loss": tot.get("loss_sum", 0.0) / max(tot.get("tokens", 0.0), 1.0),
            "eval_ar_ce": tot.get("ar_sum", 0.0) / max(tot.get("ar_n", 0.0), 1.0),
            "eval_diff_ce": tot.get("diff_sum", 0.0) / max(tot.get("diff_n", 0.0), 1.0),
            "eval_tokens": tot.get("tokens", 0.0)}
