"""The Orthrus trainer: KL distillation of the diffusion view to the frozen AR model
(seed_systems.md §2.3; the author's post: KL beat CE, single-step denoising beat multi-step).

One step (:meth:`OrthrusTrainer.loss_terms`) runs the dual-pass forward
(:func:`selforch_jax.models.orthrus.dual_pass_logits`): the frozen AR pass over each sequence
(teacher next-token distributions ``p_AR`` and the K/V), then the diffusion view over every block
``[x_s, MASK x (B-1)]`` whose queries see the AR keys strictly before the block start and their
whole block. Blocks start at ``offset + k B`` with a random ``offset in [0, B)`` per row and step
(drawn on the host from ``(seed, step, row)``, so a resumed run draws the same); a block counts
when its B-1 draft rows ``s .. s+B-2`` all predict response tokens (``loss_mask``). Loss per
draft row i (predicting token ``s+i+1``, what decoding drafts as ``d_{i+1}``):
``KL(p_AR(. | x_{<=s+i}) || p_diff,i)`` (``loss="kl"``) or the CE of the sequence's next token
(``loss="ce"``; the sequences are the model's own greedy continuations, so that token is the AR
argmax). Single-step denoising only (the multi-step option is not built). Only the diffusion view
trains (its full copies, as upstream, or a low-rank ``base + A @ B`` delta, ``view_rank > 0``);
embeddings (the mask row included), norms, MLPs and the head stay frozen.

Evaluation reports, besides the loss, ``eval_match`` (fraction of draft rows whose argmax equals
the AR argmax) and ``eval_accept_len`` (mean greedy acceptance length of a block = 1 + the longest
matching prefix of its B-1 drafts: the tokens one verify step would commit on teacher-forced
data).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.models.orthrus import VIEW, apply_view_delta, dual_pass_logits, view_delta_names
from selforch_jax.models.transformer import view_param_names
from selforch_jax.trainers.loss import token_cross_entropy
from selforch_jax.trainers.sft import BATCH_KEYS, SFTTrainer

ORTHRUS_BATCH_KEYS = BATCH_KEYS + ("offset",)
LOSSES = ("kl", "ce")


def view_filter(cfg, low_rank: bool):
  """NNX filter of the diffusion view's trained variables: the delta A/B arrays
  (``low_rank``; plus q/k norm copies where the family has them) or the view's own copies."""
  if low_rank:
    names = {n for _, a, b in view_delta_names() for n in (a, b)}
    names |= {f"{n}_{VIEW}" for n in view_param_names(cfg) if n.endswith("_norm")}
  else:
    names = {f"{n}_{VIEW}" for n in view_param_names(cfg)}
  return lambda path, x: isinstance(x, nnx.Param) and str(path[-1]) in names


