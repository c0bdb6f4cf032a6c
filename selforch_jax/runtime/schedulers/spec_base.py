"""The shared loop of the training-free lossless drafters (PTD, PLD, Lookahead) on the engine.

One engine step of request i carries (DESIGN.md §2.5, seed_systems.md §3.4):

* query 0, the **root**: the last committed token, at position ``last_pos``, in the request's
  own segment and owner (its K/V is kept, like an AR step);
* the **guess tree** (verified): node j at depth d gets position ``last_pos + d`` and sees its
  ancestors, the root and the committed past;
* the **draft** (PTD's draft tree, Lookahead's Jacobi window; never verified, never kept): node
  j sees the nodes :attr:`Draft.sees` lists, the root and the committed past, at position
  ``last_pos + offset``.

Every guess / draft node is one segment (the tree segments, shared by all requests since each
request runs alone in its own steps) whose ``visible`` row names its ancestors; all of them are
written under one scratch *tree owner*. After the step, :func:`selforch_jax.runtime.verify.
verify_tree` decides what is committed (greedy longest-prefix match, or exact multi-draft
speculative sampling with the residual rule for temperature > 0); the next plan ``relabel``\\ s
the accepted guess nodes' slots into the request's sequence (no K/V copy; their positions are
already right) and frees the tree owner (the rest of the tree and the whole draft go).

Batch > 1: requests are decoded one after the other (each alone in its own steps; finished
requests release their pages in the next plan). The first token of a request is sampled from
its prefill step's last row (greedy: argmax; else the request's rng from the filtered target
distribution: exact).

Subclasses implement :meth:`SpecScheduler.start` (after the prompt), :meth:`SpecScheduler.propose`
(the guess tree and the draft of a step) and :meth:`SpecScheduler.observe` (update caches from
the step's argmax rows).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.generation import GenerationResult, check_context
from selforch_jax.runtime.registry import fresh_bases
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult
from selforch_jax.runtime.verify import VerifyResult, target_probs, verify_tree


@dataclasses.dataclass
class Draft:
  """A draft fed alongside the guess tree (its K/V is never kept).

  Attributes:
    tokens: int ``[D]``.
    offsets: int ``[D]``: position = ``last_pos + offset`` (>= 1).
    sees: D lists of earlier draft indices each node sees (besides itself, the root and the
      committed past); a node's offset is ``len(sees) + 1`` for a path-shaped context.
  """

  tokens: list
  offsets: list
  sees: list

  @staticmethod
  def empty() -> "Draft":
    return Draft([], [], [])

  def __len__(self) -> int:
    return len(self.tokens)


@dataclasses.dataclass
class Request:
  """The host state of one request (``extra``: the drafter's own state)."""

  prompt: list
  rng: np.random.Generator
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  finish: str | None = None
  forwards: int = 0
  accepted: list = dataclasses.field(default_factory=list)
  step_tokens: list = dataclasses.field(default_factory=list)   # T of each decode step
  extra: dict = dataclasses.field(default_factory=dict)

  @property
  def last_pos(self) -> int:
    """Position of the last committed token (the next root)."""
    return len(self.prompt) + len(self.tokens) - 1

  @property
  def context(self) -> list:
    return self.prompt + self.tokens


@jax.jit
def _row_stats(logits):
  return jnp.argmax(logits, -1).astype(jnp.int32), jax.nn.logsumexp(logits, -1)


def _tree_visible(vis: np.ndarray, seq_seg: int, tree0: int, rows: list) -> None:
  """Fill tree rows of ``vis``: node k (segment ``tree0 + k``) sees the sequence segment, itself
  and the nodes ``rows[k]``."""
  n = len(rows)
  vis[tree0:tree0 + n, :] = False
  for k, anc in enumerate(rows):
    g = tree0 + k
    vis[g, seq_seg] = vis[g, g] = True
    if anc:
      vis[g, tree0 + np.asarray(anc, np.int64)] = True


class SpecScheduler(Scheduler):
  """Lossless tree/chain speculative decoding of a batch of prompts, one request at a time.

  Args:
    prompts: B non-empty lists of int token ids.
    max_new_tokens: tokens to generate per prompt (>= 1), the stop token included.
    sampling: :class:`SamplingParams` (greedy by default; else exact speculative sampling).
    stop_ids: every EOS id of the model (a committed stop id ends the answer, not included).
    owner_base, segment_base: fresh ids (:func:`~selforch_jax.runtime.registry.fresh_bases`).
    max_tree: most guess + draft nodes in one step (the step has ``1 + max_tree`` queries).
    max_guess: most guess-tree nodes in one step.
    max_pos: the model's ``max_position_embeddings`` (nodes past it are not fed).

  After :func:`~selforch_jax.runtime.scheduler.run`: :attr:`results` (one
  :class:`GenerationResult` per prompt), :attr:`owners` (to free), :attr:`stats` (one dict per
  request: ``forwards`` (engine steps, prefill included), ``tokens_per_forward`` (generated
  tokens, stop token included, per decode forward; the prefill's first token counts for the
  prefill forward), ``accepted`` (guess tokens accepted per decode step), ``mean_accepted``,
  ``step_tokens`` (queries per decode step)).

  Raises:
    ValueError: empty batch or prompt, ``max_new_tokens < 1``, ``max_tree < 0``.
  """

  name = "spec"

  def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               owner_base: int = 0, segment_base: int = 0, *, max_tree: int = 15,
               max_guess: int = 15, max_pos: int = 1 << 30):
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError(f"{type(self).__name__} needs at least one prompt, none empty")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_tree < 0 or max_guess < 0:
      raise ValueError(f"max_tree and max_guess must be >= 0, got {max_tree}, {max_guess}")
    self.max_new = int(max_new_tokens)
    self.sampling = sampling
    self.stops = frozenset(int(s) for s in stop_ids)
    self.max_tree, self.max_guess = int(max_tree), min(int(max_guess), int(max_tree))
    self.max_pos = int(max_pos)
    B = len(prompts)
    self.reqs = [Request(list(map(int, p)), np.random.default_rng([sampling.seed, i]))
                 for i, p in enumerate(prompts)]
    self.seq_owners = owner_base + np.arange(B)
    self.tree_owner = owner_base + B
    self.owners = [int(o) for o in self.seq_owners] + [self.tree_owner]
    self.seq_segs = segment_base + np.arange(B)
    self.tree0 = segment_base + B
    G = self.tree0 + self.max_tree
    self.visible = np.zeros((G, G), bool)
    self.visible[self.seq_segs, self.seq_segs] = True
    self.bidir = np.zeros(G, bool)
    self.cur = 0                  # the request being decoded
    self._pending: tuple = ()     # (relabel triples, free tree owner?) for the next plan
    self._to_free: list[int] = []
    self.results: list[GenerationResult] | None = None
    self.stats: list[dict] = []

  # --- the drafter's hooks -------------------------------------------------------------------
  def start(self, req: Request) -> None:
    """Called once after the prompt's prefill (the first token is committed)."""

  @abc.abstractmethod
  def propose(self, req: Request, budget: int) -> tuple[np.ndarray, np.ndarray, Draft]:
    """The guess tree ``(parents [N+1], tokens [N+1])`` (node 0 = root, :func:`verify_tree`'s
    layout, at most ``min(budget, max_guess)`` nodes, depth = position offset) and the draft (at
    most ``budget - N`` nodes) of the next step of ``req``."""

  def draft_probs(self, req: Request, n: int) -> np.ndarray | None:
    """The distributions the guess tree's tokens were sampled from, float ``[n, V]`` (row 0,
    the root, unused; :func:`~selforch_jax.runtime.verify.speculative_tree`'s ``draft_probs``),
    or None for deterministic guesses (one-hot q; the default). Asked when sampling only."""
    return None

  def observe(self, req: Request, draft: Draft, draft_argmax: np.ndarray,
              committed: list) -> None:
    """After a decode step: the argmax at each fed draft node, and the tokens just committed."""

  # --- the loop -------------------------------------------------------------------------------
  def _commit(self, req: Request, toks, lps) -> None:
    for t, lp in zip(toks, lps):
      if req.finish is not None:
        return
      req.tokens.append(int(t))
      req.logprobs.append(float(lp))
      if int(t) in self.stops:
        req.finish = "stop"
      elif len(req.tokens) >= self.max_new:
        req.finish = "length"

  def next_step(self) -> StepPlan | None:
    if self.results is not None:
      return None
    relabel, free_tree = self._pending or ((), False)
    self._pending = ()
    free = tuple(self._to_free) + ((self.tree_owner,) if free_tree else ())
    self._to_free = []
    req = self.reqs[self.cur]
    i = self.cur
    if not req.tokens:       # prefill
      n = len(req.prompt)
      return StepPlan(req.prompt, np.arange(n), np.full(n, self.seq_segs[i]), self.seq_owners[i],
                      self.visible, self.bidir, relabel=relabel, free_owners=free,
                      tag=("prefill", i, None))
    budget = max(0, min(self.max_tree, self.max_pos - 1 - req.last_pos))
    parents, gtoks, draft = self.propose(req, budget)
    ng = parents.size - 1
    depth = np.zeros(ng + 1, np.int64)
    for k in range(1, ng + 1):
      depth[k] = depth[parents[k]] + 1
    # a prefix of the draft (its order is closed under `sees`): the budget, and no position
    # past the model's context
    nd = min(len(draft), budget - ng)
    nd = next((k for k in range(nd) if req.last_pos + draft.offsets[k] >= self.max_pos), nd)
    draft = Draft(draft.tokens[:nd], draft.offsets[:nd], draft.sees[:nd])
    rows = []
    for k in range(1, ng + 1):          # guess node k -> tree row k - 1; ancestors only
      anc, j = [], int(parents[k])
      while j > 0:
        anc.append(j - 1)
        j = int(parents[j])
      rows.append(anc)
    rows += [[ng + s for s in sees] for sees in draft.sees]
    _tree_visible(self.visible, int(self.seq_segs[i]), self.tree0, rows)
    nt = ng + len(draft)
    tokens = np.concatenate([[req.tokens[-1]], gtoks[1:], np.asarray(draft.tokens, np.int64)])
    positions = req.last_pos + np.concatenate([[0], depth[1:],
                                               np.asarray(draft.offsets, np.int64)])
    segments = np.concatenate([[self.seq_segs[i]], self.tree0 + np.arange(nt)])
    owners = np.concatenate([[self.seq_owners[i]], np.full(nt, self.tree_owner)])
    return StepPlan(tokens, positions, segments, owners, self.visible, self.bidir,
                    relabel=relabel, free_owners=free,
                    tag=("decode", i, (parents, gtoks, draft)))

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    kind, i, info = plan.tag
    req = self.reqs[i]
    req.forwards += 1
    am, lse = jax.device_get(_row_stats(result.logits))
    if kind == "prefill":
      t = self._first_token(req, result.logits[-1], int(am[-1]))
      self._commit(req, [t], [float(result.logits[-1, t]) - float(lse[-1])])
      if req.finish is None:
        self.start(req)
    else:
      parents, gtoks, draft = info
      ng = parents.size - 1
      if self.sampling.greedy:
        vr = verify_tree(parents, gtoks, am[:ng + 1], self.sampling)
      else:
        vr = verify_tree(parents, gtoks, np.asarray(result.logits[:ng + 1]), self.sampling,
                         req.rng, self.draft_probs(req, ng + 1))
      rows = np.concatenate([[0], vr.path]).astype(np.int64)
      toks = vr.tokens.astype(np.int64)
      lps = np.asarray(result.logits[rows, toks]) - lse[rows]
      n_before = len(req.tokens)
      self._commit(req, toks.tolist(), lps.tolist())
      req.accepted.append(vr.num_accepted)
      req.step_tokens.append(int(np.size(plan.tokens)))
      committed = req.tokens[n_before:]
      if req.finish is None:
        self.observe(req, draft, am[ng + 1:], committed)
        if vr.num_accepted:
          self._pending = ([(result.slots[vr.path], int(self.seq_owners[i]),
                             int(self.seq_segs[i]))], True)
        else:
          self._pending = ((), True)
      else:
        self._pending = ((), True)
    if req.finish is not None:
      self._to_free.append(int(self.seq_owners[i]))
      self.cur += 1
      if self.cur == len(self.reqs):
        self._finish()

  def _first_token(self, req: Request, row, argmax: int) -> int:
    if self.sampling.greedy:
      return argmax
    p = target_probs(np.asarray(row)[None], self.sampling)[0]
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, req.rng.random() * c[-1], side="right"), p.size - 1))

  def _finish(self) -> None:
    self.results, self.stats = [], []
    for r in self.reqs:
      ids, lps = list(r.tokens), list(r.logprobs)
      if r.finish == "stop":
        ids, lps = ids[:-1], lps[:-1]
      self.results.append(GenerationResult(ids, lps, r.finish or "length"))
      dec = max(r.forwards - 1, 0)
      self.stats.append(dict(
          forwards=r.forwards, tokens_per_forward=len(r.tokens) / max(r.forwards, 1),
          new_tokens=len(r.tokens), decode_forwards=dec, accepted=list(r.accepted),
          mean_accepted=float(np.mean(r.accepted)) if r.accepted else 0.0,
          step_tokens=list(r.step_tokens), **r.extra.get("stats", {})))


