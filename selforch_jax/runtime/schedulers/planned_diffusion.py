"""The Planned Diffusion scheduler: an AR plan, then every promised chunk of the round filled at
once by masked diffusion, then ``<sync/>`` (issue 21; planned-diffusion/planned-diffusion,
``dream/generation_utils.py`` and ``pd_utils.py``; thesis_systems.md §3.2).

Per request, on the one engine (KV-cached; upstream's default planner re-runs the whole sequence
every token):

1. **AR planning**: one token per step (prefill first) until the plan of the round ends: the
   model writes ``<async>`` after its promises (our data format), or ``<sync/>`` / a stop token
   (upstream's format, ``</topic><sync/>`` / ``</topic><|im_end|>``).
2. **Scaffold**: each promise k of the round (length N_k) gets ``<async>`` + ``10*N_k``
   ``<|mask|>`` + ``</async>`` after the plan, fed to the request's
   :class:`~selforch_jax.lang.mask.LayoutBuilder` in sequence mode with the Planned Diffusion
   rules (:func:`~selforch_jax.lang.planned_diffusion.planned_diffusion_layout`: chunks see the
   prefix and the whole plan, themselves bidirectionally, not their siblings), so positions,
   segments and visibility are those of the training forward.
3. **Denoising**: ``steps = max(1, int(steps_ratio * longest chunk))`` iterations, noise levels
   ``linspace(1, eps, steps + 1)``. Each iteration is one *scratch* engine step over every
   still-masked chunk of every request in this phase (their K/V are attended to by the step and
   released: the pool keeps none of a noisy state; a complete chunk is not re-run: its siblings
   never see it, except under ``full_attention``, and its final state is written at the sync
   step); row j-1 of a chunk predicts its token j (the Dream shift). Per
   chunk, the ``max(1, int(masked * (1 - s / t)))`` most confident still-masked positions are
   committed (:mod:`selforch_jax.runtime.diffusion_unmask`: entropy / margin / prob confidence),
   all of them at the last iteration (Dream); or, with ``threshold`` (Fast-dLLM, Wu et al.
   2025), every masked position whose top probability is ``>= threshold``, at least the most
   confident one, until none is masked. ``pad_last`` (off by default, as upstream): positions
   whose argmax is ``[PAD]`` rank after every position whose argmax is content (with the
   threshold: they are committed only when no content prediction is left), so the confident
   filler at a chunk's tail cannot be committed before the content it would cut (a chunk's
   length is only known once its content is: confidence order alone commits the tail's
   ``[PAD]`` first and ends sentences early, as LLaDA reports for EOS). ``spread`` (off by
   default): no two adjacent positions of a chunk are committed in the same iteration
   (:func:`~selforch_jax.runtime.diffusion_unmask.select_spread`: the same confidence order,
   ``pad_last`` ranking included, skipping a position whose left or right neighbour was picked
   in this iteration; two neighbours predicted from the same masked context often disagree,
   "on on", "9830" for "98300"). When the rule leaves fewer eligible positions than the
   iteration's count, only those are committed and the rest stay masked for the next iterations
   (the count is recomputed from what is left); the last iteration still commits every position
   left, adjacent or not, so a chunk always completes in exactly ``steps`` iterations (the
   same bound as without ``spread``). With ``threshold``, ``spread`` commits the positions over
   the threshold in confidence order minus those next to one already picked (at least the most
   confident candidate), until none is masked. ``window=W`` (0 = off; the semi-autoregressive
   order of LLaDA, Nie et al. 2025, as a sliding window): only the first ``W`` still-masked
   positions of a chunk are candidates for every rule above (the last iteration still commits
   everything left); ``window=1`` fills each chunk left to right, one token per iteration, all
   chunks of the round in parallel. ``pad_tail`` (off by default): when an iteration commits a
   ``[PAD]`` at position j, every still-masked position after j is committed as ``[PAD]`` in the
   same iteration (training puts filler only at a chunk's tail), so a chunk that has ended
   stops costing iterations; a request leaves the denoising phase as soon as none of its chunks
   holds a mask. ``seed_topic`` (off by default): chunk k's first positions are its promise's
   topic ids (the plan's own tokens between ``<promise>`` and the length, tag ids dropped, at
   most ``length - 1`` of them), committed when the round is scaffolded, for data whose chunks
   begin with their topic (the cities task: ``<promise> Velora 4 </promise>`` ...
   ``<async> Velora is a city ...``; its tokenization is the same in both places). A chunk
   otherwise knows its promise only by its position in the round, and a committed state is one
   the masked-diffusion training covers (any subset of a chunk's tokens unmasked). The
   iterations are counted from the masked positions left: ``steps = max(1, int(steps_ratio *
   most masked positions of a chunk))``. A chunk's text ends at its first ``[PAD]``
   (:meth:`PlannedDiffusionScheduler.text`: anything committed after it is filler the training
   format never has). Chunk tokens are the argmax over non-tag tokens and
   ``[PAD]`` (a chunk cannot write a tag or a stop token, so its layout never changes).
4. **Sync**: one non-scratch step writes the final state of every chunk (its clean K/V) and
   ``<sync/>`` (seeing those chunks, in the same step); its logits give the next AR token.
   A round ended by a stop token skips it (nothing reads the chunks) and ends the request.

Guards (nothing crashes, no generated text is lost): at most ``max_promises`` promises per round
(the ``max_promises``-th ``</promise>`` ends the plan), at most ``max_rounds`` rounds (then
``<promise>`` / ``<async>`` are banned and decoding is plain AR; ``<|mask|>`` and ``[PAD]``, the
runtime's fillers, and the TIP register tags are never sampled by the AR planner), a plan of
more than ``plan_cap`` tokens is ended (an open promise is closed first), a promise closed without a length
gets ``default_length`` (the runtime writes its digits before ``</promise>``), a length above
``max_length`` is scaffolded with ``10*max_length`` masks, and the scaffold is shrunk to fit
``max_new_tokens`` (a round that cannot fit one mask per chunk ends the request, ``"length"``).
Runtime-written tokens (injected lengths, scaffold tags, ``<sync/>``) carry log-prob 0.0.

Full diffusion (``full_diffusion=L``, the Dream-style baseline of issue 21; Dream-7B,
``dream/generation_utils.py``: the whole answer masked, entropy-ordered unmasking): no plan and
no AR step; after the prefill the runtime writes ``<async>`` + ``L`` ``<|mask|>`` + ``</async>``
(one chunk, the format the chunks were trained in) at positions ``P .. P+L+1`` after the
``P``-token prompt, in one engine segment that sees the whole prompt and itself
bidirectionally; ``steps = max(1, int(steps_ratio * L))`` denoising iterations as above (the
same unmask rule and the same confidence); ``[PAD]`` is the end-of-text filler, stripped from
the text. The request ends after the last iteration (``"stop"`` if the chunk holds a ``[PAD]``,
else ``"length"``); its critical path is ``steps``. The chunk bypasses the layout builder
(:meth:`PlannedDiffusionScheduler.layout` covers the prompt only).

Batches: every AR step runs the pending tokens of every request in the AR phase (and the sync
steps of those that finished denoising); every denoising step runs all chunks of every request
in the diffusion phase; when both kinds wait they alternate.

Per-request figures (:attr:`PlannedDiffusionScheduler.stats`): ``forwards`` (engine steps that
ran a token of the request, prefill included), ``critical_path`` (``forwards - 1``: the
sequential steps after the prefill, AR steps + denoising steps; AR decoding's is its token
count), ``ar_steps``, ``denoise_steps``, ``rounds``, ``chunks``, ``tokens`` (response tokens,
tags and scaffold included), ``content_tokens`` (de-tagged), ``wall_s``, ``notes`` (guards and
parser degradations applied), ``well_formed``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from selforch_jax.lang import PromiseClosed, Sync, TagVocab
from selforch_jax.lang.events import PromiseAbandoned, PromiseOpened
from selforch_jax.lang.assemble import assemble_pieces, join_pieces
from selforch_jax.lang.mask import LayoutBuilder
from selforch_jax.lang.parser import DEFAULT_CAP
from selforch_jax.lang.tags import TOKENS_PER_UNIT
from selforch_jax.runtime.diffusion_unmask import CONFIDENCES, select_spread, unmask_count
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.generation import GenerationResult
from selforch_jax.runtime.registry import fresh_bases, register
from selforch_jax.runtime.sampling import SamplingParams, sample_rows
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult

__all__ = ["PlannedDiffusionScheduler", "chunk_predictions", "DEFAULTS"]

DEFAULTS = dict(steps_ratio=1.0, eps=1e-3, confidence="entropy", threshold=None, max_promises=8,
                max_rounds=4, plan_cap=96, default_length=2, max_length=8, full_diffusion=None,
                pad_last=False, spread=False, window=0, pad_tail=False, seed_topic=False)


@functools.partial(jax.jit, static_argnames=("kind",))
def _predict(logits, rows, allowed, kind):
  x = jnp.where(allowed[None, :], jnp.take(logits, rows, axis=0).astype(jnp.float32), -jnp.inf)
  logp = jax.nn.log_softmax(x, axis=-1)
  p = jnp.exp(logp)
  tok = jnp.argmax(x, axis=-1).astype(jnp.int32)
  if kind == "entropy":
    conf = jnp.sum(jnp.where(allowed[None, :], p * logp, 0.0), axis=-1)
  else:
    top = jax.lax.top_k(p, 2)[0]
    conf = top[:, 0] if kind == "prob" else top[:, 0] - top[:, 1]
  return tok, conf, jnp.max(p, axis=-1)


def chunk_predictions(logits, rows: Sequence[int], allowed: np.ndarray,
                      kind: str = "entropy") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Argmax token, confidence and top probability of ``logits[rows]`` over the allowed ids.

  On device (the ``[T, V]`` logits never leave it); the confidence is
  :func:`selforch_jax.runtime.diffusion_unmask.confidence` of the logits with disallowed ids at
  -inf. Rows are padded to a power of two (few compiled shapes).

  Args:
    logits: float32 ``[T, V]`` (a step's logits).
    rows: R row indices.
    allowed: bool ``[V]``: ids a chunk may hold.
    kind: "entropy", "margin" or "prob".

  Returns:
    ``(tokens int32 [R], confidence float32 [R], top probability float32 [R])`` numpy arrays.

  Raises:
    ValueError: unknown kind or no row.
  """
  if kind not in CONFIDENCES:
    raise ValueError(f"confidence must be one of {CONFIDENCES}, got {kind!r}")
  rows = np.asarray(rows, np.int32)
  if rows.size == 0:
    raise ValueError("chunk_predictions needs at least one row")
  R = rows.size
  padded = np.concatenate([rows, np.full((1 << (R - 1).bit_length()) - R, rows[0], np.int32)])
  tok, conf, top = jax.device_get(_predict(logits, padded, jnp.asarray(allowed), kind))
  return np.asarray(tok[:R]), np.asarray(conf[:R]), np.asarray(top[:R])


