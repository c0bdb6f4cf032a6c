"""The AR scheduler: plain greedy / sampled decoding through the engine.

Each prompt is a sequence with its own owner (page table) and its own segment (it sees only
itself). Prompt i is prefilled in one engine step of T = len(prompt_i); then every decode
step runs the last token of every unfinished sequence together (T = number of live rows;
continuous batching in one flat KV row). Finished sequences release their pages.

It reproduces :meth:`selforch_jax.decoding.generate.Generator.generate` token for token:
the token of step i (step 0 = the one after the prompt) is drawn by
``sample_token(logits[B, V], fold_in(PRNGKey(seed), i), params)`` over all B rows at
once, exactly as the foundation's batched decode does (rows that already stopped pass
stale logits, which only affect their own, discarded, row).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from selforch_jax.decoding.generate import GenerationResult
from selforch_jax.decoding.sampling import SamplingParams, sample_token
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult, run


@functools.partial(jax.jit, static_argnums=(3,))
def _sample(logits, key, step, params: SamplingParams):
  tok = sample_token(logits, jax.random.fold_in(key, step), params)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tok[:, None], axis=1)[:, 0]
  return tok, lp


class ARScheduler(Scheduler):
  """Greedy / sampled autoregressive decoding of a batch of prompts.

  Args:
    prompts: B non-empty lists of int token ids.
    max_new_tokens: tokens to generate per prompt (>= 1), the stop token included.
    sampling: :class:`SamplingParams` (greedy by default).
    stop_ids: ids that end a sequence (not included in the output).
    owner_base / segment_base: ids of sequence 0 (sequence i uses base + i); segments below
      ``segment_base`` (other jobs in the same pool) are invisible to these sequences.

  After :func:`run`, :attr:`results` holds one
  :class:`~selforch_jax.decoding.generate.GenerationResult` per prompt.

  Raises:
    ValueError: empty batch or prompt, or ``max_new_tokens < 1``.
  """

  def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               owner_base: int = 0, segment_base: int = 0):
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("ARScheduler needs at least one prompt, none empty")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    self.prompts = [list(map(int, p)) for p in prompts]
    self.max_new = int(max_new_tokens)
    self.sampling = sampling
    self.stops = frozenset(int(s) for s in stop_ids)
    B = len(prompts)
    self.owners = owner_base + np.arange(B)
    self.segs = segment_base + np.arange(B)
    G = segment_base + B
    self.visible = np.zeros((G, G), bool)
    self.visible[self.segs, self.segs] = True
    self.bidir = np.zeros(G, bool)
    self.key = jax.random.PRNGKey(sampling.seed)
    self.tokens: list[list[int]] = [[] for _ in range(B)]
    self.logprobs: list[list[float]] = [[] for _ in range(B)]
    self.done = np.zeros(B, bool)
    self._prefilled = 0
    self._freed: set[int] = set()
    self._last_logits = [None] * B   # [V] device rows of the latest logits per sequence
    self.step = 0                    # index of the next token to sample (Generator's step)
    self.results: list[GenerationResult] | None = None

  def _sample_all(self) -> None:
    B = len(self.prompts)
    logits = jnp.stack(self._last_logits)
    tok, lp = jax.device_get(_sample(logits, self.key, self.step, self.sampling))
    for i in range(B):
      if self.done[i]:
        continue
      t = int(tok[i])
      self.tokens[i].append(t)
      self.logprobs[i].append(float(lp[i]))
      if t in self.stops or len(self.tokens[i]) >= self.max_new:
        self.done[i] = True
    self.step += 1
    if self.done.all():
      self._finish()

  def _finish(self) -> None:
    self.results = []
    for ids, lps in zip(self.tokens, self.logprobs):
      if ids and ids[-1] in self.stops:
        self.results.append(GenerationResult(ids[:-1], lps[:-1], "stop"))
      else:
        self.results.append(GenerationResult(list(ids), list(lps), "length"))

  def next_step(self) -> StepPlan | None:
    if self.results is not None:
      return None
    if self._prefilled < len(self.prompts):
      i = self._prefilled
      p = self.prompts[i]
      n = len(p)
      return StepPlan(tokens=p, positions=np.arange(n), segments=np.full(n, self.segs[i]),
                      owners=self.owners[i], visible=self.visible, bidir=self.bidir,
                      tag=("prefill", [i]))
    rows = [i for i in range(len(self.prompts)) if not self.done[i]]
    toks = [self.tokens[i][-1] for i in rows]
    pos = [len(self.prompts[i]) + len(self.tokens[i]) - 1 for i in rows]
    free = tuple(int(self.owners[i]) for i in range(len(self.prompts))
                 if self.done[i] and i not in self._freed)
    return StepPlan(tokens=toks, positions=pos, segments=self.segs[rows],
                    owners=self.owners[rows], visible=self.visible, bidir=self.bidir,
                    free_owners=free, tag=("decode", rows))

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    kind, rows = plan.tag
    for o in plan.free_owners:  # finished rows release their pages in the next step's plan
      self._freed.add(int(o) - int(self.owners[0]))
    if kind == "prefill":
      self._last_logits[rows[0]] = result.logits[-1]
      self._prefilled += 1
      if self._prefilled == len(self.prompts):
        self._sample_all()
      return
    for j, i in enumerate(rows):
      self._last_logits[i] = result.logits[j]
    self._sample_all()


def generate(engine: Engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
             free_after: bool = True) -> list[GenerationResult]:
  """AR decoding of ``prompts`` on ``engine`` (the engine counterpart of ``Generator.generate``).

  Args:
    engine: an :class:`Engine` with room for every prompt plus its new tokens.
    prompts, max_new_tokens, sampling, stop_ids: as :class:`ARScheduler`.
    free_after: release every sequence's pages at the end.

  Returns:
    One :class:`GenerationResult` per prompt.

  Raises:
    PoolExhausted: the pool is too small.
  """
  # fresh owner and segment ids: sequences already in the pool stay invisible to these
  owner_base = max(engine.pool.owners(), default=-1) + 1
  segment_base = int(engine.pool.segment.max(initial=-1)) + 1
  sched = ARScheduler(prompts, max_new_tokens, sampling, stop_ids, owner_base=owner_base,
                      segment_base=segment_base)
  run(engine, sched)
  if free_after:
    for o in sched.owners:
      engine.pool.free_owner(int(o))
  return sched.results
