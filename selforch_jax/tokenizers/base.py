"""The :class:`Tokenizer` interface every backend implements (see the package docstring)."""

from __future__ import annotations

import abc
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from selforch_jax.tokenizers.chat_template import render_chat_template


__all__ = ["Tokenizer", "check_encodable"]

# End-of-turn markers of common chat templates; one counts as a stop token when the template
# writes it and the vocabulary has it.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")


class Tokenizer(abc.ABC):
  """Common interface of every tokenizer backend (see the module docstring).

  Do not instantiate directly: use :meth:`from_gguf`, :meth:`from_hf_dir` or
  :meth:`from_sentencepiece`, which return an :class:`HFTokenizer` or a
  :class:`SentencePieceTokenizer`.

  Attributes:
    chat_template (str | None): jinja2 chat template of the model (mutable).
    add_bos (bool): ``encode(..., add_special_tokens=True)`` and ``encode_chat`` prepend BOS.
    add_eos (bool): ``encode(..., add_special_tokens=True)`` appends EOS.
    name_or_path (str | None): where the tokenizer was loaded from.
  """

  def __init__(
    self,
    *,
    bos_id: int | None,
    eos_id: int | None,
    pad_id: int | None = None,
    unk_id: int | None = None,
    chat_template: str | None = None,
    add_bos: bool = False,
    add_eos: bool = False,
    name_or_path: str | None = None,
  ):
    self._bos_id = bos_id
    self._eos_id = eos_id
    self._pad_id = pad_id
    self._unk_id = unk_id
    self.chat_template = chat_template
    self.add_bos = bool(add_bos)
    self.add_eos = bool(add_eos)
    self.name_or_path = name_or_path

  # ---- backend hooks --------------------------------------------------------------------

  @abc.abstractmethod
  def _encode_text(self, text: str) -> list[int]:
    """Ids of ``text`` with the backend (added special tokens matched whole)."""

  @abc.abstractmethod
  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """Token ids back to text.

    Args:
      ids: token ids (any int sequence, e.g. a list or a 1-D numpy array).
      skip_special_tokens: drop special tokens (control tokens and those added with
        :meth:`add_special_tokens`) instead of writing their text.

    Returns:
      str: the decoded text. Byte sequences that are not valid UTF-8 decode to U+FFFD.
    """

  @property
  @abc.abstractmethod
  def vocab_size(self) -> int:
    """int: number of ids, including added tokens (the embedding table needs this many rows)."""

  @abc.abstractmethod
  def token_to_id(self, token: str) -> int | None:
    """Id of a vocabulary entry (as the vocabulary spells it, e.g. ``'Ġthe'`` in byte-level
    BPE), or ``None`` when there is none."""

  @abc.abstractmethod
  def id_to_token(self, token_id: int) -> str:
    """Vocabulary entry of an id (as the vocabulary spells it).

    Raises:
      IndexError: ``token_id`` is not in ``[0, vocab_size)``.
    """

  @abc.abstractmethod
  def add_special_tokens(self, tokens: Sequence[str]) -> list[int]:
    """Register special tokens, appending the new ones at the end of the vocabulary.

    New tokens get consecutive ids from the current ``vocab_size`` in the order given; a token
    that already exists keeps its id (and is matched whole in text from now on). Added tokens
    are recognised in text by :meth:`encode` and dropped by ``decode(...,
    skip_special_tokens=True)``. The model's embedding table must grow to ``vocab_size``.

    Args:
      tokens: token strings, e.g. ``["<promise>", "</promise>"]``.

    Returns:
      list[int]: the id of each token, in the order given.

    Raises:
      ValueError: a token is empty or not a string.
    """

  def token_bytes(self, token_id: int) -> bytes:
    """The bytes a token contributes to the decoded text (before UTF-8 decoding).

    A byte-level BPE token or a ``<0xXX>`` byte-fallback token may hold part of a multi-byte
    character (``'𝔘'`` is three tokens in SmolLM2); the parser's chunk cap uses this to close a
    chunk only between characters. Special tokens give their text's UTF-8 bytes. This default
    encodes ``decode([token_id])`` (exact for tokens that hold whole characters); the backends
    override it.

    Raises:
      IndexError: ``token_id`` is not in ``[0, vocab_size)``.
    """
    self.id_to_token(token_id)  # range check
    return self.decode([int(token_id)]).encode("utf-8", "surrogatepass")

  @property
  @abc.abstractmethod
  def special_ids(self) -> frozenset[int]:
    """frozenset[int]: ids of all special tokens (control tokens and added special tokens)."""

  @abc.abstractmethod
  def save_hf(self, directory: str | os.PathLike) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``.

    The directory loads with ``transformers.AutoTokenizer.from_pretrained(directory)`` (and
    :meth:`from_hf_dir`) and encodes identically.

    Raises:
      NotImplementedError: the backend cannot be expressed as a ``tokenizer.json``.
    """

  # ---- shared behaviour -------------------------------------------------------------------

  @property
  def bos_id(self) -> int | None:
    """int | None: id of the beginning-of-sequence token."""
    return self._bos_id

  @property
  def eos_id(self) -> int | None:
    """int | None: id of the end-of-sequence token."""
    return self._eos_id

  @property
  def pad_id(self) -> int | None:
    """int | None: id of the padding token (the EOS id when the model defines none)."""
    return self._pad_id if self._pad_id is not None else self._eos_id

  @property
  def unk_id(self) -> int | None:
    """int | None: id of the unknown token, if any."""
    return self._unk_id

  @property
  def bos_token(self) -> str | None:
    """str | None: text of the BOS token."""
    return None if self._bos_id is None else self.id_to_token(self._bos_id)

  @property
  def eos_token(self) -> str | None:
    """str | None: text of the EOS token."""
    return None if self._eos_id is None else self.id_to_token(self._eos_id)

  @property
  def pad_token(self) -> str | None:
    """str | None: text of the padding token."""
    return None if self.pad_id is None else self.id_to_token(self.pad_id)

  @property
  def unk_token(self) -> str | None:
    """str | None: text of the unknown token."""
    return None if self._unk_id is None else self.id_to_token(self._unk_id)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """tuple[int, ...]: ids that end generation: EOS, then the chat template's end-of-turn
    token (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ...) when the template writes
    one; no duplicates."""
    out: list[int] = []
    if self._eos_id is not None:
      out.append(self._eos_id)
    template = self.chat_template or ""
    for token in _END_OF_TURN_TOKENS:
      if token in template:
        token_id = self.token_to_id(token)
        if token_id is not None and token_id not in out:
          out.append(token_id)
    return tuple(out)

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Text to token ids.

    Special tokens written in the text (``<|im_start|>``, tokens added with
    :meth:`add_special_tokens`) become one id each.

    Args:
      text: the text.
      add_special_tokens: prepend BOS if ``add_bos`` is set and the text does not already
        start with BOS, and append EOS if ``add_eos`` is set.

    Returns:
      list[int]: token ids.

    Raises:
      TypeError: ``text`` is not a ``str``.
      ValueError: ``text`` holds a lone surrogate (U+D800..U+DFFF, not encodable as UTF-8);
        the message gives its index and code point.
    """
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    check_encodable(text)
    ids = self._encode_text(text)
    if add_special_tokens:
      ids = self._with_bos(ids)
      if self.add_eos and self._eos_id is not None:
        ids.append(self._eos_id)
    return ids

  def _with_bos(self, ids: list[int]) -> list[int]:
    if self.add_bos and self._bos_id is not None and (not ids or ids[0] != self._bos_id):
      return [self._bos_id] + ids
    return ids

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tokenize: bool = False,
    *,
    chat_template: str | None = None,
    **kwargs: Any,
  ) -> str | list[int]:
    """Render a conversation with the model's chat template (see :func:`render_chat_template`).

    Args:
      messages: e.g. ``[{"role": "system", "content": ...}, {"role": "user", ...}]``.
      add_generation_prompt: end with the opening of an assistant turn.
      tokenize: return ``encode_chat(...)`` ids instead of text.
      chat_template: use this template instead of ``self.chat_template``.
      **kwargs: extra template variables (e.g. ``tools``).

    Returns:
      str | list[int]: the rendered text, or its ids when ``tokenize``.

    Raises:
      ValueError: there is no chat template.
      jinja2.TemplateError: the template failed (e.g. ``raise_exception`` was called).
    """
    if tokenize:
      return self.encode_chat(
        messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template, **kwargs
      )
    template = chat_template if chat_template is not None else self.chat_template
    if template is None:
      raise ValueError(
        f"Tokenizer {self.name_or_path!r} has no chat template; pass chat_template= or set "
        ".chat_template"
      )
    variables = {"pad_token": self.pad_token, "unk_token": self.unk_token}
    variables.update(kwargs)
    return render_chat_template(
      template,
      messages,
      add_generation_prompt=add_generation_prompt,
      bos_token=self.bos_token,
      eos_token=self.eos_token,
      **variables,
    )

  def encode_chat(
    self,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    *,
    chat_template: str | None = None,
    **kwargs: Any,
  ) -> list[int]:
    """Render a conversation with the chat template and encode it.

    BOS rule: the result has exactly one BOS at the start where one is asked for. If the
    rendered text already starts with the BOS token's text (the template writes
    ``{{ bos_token }}``) no other is added; otherwise one is prepended only when ``add_bos`` is
    set. So ``encode_chat(m) == encode(text)``, or ``[bos_id] + encode(text)`` when ``add_bos``
    is set and the template writes no BOS; EOS is never appended.

    Args:
      messages: the conversation.
      add_generation_prompt: end with the opening of an assistant turn.
      chat_template: use this template instead of ``self.chat_template``.
      **kwargs: extra template variables.

    Returns:
      list[int]: prompt ids.

    Raises:
      ValueError: there is no chat template, or the rendered prompt holds a lone surrogate.
      jinja2.TemplateError: the template failed.
    """
    text = self.apply_chat_template(
      messages, add_generation_prompt=add_generation_prompt, tokenize=False, chat_template=chat_template, **kwargs
    )
    check_encodable(text, what="rendered chat prompt")
    return self._with_bos(self._encode_text(text))

  def __repr__(self) -> str:
    return (
      f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, "
      f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id}, add_bos={self.add_bos})"
    )

  # ---- constructors -------------------------------------------------------------------------

  @classmethod
  def from_gguf(cls, path_or_reader: str | os.PathLike | Any) -> "Tokenizer":
    """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

    Supported ``tokenizer.ggml.model`` values:

    * ``'gpt2'`` -- byte-level BPE from ``tokens`` + ``merges``. Pre-tokenizer by
      ``tokenizer.ggml.pre``: ``'smollm'`` = ``Digits(individual_digits=True)`` then GPT-2
      ``ByteLevel``; ``'gpt2'``/``'default'``/absent = ``ByteLevel``; ``'llama-bpe'``,
      ``'llama3'``, ``'qwen2'``, ``'deepseek-r1-qwen'`` = their split regex. Byte-level
      decoder, no byte fallback.
    * ``'llama'`` -- SentencePiece vocabulary (``tokens`` + ``scores``), tokenized like
      llama.cpp: BPE whose merges are ranked by the merged piece's score, ``'▁'`` for spaces,
      a space prefix per text fragment (``tokenizer.ggml.add_space_prefix``, default on),
      byte fallback to ``<0xXX>`` tokens when the vocabulary has them.

    Control tokens (token type 3, and unknown type 2 for ``'llama'``) become special added
    tokens; user-defined ones (type 4) become non-special added tokens (matched whole in
    text, but kept by ``skip_special_tokens``, as llama.cpp and transformers do).
    ``tokenizer.chat_template``, ``bos/eos/padding/unknown_token_id`` and
    ``add_bos_token``/``add_eos_token`` (default: on for ``'llama'``, off otherwise) are read.

    Args:
      path_or_reader: path of a ``.gguf`` file, or an open ``gguf.GGUFReader``.

    Returns:
      HFTokenizer

    Raises:
      FileNotFoundError: the path does not exist (the message names it).
      ValueError: no tokenizer metadata, an unsupported ``tokenizer.ggml.model`` or
        ``tokenizer.ggml.pre`` (the message names the value).
    """
    return _LOADERS["gguf"](path_or_reader)

  @classmethod
  def from_hf_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
    """Load a Hugging Face tokenizer directory.

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (``bos_token``,
    ``eos_token``, ``pad_token``, ``unk_token``, ``add_bos_token``, ``add_eos_token``,
    ``chat_template``), ``special_tokens_map.json`` and ``chat_template.jinja`` when present
    (the ``.jinja`` file wins over the config entry, as in transformers). When the config does
    not say ``add_bos_token``/``add_eos_token``, they are read off the ``tokenizer.json``
    post-processor. BOS/EOS are never added by the backend itself: ``encode`` does it.

    Args:
      directory: the directory.

    Returns:
      HFTokenizer

    Raises:
      FileNotFoundError: the directory has no ``tokenizer.json``.
    """
    return _LOADERS["hf_dir"](directory)

  @classmethod
  def from_sentencepiece(
    cls,
    model_path: str | os.PathLike,
    chat_template: str | None = None,
    *,
    add_bos: bool = False,
    add_eos: bool = False,
  ) -> "Tokenizer":
    """Load a SentencePiece ``.model`` file.

    BOS/EOS/PAD/UNK ids come from the model (``-1`` there means none; PAD then falls back to
    EOS). Text is encoded by SentencePiece itself, fragment by fragment between special tokens.

    Args:
      model_path: path of the ``.model`` file.
      chat_template: jinja2 chat template (SentencePiece models carry none).
      add_bos: prepend BOS in ``encode(..., add_special_tokens=True)`` and ``encode_chat``.
      add_eos: append EOS in ``encode(..., add_special_tokens=True)``.

    Returns:
      SentencePieceTokenizer

    Raises:
      FileNotFoundError: the file does not exist.
    """
    return _LOADERS["sentencepiece"](model_path, chat_template, add_bos=add_bos, add_eos=add_eos)