@dataclasses.dataclass
class _Chunk:
  start: int                 # builder index of its <async>
  length: int                # masks scaffolded (content slots)
  tokens: np.ndarray         # int [length] current state
  masked: np.ndarray         # bool [length]


class _Req:
  def __init__(self, prompt, tv, cap, length_unit):
    self.prompt = list(prompt)
    self.builder = LayoutBuilder(tv, async_sees_full_plan=True, chunk_bidirectional=True,
                                 cap=cap, length_unit=length_unit)
    self.seq: list[int] = []        # every token fed, actual ids (chunks: their current state)
    self.lp: list[float] = []       # log-prob per fed token (0.0: prompt / runtime-written)
    self.seg_map: dict[int, int] = {}
    self.queue: list[tuple[int, float]] = []   # tokens for the next AR step
    self.then_round: int | None = None         # after the queue: start the round (terminator)
    self.phase = "ar"
    self.round_lengths: list[int] = []
    self.round_topics: list[tuple[int, ...]] = []   # topic ids of the round's promises
    self.round_start: int | None = None        # builder index of the round's first <promise>
    self.chunks: list[_Chunk] = []
    self.terminator: int | None = None
    self.terminator_lp = 0.0
    self.in_promise = False
    self.steps = 0
    self.step_i = 0
    self.rounds = 0
    self.n_chunks = 0
    self.forwards = 0
    self.ar_steps = 0
    self.denoise_steps = 0
    self.notes: list[str] = []
    self.stop_token: int | None = None
    self.finish_reason = ""
    self.t0 = self.t1 = 0.0
    self.owner = self.scratch_owner = -1
    self.resp_start = self.text_start = len(self.prompt)  # teacher-forced plan: earlier
    self.fd: dict[int, tuple[int, int]] = {}   # full diffusion: index -> (position, segment)

  @property
  def response_len(self) -> int:
    return len(self.seq) - self.resp_start