class OrthrusTrainer(SFTTrainer):
  """:class:`SFTTrainer` with the Orthrus loss (module docstring).

  Args:
    model: a model with the diffusion view and the mask row (``add_orthrus``), with view deltas
      (``add_view_delta``) when ``low_rank``.
    mesh, optim, total_steps, rules: as :class:`SFTTrainer`.
    block_size: B >= 2. mask_id: the mask token id. loss: ``"kl"`` or ``"ce"``.
    low_rank: train the view's deltas instead of its full copies. seed: block offsets.

  Batches: :class:`SFTTrainer`'s (``tokens, targets, loss_mask, segment_ids, positions``, one
  example per row, right-padded) plus ``offset`` int32 ``[Bt, 1]`` (:meth:`put_batch` draws it).

  Raises:
    ValueError: ``block_size < 2``, unknown loss, no diffusion view.
  """

  def __init__(self, model, mesh, optim, total_steps: int, *, block_size: int, mask_id: int,
               loss: str = "kl", low_rank: bool = False, seed: int = 0, **kw):
    if int(block_size) < 2:
      raise ValueError(f"block_size must be >= 2, got {block_size}")
    if loss not in LOSSES:
      raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if VIEW not in model.cfg.attn_views:
      raise ValueError(f"OrthrusTrainer needs a model with the {VIEW!r} view (add_orthrus)")
    self.block_size, self.mask_id, self.loss_kind = int(block_size), int(mask_id), loss
    self.seed = int(seed)
    super().__init__(model, mesh, optim, total_steps, trainable=view_filter(model.cfg, low_rank),
                     batch_keys=ORTHRUS_BATCH_KEYS, **kw)

  def block_terms(self, params, frozen, batch) -> dict[str, jax.Array]:
    """Sums over the batch's counted blocks: ``loss_sum``, ``rows`` (draft rows), ``match_sum``,
    ``prefix_sum`` (longest matching draft prefix per block), ``blocks`` (float32 scalars)."""
    copy = lambda s: jax.tree.map(lambda x: x, s)   # noqa: E731  (Variables of this trace)
    model = apply_view_delta(nnx.merge(self.graphdef, copy(params), copy(frozen)))
    tokens, lm = batch["tokens"], batch["loss_mask"].astype(bool)
    Bt, N = tokens.shape
    Bk = self.block_size
    NB = max(1, (N - 1) // Bk)
    starts = batch["offset"][:, :1] + Bk * jnp.arange(NB)[None]               # [Bt, NB]
    rows = starts[:, :, None] + jnp.arange(Bk - 1)[None, None]                # [Bt, NB, B-1]
    rows_c = jnp.clip(rows, 0, N - 1)
    lm_rows = jnp.take_along_axis(lm, rows_c.reshape(Bt, -1), axis=1).reshape(rows.shape)
    active = jnp.all(lm_rows & (rows < N), axis=-1)                           # [Bt, NB]
    valid = batch["segment_ids"] > 0
    ar, diff = dual_pass_logits(model, tokens, batch["positions"], valid,
                                jnp.clip(starts, 0, N - 1), Bk, self.mask_id)
    teacher = jnp.take_along_axis(ar, rows_c.reshape(Bt, -1)[..., None], axis=1)
    teacher = teacher.reshape(Bt, NB, Bk - 1, -1)
    student = diff[:, :, :Bk - 1]
    if self.loss_kind == "kl":
      lt = jax.nn.log_softmax(teacher, -1)
      per_row = jnp.sum(jnp.exp(lt) * (lt - jax.nn.log_softmax(student, -1)), -1)
    else:
      tgt = jnp.take_along_axis(batch["targets"], rows_c.reshape(Bt, -1), axis=1)
      per_row = token_cross_entropy(student.reshape(Bt, -1, student.shape[-1]), tgt)
      per_row = per_row.reshape(Bt, NB, Bk - 1)
    w = active.astype(jnp.float32)
    match = (jnp.argmax(student, -1) == jnp.argmax(teacher, -1)).astype(jnp.float32)
    prefix = jnp.cumprod(match, axis=-1).sum(-1)                              # [Bt, NB]
    return {"loss_sum": jnp.sum(per_row * w[..., None]), "rows": jnp.sum(w) * (Bk - 1),
            "match_sum": jnp.sum(match * w[..., None]), "prefix_sum": jnp.sum(prefix * w),
            "blocks": jnp.sum(w)}

  def loss_terms(self, params, frozen, batch):
    t = self.block_terms(params, frozen, batch)
    return t["loss_sum"], t["rows"]

  def _eval_step(self, params, frozen, batch):
    return self.block_terms(params, frozen, batch)

  def put_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """:meth:`SFTTrainer.put_batch` with ``offset`` drawn (unless given) from ``(seed, step)``."""
    if "offset" not in batch:
      rng = np.random.default_rng([self.seed, self.step])
      Bt = np.asarray(batch["tokens"]).shape[0]
      batch = dict(batch, offset=rng.integers(0, self.block_size, (Bt, 1)).astype(np.int32))
    return super().put_batch(batch)

  def eval_loss(self, batches) -> dict[str, float]:
    """Mean loss per draft row, ``eval_match`` and ``eval_accept_len`` over the batches."""
    tot: dict[str, float] = {}
    for b in batches:
      m = jax.device_get(self._eval(self.params, self.frozen, self.put_batch(b)))
      for k, v in m.items():
        tot[k] = tot.get(k, 0.0) + float(v)
    rows, blocks = max(tot.get("rows", 0.0), 1.0), max(tot.get("blocks", 0.0), 1.0)
    return {"eval_loss": tot.get("loss_sum", 0.0) / rows,
            "eval_match": tot.get("match_sum", 0.0) / rows,
            "eval_accept_len": 1.0 + tot.get("prefix_sum", 0.0) / blocks,
            "eval_blocks": tot.get("blocks", 0.0)}

  def current_model(self) -> Any:
    """The trained model with the view written from its deltas (for export / decoding)."""
    return apply_view_delta(self.model())
