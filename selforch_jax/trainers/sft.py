"""Supervised fine-tuning step: sharded, jitted, donated; full fine-tuning or LoRA.

The model is split once (``nnx.split``) into the graph, the trainable state (all params,
or only ``nnx.LoRAParam`` adapters plus optionally new embedding rows) and the frozen
rest. ``train_step`` is a pure function under ``jax.jit`` with explicit in/out shardings
(from the params' logical axes, ``selforch_jax.sharding``) and donated params and
optimizer state. Gradient accumulation is a ``lax.scan`` over micro-batches; the loss
is the mean next-token CE over the loss-masked tokens of the whole batch, so any
accumulation / device count gives the same loss. Later trainers (DPO/IPO, GRPO, ...)
reuse this class and replace :meth:`SFTTrainer.loss_terms`.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from selforch_jax import sharding as shd
from selforch_jax.data.masks import segment_mask
from selforch_jax.models.transformer import Transformer
from selforch_jax.trainers.loss import masked_loss_sum
from selforch_jax.trainers.optim import make_optimizer

BATCH_KEYS = ("tokens", "targets", "loss_mask", "segment_ids", "positions")
# annotated rows (selforch_jax.data.annotated): the mask builder's bool [B, T, T] mask instead of
# segment ids (DESIGN.md §2.1: the same mask the runtime decodes with)
MASKED_BATCH_KEYS = ("tokens", "targets", "loss_mask", "positions", "mask")


def trainable_filter(lora: bool, train_embed: bool):
  """NNX filter of trainable variables: everything, or LoRA adapters (+ embedding/LM head)."""
  if not lora:
    return nnx.Param
  if train_embed:
    return nnx.Any(nnx.LoRAParam, nnx.PathContains("embed"), nnx.PathContains("lm_head"))
  return nnx.LoRAParam


class SFTTrainer:
  """Holds the split model, optimizer and the jitted train / eval steps.

  Args:
    model: the NNX :class:`Transformer` (split once; the trainer owns its arrays after).
    mesh: device mesh with axes ``("data", "fsdp", "tensor")``.
    optim: the ``optim`` config section (see ``trainers/optim.py``).
    total_steps: number of optimizer steps (for the schedule).
    lora: train only ``nnx.LoRAParam`` adapters (the model must have ``lora_rank > 0``).
    train_embed_rows_from: if >= 0, also train rows ``>= this`` of the embedding (and of
      an untied LM head) — the rows of newly added tokens; other rows stay frozen.
    new_rows_lr_mult: the learning rate of those new rows relative to ``optim.lr`` (their Adam
      updates are multiplied by it). Mean-initialised tag rows trained at a LoRA learning rate
      barely move (PASTA SFT on SmolLM2: p(<promise>) 0.0015 after 119 steps at 1x).
    rules: logical-axis rules.
    masked: batches carry ``mask`` bool ``[B, T, T]`` (annotated data,
      :mod:`selforch_jax.data.annotated`) instead of ``segment_ids`` int32 ``[B, T]``.
    trainable: optional NNX filter of the trained variables, instead of the ``lora`` /
      ``train_embed_rows_from`` choice (e.g. Orthrus's diffusion view,
      :mod:`selforch_jax.trainers.orthrus`).
    batch_keys: optional batch keys instead of the default ones (each ``[B, ...]`` 2-D, or
      ``mask`` 3-D).

  Raises:
    ValueError: if ``lora`` is set but the model has no adapters, or the batch size does
      not divide into ``optim.grad_accum`` micro-batches (at the first step).
  """

  def __init__(self, model: Transformer, mesh: Mesh, optim, total_steps: int, *,
               lora: bool = False, train_embed_rows_from: int = -1, rules=shd.DEFAULT_RULES,
               masked: bool = False, new_rows_lr_mult: float = 1.0, trainable=None,
               batch_keys: tuple[str, ...] | None = None):
    if lora and not model.cfg.lora_rank:
      raise ValueError("lora=True but model.lora_rank == 0: set model.lora_rank > 0")
    self.cfg = model.cfg
    self.mesh = mesh
    self.grad_accum = int(optim.grad_accum)
    self.embed_from = int(train_embed_rows_from)
    if new_rows_lr_mult <= 0:
      raise ValueError(f"new_rows_lr_mult must be > 0, got {new_rows_lr_mult}")
    self.new_rows_lr_mult = float(new_rows_lr_mult)
    filt = trainable if trainable is not None else trainable_filter(lora, self.embed_from >= 0)
    self.graphdef, params, frozen = nnx.split(model, filt, ...)
    self.tx, self.schedule = make_optimizer(optim, total_steps)
    self.params_sh = shd.state_shardings(params, mesh, rules)
    self.frozen_sh = shd.state_shardings(frozen, mesh, rules)
    self.params = jax.device_put(params, self.params_sh)
    self.frozen = jax.device_put(frozen, self.frozen_sh)
    repl = NamedSharding(mesh, P())
    # moments mirror the params (same shardings); counters etc. are replicated
    abstract_opt = jax.eval_shape(self.tx.init, self.params)
    self.opt_sh = jax.tree.map(
        lambda x: self.params_sh if isinstance(x, nnx.State) else repl, abstract_opt,
        is_leaf=lambda x: isinstance(x, nnx.State))
    self.opt_state = jax.jit(self.tx.init, out_shardings=self.opt_sh)(self.params)
    self.step = 0
    self.batch_keys = tuple(batch_keys) if batch_keys else (MASKED_BATCH_KEYS if masked
                                                            else BATCH_KEYS)
    self._batch_sh = {k: shd.batch_sharding(mesh, 3 if k == "mask" else 2) for k in self.batch_keys}
    self._train = jax.jit(
        self._train_step,
        in_shardings=(self.params_sh, self.frozen_sh, self.opt_sh, self._batch_sh),
        out_shardings=(self.params_sh, self.opt_sh, repl),
        donate_argnums=(0, 2))
    self._eval = jax.jit(self._eval_step,
                         in_shardings=(self.params_sh, self.frozen_sh, self._batch_sh),
                         out_shardings=repl)

  # --- pure functions ---------------------------------------------------------------------
  def loss_terms(self, params, frozen, batch) -> tuple[jax.Array, jax.Array]:
    """``(sum of token CE over loss-masked targets, token count)`` for one (micro-)batch."""
    model = nnx.merge(self.graphdef, params, frozen)
    mask = batch["mask"] if "mask" in batch else segment_mask(batch["segment_ids"])
    logits, _ = model(batch["tokens"], batch["positions"], mask)
    return masked_loss_sum(logits, batch["targets"], batch["loss_mask"])

  def _grads(self, params, frozen, batch):
    fn = jax.value_and_grad(lambda p, b: self.loss_terms(p, frozen, b), has_aux=True)
    if self.grad_accum == 1:
      (s, n), g = fn(params, batch)
      return s, n, g
    B = batch["tokens"].shape[0]
    if B % self.grad_accum:
      raise ValueError(f"batch size {B} is not divisible by optim.grad_accum={self.grad_accum}")
    micro = jax.tree.map(lambda x: x.reshape(self.grad_accum, B // self.grad_accum, *x.shape[1:]),
                         batch)

    def body(carry, mb):
      s, n, g = carry
      (s1, n1), g1 = fn(params, mb)
      return (s + s1, n + n1, jax.tree.map(jnp.add, g, g1)), None

    zero = jax.tree.map(jnp.zeros_like, params)
    (s, n, g), _ = jax.lax.scan(body, (jnp.float32(0), jnp.float32(0), zero), micro)
    return s, n, g

  def _train_step(self, params, frozen, opt_state, batch):
    s, n, g = self._grads(params, frozen, batch)
    n = jnp.maximum(n, 1.0)
    g = jax.tree.map(lambda x: x / n, g)
    updates, opt_state = self.tx.update(g, opt_state, params)
    if self.embed_from >= 0:
      updates = self._mask_old_rows(updates)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": s / n, "grad_norm": optax.tree.norm(g), "tokens": n}
    return params, opt_state, metrics

  def _mask_old_rows(self, updates):
    def mask(path, u):
      names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
      if "embed" in names and u.ndim == 2:  # [V, D]
        scale = (jnp.arange(u.shape[0]) >= self.embed_from) * self.new_rows_lr_mult
        return u * scale[:, None].astype(u.dtype)
      if "lm_head" in names and u.ndim == 2:  # [D, V]
        scale = (jnp.arange(u.shape[1]) >= self.embed_from) * self.new_rows_lr_mult
        return u * scale[None, :].astype(u.dtype)
      return u
    return jax.tree_util.tree_map_with_path(mask, updates)

  def _eval_step(self, params, frozen, batch):
    s, n = self.loss_terms(params, frozen, batch)
    return {"loss_sum": s, "tokens": n}

  # --- host API ---------------------------------------------------------------------------
  def put_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Place a process-local numpy batch on the mesh (batch axis over data x fsdp)."""
    missing = [k for k in self.batch_keys if k not in batch]
    if missing:
      raise KeyError(f"batch lacks {missing}; this trainer takes {list(self.batch_keys)}")
    return shd.put_batch({k: batch[k] for k in self.batch_keys}, self.mesh)

  def train_step(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    """One optimizer step on a (process-local) batch. Returns host floats:
    ``loss`` (mean nats/token), ``grad_norm``, ``tokens`` and ``lr`` (of this step)."""
    lr = float(self.schedule(self.step))
    self.params, self.opt_state, m = self._train(self.params, self.frozen, self.opt_state,
                                                 self.put_batch(batch))
    self.step += 1
    out = {k: float(v) for k, v in jax.device_get(m).items()}
    out["lr"] = lr
    return out

  def eval_loss(self, batches) -> dict[str, float]:
    """Mean loss and perplexity over an iterable of batches."""
    s = n = 0.0
    for b in batches:
      m = jax.device_get(self._eval(self.params, self.frozen, self.put_batch(b)))
      s += float(m["loss_sum"])
      n += float(m["tokens"])
    loss = s / max(n, 1.0)
    return {"eval_loss": loss, "eval_ppl": float(np.exp(min(loss, 50.0))), "eval_tokens": n}

  def model(self) -> Transformer:
    """The current model (merged view of trainable + frozen state)."""
    return nnx.merge(self.graphdef, self.params, self.frozen)

  # --- checkpoint state -------------------------------------------------------------------
  def state_dict(self) -> dict[str, Any]:
    """What a checkpoint stores: pure dicts of arrays, and the optimizer state."""
    return {"params": nnx.to_pure_dict(self.params), "frozen": nnx.to_pure_dict(self.frozen),
            "opt_state": self.opt_state, "step": self.step}

  def abstract_state_dict(self) -> dict[str, Any]:
    """Shape/dtype/sharding targets for restoring :meth:`state_dict` on this mesh."""
    def abstract(x):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return jax.tree.map(abstract, {
        "params": nnx.to_pure_dict(self.params), "frozen": nnx.to_pure_dict(self.frozen),
        "opt_state": self.opt_state}) | {"step": 0}

  def load_state_dict(self, d: Mapping[str, Any]) -> None:
    """Install restored arrays (as produced by :meth:`state_dict`)."""
    nnx.replace_by_pure_dict(self.params, d["params"])
    nnx.replace_by_pure_dict(self.frozen, d["frozen"])
    self.params = jax.device_put(self.params, self.params_sh)
    self.frozen = jax.device_put(self.frozen, self.frozen_sh)
    self.opt_state = jax.device_put(d["opt_state"], self.opt_sh)
    self.step = int(d["step"])