class PlannedDiffusionScheduler(Scheduler):
  """Planned Diffusion decoding of a batch of prompts (see the module docstring).

  Args:
    prompts: B non-empty lists of int token ids (one that ends with a PLAN and ``<async>`` is a
      teacher-forced plan: its round is scaffolded at once; the response then starts with that
      ``<async>``).
    tag_vocab: the vocabulary's :class:`TagVocab` (its ``eos_ids`` are read as text, as the
      training layout does; ``stop_ids`` end a request).
    max_new_tokens: most response tokens per prompt (plan, scaffold, chunks and runtime-written
      tags included).
    sampling: AR tokens' :class:`SamplingParams` (chunk tokens are always the argmax).
    stop_ids: ids that end a request (not included in the output).
    steps_ratio: denoising iterations per token of the round's longest chunk (> 0).
    eps: the last noise level (0 < eps < 1).
    confidence: "entropy", "margin" or "prob".
    threshold: None, or Fast-dLLM's probability threshold in (0, 1].
    max_promises, max_rounds, plan_cap, default_length, max_length: the guards (>= 1).
    full_attention: the chunks of a round see each other (upstream's dense-attention ablation;
      the trainer's ``planned_diffusion.full_attention``,
      :func:`selforch_jax.lang.planned_diffusion.dense_round_mask`).
    full_diffusion: None, or L >= 1: the Dream-style baseline (module docstring): the whole
      answer is one chunk of ``min(L, max_new_tokens - 2)`` masks, no plan.
    pad_last: commit ``[PAD]`` predictions after every content prediction (module docstring).
    spread: never commit two adjacent positions of a chunk in one denoising iteration, except
      at the last one, which commits everything left (module docstring).
    window: 0 (off), or W >= 1: semi-autoregressive unmasking, only the chunk's first W
      still-masked positions may be committed, except at the last iteration (module docstring).
    pad_tail: a committed ``[PAD]`` commits every later masked position of its chunk as
      ``[PAD]`` in the same iteration (module docstring).
    seed_topic: each chunk starts with its promise's topic ids, committed at the scaffold
      (module docstring).
    cap, length_unit: parser settings (10 tokens per promise unit).
    owner_base / segment_base: first owner / segment id this job uses.

  After :func:`~selforch_jax.runtime.scheduler.run`: :attr:`results` (one
  :class:`GenerationResult` per prompt, ``token_ids`` = the response in sequence order, tags
  included, stop excluded), :attr:`stats`, :meth:`text`, :meth:`text_ids`, :meth:`layout`,
  :meth:`sequence`, :attr:`owners`.

  Raises:
    ValueError: empty batch or prompt, ``max_new_tokens < 1``, an option out of range, or
      ``default_length`` without the tag vocab's digit ids.
  """

  def __init__(self, prompts: Sequence[Sequence[int]], tag_vocab: TagVocab, max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               steps_ratio: float = DEFAULTS["steps_ratio"], eps: float = DEFAULTS["eps"],
               confidence: str = DEFAULTS["confidence"], threshold: float | None = None,
               max_promises: int = DEFAULTS["max_promises"],
               max_rounds: int = DEFAULTS["max_rounds"], plan_cap: int = DEFAULTS["plan_cap"],
               default_length: int = DEFAULTS["default_length"],
               max_length: int = DEFAULTS["max_length"], cap: int | None = DEFAULT_CAP,
               length_unit: int = TOKENS_PER_UNIT, owner_base: int = 0, segment_base: int = 0,
               vocab_size: int | None = None, full_attention: bool = False,
               full_diffusion: int | None = None, pad_last: bool = False,
               spread: bool = False, window: int = 0, pad_tail: bool = False,
               seed_topic: bool = False):
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("PlannedDiffusionScheduler needs at least one prompt, none empty")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_options(steps_ratio=steps_ratio, eps=eps, confidence=confidence, threshold=threshold,
                  max_promises=max_promises, max_rounds=max_rounds, plan_cap=plan_cap,
                  default_length=default_length, max_length=max_length,
                  full_diffusion=full_diffusion, window=window)
    if full_diffusion is not None and max_new_tokens < 3:
      raise ValueError(f"full_diffusion needs max_new_tokens >= 3, got {max_new_tokens}")
    if not tag_vocab.digit_ids:
      raise ValueError("PlannedDiffusionScheduler needs the tag vocab's digit_ids (to write a "
                       "promise's default length)")
    self.tv = dataclasses.replace(tag_vocab, eos_ids=())
    tv = self.tv
    self.max_new = int(max_new_tokens)
    self.sampling = sampling
    self.stops = frozenset(int(s) for s in stop_ids)
    self.steps_ratio, self.eps, self.kind = float(steps_ratio), float(eps), confidence
    self.threshold = None if threshold is None else float(threshold)
    self.max_promises, self.max_rounds = int(max_promises), int(max_rounds)
    self.plan_cap, self.max_length = int(plan_cap), int(max_length)
    self.length_unit = int(length_unit)
    self.full_attention = bool(full_attention)
    self.pad_last = bool(pad_last)
    self.spread = bool(spread)
    self.window = int(window)
    self.pad_tail = bool(pad_tail)
    self.seed_topic = bool(seed_topic)
    self.full_diffusion = None if full_diffusion is None else int(full_diffusion)
    digits = str(int(default_length))
    self.default_len = ([tv.space_ids[0]] if tv.space_ids else []) + \
        [tv.digit_ids[int(c)] for c in digits]
    V = int(vocab_size) if vocab_size is not None else max(
        [tv.promise_open, tv.promise_close, tv.async_open, tv.async_close, tv.sync, tv.mask,
         tv.pad, *tv.registers, *self.stops]) + 1
    allowed = np.ones(V, bool)
    for t in (tv.promise_open, tv.promise_close, tv.async_open, tv.async_close, tv.sync,
              tv.mask, *tv.registers, *self.stops):
      if t < V:
        allowed[t] = False
    self.allowed = allowed
    self._gram_ids = [tv.promise_open, tv.async_open, tv.mask, tv.pad, *tv.registers]
    self.key = jax.random.PRNGKey(sampling.seed)
    self.sample_step = 0
    self.reqs = [_Req(p, tv, cap, length_unit) for p in prompts]
    self.owners: list[int] = []
    nxt = int(owner_base)
    for r in self.reqs:
      r.owner, r.scratch_owner = nxt, nxt + 1
      nxt += 2
      self.owners += [r.owner, r.scratch_owner]
    G = max(16, 2 * (segment_base + 1))
    self._visible = np.zeros((G, G), bool)
    self._bidir = np.zeros(G, bool)
    self._nseg = int(segment_base)
    self._prefilled = False
    self._last_kind = "denoise"
    self.results: list[GenerationResult] | None = None
    self.stats: list[dict] | None = None

  # ---- layout ---------------------------------------------------------------------------------
  def _engine_segment(self, r: _Req, bseg: int, chunk: bool) -> int:
    g = r.seg_map.get(bseg)
    if g is not None:
      return g
    sees = [r.seg_map[s] for s in sorted(r.builder.visible_segments(bseg)) if s != bseg]
    g = self._nseg
    self._nseg += 1
    if g >= self._visible.shape[0]:
      n = 2 * self._visible.shape[0]
      v = np.zeros((n, n), bool)
      v[:g, :g] = self._visible[:g, :g]
      self._visible = v
      self._bidir = np.concatenate([self._bidir, np.zeros(n - self._bidir.size, bool)])
    self._visible[g, g] = True
    self._visible[g, sees] = True
    self._bidir[g] = chunk
    r.seg_map[bseg] = g
    return g

  def _feed(self, r: _Req, token: int, lp: float = 0.0, chunk: bool = False) -> list:
    ev = r.builder.feed(int(token))
    r.seq.append(int(token))
    r.lp.append(float(lp))
    i = r.builder.num_tokens - 1
    self._engine_segment(r, r.builder.segment_of(i), chunk)
    for e in ev:
      if isinstance(e, PromiseOpened):
        r.in_promise = True
      elif isinstance(e, (PromiseClosed, PromiseAbandoned)):
        r.in_promise = False
      if isinstance(e, PromiseClosed) and e.promise is not None:
        r.round_lengths.append(int(e.length))
        r.round_topics.append(tuple(int(t) for t in e.topic_ids))
      elif isinstance(e, Sync) and e.round is not None:
        r.round_lengths, r.round_topics, r.round_start = [], [], None
    if token == self.tv.promise_open and r.round_start is None:
      r.round_start = i
    return ev

  def _query(self, r: _Req, i: int) -> tuple[int, int, int]:
    if i in r.fd:
      return (r.seq[i], *r.fd[i])
    return (r.seq[i], r.builder.position_of(i), r.seg_map[r.builder.segment_of(i)])

  def _tables(self):
    G = self._nseg
    return self._visible[:G, :G], self._bidir[:G]

  # ---- the scheduler interface ----------------------------------------------------------------
  def next_step(self) -> StepPlan | None:
    if self.results is not None:
      return None
    if not self._prefilled:
      q, rows = [], []
      t0 = time.perf_counter()
      for ri, r in enumerate(self.reqs):
        r.t0 = t0
        body = r.prompt
        if len(body) > 1 and body[-1] == self.tv.async_open:   # a teacher-forced PLAN?
          for t in body[:-1]:
            self._feed(r, t)
          if r.round_lengths and not r.in_promise:
            r.resp_start = len(body) - 1
            r.text_start = r.round_start
            r.then_round = self.tv.async_open
          else:
            self._feed(r, body[-1])
        else:
          for t in body:
            self._feed(r, t)
        q.extend((ri, i, r.owner) for i in range(r.builder.num_tokens))
        rows.append((ri, len(q) - 1))
        r.forwards += 1
      self._prefilled = True
      if self.full_diffusion is not None:
        for r in self.reqs:
          self._start_full(r)
        rows = []                 # nothing is sampled from the prefill
      return self._plan(q, scratch=False, tag=("prefill", rows))
    ar = [ri for ri, r in enumerate(self.reqs) if r.phase in ("ar", "sync")]
    dn = [ri for ri, r in enumerate(self.reqs) if r.phase == "denoise"]
    if not ar and not dn:
      return None
    kind = "ar" if ar and (not dn or self._last_kind == "denoise") else "denoise"
    self._last_kind = kind
    q = []
    if kind == "denoise":
      spans = []
      for ri in dn:
        r = self.reqs[ri]
        r.forwards += 1
        r.denoise_steps += 1
        for c in r.chunks:
          if not c.masked.any() and not self.full_attention:   # complete: no sibling sees
            continue                                               # it, its state is final
          first = len(q)
          for i in range(c.start, c.start + c.length + 2):
            q.append((ri, i, r.scratch_owner))
          spans.append((ri, c, first))
      return self._plan(q, scratch=True, tag=("denoise", spans))
    rows = []
    for ri in ar:
      r = self.reqs[ri]
      if r.phase == "ar" and not r.queue:
        continue
      r.forwards += 1
      r.ar_steps += 1
      if r.phase == "sync":      # the chunks' final state and <sync/>, which sees them
        for c in r.chunks:
          q.extend((ri, i, r.owner) for i in range(c.start, c.start + c.length + 2))
        self._feed(r, self.tv.sync, r.terminator_lp if r.terminator == self.tv.sync else 0.0)
        q.append((ri, r.builder.num_tokens - 1, r.owner))
        r.rounds += 1
        r.chunks = []
        r.phase = "ar"
      else:
        for tok, lp in r.queue:
          self._feed(r, tok, lp)
          q.append((ri, r.builder.num_tokens - 1, r.owner))
        r.queue = []
      rows.append((ri, len(q) - 1))
    return self._plan(q, scratch=False, tag=("ar", rows))

  def _plan(self, q, scratch: bool, tag) -> StepPlan:
    toks, pos, seg, own = [], [], [], []
    for ri, i, owner in q:
      t, p, g = self._query(self.reqs[ri], i)
      toks.append(t)
      pos.append(p)
      seg.append(g)
      own.append(owner)
    vis, bidir = self._tables()
    return StepPlan(tokens=toks, positions=pos, segments=seg, owners=own, visible=vis,
                    bidir=bidir, scratch=scratch,
                    tag=(tag[0], tag[1], [(ri, i) for ri, i, _ in q]))

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    kind, info, _ = plan.tag
    if kind == "denoise":
      self._on_denoise(info, result)
    else:
      rows = [ri for ri, _ in info]
      starts = [ri for ri in rows if self.reqs[ri].then_round is not None]
      pending = [(ri, j) for ri, j in info if self._wants_sample(self.reqs[ri])]
      if pending:
        fixed = [True] * (len(self._gram_ids) - 2)
        ban = [[self.reqs[ri].rounds >= self.max_rounds] * 2 + fixed for ri, _ in pending]
        toks, lps = sample_rows(result.logits, [j for _, j in pending], self.key,
                                self.sample_step, self.sampling,
                                (self._gram_ids, ban, [False] * len(pending)))
        self.sample_step += 1
        for (ri, _), t, lp in zip(pending, toks.tolist(), lps.tolist()):
          self._on_token(self.reqs[ri], int(t), float(lp))
      for ri in starts:           # a plan the runtime ended: its queue ran in this step
        r = self.reqs[ri]
        if r.phase == "ar":
          term, r.then_round = r.then_round, None
          self._start_round(r, term, 0.0)
    now = time.perf_counter()
    for r in self.reqs:
      if r.phase != "done":
        r.t1 = now
    if all(r.phase == "done" for r in self.reqs):
      self._finalize()

  def _wants_sample(self, r: _Req) -> bool:
    return r.phase == "ar" and r.then_round is None and not r.queue

  # ---- AR tokens ------------------------------------------------------------------------------
  def _on_token(self, r: _Req, tok: int, lp: float) -> None:
    tv = self.tv
    in_promise = r.in_promise
    if r.response_len >= self.max_new:   # the budget is spent: the sampled token is not kept
      self._finish(r, "length")
      return
    if tok in self.stops:
      if r.round_lengths:
        self._start_round(r, tok, lp)
      else:
        r.stop_token = tok
        self._finish(r, "stop")
      return
    if (r.round_lengths or in_promise) and tok in (tv.async_open, tv.sync):
      if in_promise:        # a plan ended inside a promise: close it first
        r.notes.append(f"{r.builder.num_tokens}: promise_closed_by_plan_end")
        r.queue = [(t, 0.0) for t in self._length_tail(r)] + [(tv.promise_close, 0.0)]
        r.then_round = tok
        return
      self._start_round(r, tok, lp)
      return
    if tok == tv.promise_close and in_promise and self._inner_length(r) is None:
      r.notes.append(f"{r.builder.num_tokens}: default_length")
      r.queue = [(t, 0.0) for t in self._length_tail(r)] + [(tok, lp)]
    else:
      r.queue = [(tok, lp)]
    if tok == tv.promise_close and in_promise and len(r.round_lengths) + 1 >= self.max_promises:
      r.notes.append(f"{r.builder.num_tokens}: max_promises")
      r.then_round = tv.async_open
    elif r.round_start is not None and r.builder.num_tokens + 1 - r.round_start > self.plan_cap:
      if not (in_promise or r.round_lengths or tok == tv.promise_close):
        r.round_start = None       # the abandoned promises' text is no plan: nothing to end
        return
      r.notes.append(f"{r.builder.num_tokens}: plan_cap")
      if in_promise and tok != tv.promise_close:
        r.queue += [(t, 0.0) for t in self._length_tail(r, tok)] + [(tv.promise_close, 0.0)]
      r.then_round = tv.async_open

  def _inner_length(self, r: _Req, extra: Sequence[int] = ()) -> int | None:
    seq = r.seq
    j = len(seq) - 1
    while j >= 0 and seq[j] != self.tv.promise_open:
      j -= 1
    return self.tv.split_length(list(seq[j + 1:]) + list(extra))[1]

  def _length_tail(self, r: _Req, extra: int | None = None) -> list[int]:
    ext = [] if extra is None else [extra]
    return [] if self._inner_length(r, ext) is not None else list(self.default_len)

  # ---- rounds ---------------------------------------------------------------------------------
  def _start_round(self, r: _Req, terminator: int, lp: float) -> None:
    """Scaffold every promise of the open round; ``terminator``: the token that ended the plan
    (``<async>``: chunk 0's opener; ``<sync/>``: fed after the chunks; a stop id: the request
    ends after denoising)."""
    tv = self.tv
    if not r.round_lengths:        # the plan's promises were abandoned: nothing to scaffold
      r.queue = [(terminator, lp)] if terminator not in self.stops else []
      if terminator in self.stops:
        r.stop_token = terminator
        self._finish(r, "stop")
      return
    lengths = [self.length_unit * min(n, self.max_length) for n in r.round_lengths]
    k = len(lengths)
    room = self.max_new - r.response_len - 2 * k - 1
    if room < k:
      r.notes.append(f"{r.builder.num_tokens}: no_room_for_round")
      self._finish(r, "length")
      return
    if sum(lengths) > room:
      r.notes.append(f"{r.builder.num_tokens}: round_shrunk_to_budget")
      scale = room / sum(lengths)
      lengths = [max(1, int(n * scale)) for n in lengths]
    r.terminator, r.terminator_lp = terminator, lp
    r.chunks = []
    for j, n in enumerate(lengths):
      start = r.builder.num_tokens
      first_lp = lp if (j == 0 and terminator == tv.async_open) else 0.0
      self._feed(r, tv.async_open, first_lp, chunk=True)
      for _ in range(n):
        self._feed(r, tv.mask, chunk=True)
      self._feed(r, tv.async_close, chunk=True)
      c = _Chunk(start, n, np.full(n, tv.mask, np.int64), np.ones(n, bool))
      if self.seed_topic and j < len(r.round_topics):   # the promise's topic starts the chunk
        topic = [t for t in r.round_topics[j] if t < self.allowed.size and self.allowed[t]]
        topic = topic[:n - 1]
        c.tokens[:len(topic)] = topic
        c.masked[:len(topic)] = False
        for i, t in enumerate(topic):
          r.seq[start + 1 + i] = int(t)
      r.chunks.append(c)
    r.n_chunks += k
    if self.full_attention:      # one dense region: every chunk of the round sees the others
      segs = [r.seg_map[r.builder.segment_of(ch.start)] for ch in r.chunks]
      self._visible[np.ix_(segs, segs)] = True
    r.steps = max(1, int(self.steps_ratio * max(int(c.masked.sum()) for c in r.chunks)))
    r.step_i = 0
    r.phase = "denoise"

  def _start_full(self, r: _Req) -> None:
    """Scaffold the Dream-style whole-answer chunk after the prompt (module docstring)."""
    tv = self.tv
    n = min(self.full_diffusion, self.max_new - 2)
    sees = sorted(set(r.seg_map.values()))
    g = self._nseg
    self._nseg += 1
    if g >= self._visible.shape[0]:
      m = 2 * g
      v = np.zeros((m, m), bool)
      v[:g, :g] = self._visible[:g, :g]
      self._visible = v
      self._bidir = np.concatenate([self._bidir, np.zeros(m - self._bidir.size, bool)])
    self._visible[g, g] = True
    self._visible[g, sees] = True
    self._bidir[g] = True
    start, pos0 = len(r.seq), r.builder.position_of(r.builder.num_tokens - 1) + 1
    for j, t in enumerate([tv.async_open] + [tv.mask] * n + [tv.async_close]):
      r.fd[start + j] = (pos0 + j, g)
      r.seq.append(int(t))
      r.lp.append(0.0)
    r.chunks = [_Chunk(start, n, np.full(n, tv.mask, np.int64), np.ones(n, bool))]
    r.n_chunks, r.rounds = 1, 1
    r.steps = max(1, int(self.steps_ratio * n))
    r.step_i = 0
    r.phase = "denoise"

  def _on_denoise(self, spans, result: StepResult) -> None:
    rows, where = [], []
    for ri, c, first in spans:
      rows.extend(range(first, first + c.length))
      where.append((ri, c, len(rows) - c.length))
    tok, conf, top = chunk_predictions(result.logits, rows, self._allowed(result), self.kind)
    done = set()
    for ri, c, off in where:
      r = self.reqs[ri]
      m = int(c.masked.sum())
      if m == 0:
        continue
      ct, cc, cp = tok[off:off + c.length], conf[off:off + c.length], top[off:off + c.length]
      pool = c.masked
      if self.window:             # semi-AR: the first `window` masked positions only
        pool = np.zeros_like(c.masked)
        pool[np.flatnonzero(c.masked)[:self.window]] = True
      cand = pool
      if self.pad_last:           # content first: [PAD] predictions rank after all content
        content = pool & (ct != self.tv.pad)
        cand = content if content.any() else pool
        cc = np.where(ct == self.tv.pad, cc - 1e9, cc)
      if self.threshold is not None:
        commit = cand & (cp >= self.threshold)
        if self.spread and commit.any():
          commit = select_spread(cc, commit, int(commit.sum()))
        if not commit.any():
          commit[int(np.argmax(np.where(cand, cc, -np.inf)))] = True
      else:
        ts = np.linspace(1.0, self.eps, r.steps + 1)
        i = min(r.step_i, r.steps - 1)
        last = i == r.steps - 1
        n = m if last else unmask_count(m, float(ts[i + 1]), float(ts[i]))
        if last:                        # the last iteration commits every position left
          commit = c.masked.copy()
        elif self.spread:               # no two neighbours in one step
          commit = select_spread(cc, pool, n)
        else:
          order = np.argsort(-np.where(pool, cc, -np.inf), kind="stable")
          order = order[:min(n, int(pool.sum()))]
          commit = np.zeros_like(c.masked)
          commit[order] = True
      pads = commit & (ct == self.tv.pad)
      if self.pad_tail and pads.any():   # filler only at the tail
        tail = c.masked & (np.arange(c.length) > int(np.argmax(pads)))
        ct = np.where(tail & ~commit, self.tv.pad, ct)
        commit = commit | tail
      c.tokens[commit] = ct[commit]
      c.masked &= ~commit
      for j in np.flatnonzero(commit):
        r.seq[c.start + 1 + int(j)] = int(ct[j])
    for ri, _, _ in spans:
      if ri in done:
        continue
      done.add(ri)
      r = self.reqs[ri]
      r.step_i += 1
      if all(not c.masked.any() for c in r.chunks):
        if self.full_diffusion is not None:
          self._finish(r, "stop" if (r.chunks[0].tokens == self.tv.pad).any() else "length")
        elif r.terminator in self.stops:
          r.stop_token = r.terminator
          r.rounds += 1
          self._finish(r, "stop")
        elif r.response_len + 1 > self.max_new:
          self._finish(r, "length")
        else:
          r.phase = "sync"

  def _allowed(self, result: StepResult) -> np.ndarray:
    V = int(result.logits.shape[-1])
    a = np.zeros(V, bool)
    n = min(V, self.allowed.size)
    a[:n] = self.allowed[:n]
    a[n:] = True
    return a

  # ---- finishing ------------------------------------------------------------------------------
  def _finish(self, r: _Req, reason: str) -> None:
    for c in r.chunks:             # a round cut short: its committed tokens stay, masks go
      for j in range(c.length):
        r.seq[c.start + 1 + j] = int(c.tokens[j])
    r.chunks, r.queue, r.then_round = [], [], None
    r.builder.finish()
    r.phase = "done"
    r.finish_reason = reason
    r.t1 = time.perf_counter()

  def _finalize(self) -> None:
    self.results, self.stats = [], []
    for r in self.reqs:
      resp = r.seq[r.resp_start:]
      self.results.append(GenerationResult(list(resp), list(r.lp[r.resp_start:]),
                                           r.finish_reason))
      notes = tuple(r.builder.layout().notes) + tuple(r.notes)
      self.stats.append(dict(
          forwards=r.forwards, critical_path=max(r.forwards - 1, 0), ar_steps=r.ar_steps,
          denoise_steps=r.denoise_steps, rounds=r.rounds, chunks=r.n_chunks,
          tokens=len(resp) + int(r.stop_token is not None),
          content_tokens=len(self._text_ids(r)), wall_s=r.t1 - r.t0, notes=list(notes),
          well_formed=not notes))

  # ---- outputs --------------------------------------------------------------------------------
  def _cut(self, ids: Sequence[int]) -> list[int]:
    """``ids`` with every chunk token after the chunk's first ``[PAD]`` replaced by ``[PAD]``
    (the text ends there: training puts filler only at a chunk's tail)."""
    tv, out, inside, cut = self.tv, [], False, False
    for t in ids:
      t = int(t)
      if t == tv.async_open:
        inside, cut = True, False
      elif t == tv.async_close:
        inside = False
      elif inside and t == tv.pad:
        cut = True
      elif inside and cut:
        t = tv.pad
      out.append(t)
    return out

  def _pieces(self, r: _Req) -> list[tuple[bool, list[int]]]:
    """``(is_chunk, ids)`` in logical order, tags stripped, each chunk cut at its first
    ``[PAD]`` (full diffusion: its one chunk)."""
    strip = lambda ids: [t for t in ids if not self.tv.is_tag(t)]  # noqa: E731
    if r.fd:
      return [(True, strip(self._cut(r.seq[r.resp_start:])))]
    pieces = assemble_pieces(self._cut(r.seq[r.text_start:]), self.tv,
                             length_unit=self.length_unit)
    return [(c, strip(ids)) for c, ids in pieces]

  def _text_ids(self, r: _Req) -> list[int]:
    return [t for _, ids in self._pieces(r) for t in ids]

  def text_ids(self, i: int) -> list[int]:
    """Final token ids of request ``i`` in logical order, tags and masks stripped, each chunk
    cut at its first ``[PAD]`` (a teacher-forced PLAN in the prompt is included from its first
    promise on)."""
    return self._text_ids(self.reqs[i])

  def text(self, i: int, tokenizer: Any) -> str:
    """The final text of request ``i`` (each chunk at its promise's place and cut at its first
    ``[PAD]``, tags stripped; pieces joined as :func:`selforch_jax.lang.assemble.join_pieces`
    does)."""
    r = self.reqs[i]
    pieces = self._pieces(r)
    if r.fd:
      return tokenizer.decode(pieces[0][1], skip_special_tokens=True)
    return join_pieces([(c, tokenizer.decode(ids, skip_special_tokens=True))
                        for c, ids in pieces])

  def sequence(self, i: int) -> list[int]:
    """Prompt + response of request ``i`` as fed (chunks in their current / final state)."""
    return list(self.reqs[i].seq)

  def layout(self, i: int):
    """The builder's :class:`~selforch_jax.lang.Layout` of request ``i`` (token ids as fed: the
    scaffold's masks; :meth:`sequence` has the final ids)."""
    return self.reqs[i].builder.layout()


