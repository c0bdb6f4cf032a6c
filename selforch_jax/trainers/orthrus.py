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
argmax).

**Denoising** (``denoise``): ``"single"`` (default; upstream's and the post's choice) trains the
fully masked block above. ``"multi"`` (the post's multi-step ablation, MDLM-style: Sahoo et al.
2024, "Simple and Effective Masked Diffusion Language Models") trains the view for the later
passes of a multi-step decoder as well: per block a noise level ``t ~ U(eps, 1)`` and each
non-anchor slot ``i in 1 .. B-1`` given its true token ``x_{s+i}`` independently with probability
``1 - t`` (the anchor is always given; :func:`~selforch_jax.models.orthrus.block_inputs` with
``reveal``), drawn on the host from ``(seed, step, row)`` (:meth:`OrthrusTrainer.put_batch`);
a draft row counts only when the token it predicts (slot ``i+1``) is not given in the block
input (a given target would be a copy). The loss is the plain mean over counted rows (no
``1/t`` ELBO weight), so its scale matches the single-step loss. Only the diffusion view
trains (its full copies, as upstream, or a low-rank ``base + A @ B`` delta, ``view_rank > 0``);
embeddings (the mask row included), norms, MLPs and the head stay frozen.

Evaluation reports, besides the loss, ``eval_match`` (fraction of draft rows whose argmax equals
the AR argmax) and ``eval_accept_len`` (mean greedy acceptance length of a block = 1 + the longest
matching prefix of its B-1 drafts: the tokens one verify step would commit on teacher-forced
data). They are single-step in both modes (eval batches reveal nothing), so runs compare.
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
DENOISE = ("single", "multi")
DENOISE_EPS = 1e-3          # t's lower end (MDLM's sampling_eps)


