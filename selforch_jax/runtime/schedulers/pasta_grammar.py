"""The PASTA tag grammar (``constrain_tags``): which tags each PASTA stream may sample next.

A promise closes only after its length, a thread ends only with ``</async>``, ``<sync/>`` only
joins an open round (:class:`~selforch_jax.runtime.schedulers.pasta.PASTAScheduler` applies
these bans to the logits before sampling).
"""

from __future__ import annotations

from typing import Sequence

from selforch_jax.lang import TagVocab

__all__ = ["constraint_ids", "grammar_ids", "tag_grammar"]


def constraint_ids(tv: TagVocab, stop_ids: Sequence[int] = (),
                   digits: bool = False) -> tuple[int, ...]:
  """The ids :class:`PASTAScheduler` constrains with ``constrain_tags``, in order:
  :func:`grammar_ids`, the sorted ``stop_ids``, then (``digits``, the scheduler's
  ``max_topic_tokens`` set) ``tv.digit_ids`` and ``tv.space_ids[:1]`` (the separator before a
  promise length). Shapes compiled for sampling depend on its length.
  """
  return (*grammar_ids(tv), *sorted({int(i) for i in stop_ids}),
          *((*tv.digit_ids, *tv.space_ids[:1]) if digits else ()))


def grammar_ids(tv: TagVocab) -> tuple[int, ...]:
  """The ids :func:`tag_grammar` rules on, in its order: ``<promise>``, ``</promise>``,
  ``<async>``, ``</async>``, ``<sync/>``, ``<|mask|>``, ``[PAD]``, then ``<reg_0..K-1>``."""
  return (tv.promise_open, tv.promise_close, tv.async_open, tv.async_close, tv.sync, tv.mask,
          tv.pad, *tv.registers)


def tag_grammar(tv: TagVocab, in_thread: bool, in_promise: bool, promise_inner: Sequence[int],
                after_promise: bool, round_open: bool, threads_full: bool = False,
                long_topic: bool = False) -> tuple[list[bool], bool]:
  """Which tags may come next (constrained decoding of PASTA's tag grammar, DESIGN.md §3).

  A thread writes text, register tags (TIP inside threads) or its ``</async>``; inside a promise
  only ``</promise>`` may close it, and only once the promise ends with a length (``TOPIC N``,
  :meth:`TagVocab.split_length`); right after a ``</promise>`` the PLAN goes on with
  ``<promise>`` or forks with ``<async>`` (nothing else); elsewhere the main thread writes text
  or register tags, opens a promise, or forks when a round is open. ``<sync/>`` is always the
  runtime's; ``<|mask|>`` and ``[PAD]`` are never sampled. Text is restricted only right after
  ``</promise>``. ``threads_full`` (the request's promises reached the scheduler's
  ``max_threads``): no ``<promise>`` may open, so right after ``</promise>`` only ``<async>``
  may follow (when no round is open there, e.g. after a prompt's promise without a length,
  ``<promise>`` stays allowed so that something is). ``long_topic`` (a promise without a length
  reached the scheduler's ``max_topic_tokens``): only the constrained ids not banned may follow
  (the scheduler adds a space and the digits, so the promise must write its length and close).

  Returns:
    ``(ban, only_tags)``: ``ban`` one bool per id of :func:`grammar_ids`; ``only_tags`` True when
    nothing but the allowed tags may follow.
  """
  K = len(tv.registers)
  if in_thread:
    return [True, True, True, False, True, True, True] + [False] * K, False
  if in_promise:
    _, n = tv.split_length(promise_inner)
    return [True, n is None, True, True, True, True, True] + [True] * K, long_topic
  if after_promise:
    return ([threads_full and round_open, True, not round_open, True, True, True, True]
            + [True] * K, True)
  return [threads_full, True, not round_open, True, True, True, True] + [False] * K, False
