"""Orthrus (chiennv2000/orthrus ``OrthrusLM.generate``; seed_systems.md §2.2) on the engine,
lossless: a trained diffusion attention view drafts a block, the frozen AR view verifies it.

Per request, after the AR prefill (the first token ``x_s`` sampled from its last row), loop:

1. **diffusion step** (``ForwardSpec(view="diffusion")``, *scratch*: its K/V are written to the
   scheduler's tree owner, attended to by the step itself and released right after, so the pool
   never keeps diffusion K/V): ``[x_s, MASK x (B-1)]`` at positions ``s .. s+B-1`` in one
   bidirectional segment that sees the request's committed sequence (its K/V, positions
   ``< s``) and the whole block. Row i predicts token ``s+i+1``: the draft ``d_1 .. d_{B-1}``
   (greedy: argmax; sampling: drawn from ``q_i = target_probs(row i)``, the same filtered
   distribution AR sampling uses, as upstream applies temperature / top-k / top-p to both views).
2. **verify step** (the AR view): the root ``x_s`` (kept in the request's sequence) and the chain
   ``d_1 .. d_{B-1}`` (under the tree owner) — :class:`SpecScheduler`'s guess-tree step with a
   one-child-per-node tree; :func:`~selforch_jax.runtime.verify.verify_tree` commits the longest
   agreeing prefix plus the bonus (greedy) or runs exact speculative sampling (accept ``d_i`` with
   ``min(1, p/q)``, residual ``norm(max(p - q, 0))`` on the first rejection; Leviathan et al.
   2023) with the drafts' ``q``. The next plan relabels the accepted drafts' slots into the
   sequence and frees the rest (the rollback of the rejected suffix); the bonus token is the next
   ``x_s`` (its K/V is written by the next verify step).

Every forward counts (``forwards`` = prefill + diffusion + verify steps; not fused), so greedy
tokens per forward are at most ``B / 2`` per iteration. The pool holds, between steps, the
committed tokens but the newest and at most ``B - 1`` verify slots: O(B) beyond the sequence.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from selforch_jax.models.orthrus import VIEW
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.registry import register
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.schedulers.spec_base import Draft, Request, SpecScheduler, spec_factory
from selforch_jax.runtime.step import ForwardSpec, StepPlan, StepResult
from selforch_jax.runtime.verify import target_probs

DEFAULT_BLOCK_SIZE = 8   # CPU (configs/orthrus.py); upstream's author post: 32


class OrthrusScheduler(SpecScheduler):
  """Orthrus decoding (module docstring) of a batch of prompts, one request at a time.

  Args:
    prompts, max_new_tokens, sampling, stop_ids, owner_base, segment_base, max_pos: as
      :class:`SpecScheduler`.
    mask_id: the model's mask token id (:func:`selforch_jax.models.orthrus.mask_token_id`).
    block_size: B >= 2, the diffusion block (1 + B - 1 drafts).

  After the run, :attr:`stats` rows have :class:`SpecScheduler`'s figures (``forwards`` counts
  every model forward) plus ``diffusion_forwards``, ``verify_forwards`` and
  ``mean_acceptance_length`` (tokens committed per verify step: accepted + 1).

  Raises:
    ValueError: as :class:`SpecScheduler`; ``block_size < 2``; ``mask_id < 0``.
  """

  name = "orthrus"

  def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               owner_base: int = 0, segment_base: int = 0, *, mask_id: int,
               block_size: int = DEFAULT_BLOCK_SIZE, max_pos: int = 1 << 30):
    if int(block_size) < 2:
      raise ValueError(f"block_size must be >= 2, got {block_size}")
    if int(mask_id) < 0:
      raise ValueError(f"mask_id must be a token id >= 0, got {mask_id}")
    super().__init__(prompts, max_new_tokens, sampling, stop_ids, owner_base, segment_base,
                     max_tree=int(block_size) - 1, max_guess=int(block_size) - 1, max_pos=max_pos)
    self.block_size, self.mask_id = int(block_size), int(mask_id)
    G = self.visible.shape[0]          # one more segment: the diffusion block (bidirectional)
    vis = np.zeros((G + 1, G + 1), bool)
    vis[:G, :G] = self.visible
    self.visible, self.bidir = vis, np.append(self.bidir, True)
    self.block_seg = G

  def next_step(self) -> StepPlan | None:
    if self.results is not None:
      return None
    i, req = self.cur, self.reqs[self.cur]
    if req.tokens and "draft" not in req.extra:
      budget = max(0, min(self.max_tree, self.max_pos - 1 - req.last_pos))
      k = min(self.block_size - 1, budget, self.max_new - len(req.tokens))
      if k == 0:
        req.extra["draft"] = ([], None)
      else:
        nb = min(self.block_size, budget + 1)     # no position past the model's context
        relabel, free_tree = self._pending or ((), False)
        self._pending = ()
        free = tuple(self._to_free) + ((self.tree_owner,) if free_tree else ())
        self._to_free = []
        g = self.block_seg
        self.visible[g, :] = False
        self.visible[g, self.seq_segs[i]] = self.visible[g, g] = True
        tokens = [req.tokens[-1]] + [self.mask_id] * (nb - 1)
        return StepPlan(tokens, req.last_pos + np.arange(nb), np.full(nb, g), self.tree_owner,
                        self.visible, self.bidir, relabel=relabel, free_owners=free,
                        scratch=True, spec=ForwardSpec(view=VIEW), tag=("draft", i, k))
    return super().next_step()

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    kind, i, k = plan.tag
    if kind != "draft":
      if kind == "decode":
        req = self.reqs[i]
        st = req.extra.setdefault("stats", dict(diffusion_forwards=0, verify_forwards=0))
        st["verify_forwards"] += 1
      super().on_step(plan, result)
      return
    req = self.reqs[i]
    req.forwards += 1
    req.extra.setdefault("stats", dict(diffusion_forwards=0, verify_forwards=0))
    req.extra["stats"]["diffusion_forwards"] += 1
    rows = np.asarray(result.logits)[:k]   # host slice: no device gather compiled per k
    if self.sampling.greedy:
      req.extra["draft"] = (rows.argmax(-1).astype(np.int64).tolist(), None)
      return
    q = target_probs(rows, self.sampling)
    c = np.cumsum(q, axis=-1)
    u = req.rng.random(k)[:, None] * c[:, -1:]
    d = np.minimum((c <= u).sum(-1), q.shape[1] - 1)
    req.extra["draft"] = (d.astype(np.int64).tolist(), q)

  def propose(self, req: Request, budget: int):
    d, q = req.extra.pop("draft", ([], None))
    d = d[:budget]
    req.extra["q"] = None if q is None else q[:len(d)]
    return (np.arange(-1, len(d), dtype=np.int64), np.asarray([0] + d, np.int64), Draft.empty())

  def draft_probs(self, req: Request, n: int) -> np.ndarray | None:
    q = req.extra.get("q")
    if q is None or n <= 1:
      return None
    return np.concatenate([np.full((1, q.shape[1]), 1.0 / q.shape[1]), q[:n - 1]])

  def _finish(self) -> None:
    super()._finish()
    for st in self.stats:
      st.setdefault("diffusion_forwards", 0)
      st.setdefault("verify_forwards", 0)
      st["mean_acceptance_length"] = (float(np.mean(st["accepted"])) + 1.0
                                      if st["accepted"] else 0.0)


_factory = spec_factory(OrthrusScheduler)


def orthrus_factory(engine: Engine, prompts, *, mask_id: int | None = None, **kw):
  """Build an :class:`OrthrusScheduler` on ``engine`` (:func:`spec_factory`); ``mask_id``
  defaults to the model's last vocabulary row (where ``add_orthrus`` puts ``<|mask|>``).

  Raises:
    ValueError: the engine's model has no diffusion view.
  """
  if VIEW not in engine.cfg.attn_views:
    raise ValueError(f"runtime 'orthrus' needs a model with the {VIEW!r} attention view (an "
                     "Orthrus adapter, --config.adapter=DIR)")
  if mask_id is None:
    mask_id = int(engine.cfg.vocab_size) - 1
  return _factory(engine, prompts, mask_id=mask_id, **kw)


register("orthrus")(orthrus_factory)