@register("planned_diffusion")
def _planned_diffusion(engine: Engine, prompts: Sequence[Sequence[int]], **kw) -> Scheduler:
  """Planned Diffusion (:class:`PlannedDiffusionScheduler`); ``kw``: ``tag_vocab`` (required),
  ``max_new_tokens``, ``sampling``, ``stop_ids`` and the scheduler's options."""
  owner_base, segment_base = fresh_bases(engine)
  tv = kw.pop("tag_vocab")
  kw.setdefault("vocab_size", int(engine.cfg.vocab_size))
  return PlannedDiffusionScheduler(prompts, tv, owner_base=owner_base, segment_base=segment_base,
                                   **kw)


def check_options(*, steps_ratio: float = DEFAULTS["steps_ratio"], eps: float = DEFAULTS["eps"],
                  confidence: str = DEFAULTS["confidence"], threshold: float | None = None,
                  max_promises: int = DEFAULTS["max_promises"],
                  max_rounds: int = DEFAULTS["max_rounds"], plan_cap: int = DEFAULTS["plan_cap"],
                  default_length: int = DEFAULTS["default_length"],
                  max_length: int = DEFAULTS["max_length"], full_diffusion: int | None = None,
                  window: int = DEFAULTS["window"], **_ignored) -> None:
  """Check Planned Diffusion's decoding options before any work (the scheduler and the decode
  CLI, which calls it before the model loads, with its 0 = off mapped to None). ``threshold``
  and ``full_diffusion`` are off at None, ``window`` at 0; other keys (``pad_last``,
  ``spread``, ``pad_tail``, ...) are ignored.

  Raises:
    ValueError: naming the bad option and its valid range.
  """
  if not float(steps_ratio) > 0:
    raise ValueError(f"planned_diffusion steps_ratio must be > 0, got {steps_ratio}")
  if not 0.0 < float(eps) < 1.0:
    raise ValueError(f"planned_diffusion eps must be in (0, 1), got {eps}")
  if confidence not in CONFIDENCES:
    raise ValueError(f"planned_diffusion confidence must be one of {CONFIDENCES}, "
                     f"got {confidence!r}")
  if threshold is not None and not 0.0 < float(threshold) <= 1.0:
    raise ValueError(f"planned_diffusion threshold must be in (0, 1] (off: None in Python, 0 on "
                     f"the command line), got {threshold}")
  for name, v in (("max_promises", max_promises), ("max_rounds", max_rounds),
                  ("plan_cap", plan_cap), ("default_length", default_length),
                  ("max_length", max_length)):
    if int(v) < 1:
      raise ValueError(f"planned_diffusion {name} must be >= 1, got {v}")
  if full_diffusion is not None and int(full_diffusion) < 1:
    raise ValueError(f"planned_diffusion full_diffusion must be >= 1 (off: None in Python, 0 on "
                     f"the command line), got {full_diffusion}")
  if int(window) < 0:
    raise ValueError(f"planned_diffusion window must be >= 0 (0 = off), got {window}")
