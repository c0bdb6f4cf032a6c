"""Annotated SFT examples: a conversation in the orchestration language -> a training row whose
attention mask is the mask builder's (DESIGN.md §2.1, one mask for training and decoding).

A PASTA or TIP training example is an ordinary chat example whose assistant text carries tags
(``<promise>``, ``<async>``, ``<sync/>``, ``<reg_k>``, ...). After tokenization (tags are single
added tokens), :func:`annotated_example` runs :func:`selforch_jax.lang.mask.build_layout` over the
whole conversation and returns the row the trainer consumes::

  tokens, targets, loss_mask, positions   int32[T]
  mask                                    bool[T, T]   (query x key)

so that ``model(tokens, positions, mask)`` is the full-sequence forward of the train = decode oracle
(DESIGN.md §2.2): every token sees exactly what the runtime lets it see when it is decoded (PASTA
threads their fork context, TIP tokens no evicted step), at the positions the runtime gives it.

Targets follow the canonical order (the training sequence is the decoding order), with one rule
for the runtime's own tokens: the runtime, not the model, writes the token after a ``</async>`` (the
next thread's ``<async>`` or the join's ``<sync/>``), so the target after a ``</async>`` is not
trained (``loss_mask = 0``). The model does learn to end the PLAN with ``<async>`` (the fork
signal), to close each chunk with ``</async>``, and what follows ``<sync/>``.

The pipeline side (:func:`AnnotateTokenize`) applies a registered annotator
(:mod:`selforch_jax.lang.annotators`) to each example's last assistant turn first; with
``strip_tags`` it keeps the plain response instead (the Baseline-SFT data: the same examples and
words, no tags; every annotator returns a response whose tag-free logical text is the original).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Sequence

import numpy as np

from selforch_jax.data.tokenize import ChatTokenizer, tokenize_chat
from selforch_jax.lang.mask import build_layout
from selforch_jax.lang.tags import TagVocab

__all__ = ["annotated_example", "annotate_messages", "strip_messages", "AnnotateTokenize", "ROW_KEYS"]

ROW_KEYS = ("tokens", "targets", "loss_mask", "positions", "mask", "valid")


def annotated_example(token_ids: Sequence[int] | np.ndarray, assistant_mask: Sequence[int] | np.ndarray,
                      tag_vocab: TagVocab, seq_len: int, *, pad_id: int = 0,
                      async_sees_full_plan: bool = False,
                      chunk_bidirectional: bool | str = False) -> dict[str, np.ndarray] | None:
  """One padded training row of an annotated conversation.

  Args:
    token_ids: ``int[n]`` the whole conversation (prompt turns + annotated assistant turn), as
      :func:`~selforch_jax.data.tokenize.tokenize_chat` gives it.
    assistant_mask: ``int[n]``, 1 on the tokens the model is trained to produce (tokenize_chat's
      ``loss_mask``).
    tag_vocab: the vocabulary's tags.
    seq_len: T; the conversation is cut to ``T + 1`` tokens before the next-token shift.
    pad_id: token id on padding.
    async_sees_full_plan, chunk_bidirectional: mask-builder options
      (:class:`~selforch_jax.lang.mask.LayoutBuilder`).

  Returns:
    ``{"tokens", "targets", "loss_mask", "positions", "valid": int32[T], "mask": bool[T, T]}``
    (``valid``: 1 on real tokens, 0 on padding), or None
    when no trained target is left after the cut. Row t predicts ``targets[t]`` from ``tokens[t]``
    seeing the keys ``mask[t]``; padding rows see only themselves and are not trained. The whole
    conversation is one document: end-of-turn tokens do not start a new one.

  Raises:
    ValueError: ``seq_len < 1`` or ``token_ids`` / ``assistant_mask`` of different lengths.
  """
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}")
  ids = np.asarray(token_ids, np.int64).reshape(-1)
  am = np.asarray(assistant_mask, np.int32).reshape(-1)
  if ids.shape != am.shape:
    raise ValueError(f"token_ids {ids.shape} and assistant_mask {am.shape} differ in length")
  ids, am = ids[:seq_len + 1], am[:seq_len + 1]
  n = ids.shape[0]
  if n < 2:
    return None
  layout = build_layout(ids, tag_vocab, eos_ids=(), async_sees_full_plan=async_sees_full_plan,
                        chunk_bidirectional=chunk_bidirectional)
  m = n - 1
  loss = am[1:] * (ids[:-1] != tag_vocab.async_close)
  if not loss.any():
    return None
  T = int(seq_len)
  row = {
      "tokens": np.full(T, pad_id, np.int32),
      "targets": np.full(T, pad_id, np.int32),
      "loss_mask": np.zeros(T, np.int32),
      "positions": np.zeros(T, np.int32),
      "mask": np.eye(T, dtype=bool),
      "valid": np.zeros(T, np.int32),
  }
  row["tokens"][:m] = ids[:-1]
  row["targets"][:m] = ids[1:]
  row["loss_mask"][:m] = loss
  row["positions"][:m] = layout.positions[:-1]
  row["mask"][:m, :m] = layout.token_mask()[:-1, :-1]
  row["valid"][:m] = 1
  return row


def _last_assistant(messages: Sequence[Mapping[str, str]]) -> int | None:
  for i in range(len(messages) - 1, -1, -1):
    if messages[i]["role"] == "assistant":
      return i
  return None


def annotate_messages(messages: Sequence[Mapping[str, str]], annotator: Any
                      ) -> tuple[list[dict[str, str]], Any]:
  """Annotate the last assistant turn of a conversation.

  Args:
    messages: chat turns ``{"role", "content"}``.
    annotator: a :class:`~selforch_jax.lang.annotators.base.Annotator`.

  Returns:
    ``(messages with that turn annotated, the Annotation)``; when the annotator returns no text
    (nothing to annotate) the turn stays plain and the Annotation says so. The prompt passed to the
    annotator is the last user turn before it ("" if none).
  """
  out = [dict(m) for m in messages]
  i = _last_assistant(out)
  if i is None:
    return out, None
  prompt = next((out[j]["content"] for j in range(i - 1, -1, -1) if out[j]["role"] == "user"), "")
  ann = annotator.annotate(prompt, out[i]["content"])
  if ann.text is not None:
    out[i]["content"] = ann.text
  return out, ann


def strip_messages(messages: Sequence[Mapping[str, str]], tokenizer: ChatTokenizer,
                   tag_vocab: TagVocab) -> list[dict[str, str]]:
  """The conversation with every assistant turn in plain text: tags, promise topics and lengths
  removed, chunks in logical order (:func:`selforch_jax.lang.assemble.assemble_text`)."""
  from selforch_jax.lang.assemble import assemble_text

  out = [dict(m) for m in messages]
  for m in out:
    if m["role"] == "assistant":
      m["content"] = assemble_text(tokenizer.encode(m["content"]), tag_vocab, tokenizer)
  return out


def _build_annotator(name: str, args: Mapping[str, Any] | None, tokenizer: ChatTokenizer):
  from selforch_jax.lang import annotators  # registers every annotator

  kwargs = dict(args or {})
  factory = annotators.base.annotator_factory(name)  # ValueError naming the known ones
  if "tokenizer" in inspect.signature(factory).parameters and "tokenizer" not in kwargs:
    kwargs["tokenizer"] = tokenizer
  return annotators.get_annotator(name, **kwargs)


class AnnotateTokenize:
  """Picklable grain map: chat example -> annotated, tokenized, masked row (None if nothing to
  learn).

  Args:
    tokenizer: a tokenizer with the tags added (:func:`~selforch_jax.lang.tags.add_tags`).
    tag_vocab: its :class:`TagVocab`.
    seq_len: T.
    annotator: a registered annotator name, or None (the examples are already annotated, or plain).
    annotator_args: keyword arguments of the annotator (a ``tokenizer`` argument is filled in).
    strip_tags: train on plain responses (Baseline-SFT): the annotator is not run, and responses
      that already carry tags are stripped (:func:`strip_messages`).
    pad_id, async_sees_full_plan, chunk_bidirectional: see :func:`annotated_example`.

  Raises:
    ValueError: unknown annotator name (at construction, before any work).
  """

  def __init__(self, tokenizer: ChatTokenizer, tag_vocab: TagVocab, seq_len: int, *,
               annotator: str | None = None, annotator_args: Mapping[str, Any] | None = None,
               strip_tags: bool = False, pad_id: int = 0, async_sees_full_plan: bool = False,
               chunk_bidirectional: bool | str = False):
    self.tokenizer = tokenizer
    self.tag_vocab = tag_vocab
    self.seq_len = int(seq_len)
    self.strip_tags = bool(strip_tags)
    self.annotator = None
    if annotator and not self.strip_tags:
      self.annotator = _build_annotator(annotator, annotator_args, tokenizer)
    self.pad_id = int(pad_id)
    self.async_sees_full_plan = async_sees_full_plan
    self.chunk_bidirectional = chunk_bidirectional

  def __call__(self, example: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    messages = example["messages"]
    if self.annotator is not None:
      messages, _ = annotate_messages(messages, self.annotator)
    elif self.strip_tags:
      messages = strip_messages(messages, self.tokenizer, self.tag_vocab)
    tok = tokenize_chat(messages, self.tokenizer, max_len=self.seq_len + 1)
    return annotated_example(tok["input_ids"], tok["loss_mask"], self.tag_vocab, self.seq_len,
                             pad_id=self.pad_id, async_sees_full_plan=self.async_sees_full_plan,
                             chunk_bidirectional=self.chunk_bidirectional)
