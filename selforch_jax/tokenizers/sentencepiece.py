"""SentencePiece backend: :class:`SentencePieceTokenizer` over a ``.model`` file."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import sentencepiece as spm

from selforch_jax.tokenizers.base import Tokenizer, _check_new_tokens, register_loader

__all__ = ["SentencePieceTokenizer", "load_sentencepiece"]


class SentencePieceTokenizer(Tokenizer):
  """:class:`Tokenizer` over a ``sentencepiece.SentencePieceProcessor``.

  Text between special tokens is encoded by SentencePiece (so each fragment gets its own dummy
  prefix, as in llama.cpp). Control pieces (``<s>``, ``</s>``) and tokens added with
  :meth:`add_special_tokens` are matched whole in text; added tokens get ids from
  ``processor.get_piece_size()`` on.

  Args:
    processor: the loaded SentencePiece model.
    **kwargs: see :class:`Tokenizer` (ids default to the model's own).
  """

  def __init__(self, processor: spm.SentencePieceProcessor, **kwargs: Any):
    self.processor = processor
    n = processor.get_piece_size()

    def model_id(i: int) -> int | None:
      return i if 0 <= i < n else None

    kwargs.setdefault("bos_id", model_id(processor.bos_id()))
    kwargs.setdefault("eos_id", model_id(processor.eos_id()))
    kwargs.setdefault("pad_id", model_id(processor.pad_id()))
    kwargs.setdefault("unk_id", model_id(processor.unk_id()))
    super().__init__(**kwargs)
    self._base_size = n
    self._added: dict[str, int] = {}  # token -> id (ids >= n)
    self._added_by_id: dict[int, str] = {}
    self._control = {processor.id_to_piece(i): i for i in range(n) if processor.is_control(i)}
    self._control = {t: i for t, i in self._control.items() if t}
    self._split_re: re.Pattern | None = None
    self._rebuild_split()

  def _rebuild_split(self) -> None:
    matchable = sorted({**self._control, **self._added}, key=len, reverse=True)
    self._split_re = re.compile("(" + "|".join(map(re.escape, matchable)) + ")") if matchable else None

  def _special_to_id(self, token: str) -> int:
    return self._added[token] if token in self._added else self._control[token]

  def _encode_text(self, text: str) -> list[int]:
    if self._split_re is None:
      return list(self.processor.encode(text)) if text else []
    ids: list[int] = []
    for k, part in enumerate(self._split_re.split(text)):
      if k % 2:
        ids.append(self._special_to_id(part))
      elif part:
        ids.extend(self.processor.encode(part))
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:  # noqa: D102
    pieces: list[str] = []
    run: list[int] = []
    for i in (int(x) for x in ids):
      if 0 <= i < self._base_size and not self.processor.is_control(i):
        run.append(i)
        continue
      if run:
        pieces.append(self.processor.decode(run))
        run = []
      if i in self._added_by_id:
        if not skip_special_tokens:
          pieces.append(self._added_by_id[i])
      elif 0 <= i < self._base_size:  # control piece
        if not skip_special_tokens:
          pieces.append(self.processor.id_to_piece(i))
      else:
        raise IndexError(f"token id {i} out of range [0, {self.vocab_size})")
    if run:
      pieces.append(self.processor.decode(run))
    return "".join(pieces)

  @property
  def vocab_size(self) -> int:  # noqa: D102
    return self._base_size + len(self._added)

  def token_to_id(self, token: str) -> int | None:  # noqa: D102
    if token in self._added:
      return self._added[token]
    i = self.processor.piece_to_id(token)
    return i if 0 <= i < self._base_size and self.processor.id_to_piece(i) == token else None

  def id_to_token(self, token_id: int) -> str:  # noqa: D102
    token_id = int(token_id)
    if 0 <= token_id < self._base_size:
      return self.processor.id_to_piece(token_id)
    if token_id in self._added_by_id:
      return self._added_by_id[token_id]
    raise IndexError(f"token id {token_id} out of range [0, {self.vocab_size})")

  def add_special_tokens(self, tokens: Sequence[str]) -> list[int]:  # noqa: D102
    tokens = _check_new_tokens(tokens)
    out = []
    for token in tokens:
      token_id = self.token_to_id(token)
      if token_id is None:
        token_id = self.vocab_size
        self._added[token] = token_id
        self._added_by_id[token_id] = token
      elif token_id < self._base_size and token not in self._control:
        # An existing piece becomes special: matched whole in text from now on.
        self._added[token] = token_id
        self._added_by_id[token_id] = token
      out.append(token_id)
    self._rebuild_split()
    return out

  @property
  def special_ids(self) -> frozenset[int]:  # noqa: D102
    return frozenset(self._control.values()) | frozenset(self._added.values())

  def token_bytes(self, token_id: int) -> bytes:  # noqa: D102
    token = self.id_to_token(token_id)
    token_id = int(token_id)
    if token_id < self._base_size and self.processor.is_byte(token_id):
      return bytes([int(token[3:5], 16)])  # '<0xE2>'
    if token_id in self._added_by_id or token_id in self.special_ids:
      return token.encode("utf-8")
    return token.replace("\u2581", " ").encode("utf-8")

  def save_hf(self, directory: str | os.PathLike) -> None:  # noqa: D102
    raise NotImplementedError(
      "save_hf is not supported for the sentencepiece backend (SentencePiece models are not "
      "expressible as a tokenizer.json without conversion); ship the .model file instead"
    )


def load_sentencepiece(
  model_path: str | os.PathLike,
  chat_template: str | None = None,
  *,
  add_bos: bool = False,
  add_eos: bool = False,
) -> SentencePieceTokenizer:
  """The body of :meth:`Tokenizer.from_sentencepiece` (see there for arguments and errors)."""
  model_path = os.fspath(model_path)
  if not os.path.isfile(model_path):
    raise FileNotFoundError(f"SentencePiece model not found: {model_path!r}")
  processor = spm.SentencePieceProcessor(model_file=model_path)
  return SentencePieceTokenizer(
    processor, chat_template=chat_template, add_bos=add_bos, add_eos=add_eos, name_or_path=model_path
  )


register_loader("sentencepiece", load_sentencepiece)
