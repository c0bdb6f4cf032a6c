"""The shared base of the policy-optimization trainers (GRPO, BoNBoN/IPO).

:class:`PolicyTrainer` is an :class:`~selforch_jax.trainers.sft.SFTTrainer` (same split into
trainable / frozen state, LoRA filter, new-embedding-row masking, optimizer, shardings,
donation, checkpoint state) with three changes:

* the batch carries the keys of :attr:`PolicyTrainer.batch_ranks` (each with its rank, e.g. a
  ``[B, T, T]`` mask or per-row ``[B]`` advantages), sharded over the batch axes;
* :meth:`PolicyTrainer.loss_terms` returns ``(loss sum, aux)`` where ``aux["count"]`` is the
  normaliser (tokens or pairs) and every other ``aux`` entry a sum reported divided by it;
* :attr:`PolicyTrainer.ref_params` is a frozen copy of the initial trainable state, so the
  reference policy pi_ref is the model the run started from (with LoRA: the initial adapters,
  i.e. the base model when they start at zero).

Gradient accumulation is not supported (``optim.grad_accum`` must be 1): rollout batches are
small.
"""

from __future__ import annotations

import abc
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from selforch_jax import sharding as shd
from selforch_jax.trainers.logprobs import token_logprobs
from selforch_jax.trainers.sft import SFTTrainer

LOGPROB_KEYS = ("tokens", "targets", "positions", "mask")


class PolicyTrainer(SFTTrainer, abc.ABC):
  """Base class; subclasses set :attr:`batch_ranks` and implement :meth:`loss_terms`.

  Args: as :class:`SFTTrainer` (``model, mesh, optim, total_steps, lora,
  train_embed_rows_from, rules``).

  Raises:
    ValueError: ``optim.grad_accum != 1``, or as :class:`SFTTrainer`.
  """

  batch_ranks: Mapping[str, int] = {}

  def __init__(self, model, mesh, optim, total_steps: int, *, lora: bool = False,
               train_embed_rows_from: int = -1, rules=shd.DEFAULT_RULES,
               new_rows_lr_mult: float = 1.0):
    if int(optim.grad_accum) != 1:
      raise ValueError(f"policy trainers need optim.grad_accum=1, got {optim.grad_accum}")
    super().__init__(model, mesh, optim, total_steps, lora=lora,
                     train_embed_rows_from=train_embed_rows_from, rules=rules,
                     new_rows_lr_mult=new_rows_lr_mult)
    repl = NamedSharding(mesh, P())
    self.batch_keys = tuple(self.batch_ranks)
    self._batch_sh = {k: shd.batch_sharding(mesh, r) for k, r in self.batch_ranks.items()}
    # pi_ref: a copy of the initial trainable state (the params themselves are donated)
    self.ref_params = jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                              out_shardings=self.params_sh)(self.params)
    self._train = jax.jit(
        self._train_step,
        in_shardings=(self.params_sh, self.frozen_sh, self.opt_sh, self._batch_sh),
        out_shardings=(self.params_sh, self.opt_sh, repl),
        donate_argnums=(0, 2))
    self._loss = jax.jit(lambda p, f, b: self.loss_terms(p, f, b),
                         in_shardings=(self.params_sh, self.frozen_sh, self._batch_sh),
                         out_shardings=repl)
    lp_sh = {k: shd.batch_sharding(mesh, 3 if k == "mask" else 2) for k in LOGPROB_KEYS}
    self._logp = jax.jit(self._token_logprobs,
                         in_shardings=(self.params_sh, self.frozen_sh, lp_sh),
                         out_shardings=shd.batch_sharding(mesh, 2))

  # --- pure functions ---------------------------------------------------------------------
  @abc.abstractmethod
  def loss_terms(self, params, frozen, batch):
    """``(loss sum, aux dict of float32 scalar sums with a "count" entry)`` (pure)."""

  def _token_logprobs(self, params, frozen, batch):
    return token_logprobs(self.merge(params, frozen), batch)

  def merge(self, params, frozen):
    """The model with the given trainable state (pure; usable under jit)."""
    from flax import nnx
    return nnx.merge(self.graphdef, params, frozen)

  def _train_step(self, params, frozen, opt_state, batch):
    (s, aux), g = jax.value_and_grad(lambda p: self.loss_terms(p, frozen, batch),
                                     has_aux=True)(params)
    n = jnp.maximum(aux["count"], 1.0)
    g = jax.tree.map(lambda x: x / n, g)
    updates, opt_state = self.tx.update(g, opt_state, params)
    if self.embed_from >= 0:
      updates = self._mask_old_rows(updates)
    params = optax.apply_updates(params, updates)
    metrics = {"loss": s / n, "grad_norm": optax.tree.norm(g), "count": aux["count"]}
    metrics.update({k: v / n for k, v in aux.items() if k != "count"})
    return params, opt_state, metrics

  # --- host API ---------------------------------------------------------------------------
  def logprobs(self, batch: Mapping[str, np.ndarray], reference: bool = False) -> np.ndarray:
    """Token log-probs ``float32 [B, T]`` of ``batch`` (keys ``tokens, targets, positions``
    ``[B, T]`` and ``mask [B, T, T]``) under the current policy, or pi_ref if ``reference``."""
    b = shd.put_batch({k: batch[k] for k in LOGPROB_KEYS}, self.mesh)
    p = self.ref_params if reference else self.params
    return np.asarray(jax.device_get(self._logp(p, self.frozen, b)), np.float32)

  def loss(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The loss of ``batch`` under the current policy, no update: host floats ``loss``
    (sum / count), ``count`` and the aux means."""
    s, aux = jax.device_get(self._loss(self.params, self.frozen, self.put_batch(batch)))
    n = max(float(aux["count"]), 1.0)
    out = {"loss": float(s) / n, "count": float(aux["count"])}
    out.update({k: float(v) / n for k, v in aux.items() if k != "count"})
    return out

  def put_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Place a numpy batch with the keys of :attr:`batch_ranks` on the mesh.

    :meth:`train_step` (inherited) then returns host floats ``loss``, ``grad_norm``,
    ``count``, the subclass's aux means and ``lr``.

    Raises:
      KeyError: a key is missing.
    """
    missing = [k for k in self.batch_keys if k not in batch]
    if missing:
      raise KeyError(f"batch lacks {missing}; this trainer takes {list(self.batch_keys)}")
    return shd.put_batch({k: batch[k] for k in self.batch_keys}, self.mesh)