def n_blocks(seq_len: int, block_size: int) -> int:
  """Blocks per row of a ``seq_len`` batch: ``max(1, (seq_len - 1) // block_size)``."""
  return max(1, (int(seq_len) - 1) // int(block_size))


def draw_reveal(seed: int, step: int, rows: int, num_blocks: int, block_size: int,
                eps: float = DENOISE_EPS) -> np.ndarray:
  """The multi-step training reveal mask (module docstring), bool ``[rows, NB * B]``
  (block-major, slot 0 of each block True): per row ``r`` a generator seeded by
  ``(seed, step, r, 1)``, per block ``t = eps + (1 - eps) u``, slot revealed iff its uniform
  ``>= t`` (probability ``1 - t``)."""
  out = np.zeros((rows, num_blocks, block_size), bool)
  for r in range(rows):
    g = np.random.default_rng([int(seed), int(step), r, 1])
    t = eps + (1.0 - eps) * g.random((num_blocks, 1))
    out[r] = g.random((num_blocks, block_size)) >= t
  out[:, :, 0] = True
  return out.reshape(rows, num_blocks * block_size)


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
    low_rank: train the view's deltas instead of its full copies. seed: block offsets (and
      the reveal masks). denoise: ``"single"`` or ``"multi"`` (module docstring).

  Batches: :class:`SFTTrainer`'s (``tokens, targets, loss_mask, segment_ids, positions``, one
  example per row, right-padded) plus ``offset`` int32 ``[Bt, 1]`` and, for ``"multi"``,
  ``reveal`` bool ``[Bt, NB * B]`` (:meth:`put_batch` draws both).

  Raises:
    ValueError: ``block_size < 2``, unknown loss or denoise, no diffusion view.
  """

  def __init__(self, model, mesh, optim, total_steps: int, *, block_size: int, mask_id: int,
               loss: str = "kl", low_rank: bool = False, seed: int = 0,
               denoise: str = "single", **kw):
    if int(block_size) < 2:
      raise ValueError(f"block_size must be >= 2, got {block_size}")
    if loss not in LOSSES:
      raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if denoise not in DENOISE:
      raise ValueError(f"denoise must be one of {DENOISE}, got {denoise!r}")
    if VIEW not in model.cfg.attn_views:
      raise ValueError(f"OrthrusTrainer needs a model with the {VIEW!r} view (add_orthrus)")
    self.block_size, self.mask_id, self.loss_kind = int(block_size), int(mask_id), loss
    self.seed, self.denoise = int(seed), denoise
    keys = ORTHRUS_BATCH_KEYS + (("reveal",) if denoise == "multi" else ())
    super().__init__(model, mesh, optim, total_steps, trainable=view_filter(model.cfg, low_rank),
                     batch_keys=keys, **kw)

  def block_terms(self, params, frozen, batch) -> dict[str, jax.Array]:
    """Sums over the batch's counted blocks: ``loss_sum``, ``rows`` (draft rows), ``match_sum``,
    ``prefix_sum`` (longest matching draft prefix per block), ``blocks`` (float32 scalars).
    With ``batch["reveal"]`` (multi) the rows whose target slot is revealed are left out of
    ``loss_sum``, ``rows`` and ``match_sum``."""
    copy = lambda s: jax.tree.map(lambda x: x, s)   # noqa: E731  (Variables of this trace)
    model = apply_view_delta(nnx.merge(self.graphdef, copy(params), copy(frozen)))
    tokens, lm = batch["tokens"], batch["loss_mask"].astype(bool)
    Bt, N = tokens.shape
    Bk = self.block_size
    NB = n_blocks(N, Bk)
    starts = batch["offset"][:, :1] + Bk * jnp.arange(NB)[None]               # [Bt, NB]
    rows = starts[:, :, None] + jnp.arange(Bk - 1)[None, None]                # [Bt, NB, B-1]
    rows_c = jnp.clip(rows, 0, N - 1)
    lm_rows = jnp.take_along_axis(lm, rows_c.reshape(Bt, -1), axis=1).reshape(rows.shape)
    active = jnp.all(lm_rows & (rows < N), axis=-1)                           # [Bt, NB]
    valid = batch["segment_ids"] > 0
    reveal = batch.get("reveal")
    if reveal is not None:
      reveal = reveal.reshape(Bt, NB, Bk).astype(bool)
    ar, diff = dual_pass_logits(model, tokens, batch["positions"], valid,
                                jnp.clip(starts, 0, N - 1), Bk, self.mask_id, reveal)
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
    if reveal is not None:            # row i predicts slot i+1: count it when that is masked
      wr = w[..., None] * (~reveal[:, :, 1:]).astype(jnp.float32)            # [Bt, NB, B-1]
      return {"loss_sum": jnp.sum(per_row * wr), "rows": jnp.sum(wr),
              "match_sum": jnp.sum(match * wr), "prefix_sum": jnp.sum(prefix * w),
              "blocks": jnp.sum(w)}
    return {"loss_sum": jnp.sum(per_row * w[..., None]), "rows": jnp.sum(w) * (Bk - 1),
            "match_sum": jnp.sum(match * w[..., None]), "prefix_sum": jnp.sum(prefix * w),
            "blocks": jnp.sum(w)}

  def loss_terms(self, params, frozen, batch):
    t = self.block_terms(params, frozen, batch)
    return t["loss_sum"], t["rows"]

  def _eval_step(self, params, frozen, batch):
    return self.block_terms(params, frozen, batch)

  def put_batch(self, batch: Mapping[str, np.ndarray],
                reveal: bool = True) -> dict[str, jax.Array]:
    """:meth:`SFTTrainer.put_batch` with ``offset`` drawn (unless given) from ``(seed, step)``
    and, for ``denoise="multi"``, ``reveal`` (unless given) by :func:`draw_reveal` from
    ``(seed, step, row)`` (``reveal=False``: nothing revealed but the anchors, the single-step
    blocks; evaluation)."""
    Bt, N = np.asarray(batch["tokens"]).shape
    if "offset" not in batch:
      rng = np.random.default_rng([self.seed, self.step])
      batch = dict(batch, offset=rng.integers(0, self.block_size, (Bt, 1)).astype(np.int32))
    if self.denoise == "multi" and "reveal" not in batch:
      NB = n_blocks(N, self.block_size)
      if reveal:
        r = draw_reveal(self.seed, self.step, Bt, NB, self.block_size)
      else:
        r = np.zeros((Bt, NB, self.block_size), bool)
        r[:, :, 0] = True
        r = r.reshape(Bt, -1)
      batch = dict(batch, reveal=r)
    return super().put_batch(batch)

  def eval_loss(self, batches) -> dict[str, float]:
    """Mean loss per draft row, ``eval_match`` and ``eval_accept_len`` over the batches (always
    single-step blocks: a ``"multi"`` run's eval reveals nothing)."""
    tot: dict[str, float] = {}
    for b in batches:
      b = {k: v for k, v in b.items() if k != "reveal"}
      m = jax.device_get(self._eval(self.params, self.frozen, self.put_batch(b, reveal=False)))
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
