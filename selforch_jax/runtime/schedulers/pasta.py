"""The PASTA scheduler: promised chunks decoded as parallel AR threads in one KV pool.

PASTA (Jin et al., ICML 2025, "Learning to Keep a Promise: Scaling Language Model Decoding
Parallelism with Learned Asynchronous Decoding"; DESIGN.md §3, thesis_systems.md §1). The
model writes a PLAN of ``<promise> TOPIC N </promise>`` entries in its main thread; when it
emits ``<async>`` the runtime forks one thread per promise and decodes them together; when
every thread has closed, the runtime feeds ``<sync/>`` and the main thread continues, seeing
every chunk.

Every token's position, segment and visible segments come from
:class:`~selforch_jax.lang.mask.LayoutBuilder` in stream mode (the ``lang`` package's
"Runtime recipe"), so decoding uses the same rules as the training mask
(:func:`~selforch_jax.lang.mask.build_layout`):

* prompt tokens and main-thread tokens are fed with ``stream=None``;
* the main thread's ``<async>`` while a round is open (promises with a length were made) is
  the fork: it becomes thread 0's first token, and the runtime feeds ``<async>`` as the first
  token of threads ``1..n-1`` (``stream=k``) in the same engine step — no KV is copied, each
  thread gets a new page-table owner and a new segment that sees the prefix and the PLAN up to
  the end of its promise;
* every engine step runs the next token of every live thread of every request (continuous
  batching in one flat KV row); a thread ends at its ``</async>``, at its cap
  ``max(2·10·N, cap)`` (parser rule ``chunk_cap``) or at a stop token it generated (replaced by
  ``</async>``); the token that ends it is still run (its K/V is part of the chunk the
  join sees), its logits are discarded;
* when the last live thread ends, ``<sync/>`` is fed and run *in the same step* (it sees the
  chunk tokens written by that step, which the step mask allows), and its logits give the main
  thread's next token;
* a prompt that ends with ``<async>`` after a PLAN (a teacher-forced plan) forks at once.

Malformed output (the parser's degradation rules) never stops decoding and loses no text:
a promise without a length gets no thread, nested tags inside a thread are thread text, a
thread that never closes is closed at its cap, a stop token inside a thread closes it (fed as
``</async>``), a stop token inside a PLAN ends the request with a forced join, and a job
that runs out of ``max_new_tokens`` with live threads is finished by ``LayoutBuilder.finish``
(forced closes and join). A request is *well-formed* iff no ``Degraded`` event occurred.

Per-request figures: :class:`~selforch_jax.runtime.schedulers.pasta_state.PastaStats`.

The final text is :func:`selforch_jax.lang.assemble` of the canonical sequence (logical
order: each chunk at the place of its promise; a teacher-forced PLAN in the prompt is
included, from its first promise on).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from selforch_jax.runtime.generation import GenerationResult
from selforch_jax.runtime.sampling import SamplingParams, sample_rows
from selforch_jax.lang import (
  MAIN, AsyncClosed, EndOfText, LayoutBuilder, PromiseClosed, RegisterUse, Sync, TagVocab,
  assemble,
)
from selforch_jax.lang.assemble import assemble_pieces, join_pieces
from selforch_jax.lang.parser import DEFAULT_CAP
from selforch_jax.lang.tags import TOKENS_PER_UNIT
from selforch_jax.runtime.engine import Engine, bucket_size
from selforch_jax.runtime.registry import fresh_bases, register
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult, run_job
from selforch_jax.runtime.schedulers.pasta_grammar import constraint_ids, grammar_ids, tag_grammar
from selforch_jax.runtime.schedulers.pasta_state import PastaStats, _Request

__all__ = ["PASTAScheduler", "PastaStats", "sample_rows", "grammar_ids", "constraint_ids",
           "tag_grammar", "generate", "DEFAULT_MAX_THREADS", "DEFAULT_MAX_TOPIC_TOKENS",
           "POOL_TAG_TOKENS"]

# Defaults of the decode CLI / demo / PO rollouts under the tag grammar (one place).
DEFAULT_MAX_THREADS = 16       # most threads one answer may fork (``max_threads``)
DEFAULT_MAX_TOPIC_TOKENS = 12  # most tokens of a promise topic before its length is forced
POOL_TAG_TOKENS = 64           # pool slots per answer for runtime-fed tags (<async>, <sync/>)


class PASTAScheduler(Scheduler):
  """Greedy / sampled PASTA decoding of a batch of prompts (see the module docstring).

  Args:
    prompts: B non-empty lists of int token ids (a prompt may end with a PLAN and ``<async>``:
      a teacher-forced plan forks at once).
    tag_vocab: the vocabulary's :class:`TagVocab`.
    max_new_tokens: most response tokens per prompt (canonical order, tags and runtime-fed
      tags included); a request reaching it is finished with forced closes and join.
    sampling: :class:`SamplingParams` (greedy by default); the key of step i is
      ``fold_in(PRNGKey(seed), i)`` over all rows sampled in that step.
    stop_ids: ids that end the main thread (not included in the output); one sampled inside a
      thread ends that thread: the runtime feeds ``</async>`` in its place (noted as
      ``eos_in_thread``). The layout reads ``tag_vocab.eos_ids`` as text (``eos_ids=()``, as
      the training data's ``build_layout`` does), so prompts may hold end-of-turn tokens.
    cap: floor of a thread's budget ``max(2·length_unit·N, cap)`` (None: unlimited).
    length_unit: tokens per promise unit N (10 in DESIGN.md §3).
    max_rounds: finish a request right after its ``max_rounds``-th join (None: no limit;
      finish_reason ``"rounds"``), e.g. to time one round of threads.
    owner_base / segment_base: first owner / segment id this job uses (it allocates more as
      threads fork); segments below ``segment_base`` stay invisible.
    constrain_tags: sample under the tag grammar (:func:`tag_grammar`: e.g. a promise closes
      only with ``</promise>`` after its length, a thread cannot open a promise; a stop token
      cannot be sampled inside a promise, right after one, or inside a thread); sampled
      log-probs are then those of the constrained distribution. Off by default (the training
      forward's log-probs and the parser's degradation paths are what the tests compare).
    max_topic_tokens: with ``constrain_tags``, the most tokens a promise may hold without a
      length: then it must write its length, a space (``tag_vocab.space_ids[0]``, if any) and
      one or two digits, and close (None: no limit; needs ``tag_vocab.digit_ids``).
    max_threads: with ``constrain_tags``, the most threads one request may fork over all its
      rounds: once its answer's promises (a teacher-forced PLAN's open round included) reach
      it, ``<promise>`` is banned (right after a ``</promise>`` only ``<async>`` may follow), so a pool with
      room for the tokens plus ``max_threads`` partial pages cannot run out (None: no cap).

  After :func:`~selforch_jax.runtime.scheduler.run`: :attr:`results` (one
  :class:`GenerationResult` per prompt; ``token_ids`` canonical, tags included, stop excluded;
  ``logprobs`` 0.0 at runtime-fed tags, see :attr:`injected`), :attr:`stats`
  (:class:`PastaStats`), :meth:`text_ids` (final logical-order ids), :meth:`layout` (the
  stream-mode layout of prompt + response), :attr:`owners` (every owner used).

  Raises:
    ValueError: empty batch or prompt, ``max_new_tokens < 1``, ``max_threads < 1``,
      ``max_topic_tokens < 1`` or without digit ids.
  """

  def __init__(self, prompts: Sequence[Sequence[int]], tag_vocab: TagVocab, max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               cap: int | None = DEFAULT_CAP, length_unit: int = TOKENS_PER_UNIT,
               max_rounds: int | None = None, owner_base: int = 0, segment_base: int = 0,
               constrain_tags: bool = False, max_threads: int | None = None,
               max_topic_tokens: int | None = None):
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("PASTAScheduler needs at least one prompt, none empty")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if max_threads is not None and max_threads < 1:
      raise ValueError(f"max_threads must be >= 1 or None, got {max_threads}")
    self.max_threads = max_threads
    if max_topic_tokens is not None and (max_topic_tokens < 1 or not tag_vocab.digit_ids):
      raise ValueError(f"max_topic_tokens={max_topic_tokens} must be >= 1 and the tag vocab "
                       "needs digit_ids")
    self.max_topic = max_topic_tokens
    self.stops = frozenset(int(s) for s in stop_ids)
    # the training layout (data.annotated: build_layout with eos_ids=()) reads EOS as text; the
    # runtime never feeds a stop token (the main thread ends, a thread gets </async>)
    self.tv = dataclasses.replace(tag_vocab, eos_ids=())
    self.max_new = int(max_new_tokens)
    self.max_rounds = max_rounds
    self.sampling = sampling
    self.constrain_tags = bool(constrain_tags)
    tv = self.tv
    # the tag grammar's ids, the stop ids (banned inside a promise and inside a thread), then
    # the digits (the only text after a promise topic of max_topic_tokens)
    self._grammar_ids = constraint_ids(tv, self.stops, digits=max_topic_tokens is not None)
    self.key = jax.random.PRNGKey(sampling.seed)
    self.reqs = [_Request(list(map(int, p)), self.tv, cap, length_unit) for p in prompts]
    self._next_owner = int(owner_base)
    self._seg_base = int(segment_base)
    G = max(16, 2 * (segment_base + 1))
    self._visible = np.zeros((G, G), bool)
    self._nseg = segment_base
    self._prefilled = 0
    self._free_next: list[int] = []
    self.owners: list[int] = []
    self.step = 0
    self.results: list[GenerationResult] | None = None
    self.stats: list[PastaStats] | None = None
    self.injected: list[list[bool]] | None = None

  # ---- ids ------------------------------------------------------------------------------------
  def _new_owner(self) -> int:
    o = self._next_owner
    self._next_owner += 1
    self.owners.append(o)
    return o

  def _engine_segment(self, r: _Request, bseg: int) -> int:
    g = r.seg_map.get(bseg)
    if g is not None:
      return g
    sees = [self._engine_segment(r, s) for s in sorted(r.builder.visible_segments(bseg)) if s != bseg]
    g = self._nseg
    self._nseg += 1
    if g >= self._visible.shape[0]:
      n = 2 * self._visible.shape[0]
      v = np.zeros((n, n), bool)
      v[:g, :g] = self._visible[:g, :g]
      self._visible = v
    self._visible[g, g] = True
    self._visible[g, sees] = True
    r.seg_map[bseg] = g
    return g

  def _feed(self, r: _Request, token: int, stream: int | None, q: dict) -> None:
    """Feed one token to the request's builder and append its query to ``q``."""
    b = r.builder
    ev = b.feed(token, stream)
    r.track(ev)
    i = b.num_tokens - 1
    key = MAIN if stream is None else stream
    if stream is None:
      if token == self.tv.promise_open:
        r.in_promise, r.promise_inner, r.length_at = True, [], None
      elif token == self.tv.promise_close:
        r.in_promise = False
      elif r.in_promise:
        r.promise_inner.append(token)
        if (self.max_topic is not None and r.length_at is None
            and len(r.promise_inner) >= self.max_topic
            and self.tv.split_length(r.promise_inner)[1] is None):
          r.length_at = len(r.promise_inner)
      r.last_main = token
    q["tokens"].append(token)
    q["positions"].append(b.position_of(i))
    q["segments"].append(self._engine_segment(r, b.segment_of(i)))
    q["owners"].append(r.owner_of[key])
    q["index"].append(i)
    q["req"].append(r)
    q["closed"].append(any(isinstance(e, AsyncClosed) and e.stream == key for e in ev))
    src = r.pending_src.pop(key, None)
    if src is not None:
      r.pred_map[i] = src
    off = b.document_offset
    for e in ev:  # TIP registers (inside threads too): the killed step is evicted before the step
      if isinstance(e, RegisterUse):
        q["evict"].extend(r.slot_of.pop(j + off) for j in e.killed if j + off in r.slot_of)

  # ---- the scheduler interface -----------------------------------------------------------------
  def next_step(self) -> StepPlan | None:
    if self.results is not None:
      return None
    free = tuple(self._free_next)
    self._free_next = []
    q = dict(tokens=[], positions=[], segments=[], owners=[], index=[], closed=[], evict=[],
             req=[])
    meta = []  # (request, stream, needs_logits) per query
    if self._prefilled < len(self.reqs):
      ri = self._prefilled
      r = self.reqs[ri]
      r.t0 = time.perf_counter()
      r.owner_of[MAIN] = self._new_owner()
      prompt = r.prompt
      fork = False
      if len(prompt) > 1 and prompt[-1] == self.tv.async_open:
        # a teacher-forced PLAN: fork at once if the prompt's promises opened a round
        probe = _Request(prompt[:-1], self.tv, r.builder.cap, r.builder.length_unit)
        for t in prompt[:-1]:
          probe.track(probe.builder.feed(t))
        fork = bool(probe.round_lengths)
      body = prompt[:-1] if fork else prompt
      for t in body:
        self._feed(r, t, None, q)
        meta.append((ri, MAIN, False))
      r.prompt_plan_start = r.plan_start
      r.promised = len(r.round_lengths)  # earlier turns' rounds are not this answer's threads
      if fork:
        self._fork(r, self.tv.async_open, 0.0, injected=True)
        return StepPlan(tokens=q["tokens"], positions=q["positions"], segments=q["segments"],
                        owners=q["owners"], visible=self._tables()[0], bidir=self._tables()[1],
                        free_owners=free, evict=q["evict"], tag=("prefill", ri, meta, q))
      meta[-1] = (ri, MAIN, True)
      return StepPlan(tokens=q["tokens"], positions=q["positions"], segments=q["segments"],
                      owners=q["owners"], visible=self._tables()[0], bidir=self._tables()[1],
                      free_owners=free, tag=("prefill", ri, meta, q))
    for ri, r in enumerate(self.reqs):
      if r.done:
        continue
      if r.live:
        closed_now = []
        for k in list(r.live):
          tok = r.pending.pop(k)
          r.threads[k].append(tok)
          r.threads_lp[k].append(r.pending_lp.pop(k))
          r.threads_inj[k].append(r.pending_injected.pop(k))
          self._feed(r, tok, k, q)
          closed = q["closed"][-1]
          meta.append((ri, k, not closed))
          if closed:
            closed_now.append(k)
        r.max_parallel = max(r.max_parallel, len(r.live))
        for k in closed_now:
          r.live.remove(k)
        if not r.live:  # join in the same step: <sync/> sees the chunks written by this step
          r.flush_threads()
          r.main.append(self.tv.sync)
          r.main_lp.append(0.0)
          r.main_injected.append(True)
          self._feed(r, self.tv.sync, None, q)
          r.rounds += 1
          meta.append((ri, MAIN, True))
      else:
        tok = r.pending.pop(MAIN)
        r.main.append(tok)
        r.main_lp.append(r.pending_lp.pop(MAIN))
        r.main_injected.append(r.pending_injected.pop(MAIN))
        self._feed(r, tok, None, q)
        meta.append((ri, MAIN, True))
    if not q["tokens"]:
      return None
    vis, bidir = self._tables()
    return StepPlan(tokens=q["tokens"], positions=q["positions"], segments=q["segments"],
                    owners=q["owners"], visible=vis, bidir=bidir, free_owners=free,
                    evict=q["evict"], tag=("decode", None, meta, q))

  def _tables(self):
    G = self._nseg
    return self._visible[:G, :G], np.zeros(G, bool)

  def _fork(self, r: _Request, first: int, first_lp: float, injected: bool,
            src: int | None = None) -> None:
    """Start one thread per promise of the open round; thread 0's first token is ``first``."""
    n = len(r.round_lengths)
    r.live = list(range(n))
    r.n_threads += n
    for k in range(n):
      r.owner_of[k] = self._new_owner()
      r.threads[k], r.threads_lp[k], r.threads_inj[k] = [], [], []
      r.pending[k] = self.tv.async_open
      r.pending_lp[k] = first_lp if k == 0 else 0.0
      r.pending_injected[k] = injected if k == 0 else True
      r.pending_src[k] = src if k == 0 else None

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    _, _, meta, q = plan.tag
    for r, i, slot in zip(q["req"], q["index"], np.asarray(result.slots).tolist()):
      r.slot_of[i] = slot
    touched = {m[0] for m in meta}
    for ri in touched:
      self.reqs[ri].forwards += 1
    if plan.tag[0] == "prefill":
      self._prefilled += 1
    rows = [j for j, m in enumerate(meta) if m[2]]
    if rows:
      constraint = None
      if self.constrain_tags:
        gram = [self._grammar(self.reqs[meta[j][0]], meta[j][1]) for j in rows]
        constraint = (self._grammar_ids, [g[0] for g in gram], [g[1] for g in gram])
      toks, lps = sample_rows(result.logits, rows, self.key, self.step, self.sampling, constraint)
      self.step += 1
      for j, t, lp in zip(rows, toks.tolist(), lps.tolist()):
        ri, stream, _ = meta[j]
        self._on_token(self.reqs[ri], stream, int(t), float(lp), q["index"][j])
    now = time.perf_counter()
    for ri in touched:
      r = self.reqs[ri]
      r.t1 = now
      if not r.done and r.response_len() + len(r.pending) >= self.max_new:
        self._finish(r, "length")
      elif not r.done and self.max_rounds is not None and r.rounds >= self.max_rounds:
        r.pending = {}   # the main token sampled after the join is not part of the job
        r.sampled -= 1
        self._finish(r, "rounds")
    if self._prefilled == len(self.reqs) and all(r.done for r in self.reqs):
      self._finalize()

  def _grammar(self, r: _Request, stream: int) -> tuple[list[bool], bool]:
    in_thread = stream != MAIN
    after = not in_thread and r.last_main == self.tv.promise_close
    full = self.max_threads is not None and r.promised >= self.max_threads
    forced = (self.max_topic is not None and not in_thread and r.in_promise
              and r.length_at is not None)
    ban, only = tag_grammar(self.tv, in_thread, r.in_promise, r.promise_inner, after,
                            bool(r.round_lengths), full, forced)
    ban += [in_thread or r.in_promise or after] * len(self.stops)
    if self.max_topic is not None:  # the digits, then the space: text unless `only`
      if forced:   # the forced length: [space], one or two digits, then </promise>
        k = len(r.promise_inner) - r.length_at
        sp = len(self.tv.space_ids[:1])
        ban += [not sp <= k < sp + 2] * len(self.tv.digit_ids) + [k >= sp] * sp
      else:
        ban += [only] * (len(self.tv.digit_ids) + len(self.tv.space_ids[:1]))
    return ban, only

  def _on_token(self, r: _Request, stream: int, tok: int, lp: float, from_index: int) -> None:
    r.sampled += 1
    if stream == MAIN:
      if tok in self.stops:
        r.stop_token = tok
        self._finish(r, "stop")
        return
      if tok == self.tv.async_open and r.round_lengths:
        self._fork(r, tok, lp, injected=False, src=from_index)
        return
    elif tok in self.stops:  # a stop token inside a thread ends the thread: fed as </async>
      r.notes.append(f"{r.builder.num_tokens + len(r.pending)}: eos_in_thread")
      r.pending[stream], r.pending_lp[stream], r.pending_injected[stream] = \
          self.tv.async_close, 0.0, True
      r.pending_src[stream] = None
      return
    r.pending[stream], r.pending_lp[stream], r.pending_injected[stream] = tok, lp, False
    r.pending_src[stream] = from_index

  def _finish(self, r: _Request, reason: str) -> None:
    """End a request. Sampled tokens not yet run are appended (they need no K/V), then
    ``LayoutBuilder.finish`` force-closes live threads and joins."""
    for k in sorted(r.pending):
      tok = r.pending[k]
      ev = r.builder.feed(tok, None if k == MAIN else k)
      r.track(ev)
      src = r.pending_src.get(k)
      if src is not None:
        r.pred_map[r.builder.num_tokens - 1] = src
      lst, lps, inj = ((r.main, r.main_lp, r.main_injected) if k == MAIN else
                       (r.threads[k], r.threads_lp[k], r.threads_inj[k]))
      lst.append(tok)
      lps.append(r.pending_lp[k])
      inj.append(r.pending_injected[k])
    r.builder.finish()
    if r.threads:
      # threads still open (cut by max_new_tokens): the builder closed them; mark where their
      # </async> belongs in the canonical sequence so the final text assembles each chunk alone
      pos = len(r.main)
      for k in sorted(r.threads):
        pos += len(r.threads[k])
        if k in r.live and r.threads[k][-1:] != [self.tv.async_close]:
          r.forced_closes.append(pos)
      r.flush_threads()
    r.live, r.pending = [], {}
    r.finish_reason = reason
    r.t1 = time.perf_counter()
    self._free_next += [o for o in r.owner_of.values()]

  def _finalize(self) -> None:
    self.results, self.stats, self.injected = [], [], []
    for r in self.reqs:
      self.results.append(GenerationResult(list(r.main), list(r.main_lp), r.finish_reason))
      self.injected.append(list(r.main_injected))
      stop = r.stop_token is not None
      tokens = len(r.main) + int(stop)
      notes = r.builder.layout().notes + tuple(r.notes)
      content = len(self._text_ids(r))
      self.stats.append(PastaStats(
          tokens=tokens, sampled_tokens=r.sampled, content_tokens=content,
          forwards=r.forwards, theoretical_speedup=(content + int(stop)) / max(r.forwards, 1),
          tokens_per_forward=tokens / max(r.forwards, 1),
          wall_s=(r.t1 or 0.0) - (r.t0 or 0.0), rounds=r.rounds, threads=r.n_threads,
          max_parallel=r.max_parallel, degraded=tuple(notes), well_formed=not notes))

  # ---- outputs --------------------------------------------------------------------------------
  def _canonical(self, r: _Request) -> list[int]:
    head = r.prompt[r.prompt_plan_start:] if r.prompt_plan_start is not None else []
    if head and head[-1] == self.tv.async_open and r.main[:1] != [self.tv.async_open]:
      head = head[:-1]
    main = list(r.main)
    for pos in reversed(r.forced_closes):
      main.insert(pos, self.tv.async_close)
    return head + main

  def _text_ids(self, r: _Request) -> list[int]:
    ids = assemble(self._canonical(r), self.tv, cap=r.builder.cap,
                   length_unit=r.builder.length_unit)
    return [t for t in ids if not self.tv.is_tag(t)]  # e.g. the <promise> of an abandoned one

  def text(self, i: int, tokenizer: Any) -> str:
    """The final text of request ``i`` a reader sees: :meth:`text_ids`' tokens with each chunk
    and the text around it decoded apart and joined by the separator the layout implies
    (:func:`selforch_jax.lang.assemble.join_pieces`: a chunk starting a list item goes on a new
    line, two pieces never run together into one word)."""
    r = self.reqs[i]
    pieces = assemble_pieces(self._canonical(r), self.tv, cap=r.builder.cap,
                             length_unit=r.builder.length_unit)
    return join_pieces([(c, tokenizer.decode([t for t in ids if not self.tv.is_tag(t)],
                                             skip_special_tokens=True)) for c, ids in pieces])

  def text_ids(self, i: int) -> list[int]:
    """Final token ids of request ``i`` in logical order, tags stripped (a teacher-forced PLAN
    in the prompt is included from its first promise on)."""
    return self._text_ids(self.reqs[i])

  def layout(self, i: int):
    """The stream-mode :class:`~selforch_jax.lang.Layout` of request ``i`` (prompt + response
    in feed order)."""
    return self.reqs[i].builder.layout()

  def sampled_from(self, i: int) -> dict[int, int]:
    """``{builder index j: builder index q}``: token j (fed) was sampled from query q's
    logits (tokens fed by the runtime and prompt tokens are absent)."""
    return dict(self.reqs[i].pred_map)