def spec_factory(cls: type[SpecScheduler]) -> Callable[..., SpecScheduler]:
  """The registry factory of a :class:`SpecScheduler` subclass (what PTD, PLD and Lookahead
  register): ``factory(engine, prompts, *, max_new_tokens, sampling=SamplingParams(),
  stop_ids=(), tag_vocab=None, **opts)`` checks the context, picks fresh owner and segment
  bases on ``engine``, defaults ``max_pos`` to the model's context and builds ``cls``;
  ``tag_vocab`` is accepted (the registry passes it to every system) and unused.

  Raises (from the factory):
    ContextLengthError: a prompt plus ``max_new_tokens`` exceeds the model's context.
    TypeError: an option ``cls`` does not take.
  """
  def factory(engine: Engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
              sampling: SamplingParams = SamplingParams(), stop_ids=(), tag_vocab=None,
              **opts) -> SpecScheduler:
    max_pos = engine.cfg.max_position_embeddings
    check_context([len(p) for p in prompts], max_new_tokens, max_pos)
    owner_base, segment_base = fresh_bases(engine)
    opts.setdefault("max_pos", max_pos)
    return cls(prompts, max_new_tokens, sampling, stop_ids, owner_base, segment_base, **opts)

  factory.__name__ = factory.__qualname__ = f"{cls.__name__}_factory"
  factory.__doc__ = f"Build a :class:`{cls.__name__}` on ``engine`` (see :func:`spec_factory`)."
  return factory
