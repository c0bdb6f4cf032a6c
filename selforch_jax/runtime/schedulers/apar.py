"""APAR-style decoding (Liu et al. 2024, "APAR: LLMs Can Do Auto-Parallel Auto-Regressive
Decoding", arXiv:2401.06761) on the engine: a baseline for PASTA (issue 5).

APAR forks at the item boundaries of hierarchical text, with no plan and no length: when the
parent sequence starts a new list item, a child branch writes that item while the parent moves
on to the next one; branches share the prefix KV (tree attention), and the answer is the tree
read in order. What this module implements, precisely:

* **Fork rule (rule-based boundary).** The main thread decodes AR. When its text ends with a
  list-item start — a newline, optional spaces, then a marker ``"<k>."``, ``"<k>)"``, ``"-"``,
  ``"*"`` or ``"•"`` (:data:`ITEM_START`) — the runtime forks a *child* for that item: the
  token the main thread samples next is the child's first token, and the child continues the
  item seeing everything the main thread wrote up to and including the marker (a new segment,
  a new page-table owner, no KV copy). The main thread is fed a newline instead (it "jumps" to
  the next item, seeing none of the children) and continues.
* **Child end.** A child ends at its first token that contains a newline (the end of its item;
  that token is dropped), at a stop token, or at ``child_tokens`` tokens.
* **Batching.** Every engine step runs the main thread's next token and the next token of every
  live child (one step). When the main thread stops (stop token, ``max_new_tokens``, or after
  ``max_forks`` forks it decodes plainly), the live children finish, batched.
* **Positions.** Tree positions as in APAR: a child starts at the position right after its
  marker; the main thread's injected newline takes the same position (branches never see each
  other, so equal positions do not collide).
* **Final text.** The main thread's tokens with each child's tokens inserted right after its
  marker (tree order).

Differences from the paper: APAR *fine-tunes* the model so that the parent itself writes the next
item's start after a fork (``[Fork]``/``[Child]`` control tokens on rule-restructured data); here
the boundary is detected by the pattern above on any model and the parent's jump is the injected
newline, so the parent writes the next marker itself only if the model continues lists that way
(on an untrained base model it usually does); the children see the earlier item *markers* but
not the earlier items' text. There is no join: text the main thread writes after the list does
not see the children (as in APAR, where the parent never attends to its children).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Sequence

import jax
import numpy as np

from selforch_jax.runtime.generation import GenerationResult
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.sampling import sample_rows
from selforch_jax.runtime.registry import fresh_bases, register
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult, run

__all__ = ["ITEM_START", "APARScheduler", "APARResult", "apar_generate", "APARBatch"]

ITEM_START = re.compile(r"\n[ \t]*(?:\d+[.)]|[-*\u2022])[ \t]*$")


@dataclasses.dataclass
class APARResult:
  """One APAR answer.

  Attributes:
    token_ids: the answer in tree order (main thread with children inserted; stop excluded).
    tokens: tokens generated (sampled + injected newlines + the stop token if any).
    forwards: engine steps (prefill included).
    forks: children forked; max_parallel: most branches (main + children) in one step.
    wall_s: wall-clock seconds.
    finish_reason: ``"stop"`` or ``"length"``.
  """

  token_ids: list[int]
  tokens: int
  forwards: int
  forks: int
  max_parallel: int
  wall_s: float
  finish_reason: str


class _Branch:
  def __init__(self, owner: int, seg: int, pos: int):
    self.owner, self.seg, self.pos = owner, seg, pos
    self.tokens: list[int] = []
    self.pending: int | None = None
    self.done = False


class APARScheduler(Scheduler):
  """APAR-style decoding of one prompt (see the module docstring for the exact rules).

  Args:
    prompt: non-empty list of int token ids.
    tokenizer: decodes the main thread's tail (item starts) and children's tokens (newlines).
    max_new_tokens: most tokens over all branches (>= 1).
    child_tokens: a child's budget.
    max_forks: forks per request (afterwards the main thread decodes plainly).
    sampling, stop_ids: as :class:`~selforch_jax.runtime.schedulers.ar.ARScheduler`.
    owner_base / segment_base: first ids this job uses.

  After :func:`run`: :attr:`result` (:class:`APARResult`).

  Raises:
    ValueError: empty prompt or ``max_new_tokens < 1``.
  """

  def __init__(self, prompt: Sequence[int], tokenizer: Any, max_new_tokens: int, *,
               child_tokens: int = 64, max_forks: int = 8,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               owner_base: int = 0, segment_base: int = 0):
    if len(prompt) == 0 or max_new_tokens < 1:
      raise ValueError("APARScheduler needs a non-empty prompt and max_new_tokens >= 1")
    self.prompt = [int(t) for t in prompt]
    self.tok = tokenizer
    self.max_new, self.child_tokens, self.max_forks = int(max_new_tokens), int(child_tokens), int(max_forks)
    self.sampling, self.stops = sampling, frozenset(int(s) for s in stop_ids)
    self.key = jax.random.PRNGKey(sampling.seed)
    self.newline = tokenizer.encode("\n")[-1]
    self._owner, self._seg0 = int(owner_base), int(segment_base)
    G = self._seg0 + 64
    self.visible = np.zeros((G, G), bool)
    self._nseg = self._seg0
    self.owners: list[int] = []
    self.main = _Branch(self._new_owner(), self._new_seg([]), 0)
    self.main_segs = [self.main.seg]
    self.main_text: list[int | _Branch] = []   # main tokens and children (tree order)
    self.children: list[_Branch] = []
    self.step = self.forwards = self.generated = self.max_parallel = 0
    self.prefilled = False
    self.finish_reason: str | None = None
    self.t0 = time.perf_counter()
    self.result: APARResult | None = None

  def _new_owner(self) -> int:
    self._owner += 1
    self.owners.append(self._owner - 1)
    return self._owner - 1

  def _new_seg(self, sees: list[int]) -> int:
    g = self._nseg
    self._nseg += 1
    if g >= self.visible.shape[0]:
      v = np.zeros((2 * g, 2 * g), bool)
      v[:g, :g] = self.visible[:g, :g]
      self.visible = v
    self.visible[g, g] = True
    self.visible[g, sees] = True
    return g

  def _budget_left(self) -> int:
    return self.max_new - self.generated

  def next_step(self) -> StepPlan | None:
    if self.result is not None:
      return None
    vis = self.visible[:self._nseg, :self._nseg]
    bidir = np.zeros(self._nseg, bool)
    if not self.prefilled:
      n = len(self.prompt)
      self.main.pos = n
      return StepPlan(tokens=self.prompt, positions=np.arange(n), segments=np.full(n, self.main.seg),
                      owners=self.main.owner, visible=vis, bidir=bidir, tag=[self.main])
    live = [b for b in [self.main, *self.children] if not b.done and b.pending is not None]
    if not live:
      return None
    toks, pos, segs, owners = [], [], [], []
    for b in live:
      toks.append(b.pending)
      pos.append(b.pos)
      segs.append(b.seg)
      owners.append(b.owner)
      b.pos += 1
      b.pending = None
    self.max_parallel = max(self.max_parallel, len(live))
    return StepPlan(tokens=toks, positions=pos, segments=segs, owners=owners, visible=vis,
                    bidir=bidir, tag=live)

  def _main_tail_is_item_start(self) -> bool:
    main = [t for t in self.main_text[-6:] if isinstance(t, int)]
    tail = (self.prompt + main)[-6:]   # a prompt ending in an item start forks at once
    return bool(ITEM_START.search(self.tok.decode(tail, skip_special_tokens=True)))

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    self.forwards += 1
    live = plan.tag
    if not self.prefilled:
      self.prefilled = True
      rows = [len(self.prompt) - 1]
    else:
      rows = list(range(len(live)))
    toks, _ = sample_rows(result.logits, rows, self.key, self.step, self.sampling)
    self.step += 1
    for b, t in zip(live, toks.tolist()):
      t = int(t)
      self.generated += 1
      if b is self.main:
        self._on_main(t)
      else:
        self._on_child(b, t)
    if self._budget_left() <= 0 and self.finish_reason is None:
      self.finish_reason = "length"
      self.main.done = True
    if self.main.done:
      for c in self.children:
        if not c.done and (c.pending is None or self._budget_left() <= 0):
          c.done = True
    if self.main.done and all(c.done for c in self.children):
      self._finalize()

  def _on_main(self, t: int) -> None:
    if t in self.stops:
      self.finish_reason = "stop"
      self.main.done = True
      return
    if (len(self.children) < self.max_forks and "\n" not in self.tok.decode([t])
        and self._main_tail_is_item_start()):
      # fork: the sampled token starts the child's item; the main thread jumps to a new line
      child = _Branch(self._new_owner(), self._new_seg(list(self.main_segs)), self.main.pos)
      child.tokens.append(t)
      child.pending = t
      self.children.append(child)
      self.main_text.append(child)
      self.main.seg = self._new_seg(list(self.main_segs))
      self.main_segs.append(self.main.seg)
      self.main.pending = self.newline
      self.main_text.append(self.newline)
      self.generated += 1  # the injected newline
      return
    self.main.pending = t
    self.main_text.append(t)

  def _on_child(self, c: _Branch, t: int) -> None:
    if t in self.stops or "\n" in self.tok.decode([t]):
      c.done = True
      return
    c.tokens.append(t)
    if len(c.tokens) >= self.child_tokens:
      c.done = True
    else:
      c.pending = t

  def _finalize(self) -> None:
    ids: list[int] = []
    for x in self.main_text:
      ids.extend(x.tokens if isinstance(x, _Branch) else [x])
    self.result = APARResult(
        token_ids=ids, tokens=self.generated, forwards=self.forwards, forks=len(self.children),
        max_parallel=self.max_parallel, wall_s=time.perf_counter() - self.t0,
        finish_reason=self.finish_reason or "length")


def apar_generate(engine: Engine, prompt: Sequence[int], tokenizer: Any, *, max_new_tokens: int,
                  **kw) -> APARResult:
  """Run :class:`APARScheduler` on ``engine`` (fresh owner / segment ids) and free its pages.

  Raises:
    PoolExhausted: the pool is too small.
  """
  owner_base, segment_base = fresh_bases(engine)
  sched = APARScheduler(prompt, tokenizer, max_new_tokens, owner_base=owner_base,
                        segment_base=segment_base, **kw)
  run(engine, sched)
  for o in sched.owners:
    engine.pool.free_owner(int(o))
  return sched.result


class APARBatch(Scheduler):
  """APAR for a batch of prompts (the registry's ``"apar"``): one :class:`APARScheduler` per
  prompt, run one after the other on the same engine (each frees its pages when it ends).

  Args:
    engine: the engine. prompts: B non-empty lists of int token ids.
    tokenizer, max_new_tokens, **kw: as :class:`APARScheduler`.

  After :func:`run`: :attr:`results` (one :class:`GenerationResult` per prompt: tree-order
  ``token_ids``, no log-probs), :attr:`apar` (the :class:`APARResult` of each), :attr:`owners`.

  Raises:
    ValueError: no prompt (or as :class:`APARScheduler`).
  """

  def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]], tokenizer: Any,
               max_new_tokens: int, **kw):
    if not prompts:
      raise ValueError("APARBatch needs at least one prompt")
    self.engine, self.prompts, self.tok = engine, [list(p) for p in prompts], tokenizer
    self.max_new, self.kw = int(max_new_tokens), kw
    self.owners: list[int] = []
    self.apar: list[APARResult] = []
    self.results: list[GenerationResult] | None = None
    self._cur: APARScheduler | None = None

  def _start(self, i: int) -> None:
    owner_base, segment_base = fresh_bases(self.engine)
    self._cur = APARScheduler(self.prompts[i], self.tok, self.max_new, owner_base=owner_base,
                              segment_base=segment_base, **self.kw)

  def next_step(self) -> StepPlan | None:
    while self.results is None:
      if self._cur is None:
        self._start(len(self.apar))
      plan = self._cur.next_step()
      if plan is not None:
        return plan
      self.apar.append(self._cur.result)
      for o in self._cur.owners:
        self.engine.pool.free_owner(int(o))
      self.owners += [int(o) for o in self._cur.owners]
      self._cur = None
      if len(self.apar) == len(self.prompts):
        self.results = [GenerationResult(list(r.token_ids), [], r.finish_reason)
                        for r in self.apar]
    return None

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    self._cur.on_step(plan, result)


@register("apar")
def _apar(engine: Engine, prompts: Sequence[Sequence[int]], *, tokenizer: Any = None,
          tag_vocab=None, max_new_tokens: int = 256, **kw) -> Scheduler:
  """APAR-style decoding (:class:`APARBatch`); needs ``tokenizer``; takes ``max_new_tokens``,
  ``child_tokens``, ``max_forks``, ``sampling``, ``stop_ids``; ``tag_vocab`` is unused.

  Raises:
    ValueError: no tokenizer."""
  if tokenizer is None:
    raise ValueError("the 'apar' scheduler needs tokenizer= (it reads item starts as text)")
  return APARBatch(engine, prompts, tokenizer, max_new_tokens, **kw)