# the ``Tokenizer.from_*`` constructors: each backend module registers its loader when the
# package imports it (so this module imports no backend and no cycle runs through it)
_LOADERS: dict[str, Any] = {}


def register_loader(kind: str, loader) -> None:
  """Register the builder ``Tokenizer.from_<kind>`` calls (``gguf``, ``hf_dir``,
  ``sentencepiece``)."""
  _LOADERS[kind] = loader


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_encodable(text: str, what: str = "text") -> None:
  """Raise a clear error when ``text`` cannot be encoded as UTF-8 (so cannot be tokenized).

  A Python ``str`` may hold lone surrogates (U+D800..U+DFFF, e.g. from ``'\\ud800'`` or from
  bytes decoded with ``errors='surrogateescape'``); the tokenizer backends reject them with an
  unhelpful ``TypeError``.

  Args:
    text: the text about to be tokenized.
    what: how the message names the text.

  Raises:
    ValueError: the first lone surrogate, by index and code point (e.g. ``U+D800 at index 0``).
  """
  bad = _SURROGATE.search(text)
  if bad is not None:
    i = bad.start()
    raise ValueError(
      f"{what} holds a lone surrogate U+{ord(text[i]):04X} at index {i} (near {text[max(0, i - 10):i + 10]!r}); "
      "it is not valid Unicode and cannot be tokenized -- fix the text's encoding or drop the character"
    )


def _check_new_tokens(tokens: Sequence[str]) -> list[str]:
  if isinstance(tokens, str):
    raise ValueError("add_special_tokens expects a list of strings, got a single str")
  tokens = list(tokens)
  for token in tokens:
    if not isinstance(token, str) or not token:
      raise ValueError(f"special tokens must be non-empty strings, got {token!r}")
  return tokens
