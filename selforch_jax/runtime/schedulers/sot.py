"""Skeleton-of-Thought (Ning et al. 2023, "Skeleton-of-Thought: Prompting LLMs for Efficient
Parallel Generation", arXiv:2307.15337) on the engine: a baseline for PASTA (issue 5).

Two stages, both on the same :class:`~selforch_jax.runtime.engine.Engine`:

1. **Skeleton**: the question in SoT's skeleton prompt (:data:`SKELETON_PROMPT`, the paper's
   template, Appendix A), the assistant turn pre-filled with ``"1."``; AR decoding
   (:class:`~selforch_jax.runtime.schedulers.ar.ARScheduler`) up to ``skeleton_tokens``.
2. **Point expansion**: :func:`parse_points` reads the numbered points (``"1. ..."``, at most
   ``max_points``); each point gets SoT's point-expanding prompt (:data:`POINT_PROMPT`: the
   question, the whole skeleton, "continue only point i"), the assistant turn pre-filled with
   ``"i. <point>"``; all points are decoded as one AR batch — every engine step runs the next
   token of every unfinished point (one segment and one page-table owner per point).

The answer is the concatenation ``"i. <point> <expansion>"`` in point order. A skeleton without
a numbered point falls back to the skeleton text itself (no expansion; SoT's paper does the same
when the skeleton parse fails: the request is answered by the skeleton stage).

Per request (:class:`SoTResult`): generated tokens (skeleton + expansions), forwards (engine
steps: prefill + decode of stage 1, plus prefills and batched decode steps of stage 2), wall
seconds, whether the skeleton parsed.

Differences from the paper: the point prompts are prefilled one per engine step (the paper sends
them as a batch of API calls / one padded batch); decoding is greedy unless ``sampling`` says
otherwise; no router (SoT-R) is used.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Sequence

from selforch_jax.runtime.generation import GenerationResult
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.schedulers.ar import ARScheduler
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.registry import fresh_bases, register
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, StepResult, run

__all__ = ["SKELETON_PROMPT", "POINT_PROMPT", "parse_points", "point_prompts", "expand_points",
           "SoTResult", "skeleton_of_thought", "SoTScheduler"]

# Ning et al. 2023, Appendix A (skeleton and point-expanding prompt templates).
SKELETON_PROMPT = (
    "You're an organizer responsible for only giving the skeleton (not the full content) for "
    "answering the question. Provide the skeleton in a list of points (numbered 1., 2., 3., etc.) "
    "to answer the question. Instead of writing a full sentence, each skeleton point should be "
    "very short with only 3~5 words. Generally, the skeleton should have 3~10 points.\n\n"
    "Question:\n{question}\n")
POINT_PROMPT = (
    "You're responsible for continuing the writing of one and only one point in the overall "
    "answer to the following question.\n\n{question}\n\nThe skeleton of the answer is\n\n"
    "{skeleton}\n\nContinue and only continue the writing of point {index}. Write it **very "
    "shortly** in 1~2 sentence and do not continue with other points!")

_POINT_RE = re.compile(r"^\s*(\d+)\s*[.)]\s*(.+?)\s*$")


def parse_points(skeleton: str, max_points: int = 10) -> list[str]:
  """The numbered points of a skeleton: lines ``"<k>. text"`` (or ``"<k>) text"``) with
  consecutive numbers from 1; parsing stops at the first line breaking the sequence.

  Args:
    skeleton: the skeleton text (the pre-filled ``"1."`` included).
    max_points: keep at most this many points.

  Returns:
    The points' texts (without their numbers), possibly empty.
  """
  points: list[str] = []
  for line in skeleton.splitlines():
    m = _POINT_RE.match(line)
    if m is None:
      if points and line.strip():
        break
      continue
    if int(m.group(1)) != len(points) + 1:
      break
    points.append(m.group(2))
    if len(points) >= max_points:
      break
  return points


@dataclasses.dataclass
class SoTResult:
  """One SoT answer.

  Attributes:
    text: the final answer (points with their expansions, in point order).
    skeleton: the skeleton text; points: the parsed points (empty: skeleton stage only).
    tokens: tokens generated (skeleton + every expansion, stop tokens included).
    forwards: engine steps this request ran (both stages, prefills included).
    wall_s: wall-clock seconds of both stages.
    parsed: the skeleton had at least one numbered point.
  """

  text: str
  skeleton: str
  points: list[str]
  tokens: int
  forwards: int
  wall_s: float
  parsed: bool


def _chat(tok: Any, user: str, prefill: str) -> list[int]:
  return tok.encode_chat([{"role": "user", "content": user}], add_generation_prompt=True) + \
      tok.encode(prefill)


def _ar(engine: Engine, prompts, max_new, sampling, stop_ids):
  owner_base, segment_base = fresh_bases(engine)
  sched = ARScheduler(prompts, max_new, sampling, stop_ids, owner_base=owner_base,
                      segment_base=segment_base)
  steps = run(engine, sched)
  for o in sched.owners:
    engine.pool.free_owner(int(o))
  return sched.results, steps


def skeleton_of_thought(engine: Engine, tokenizer: Any, question: str, *,
                        skeleton_tokens: int = 96, point_tokens: int = 64, max_points: int = 10,
                        sampling: SamplingParams = SamplingParams(),
                        stop_ids: Sequence[int] | None = None) -> SoTResult:
  """Answer ``question`` with Skeleton-of-Thought on ``engine`` (see the module docstring).

  Args:
    engine: the engine (its pool must hold ``max_points`` point prompts plus expansions).
    tokenizer: a :class:`~selforch_jax.tokenizers.Tokenizer` with a chat template.
    question: the user's instruction.
    skeleton_tokens / point_tokens: token budgets of the two stages.
    max_points: at most this many points are expanded.
    sampling: :class:`SamplingParams` of both stages (greedy by default).
    stop_ids: default ``tokenizer.stop_ids``.

  Returns:
    :class:`SoTResult`.

  Raises:
    PoolExhausted: the pool is too small for the point batch.
  """
  stops = tuple(tokenizer.stop_ids if stop_ids is None else stop_ids)
  t0 = time.perf_counter()
  (sk,), steps1 = _ar(engine, [_chat(tokenizer, SKELETON_PROMPT.format(question=question), "1.")],
                      skeleton_tokens, sampling, stops)
  skeleton = "1." + tokenizer.decode(sk.token_ids, skip_special_tokens=True)
  points = parse_points(skeleton, max_points)
  tokens = len(sk.token_ids) + (sk.finish_reason == "stop")
  if not points:
    return SoTResult(text=skeleton.strip(), skeleton=skeleton, points=[], tokens=tokens,
                     forwards=steps1, wall_s=time.perf_counter() - t0, parsed=False)
  parts, tokens2, steps2 = expand_points(engine, tokenizer, question, points,
                                         point_tokens=point_tokens, sampling=sampling,
                                         stop_ids=stops)
  return SoTResult(text="\n".join(s.rstrip() for s in parts), skeleton=skeleton, points=points,
                   tokens=tokens + tokens2, forwards=steps1 + steps2,
                   wall_s=time.perf_counter() - t0, parsed=True)


def point_prompts(tokenizer: Any, question: str, points: Sequence[str]) -> list[list[int]]:
  """SoT's point-expanding prompts (:data:`POINT_PROMPT`), the assistant turn pre-filled with
  ``"i. <point>"``; one int token list per point."""
  sk_text = "\n".join(f"{i + 1}. {p}" for i, p in enumerate(points))
  return [_chat(tokenizer, POINT_PROMPT.format(question=question, skeleton=sk_text, index=i + 1),
                f"{i + 1}. {p}") for i, p in enumerate(points)]


def expand_points(engine: Engine, tokenizer: Any, question: str, points: Sequence[str], *,
                  point_tokens: int = 64, sampling: SamplingParams = SamplingParams(),
                  stop_ids: Sequence[int] | None = None) -> tuple[list[str], int, int]:
  """SoT stage 2: expand every point in one AR batch (each engine step runs every unfinished
  point).

  Returns:
    ``(parts, tokens, forwards)``: ``"i. <point><expansion>"`` per point, tokens generated
    (stop tokens included), engine steps.

  Raises:
    ValueError: no points. PoolExhausted: the pool is too small.
  """
  if not points:
    raise ValueError("expand_points needs at least one point")
  stops = tuple(tokenizer.stop_ids if stop_ids is None else stop_ids)
  res, steps = _ar(engine, point_prompts(tokenizer, question, points), point_tokens, sampling,
                   stops)
  parts, tokens = [], 0
  for i, (p, r) in enumerate(zip(points, res)):
    parts.append(f"{i + 1}. {p}" + tokenizer.decode(r.token_ids, skip_special_tokens=True))
    tokens += len(r.token_ids) + (r.finish_reason == "stop")
  return parts, tokens, steps


class SoTScheduler(Scheduler):
  """Skeleton-of-Thought for a batch of questions as one scheduler (the registry's ``"sot"``).

  Stage 1 decodes every question's skeleton as one AR batch; stage 2 expands every parsed point
  of every question as one AR batch (the same prompts and rules as :func:`skeleton_of_thought`).
  A question whose skeleton has no numbered point is answered by its skeleton (finish reason
  ``"degraded"``: SoT's fallback).

  Args:
    engine: the engine (the stage-1 sequences are released before stage 2 starts).
    tokenizer: a tokenizer with a chat template (``encode_chat``, ``encode``, ``decode``).
    questions: B user instructions (SoT writes its own prompts around them).
    skeleton_tokens / point_tokens / max_points: as :func:`skeleton_of_thought`.
    sampling: :class:`SamplingParams` of both stages. stop_ids: default ``tokenizer.stop_ids``.

  After :func:`run`: :attr:`results` (one :class:`GenerationResult` per question: ``token_ids``
  = ``tokenizer.encode`` of the final text, no log-probs; ``finish_reason`` ``"stop"`` when every
  point (or the skeleton) ended at a stop id, ``"length"`` when one was cut, ``"degraded"``
  without a parsed point), :attr:`texts` (final texts), :attr:`stats` (per question: ``points``,
  ``tokens`` generated, ``forwards`` engine steps that ran a token of it, ``parsed``),
  :attr:`owners`.

  Raises:
    ValueError: no question, or an empty one.
  """

  def __init__(self, engine: Engine, tokenizer: Any, questions: Sequence[str], *,
               skeleton_tokens: int = 96, point_tokens: int = 64, max_points: int = 10,
               sampling: SamplingParams = SamplingParams(),
               stop_ids: Sequence[int] | None = None):
    if not questions or any(not str(q).strip() for q in questions):
      raise ValueError("SoTScheduler needs at least one question, none empty")
    self.engine, self.tok = engine, tokenizer
    self.questions = [str(q) for q in questions]
    self.point_tokens, self.max_points = int(point_tokens), int(max_points)
    self.sampling = sampling
    self.stops = tuple(tokenizer.stop_ids if stop_ids is None else stop_ids)
    B = len(self.questions)
    self.owners: list[int] = []
    self.forwards = [0] * B
    self.tokens = [0] * B
    self.stage = 1
    self.results: list[GenerationResult] | None = None
    self.texts: list[str] | None = None
    self.stats: list[dict] | None = None
    self._inner = self._ar([_chat(tokenizer, SKELETON_PROMPT.format(question=q), "1.")
                            for q in self.questions], skeleton_tokens)
    self._row_req = list(range(B))

  def _ar(self, prompts, max_new) -> ARScheduler:
    owner_base, segment_base = fresh_bases(self.engine)
    s = ARScheduler(prompts, max_new, self.sampling, self.stops, owner_base=owner_base,
                    segment_base=segment_base)
    self.owners += [int(o) for o in s.owners]
    return s

  def next_step(self) -> StepPlan | None:
    while self.results is None:
      plan = self._inner.next_step()
      if plan is not None:
        return plan
      if self.stage == 1:
        self._start_points()
      else:
        self._finalize()
    return None

  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    self._inner.on_step(plan, result)
    for q in {self._row_req[r] for r in plan.tag[1]}:
      self.forwards[q] += 1

  def _start_points(self) -> None:
    for o in self._inner.owners:
      self.engine.pool.free_owner(int(o))
    self.skeletons, self.points, self._sk_reason = [], [], []
    prompts, self._row_req, self._point_of = [], [], []
    for q, (question, r) in enumerate(zip(self.questions, self._inner.results)):
      sk = "1." + self.tok.decode(r.token_ids, skip_special_tokens=True)
      pts = parse_points(sk, self.max_points)
      self.tokens[q] += len(r.token_ids) + (r.finish_reason == "stop")
      self.skeletons.append(sk)
      self.points.append(pts)
      self._sk_reason.append(r.finish_reason)
      if pts:
        for k, pp in enumerate(point_prompts(self.tok, question, pts)):
          prompts.append(pp)
          self._row_req.append(q)
          self._point_of.append(k)
    self.stage = 2
    if not prompts:
      self._finalize()
      return
    self._inner = self._ar(prompts, self.point_tokens)

  def _finalize(self) -> None:
    B = len(self.questions)
    parts = [[] for _ in range(B)]
    reasons = [[] for _ in range(B)]
    if self.stage == 2 and self._inner.results is not None and self._row_req:
      for q, k, r in zip(self._row_req, self._point_of, self._inner.results):
        parts[q].append(f"{k + 1}. {self.points[q][k]}"
                        + self.tok.decode(r.token_ids, skip_special_tokens=True))
        reasons[q].append(r.finish_reason)
        self.tokens[q] += len(r.token_ids) + (r.finish_reason == "stop")
      for o in self._inner.owners:
        self.engine.pool.free_owner(int(o))
    self.texts, self.results, self.stats = [], [], []
    for q in range(B):
      if self.points[q]:
        text = "\n".join(s.rstrip() for s in parts[q])
        reason = "length" if "length" in reasons[q] else "stop"
      else:
        text = self.skeletons[q].strip()
        reason = "degraded"
      self.texts.append(text)
      self.results.append(GenerationResult(list(self.tok.encode(text)), [], reason))
      self.stats.append(dict(points=len(self.points[q]), tokens=self.tokens[q],
                             forwards=self.forwards[q], parsed=bool(self.points[q])))


@register("sot")
def _sot(engine: Engine, prompts: Sequence[Sequence[int]], *, tokenizer: Any = None,
         questions: Sequence[str] | None = None, tag_vocab=None, max_new_tokens: int | None = None,
         **kw) -> Scheduler:
  """Skeleton-of-Thought (:class:`SoTScheduler`); needs ``tokenizer`` and ``questions`` (the
  user instructions; ``prompts`` are not used: SoT writes its own); ``max_new_tokens`` caps
  ``skeleton_tokens`` and ``point_tokens``; ``tag_vocab`` is accepted and unused.

  Raises:
    ValueError: no tokenizer, or not one question per prompt."""
  if tokenizer is None or questions is None or len(questions) != len(prompts):
    raise ValueError("the 'sot' scheduler needs tokenizer= and questions= (one user "
                     "instruction per prompt)")
  if max_new_tokens is not None:
    kw.setdefault("skeleton_tokens", min(96, int(max_new_tokens)))
    kw.setdefault("point_tokens", min(64, int(max_new_tokens)))
  return SoTScheduler(engine, tokenizer, questions, **kw)
