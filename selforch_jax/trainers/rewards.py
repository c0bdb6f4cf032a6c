"""Rewards of sampled responses, by name (GRPO, BoNBoN quality).

A reward is ``fn(text, reference, format_weight) -> float``: ``text`` is the response as
plain text (tags stripped), ``reference`` the dataset's reference (a GSM8K worked solution or a
bare answer).

* ``"gsm8k"``: ``correct + format_weight * formatted``: ``correct`` = 1 if the response's final
  answer matches the reference (:func:`selforch_jax.eval.answers.is_correct`, exact match after
  normalisation), ``formatted`` = 1 if the answer is written explicitly (``#### N`` or
  ``\\boxed{N}``, i.e. :func:`~selforch_jax.eval.answers.extract_answer` finds it without the
  last-number fallback). Range ``[0, 1 + format_weight]``.
* ``"gsm8k_correct"``: ``correct`` only.
"""

from __future__ import annotations

from typing import Callable

from selforch_jax.eval.answers import extract_answer, is_correct
from selforch_jax.registry import Registry

RewardFn = Callable[[str, str, float], float]
_REWARDS: Registry[RewardFn] = Registry("reward")


def register_reward(name: str):
  """Decorator registering ``fn(text, reference, format_weight) -> float`` as ``name``.

  Raises:
    ValueError: ``name`` is taken.
  """
  return _REWARDS.register(name)


def reward_names() -> list[str]:
  """Registered reward names, sorted."""
  return _REWARDS.names()


def get_reward(name: str) -> RewardFn:
  """The reward ``name``.

  Raises:
    KeyError: unknown name (the message lists the known ones).
  """
  return _REWARDS.get(name)


@register_reward("gsm8k")
def gsm8k_reward(text: str, reference: str, format_weight: float = 0.1) -> float:
  """Exact-match correctness plus ``format_weight`` for an explicit final answer."""
  correct = float(is_correct(text, reference))
  formatted = float(extract_answer(text, fallback=None) is not None)
  return correct + float(format_weight) * formatted


@register_reward("gsm8k_correct")
def gsm8k_correct(text: str, reference: str, format_weight: float = 0.0) -> float:
  """Exact-match correctness only (``format_weight`` is ignored)."""
  return float(is_correct(text, reference))
