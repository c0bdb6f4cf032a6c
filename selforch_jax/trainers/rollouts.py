"""Rollouts for policy optimization: sample responses through the engine with a named
scheduler (``runtime.registry``), then lay them out as training rows.

:func:`sample` runs G copies of each prompt through one scheduler job on a fresh
:class:`~selforch_jax.runtime.engine.Engine` holding the current policy (rows are
prompt-major: row ``p * G + g``; the copies draw different samples because every row of a
sampling step gets its own draw). :func:`to_batch` turns prompts + responses into rows
``tokens, targets, loss_mask, positions`` int32 ``[B, T]`` and ``mask`` bool ``[B, T, T]``:

* with a ``tag_vocab`` (PASTA / TIP rollouts), positions and mask come from
  ``lang.build_layout`` of the rollout's tokens (one document, as in
  :func:`selforch_jax.data.annotated.annotated_example`), i.e. the layout the runtime decoded
  with (train = decode, DESIGN.md §2.2), and the target after ``</async>`` (written by the
  runtime, not sampled) is not trained;
* without, plain causal attention over the sequence, positions ``0..n-1``.

``loss_mask`` is 1 exactly on targets that are response tokens (the stop token included when the
response ended with it).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import numpy as np

from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.schedulers import make_scheduler
from selforch_jax.runtime.scheduler import run


@dataclasses.dataclass
class Rollouts:
  """Sampled responses of one rollout batch (B = prompts x group_size rows, prompt-major).

  Attributes:
    prompts: B prompt token-id lists (prompt p repeated G times; a trailing ``<async>`` that the
      response repeats, as PASTA's does after a teacher-forced PLAN, is dropped).
    responses: B response token-id lists in canonical order; the stop token is appended when
      the response ended with it (``finish == "stop"``).
    sampler_logprobs: B lists of the sampler's log-probs (float, nats, temperature 1 logits) of
      the response tokens, stop token excluded.
    finish: B finish reasons (``"stop"`` / ``"length"``).
    group_size: G.
    decode_s: wall-clock seconds of the scheduler job.
  """

  prompts: list[list[int]]
  responses: list[list[int]]
  sampler_logprobs: list[list[float]]
  finish: list[str]
  group_size: int
  decode_s: float = 0.0

  @property
  def num_prompts(self) -> int:
    return len(self.prompts) // self.group_size

  def response_lengths(self) -> np.ndarray:
    """int ``[B]`` response tokens (stop token included)."""
    return np.asarray([len(r) for r in self.responses], np.int64)


def sample(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop_id: int | None,
           scheduler: str = "ar", group_size: int = 1,
           sampling: SamplingParams = SamplingParams(), num_pages: int = 256,
           page_size: int = 16, scheduler_kwargs: Mapping[str, Any] | None = None,
           tag_vocab=None) -> Rollouts:
  """Sample ``group_size`` responses per prompt with scheduler ``scheduler``.

  Args:
    model: the policy (a :class:`~selforch_jax.models.transformer.Transformer`; an engine is
      built on it, so later changes to the model are not seen by this call).
    prompts: P non-empty lists of int token ids.
    max_new_tokens: response budget (tokens, stop token included).
    stop_id: the id that ends a response (e.g. the chat end-of-turn), or None.
    scheduler: a ``runtime.registry`` name ("ar", "pasta", "tip").
    group_size: G >= 1 samples per prompt.
    sampling: :class:`SamplingParams` (temperature 0 = greedy: the G copies are then equal).
    num_pages, page_size: the engine's KV pool.
    scheduler_kwargs: extra options of the scheduler.
    tag_vocab: the model's :class:`~selforch_jax.lang.tags.TagVocab` (passed to the scheduler
      when given; "tip" and "pasta" need it).

  Returns:
    :class:`Rollouts`.

  Raises:
    ValueError: ``group_size < 1`` or no prompts.
    KeyError: unknown scheduler.
    PoolExhausted: the pool cannot hold the batch.
  """
  if group_size < 1:
    raise ValueError(f"group_size must be >= 1, got {group_size}")
  if not prompts:
    raise ValueError("sample needs at least one prompt")
  rows = [list(map(int, p)) for p in prompts for _ in range(group_size)]
  engine = Engine(model, num_pages=num_pages, page_size=page_size)
  stop_ids = () if stop_id is None else (int(stop_id),)
  kw = dict(scheduler_kwargs or {})
  if tag_vocab is not None:
    kw["tag_vocab"] = tag_vocab
  sched = make_scheduler(scheduler, engine, rows, max_new_tokens=max_new_tokens,
                         sampling=sampling, stop_ids=stop_ids, **kw)
  t0 = time.perf_counter()
  run(engine, sched)
  dt = time.perf_counter() - t0
  responses, lps, finish = [], [], []
  for i, res in enumerate(sched.results):
    ids = list(res.token_ids)
    if (tag_vocab is not None and rows[i] and rows[i][-1] == tag_vocab.async_open
        and ids[:1] == [tag_vocab.async_open]):
      # a prompt ending with a teacher-forced PLAN's <async>: PASTA's canonical response starts
      # with that <async> again; the training sequence holds it once
      rows[i] = rows[i][:-1]
    if res.finish_reason == "stop" and stop_id is not None:
      ids.append(int(stop_id))
    responses.append(ids)
    lps.append(list(res.logprobs))
    finish.append(res.finish_reason)
  return Rollouts(rows, responses, lps, finish, int(group_size), dt)


def sequence_row(prompt: Sequence[int], response: Sequence[int], seq_len: int, pad_id: int = 0,
                 tag_vocab=None, **layout_kw) -> dict[str, np.ndarray]:
  """One training row of prompt + response (see the module docstring).

  Args:
    prompt, response: token ids (the prompt non-empty).
    seq_len: T; the sequence is cut to ``T + 1`` tokens before the next-token shift.
    pad_id: id on padding.
    tag_vocab: lay the row out with ``lang.build_layout(ids, tag_vocab, eos_ids=(),
      **layout_kw)`` (the one-document layout of ``data.annotated``; pass the scheduler's
      ``cap`` / ``length_unit`` if it was given others) and leave the target after
      ``</async>`` untrained; None = causal, positions ``0..n-1``.

  Returns:
    ``tokens, targets, loss_mask, positions`` int32 ``[T]``, ``mask`` bool ``[T, T]``; padding
    rows see only themselves and are not trained.

  Raises:
    ValueError: ``seq_len < 1`` or an empty prompt.
  """
  if seq_len < 1 or not len(prompt):
    raise ValueError(f"sequence_row needs seq_len >= 1 and a prompt; got {seq_len}, {len(prompt)}")
  ids = np.asarray(list(prompt) + list(response), np.int64)[:seq_len + 1]
  resp = (np.arange(ids.size) >= len(prompt)).astype(np.int32)
  T, m = int(seq_len), ids.size - 1
  row = {"tokens": np.full(T, pad_id, np.int32), "targets": np.full(T, pad_id, np.int32),
         "loss_mask": np.zeros(T, np.int32), "positions": np.zeros(T, np.int32),
         "mask": np.eye(T, dtype=bool)}
  if m < 1:
    return row
  row["tokens"][:m] = ids[:-1]
  row["targets"][:m] = ids[1:]
  if tag_vocab is None:
    row["loss_mask"][:m] = resp[1:]
    row["positions"][:m] = np.arange(m)
    row["mask"][:m, :m] = np.tril(np.ones((m, m), bool))
    return row
  from selforch_jax.lang import build_layout
  lay = build_layout(ids, tag_vocab, eos_ids=(), **layout_kw)
  # as data.annotated: the runtime, not the model, writes the token after </async>
  row["loss_mask"][:m] = resp[1:] * (ids[:-1] != tag_vocab.async_close)
  row["positions"][:m] = lay.positions[:-1]
  row["mask"][:m, :m] = lay.token_mask()[:-1, :-1]
  return row


def causal_row(prompt: Sequence[int], response: Sequence[int], seq_len: int,
               pad_id: int = 0) -> dict[str, np.ndarray]:
  """:func:`sequence_row` with causal attention."""
  return sequence_row(prompt, response, seq_len, pad_id)


def to_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], seq_len: int,
             *, pad_id: int = 0, tag_vocab=None, **layout_kw) -> dict[str, np.ndarray]:
  """Rows of prompts + responses (:func:`sequence_row` each).

  Args:
    prompts, responses: B token-id lists each.
    seq_len: T (longer sequences are cut; their tail is not trained).
    pad_id: id on padding.
    tag_vocab: a :class:`~selforch_jax.lang.tags.TagVocab` to lay rows out with
      ``lang.build_layout`` (with ``layout_kw``, e.g. ``cap``, ``length_unit``); None = causal.

  Returns:
    ``tokens, targets, loss_mask, positions`` int32 ``[B, T]``, ``mask`` bool ``[B, T, T]``.

  Raises:
    ValueError: different numbers of prompts and responses.
  """
  if len(prompts) != len(responses):
    raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
  rows = [sequence_row(p, r, seq_len, pad_id, tag_vocab, **layout_kw)
          for p, r in zip(prompts, responses)]
  keys = ("tokens", "targets", "loss_mask", "positions", "mask")
  return {k: np.stack([row[k] for row in rows]) for k in keys}


def bucket_len(n: int, multiple: int = 64) -> int:
  """``n`` rounded up to a multiple of ``multiple`` (fewer distinct shapes to compile)."""
  return max(multiple, -(-int(n) // multiple) * multiple)