def generate(engine: Engine, prompts: Sequence[Sequence[int]], tag_vocab: TagVocab, *,
             max_new_tokens: int, free_after: bool = True, **kw) -> PASTAScheduler:
  """PASTA decoding of ``prompts`` on ``engine`` (fresh owner / segment ids).

  Args:
    engine: an :class:`Engine` with room for every request.
    prompts, tag_vocab, max_new_tokens, **kw: as :class:`PASTAScheduler`.
    free_after: release every owner's pages at the end.

  Returns:
    The finished :class:`PASTAScheduler` (``results``, ``stats``, ``text_ids``, ``layout``).

  Raises:
    PoolExhausted: the pool is too small.
  """
  owner_base, segment_base = fresh_bases(engine)
  sched = PASTAScheduler(prompts, tag_vocab, max_new_tokens, owner_base=owner_base,
                         segment_base=segment_base, **kw)
  return run_job(engine, sched, free_after)


@register("pasta")
def _pasta(engine: Engine, prompts: Sequence[Sequence[int]], **kw) -> Scheduler:
  """PASTA parallel-thread decoding (:class:`~selforch_jax.runtime.schedulers.pasta.PASTAScheduler`);
  ``kw``: ``tag_vocab`` (required), ``max_new_tokens``, ``sampling``, ``stop_ids``, ``cap``,
  ``length_unit``. ``results[i].token_ids`` are canonical (threads in promise order)."""
  owner_base, segment_base = fresh_bases(engine)
  tv = kw.pop("tag_vocab")
  return PASTAScheduler(prompts, tv, owner_base=owner_base, segment_base=segment_base, **kw)
