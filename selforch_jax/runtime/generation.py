"""What a decode returns and when it stops: :class:`GenerationResult`, :class:`StopConditions`,
the model's EOS ids and the context-length check (every scheduler shares them).

Finish reasons (the OpenAI / vLLM vocabulary, plus one of ours):

* ``"stop"``: an EOS id of the model or a stop string ended the answer;
* ``"length"``: ``max_new_tokens`` was reached;
* ``"degraded"``: the answer ended, but the runtime had to repair the model's annotations on the
  way (a malformed plan decoded as plain text, an unclosed chunk closed by a cap, ...).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Iterable, Sequence

FINISH_REASONS = ("stop", "length", "degraded")


class ContextLengthError(ValueError):
  """A prompt plus ``max_new_tokens`` does not fit the model's context (message names both)."""


@dataclasses.dataclass
class GenerationResult:
  """One decoded answer.

  Attributes:
    token_ids: generated ids (int), without the stop token (for PASTA / TIP: the canonical
      serialized order, tags included).
    logprobs: float natural-log probability of each of ``token_ids`` under the model.
    finish_reason: one of :data:`FINISH_REASONS`.
  """

  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str


@dataclasses.dataclass(frozen=True)
class StopConditions:
  """When one answer ends.

  Attributes:
    eos_ids: every id that ends an answer (the model's EOS ids: :func:`eos_ids`); the EOS token
      is not part of the answer.
    stop_strings: strings that end the answer when its text contains one (the text is cut
      before the string; the tokens up to and including the one that completed it are kept).
    max_new_tokens: most tokens per answer (>= 1), the EOS token included.

  Raises:
    ValueError: ``max_new_tokens < 1`` or an empty stop string.
  """

  eos_ids: tuple[int, ...] = ()
  stop_strings: tuple[str, ...] = ()
  max_new_tokens: int = 256

  def __post_init__(self):
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))
    object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if any(not s for s in self.stop_strings):
      raise ValueError("stop strings must be non-empty")


def find_stop_string(text: str, stop_strings: Sequence[str]) -> int:
  """The index in ``text`` where the earliest stop string starts, or -1 if none occurs."""
  hits = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
  return min(hits) if hits else -1


class StopStringWatcher:
  """Incremental stop-string detection over one answer's tokens.

  Args:
    decode: ``ids -> text`` (the tokenizer's ``decode``).
    stop_strings: as :class:`StopConditions`.

  :meth:`push` takes each new token id and returns True once the decoded answer contains a
  stop string; only the tail that can hold a new match is decoded each time.
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], stop_strings: Sequence[str]):
    self.decode = decode
    self.stops = tuple(stop_strings)
    self.ids: list[int] = []
    self._tail = 8 + max((len(s) for s in self.stops), default=0)

  def push(self, token_id: int) -> bool:
    """Add ``token_id``; True if the answer now contains a stop string."""
    self.ids.append(int(token_id))
    if not self.stops:
      return False
    return find_stop_string(self.decode(self.ids[-self._tail:]), self.stops) >= 0


def cut_at_stop(text: str, stop_strings: Sequence[str]) -> tuple[str, bool]:
  """``(text before the earliest stop string, True)`` or ``(text, False)``."""
  i = find_stop_string(text, stop_strings)
  return (text[:i], True) if i >= 0 else (text, False)


def eos_ids(tokenizer, generation_config: dict | str | os.PathLike | None = None
            ) -> tuple[int, ...]:
  """Every id that ends an answer: the tokenizer's EOS and end-of-turn ids
  (``tokenizer.stop_ids``) and the ``eos_token_id`` (int or list) of an HF
  ``generation_config.json`` (a dict, a file or a model directory holding one).

  Returns:
    tuple of distinct ints, tokenizer ids first.
  """
  out = list(getattr(tokenizer, "stop_ids", ()) or ())
  gc = generation_config
  if isinstance(gc, (str, os.PathLike)):
    path = os.path.join(gc, "generation_config.json") if os.path.isdir(gc) else gc
    gc = json.load(open(path, encoding="utf-8")) if os.path.isfile(path) else None
  ids = (gc or {}).get("eos_token_id")
  for i in ([ids] if isinstance(ids, int) else list(ids or [])):
    if int(i) not in out:
      out.append(int(i))
  return tuple(int(i) for i in out)


def check_context(prompt_lengths: Iterable[int], max_new_tokens: int, context: int) -> None:
  """Refuse a decode that cannot fit the model's context.

  Args:
    prompt_lengths: tokens of each prompt.
    max_new_tokens: tokens to generate per prompt.
    context: the model's ``max_position_embeddings``.

  Raises:
    ContextLengthError: some prompt plus ``max_new_tokens`` exceeds ``context`` (the message
      names the prompt, its length, ``max_new_tokens`` and the context).
  """
  for i, n in enumerate(prompt_lengths):
    if int(n) + int(max_new_tokens) > int(context):
      raise ContextLengthError(
          f"prompt {i} has {int(n)} tokens; with max_new_tokens={int(max_new_tokens)} that is "
          f"{int(n) + int(max_new_tokens)} > the model's context of {int(context)} tokens")
