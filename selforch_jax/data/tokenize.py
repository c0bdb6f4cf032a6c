"""Chat examples -> token ids with an assistant-only loss mask.

The loss mask is derived from the tokenizer's own chat template, by rendering prefixes
of the conversation (no template-specific parsing): for assistant turn ``i``

* ``start`` = length of ``encode_chat(messages[:i], add_generation_prompt=True)``,
  i.e. everything up to and including the assistant header (``<|im_start|>assistant\\n``);
* ``end``   = length of ``encode_chat(messages[:i+1], add_generation_prompt=False)``,
  i.e. the turn with its closing text (``...<|im_end|>\\n``);
* the mask is 1 on ``[start, stop]`` where ``stop`` is the last end-of-turn token
  (``tokenizer.stop_ids``, else ``eos_id``) inside ``[start, end)``; text the template adds
  after that token (ChatML's ``\\n``) is not trained on, because generation stops at the
  end-of-turn token. If the turn has no stop token the whole ``[start, end)`` is masked.

Token counts of prefixes are measured as the common prefix with the ids of the whole
conversation, so the ids returned are always exactly
``tokenizer.encode_chat(messages, add_generation_prompt=False)``.

Truncation rule: ``ids[:max_len]`` and ``mask[:max_len]`` -- the *end* of the conversation
is cut, the prompt is kept; an example whose assistant tokens are all cut has an all-zero
mask (the pipeline drops such examples).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import numpy as np


class ChatTokenizer(Protocol):
  """The part of ``selforch_jax.tokenizers.Tokenizer`` the data pipeline uses.

  ``stop_ids`` (end-of-turn / EOS ids) close assistant turns in the loss mask; ``pad_id``
  (None = 0) fills padding; ``encode_chat`` renders the chat template and encodes it.
  """

  eos_id: int | None
  pad_id: int | None
  stop_ids: Sequence[int]

  def encode_chat(self, messages: Sequence[Mapping[str, str]],
                  add_generation_prompt: bool = True) -> list[int]:
    ...


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
  n = min(len(a), len(b))
  a_arr = np.asarray(a[:n], dtype=np.int64)
  b_arr = np.asarray(b[:n], dtype=np.int64)
  diff = np.nonzero(a_arr != b_arr)[0]
  return int(diff[0]) if diff.size else n


def _encode_prefix(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, str]],
                   add_generation_prompt: bool) -> list[int]:
  # encode_chat (not encode(render(...))) so BOS handling matches the full conversation.
  try:
    return list(tokenizer.encode_chat(list(messages), add_generation_prompt=add_generation_prompt))
  except Exception:  # pylint: disable=broad-except  # a template may reject an empty prefix
    if messages:
      raise
    return []


def _end_of_turn_ids(tokenizer: ChatTokenizer) -> set[int]:
  ids = set(int(i) for i in (getattr(tokenizer, "stop_ids", None) or ()))
  eos = getattr(tokenizer, "eos_id", None)
  if eos is not None:
    ids.add(int(eos))
  return ids


def tokenize_chat(messages: Sequence[Mapping[str, str]], tokenizer: ChatTokenizer,
                  max_len: int | None = None) -> dict[str, np.ndarray]:
  """Tokenize a conversation and mark the tokens the model is trained to produce.

  Args:
    messages: list of ``{"role", "content"}`` turns; roles other than ``"assistant"``
      are context (mask 0).
    tokenizer: a :class:`ChatTokenizer`.
    max_len: if given, keep the first ``max_len`` tokens (truncate from the end).

  Returns:
    ``{"input_ids": int32[n], "loss_mask": int32[n]}`` with ``n <= max_len``;
    ``loss_mask[t] == 1`` iff token ``t`` belongs to an assistant turn's content or is the
    end-of-turn token closing it (the assistant header and the template's text after the
    end-of-turn token are 0).

  Raises:
    ValueError: if ``messages`` is empty or ``max_len < 1``.
  """
  if not messages:
    raise ValueError("tokenize_chat needs at least one message")
  if max_len is not None and max_len < 1:
    raise ValueError(f"max_len must be >= 1, got {max_len}")
  ids = list(tokenizer.encode_chat(messages, add_generation_prompt=False))
  mask = np.zeros(len(ids), np.int32)
  stop = _end_of_turn_ids(tokenizer)
  for i, m in enumerate(messages):
    if m["role"] != "assistant":
      continue
    head = _encode_prefix(tokenizer, messages[:i], add_generation_prompt=True)
    turn = _encode_prefix(tokenizer, messages[:i + 1], add_generation_prompt=False)
    start = _common_prefix_len(head, ids)
    end = _common_prefix_len(turn, ids)
    if end <= start:
      continue
    span = ids[start:end]
    last = max((j for j, t in enumerate(span) if t in stop), default=len(span) - 1)
    mask[start:start + last + 1] = 1
  out_ids = np.asarray(ids, np.int32)
  if max_len is not None:
    out_ids, mask = out_ids[:max_len], mask[:max_len]
  return {"input_ids": out_ids, "loss_mask": mask}


def tokenize_example(example: Mapping[str, Any], tokenizer: ChatTokenizer,
                     max_len: int | None = None) -> dict[str, np.ndarray]:
  """:func:`tokenize_chat` on ``example["messages"]`` (other fields are dropped).

  Raises:
    KeyError: if the example has no ``"messages"``.
  """
  return tokenize_chat(example["messages"], tokenizer, max_len=max_len)


def shift_for_lm(tokenized: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Next-token training view of one tokenized example.

  Args:
    tokenized: ``{"input_ids": int32[n], "loss_mask": int[n]}``, ``n >= 2``.

  Returns:
    ``{"tokens": ids[:-1], "targets": ids[1:], "loss_mask": loss_mask[1:]}``, each int32
    of length ``n - 1``: ``loss_mask[t]`` says whether ``targets[t]`` is trained on.
    The shift happens per example, before packing, so no example predicts a token of
    the next example packed after it.

  Raises:
    ValueError: if ``n < 2``.
  """
  ids = np.asarray(tokenized["input_ids"], np.int32)
  if ids.shape[0] < 2:
    raise ValueError(f"need at least 2 tokens to shift, got {ids.shape[0]}")
  return {
      "tokens": ids[:-1],
      "targets": ids[1:],
      "loss_mask": np.asarray(tokenized["loss_mask"], np.int32)[1:],
  }
