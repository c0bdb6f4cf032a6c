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

Every forward counts (``forwards`` = prefill + diffusion + verify steps), so unfused greedy
tokens per forward are at most ``B / 2`` per iteration. The pool holds, between steps, the
committed tokens but the newest and at most ``B - 1`` verify slots: O(B) beyond the sequence.

**Fused** (``fused=True``; beyond upstream): the verify step of block k also carries a
diffusion draft of block k+1 (one forward with per-query views, ``ForwardSpec.query_view``).
Its diffusion queries are ``[d_j, MASK x (B-1)]`` at positions ``s+j .. s+j+B-1``, anchored at
verified draft ``d_j`` (``fuse_at=j``; default the last draft ``d_k``, the issue's "assume block
k is accepted whole"), in the diffusion segment that sees the committed sequence, the root and
the verify chain ``d_1 .. d_{j-1}`` (the AR keys strictly before ``s+j``, written by the same
step) and itself: exactly the training layout of a block starting at ``s+j``
(:func:`~selforch_jax.models.orthrus.dual_pass_logits`), so it needs no training of its own.
Row r predicts position ``s+j+r+1``. When ``a >= j`` drafts are accepted, the committed
sequence agrees with everything the block assumed, and rows ``a+1-j ..`` (past the bonus at
``s+a+1``) are the next block's drafts: the next verify step runs at once. When ``a < j`` they
are dropped and a standalone diffusion step drafts from the bonus, as unfused. Its K/V go to a
separate scratch owner released right after the step (``StepPlan.scratch_owners``), so the
pool never keeps diffusion K/V. A block whose fused draft is used costs one forward instead of
two; a fused step has up to ``2B`` queries. Drafts from a smaller ``j`` are usable more often
but condition on masks where the accepted tokens past ``d_j`` are.

**Multi-step denoising** (``denoise_steps=n > 1``; the Orthrus post's multi-step ablation, the
MaskGIT / LLaDA confidence-remasking schedule: Chang et al. 2022, Nie et al. 2025 ``generate.py``
``low_confidence``): step 1 becomes ``n' = min(n, k)`` scratch diffusion passes over the same
positions (``k`` the block's drafts). Each pass fixes into the block input (the next pass's
tokens, in place of the mask) the most confident still-masked drafts (confidence = the row's
max probability: softmax of the logits greedy, ``target_probs`` sampling), ``k (p+1) // n' -
k p // n'`` of them at pass ``p`` (an equal share; the last pass fills the rest). Greedy fixes
the argmax. Sampling draws a fixed token from its row's filtered distribution ``q`` at that
pass and keeps ``q`` as its draft probability. Each pass is a forward (``diffusion_forwards``).
Verification is unchanged, so greedy stays lossless. **Exact sampling** needs more than "q is
what the token was drawn from": when an earlier draft ``d_j`` is fixed in a later pass than
``d_i`` (``j < i``), ``q_j`` depends on ``d_i``, so accepting ``d_j`` tells the verifier
something about ``d_i`` and ``d_i`` given the accepted prefix is no longer distributed as
``q_i``. Sampling therefore verifies only the longest prefix ``d_1 .. d_m`` whose fixing passes
do not decrease (each ``q_i`` then depends on the earlier drafts and on later tokens that are
not verified, i.e. side information drawn before it; the prefix length is known before
``d_m``'s draw). Greedy verifies all ``k``. ``fused=True`` with ``denoise_steps > 1`` is an
error (a fused draft is one pass by construction).
"""

from __future__ import annotations

import dataclasses
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
    fused: fuse each verify step with the next block's diffusion draft (module docstring).
    fuse_at: the verified draft j >= 1 the fused draft is anchored at (None or 0: the last one,
      usable only when the block is accepted whole; j: usable whenever >= j drafts are
      accepted).
    denoise_steps: n >= 1 scratch diffusion passes per block (module docstring; 1: one pass,
      upstream's decoder).

  After the run, :attr:`stats` rows have :class:`SpecScheduler`'s figures (``forwards`` counts
  every model forward) plus ``diffusion_forwards``, ``verify_forwards`` and
  ``mean_acceptance_length`` (tokens committed per verify step: accepted + 1), ``fused_drafts``
  (fused drafts used: verify steps that ran with no diffusion step before them).

  Raises:
    ValueError: as :class:`SpecScheduler`; ``mask_id < 0``; the options (:func:`check_options`).
  """

  name = "orthrus"

  def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               owner_base: int = 0, segment_base: int = 0, *, mask_id: int,
               block_size: int = DEFAULT_BLOCK_SIZE, fused: bool = False,
               fuse_at: int | None = None, denoise_steps: int = 1, max_pos: int = 1 << 30):
    check_options(block_size, fused, fuse_at, denoise_steps)
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
    self.fused = bool(fused)
    self.fuse_at = int(fuse_at) if fuse_at else None
    self.denoise_steps = int(denoise_steps)
    self.draft_owner = self.tree_owner + 1      # the fused step's diffusion queries (scratch)
    self.owners.append(self.draft_owner)
    self._fused: tuple | None = None            # a fused plan's (T, anchor j, block rows)

  def next_step(self) -> StepPlan | None:
    if self.results is not None:
      return None
    i, req = self.cur, self.reqs[self.cur]
    dn = req.extra.get("denoise")
    if dn is not None:                            # a later pass of a multi-step draft
      nb = len(dn["tokens"])
      return StepPlan(list(dn["tokens"]), req.last_pos + np.arange(nb),
                      np.full(nb, self.block_seg), self.tree_owner, self.visible, self.bidir,
                      scratch=True, spec=ForwardSpec(view=VIEW), tag=("draft", i, dn["k"]))
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
        g = self._block_visible(i, 0)
        tokens = [req.tokens[-1]] + [self.mask_id] * (nb - 1)
        if min(self.denoise_steps, k) > 1:
          req.extra["denoise"] = dict(k=k, tokens=list(tokens), p=0,
                                      passes=min(self.denoise_steps, k),
                                      fixed=np.full(k, -1, np.int64), d=np.zeros(k, np.int64),
                                      q=None)
        return StepPlan(tokens, req.last_pos + np.arange(nb), np.full(nb, g), self.tree_owner,
                        self.visible, self.bidir, relabel=relabel, free_owners=free,
                        scratch=True, spec=ForwardSpec(view=VIEW), tag=("draft", i, k))
    plan = super().next_step()
    self._fused = None
    if self.fused and plan is not None and plan.tag[0] == "decode":
      plan = self._fuse(plan, req)
    return plan

  def _fuse(self, plan: StepPlan, req: Request) -> StepPlan:
    """``plan`` (the verify step of ``req``) plus the diffusion draft of the next block,
    anchored at verified draft ``j`` (module docstring); unchanged when nothing fits."""
    T = np.size(plan.tokens)
    k = T - 1                                   # drafts verified by this step
    j = k if self.fuse_at is None else min(self.fuse_at, k)
    anchor = req.last_pos + j                   # the anchor draft's position
    # drafts the next block will want if exactly j drafts are accepted (then the bonus)
    left = self.max_new - len(req.tokens) - (j + 1)
    budget_next = max(0, min(self.max_tree, self.max_pos - 2 - anchor))
    want = min(self.block_size - 1, left, budget_next)
    if j == 0 or want <= 0:
      return plan
    nb = want + 1                               # the anchor row predicts the bonus
    i = plan.tag[1]
    g = self._block_visible(i, j - 1)
    tokens = np.concatenate([np.asarray(plan.tokens, np.int64),
                             [int(np.asarray(plan.tokens)[j])], np.full(nb - 1, self.mask_id)])
    view = np.zeros(T + nb, bool)
    view[T:] = True
    self._fused = (T, j, nb)
    return dataclasses.replace(
        plan, tokens=tokens,
        positions=np.concatenate([np.asarray(plan.positions), anchor + np.arange(nb)]),
        segments=np.concatenate([np.asarray(plan.segments), np.full(nb, g)]),
        owners=np.concatenate([np.broadcast_to(np.asarray(plan.owners), (T,)),
                               np.full(nb, self.draft_owner)]),
        visible=self.visible, scratch_owners=(self.draft_owner,),
        spec=ForwardSpec(view=VIEW, query_view=view))

  def _block_visible(self, i: int, chain: int) -> int:
    """Set the diffusion block's visibility row for request ``i``: its committed sequence, the
    first ``chain`` verify-chain nodes of this step and itself; returns the block segment."""
    g = self.block_seg
    self.visible[g, :] = False
    self.visible[g, self.seq_segs[i]] = self.visible[g, g] = True
    self.visible[g, self.tree0:self.tree0 + chain] = True
    return g

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    kind, i, k = plan.tag
    if kind != "draft":
      req = self.reqs[i]
      st = req.extra.setdefault("stats", _zero_stats())
      if kind == "decode":
        st["verify_forwards"] += 1
        st["fused_drafts"] += int(req.extra.pop("fused_draft", False))
      fused, self._fused = self._fused, None
      super().on_step(plan, result)
      if fused is not None and req.finish is None and req.accepted[-1] >= fused[1]:
        T, j, nb = fused      # row r of the block predicts position anchor + r + 1: the
        r0 = req.accepted[-1] + 1 - j                 # rows past the bonus are the drafts
        n = min(nb - r0, self.max_new - len(req.tokens))
        if n > 0:
          self._take_draft(req, np.asarray(result.logits)[T + r0:T + r0 + n])
          req.extra["fused_draft"] = True
      return
    req = self.reqs[i]
    req.forwards += 1
    req.extra.setdefault("stats", _zero_stats())["diffusion_forwards"] += 1
    if "denoise" in req.extra:
      self._denoise_pass(req, np.asarray(result.logits)[:k])
      return
    self._take_draft(req, np.asarray(result.logits)[:k])  # host slice: no gather compiled per k

  def _denoise_pass(self, req: Request, rows: np.ndarray) -> None:
    """One pass of a multi-step draft (module docstring): fix this pass's share of the most
    confident still-masked drafts from rows ``[k, V]`` (row j predicts draft j+1, block slot
    j+1); after the last pass the drafts go to :meth:`propose` (sampling: the prefix whose
    fixing passes do not decrease)."""
    dn = req.extra["denoise"]
    k, n, p = dn["k"], dn["passes"], dn["p"]
    free = np.flatnonzero(dn["fixed"] < 0)
    share = len(free) if p == n - 1 else (k * (p + 1)) // n - (k * p) // n
    if self.sampling.greedy:
      z = rows[free].astype(np.float64)
      z = np.exp(z - z.max(-1, keepdims=True))
      conf = z.max(-1) / z.sum(-1)
    else:
      q = target_probs(rows[free], self.sampling)
      conf = q.max(-1)
    pick = np.argsort(-conf, kind="stable")[:share]             # into free
    take = free[pick]
    if self.sampling.greedy:
      dn["d"][take] = rows[take].argmax(-1)
    else:
      if dn["q"] is None:
        dn["q"] = np.zeros((k, q.shape[1]))
      qs = q[pick]
      dn["d"][take] = _draw(qs, req.rng)
      dn["q"][take] = qs
    dn["fixed"][take] = p
    for j in take:
      dn["tokens"][j + 1] = int(dn["d"][j])
    dn["p"] = p + 1
    if dn["p"] < n:
      return
    del req.extra["denoise"]
    d, q = dn["d"].tolist(), dn["q"]
    if q is not None:       # exact sampling: the prefix whose fixing passes do not decrease
      m = 1
      while m < k and dn["fixed"][m] >= dn["fixed"][m - 1]:
        m += 1
      d, q = d[:m], q[:m]
    req.extra["draft"] = (d, q)

  def _take_draft(self, req: Request, rows: np.ndarray) -> None:
    """The next block's drafts from diffusion rows ``[k, V]`` (row j predicts draft j+1)."""
    if self.sampling.greedy:
      req.extra["draft"] = (rows.argmax(-1).astype(np.int64).tolist(), None)
      return
    q = target_probs(rows, self.sampling)
    req.extra["draft"] = (_draw(q, req.rng).tolist(), q)

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
      for key, v in _zero_stats().items():
        st.setdefault(key, v)
      st["mean_acceptance_length"] = (float(np.mean(st["accepted"])) + 1.0
                                      if st["accepted"] else 0.0)


def check_options(block_size: int, fused: bool = False, fuse_at: int | None = None,
                  denoise_steps: int = 1) -> None:
  """Check Orthrus's decoding options before any work (the scheduler and the decode CLI).

  Args:
    block_size: B >= 2. fused: fuse verify + next draft. fuse_at: None or 0 (the last draft)
      or j in ``[1, B)``; needs ``fused``. denoise_steps: >= 1; > 1 needs ``fused=False``.

  Raises:
    ValueError: naming the bad option and its valid range.
  """
  if int(block_size) < 2:
    raise ValueError(f"orthrus block_size must be >= 2, got {block_size}")
  if fuse_at and not 1 <= int(fuse_at) < int(block_size):
    raise ValueError(f"orthrus fuse_at must be 0 (the last draft) or a draft index in [1, "
                     f"{int(block_size) - 1}] (block_size={int(block_size)}), got {fuse_at}")
  if fuse_at and not fused:
    raise ValueError(f"orthrus fuse_at={fuse_at} anchors the fused draft: it needs fused=True")
  if int(denoise_steps) < 1:
    raise ValueError(f"orthrus denoise_steps must be >= 1, got {denoise_steps}")
  if fused and int(denoise_steps) > 1:
    raise ValueError("orthrus fused=True drafts a block in one pass: it cannot take "
                     f"denoise_steps={denoise_steps} > 1 (use fused=False)")


def _draw(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """One token per row of ``q`` (float ``[n, V]``, rows summing to ~1) by inverse CDF with
  ``n`` uniforms from ``rng``; int64 ``[n]``."""
  c = np.cumsum(q, axis=-1)
  u = rng.random(q.shape[0])[:, None] * c[:, -1:]
  return np.minimum((c <= u).sum(-1), q.shape[1] - 1).astype(np.int64)


def _zero_stats() -> dict:
  return dict(diffusion_forwards=0, verify_forwards=0, fused_drafts=0)


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
