"""The AR scheduler: plain greedy / sampled decoding through the engine.

Each prompt is a sequence with its own owner (page table) and its own segment (it sees only
itself). Prompt i is prefilled in one engine step of T = len(prompt_i); then every decode
step runs the last token of every unfinished sequence together (T = number of live rows;
continuous batching in one flat KV row). Finished sequences release their pages.

The token of step i (step 0 = the one after the prompt) is drawn by the runtime's one sampler,
:func:`selforch_jax.runtime.sampling.sample` over ``logits[B, V]`` with the key
``fold_in(PRNGKey(seed), i)``, over all B rows at once (rows that already stopped pass stale
logits, which only affect their own, discarded, row). Greedy decoding of a request in a batch
gives exactly the tokens it gets alone (tests/test_decode.py).

Stop conditions (:mod:`selforch_jax.runtime.generation`): any of ``stop_ids`` (every EOS id of the
model: :func:`~selforch_jax.runtime.generation.eos_ids`; not part of the answer, finish reason
``"stop"``), a stop string (``stop_strings`` with a ``decode`` callable: the answer's text
contains one; the tokens up to the one that completed it are kept, the text is cut by
:func:`~selforch_jax.runtime.generation.cut_at_stop` where results become text; ``"stop"``), or
``max_new_tokens`` (``"length"``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from selforch_jax.runtime.generation import GenerationResult, StopStringWatcher, check_context
from selforch_jax.runtime.sampling import SamplingParams, sample
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.registry import fresh_bases, register
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult, run, run_job


class ARScheduler(Scheduler):
  """Greedy / sampled autoregressive decoding of a batch of prompts.

  Args:
    prompts: B non-empty lists of int token ids.
    max_new_tokens: tokens to generate per prompt (>= 1), the stop token included.
    sampling: :class:`SamplingParams` (greedy by default).
    stop_ids: ids that end a sequence (not included in the output): every EOS id of the model
      (:func:`~selforch_jax.runtime.generation.eos_ids`).
    owner_base / segment_base: ids of sequence 0 (sequence i uses base + i); segments below
      ``segment_base`` (other jobs in the same pool) are invisible to these sequences.
    stop_strings: strings that end a sequence once its decoded text holds one (needs
      ``decode``); the tokens are kept, the text is cut where results become text.
    decode: ``ids -> str`` (the tokenizer's ``decode``), for ``stop_strings``.
    on_token: optional ``callback(row, token_id)`` called with every token that becomes part
      of an answer, as it is sampled (streaming; a stop id is not passed).

  After :func:`run`, :attr:`results` holds one
  :class:`~selforch_jax.runtime.generation.GenerationResult` per prompt (``finish_reason``
  ``"stop"`` or ``"length"``).

  Raises:
    ValueError: empty batch or prompt, ``max_new_tokens < 1``, or ``stop_strings`` without
      ``decode``.
  """

  def __init__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               owner_base: int = 0, segment_base: int = 0, *,
               stop_strings: Sequence[str] = (),
               decode: Callable[[Sequence[int]], str] | None = None,
               on_token: Callable[[int, int], None] | None = None):
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("ARScheduler needs at least one prompt, none empty")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if stop_strings and decode is None:
      raise ValueError("stop_strings need a decode callable (ids -> text)")
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
    self.step = 0                    # index of the next token to sample
    self.stop_strings = tuple(stop_strings)
    self.watchers = ([StopStringWatcher(decode, self.stop_strings) for _ in range(B)]
                     if self.stop_strings else None)
    self.hit_stop_string = np.zeros(B, bool)
    self.on_token = on_token
    self.results: list[GenerationResult] | None = None

  def _sample_all(self) -> None:
    B = len(self.prompts)
    logits = jnp.stack(self._last_logits)
    tok, lp = jax.device_get(sample(logits, self.key, self.step, self.sampling))
    for i in range(B):
      if self.done[i]:
        continue
      t = int(tok[i])
      self.tokens[i].append(t)
      self.logprobs[i].append(float(lp[i]))
      if t in self.stops:
        self.done[i] = True
        continue
      if self.on_token is not None:
        self.on_token(i, t)
      if self.watchers is not None and self.watchers[i].push(t):
        self.hit_stop_string[i] = True
        self.done[i] = True
      if len(self.tokens[i]) >= self.max_new:
        self.done[i] = True
    self.step += 1
    if self.done.all():
      self._finish()

  def _finish(self) -> None:
    self.results = []
    for i, (ids, lps) in enumerate(zip(self.tokens, self.logprobs)):
      if ids and ids[-1] in self.stops:
        self.results.append(GenerationResult(ids[:-1], lps[:-1], "stop"))
      else:
        reason = "stop" if self.hit_stop_string[i] else "length"
        self.results.append(GenerationResult(list(ids), list(lps), reason))

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
             free_after: bool = True, **kw) -> list[GenerationResult]:
  """AR decoding of ``prompts`` on ``engine`` (batched: one engine step per token).

  Args:
    engine: an :class:`Engine` with room for every prompt plus its new tokens.
    prompts, max_new_tokens, sampling, stop_ids: as :class:`ARScheduler`.
    free_after: release every sequence's pages at the end.
    **kw: ``stop_strings``, ``decode``, ``on_token`` of :class:`ARScheduler`.

  Returns:
    One :class:`GenerationResult` per prompt.

  Raises:
    ContextLengthError: a prompt plus ``max_new_tokens`` exceeds the model's
      ``max_position_embeddings`` (checked before anything runs).
    PoolExhausted: the pool is too small.
  """
  check_context([len(p) for p in prompts], max_new_tokens, engine.cfg.max_position_embeddings)
  # fresh owner and segment ids: sequences already in the pool stay invisible to these
  owner_base, segment_base = fresh_bases(engine)
  sched = ARScheduler(prompts, max_new_tokens, sampling, stop_ids, owner_base=owner_base,
                      segment_base=segment_base, **kw)
  return run_job(engine, sched, free_after).results


@register("ar")
def _ar(engine: Engine, prompts: Sequence[Sequence[int]], tag_vocab=None, **kw) -> Scheduler:
  """Plain AR decoding (:class:`~selforch_jax.runtime.schedulers.ar.ARScheduler`); ``tag_vocab`` is
  accepted and unused (tags are decoded as ordinary tokens).

  Raises:
    ContextLengthError: a prompt plus ``max_new_tokens`` exceeds the model's context."""
  if "max_new_tokens" in kw:
    check_context([len(p) for p in prompts], kw["max_new_tokens"],
                  engine.cfg.max_position_embeddings)
  owner_base, segment_base = fresh_bases(engine)
  return ARScheduler(prompts, owner_base=owner_base, segment_base=segment_base, **kw)
