"""One tokenizer interface over HF ``tokenizers`` and ``sentencepiece``, with chat templates.

Every model in the zoo is driven through :class:`Tokenizer`:

  tok = Tokenizer.from_gguf(smollm2_gguf_path())      # GGUF metadata (SmolLM2's default)
  tok = Tokenizer.from_hf_dir("path/to/hf_model")     # tokenizer.json + tokenizer_config.json
  tok = Tokenizer.from_sentencepiece("tokenizer.model", chat_template=...)

  ids = tok.encode("Hello <|im_start|>")              # special tokens in text -> one id each
  text = tok.decode(ids)
  tag_ids = tok.add_special_tokens(["<promise>", "</promise>"])   # appended: 49152, 49153
  prompt_ids = tok.encode_chat([{"role": "user", "content": "Hi"}])

Conventions pinned by ``tests/test_tokenizers.py``:

* ``encode(text)`` never adds BOS/EOS; ``encode(text, add_special_tokens=True)`` adds BOS when the
  tokenizer's ``add_bos`` flag is set and the text does not already start with it (never two BOS),
  and EOS when ``add_eos`` is set.
* Special (and added) tokens written in the text are matched whole, like llama.cpp and HF.
* ``encode_chat(messages)`` renders the model's own chat template and encodes it; it has exactly one
  BOS where the template or the ``add_bos`` flag asks for one.
* GGUF byte-level BPE with ``tokenizer.ggml.pre = 'smollm'`` splits every numeric character on its
  own before the GPT-2 regex (llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` and the original SmolLM2
  ``tokenizer.json``). transformers' GGUF converter (5.x) omits that split, so it differs from this
  module where whitespace directly precedes a numeric character: a whitespace run before a digit
  (``"a  1"``) or a space before a multi-byte numeral such as ``" ٣"``.
"""

from __future__ import annotations

import abc
import datetime
import functools
import json
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import sentencepiece as spm
import tokenizers as hf_tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

__all__ = [
  "Tokenizer",
  "HFTokenizer",
  "SentencePieceTokenizer",
  "render_chat_template",
  "GGUF_TOKEN_TYPE_NORMAL",
  "GGUF_TOKEN_TYPE_UNKNOWN",
  "GGUF_TOKEN_TYPE_CONTROL",
  "GGUF_TOKEN_TYPE_USER_DEFINED",
  "GGUF_TOKEN_TYPE_UNUSED",
  "GGUF_TOKEN_TYPE_BYTE",
]

# llama.cpp's llama_token_type values, as stored in ``tokenizer.ggml.token_type``.
GGUF_TOKEN_TYPE_NORMAL = 1
GGUF_TOKEN_TYPE_UNKNOWN = 2
GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4
GGUF_TOKEN_TYPE_UNUSED = 5
GGUF_TOKEN_TYPE_BYTE = 6

# End-of-turn markers of common chat templates; one counts as a stop token when the template
# writes it and the vocabulary has it.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")

# Split regexes (llama.cpp / HF tokenizer.json) for GGUF byte-level BPE pre-tokenizer types that are
# not plain GPT-2. ``ignore_merges`` mirrors llama.cpp's ``tokenizer_ignore_merges``.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE_TYPES = {
  "llama3": (_LLAMA3_SPLIT, True),
  "llama-v3": (_LLAMA3_SPLIT, True),
  "llama-bpe": (_LLAMA3_SPLIT, True),
  "qwen2": (_QWEN2_SPLIT, False),
  "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}
_GPT2_PRE_TYPES = (None, "default", "gpt2", "gpt-2")
_SUPPORTED_GGUF_MODELS = ("gpt2", "llama")


# --------------------------------------------------------------------------------------------
# chat templates
# --------------------------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
  """Accepts HF's ``{% generation %}...{% endgeneration %}`` and renders the body unchanged."""

  tags = {"generation"}

  def parse(self, parser):  # noqa: D102 - jinja2 hook
    next(parser.stream)
    return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Like HF: no HTML escaping (jinja's builtin tojson escapes <, >, &, ').
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def _compile_chat_template(template: str) -> jinja2.Template:
  env = ImmutableSandboxedEnvironment(
    trim_blocks=True,
    lstrip_blocks=True,
    extensions=[_GenerationTag, jinja2.ext.loopcontrols],
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(template)


def render_chat_template(
  template: str,
  messages: Sequence[Mapping[str, Any]],
  *,
  add_generation_prompt: bool = True,
  bos_token: str | None = None,
  eos_token: str | None = None,
  **kwargs: Any,
) -> str:
  """Render a (HF-style, jinja2) chat template the way ``transformers`` does.

  The template runs in jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks``, the ``loopcontrols`` extension, HF's ``{% generation %}`` tag (a no-op
  here), a ``tojson`` filter without HTML escaping, and the globals ``raise_exception(msg)`` and
  ``strftime_now(fmt)``.

  Args:
    template: the jinja2 source.
    messages: the conversation, e.g. ``[{"role": "user", "content": "Hi"}]``.
    add_generation_prompt: render the opening of an assistant turn at the end.
    bos_token: text of the BOS token, exposed to the template as ``bos_token``.
    eos_token: text of the EOS token, exposed as ``eos_token``.
    **kwargs: further template variables (``tools``, ``pad_token``, ...).

  Returns:
    str: the rendered prompt text.

  Raises:
    jinja2.TemplateError: the template does not parse, or called ``raise_exception``.
  """
  compiled = _compile_chat_template(template)
  return compiled.render(
    messages=list(messages),
    add_generation_prompt=add_generation_prompt,
    bos_token=bos_token,
    eos_token=eos_token,
    **kwargs,
  )


# --------------------------------------------------------------------------------------------
# the interface
# --------------------------------------------------------------------------------------------


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
    """
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
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
      ValueError: there is no chat template.
      jinja2.TemplateError: the template failed.
    """
    text = self.apply_chat_template(
      messages, add_generation_prompt=add_generation_prompt, tokenize=False, chat_template=chat_template, **kwargs
    )
    return self._with_bos(self._encode_text(text))

  def __repr__(self) -> str:
    return (
      f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={self.vocab_size}, "
      f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id}, add_bos={self.add_bos})"
    )

  # ---- constructors -------------------------------------------------------------------------

  @classmethod
  def from_gguf(cls, path_or_reader: str | os.PathLike | Any) -> HFTokenizer:
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
    reader, name = _open_gguf(path_or_reader)
    model_type = _gguf_value(reader, "tokenizer.ggml.model")
    if model_type is None:
      raise ValueError(f"{name}: no tokenizer.ggml.model in the GGUF metadata (no tokenizer stored)")
    tokens = _gguf_value(reader, "tokenizer.ggml.tokens")
    if not tokens:
      raise ValueError(f"{name}: no tokenizer.ggml.tokens in the GGUF metadata")
    token_types = _gguf_value(reader, "tokenizer.ggml.token_type") or [GGUF_TOKEN_TYPE_NORMAL] * len(tokens)
    bos_id = _gguf_value(reader, "tokenizer.ggml.bos_token_id")
    eos_id = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
    unk_id = _gguf_value(reader, "tokenizer.ggml.unknown_token_id")
    pad_id = _gguf_value(reader, "tokenizer.ggml.padding_token_id")
    if model_type == "gpt2":
      backend = _byte_level_bpe_from_gguf(
        name,
        tokens,
        token_types,
        _gguf_value(reader, "tokenizer.ggml.merges"),
        _gguf_value(reader, "tokenizer.ggml.pre"),
        special_ids=[i for i in (bos_id, eos_id) if i is not None],
      )
      add_bos_default = False
    elif model_type == "llama":
      backend = _sentencepiece_bpe_from_gguf(
        tokens,
        token_types,
        _gguf_value(reader, "tokenizer.ggml.scores"),
        unk_id,
        add_space_prefix=bool(_gguf_value(reader, "tokenizer.ggml.add_space_prefix", True)),
        special_ids=[i for i in (bos_id, eos_id) if i is not None],
      )
      add_bos_default = True
    else:
      raise ValueError(
        f"{name}: unsupported GGUF tokenizer model tokenizer.ggml.model={model_type!r}; "
        f"supported: {', '.join(repr(m) for m in _SUPPORTED_GGUF_MODELS)}"
      )
    return HFTokenizer(
      backend,
      bos_id=bos_id,
      eos_id=eos_id,
      pad_id=pad_id,
      unk_id=unk_id,
      chat_template=_gguf_value(reader, "tokenizer.chat_template"),
      add_bos=bool(_gguf_value(reader, "tokenizer.ggml.add_bos_token", add_bos_default)),
      add_eos=bool(_gguf_value(reader, "tokenizer.ggml.add_eos_token", False)),
      name_or_path=name,
    )

  @classmethod
  def from_hf_dir(cls, directory: str | os.PathLike) -> HFTokenizer:
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
    directory = os.fspath(directory)
    tokenizer_json = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(tokenizer_json):
      raise FileNotFoundError(f"No tokenizer.json in {directory!r}")
    backend = hf_tokenizers.Tokenizer.from_file(tokenizer_json)
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    special_map = _read_json(os.path.join(directory, "special_tokens_map.json"))

    def token_id(key: str) -> int | None:
      value = config.get(key, special_map.get(key))
      if isinstance(value, Mapping):
        value = value.get("content")
      return backend.token_to_id(value) if isinstance(value, str) else None

    chat_template = config.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": ..., "template": ...}, ...]
      named = {t.get("name"): t.get("template") for t in chat_template}
      chat_template = named.get("default", next(iter(named.values()), None))
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
      with open(jinja_file, encoding="utf-8") as f:
        chat_template = f.read()

    bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
    add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
    if add_bos is None or add_eos is None:
      probe_bos, probe_eos = _post_processor_adds(backend, bos_id, eos_id)
      add_bos = probe_bos if add_bos is None else add_bos
      add_eos = probe_eos if add_eos is None else add_eos
    return HFTokenizer(
      backend,
      bos_id=bos_id,
      eos_id=eos_id,
      pad_id=token_id("pad_token"),
      unk_id=token_id("unk_token"),
      chat_template=chat_template,
      add_bos=bool(add_bos),
      add_eos=bool(add_eos),
      name_or_path=directory,
    )

  @classmethod
  def from_sentencepiece(
    cls,
    model_path: str | os.PathLike,
    chat_template: str | None = None,
    *,
    add_bos: bool = False,
    add_eos: bool = False,
  ) -> SentencePieceTokenizer:
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
    model_path = os.fspath(model_path)
    if not os.path.isfile(model_path):
      raise FileNotFoundError(f"SentencePiece model not found: {model_path!r}")
    processor = spm.SentencePieceProcessor(model_file=model_path)
    return SentencePieceTokenizer(
      processor, chat_template=chat_template, add_bos=add_bos, add_eos=add_eos, name_or_path=model_path
    )


# --------------------------------------------------------------------------------------------
# backend: HF tokenizers
# --------------------------------------------------------------------------------------------


class HFTokenizer(Tokenizer):
  """:class:`Tokenizer` over a ``tokenizers.Tokenizer`` (built from GGUF or ``tokenizer.json``).

  Args:
    backend: the ``tokenizers.Tokenizer``; its post-processor is never used (``encode`` adds
      BOS/EOS itself).
    **kwargs: see :class:`Tokenizer`.
  """

  def __init__(self, backend: hf_tokenizers.Tokenizer, **kwargs: Any):
    super().__init__(**kwargs)
    self.backend = backend

  def _encode_text(self, text: str) -> list[int]:
    return list(self.backend.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:  # noqa: D102
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  @property
  def vocab_size(self) -> int:  # noqa: D102
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:  # noqa: D102
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str:  # noqa: D102
    token = self.backend.id_to_token(int(token_id)) if int(token_id) >= 0 else None
    if token is None:
      raise IndexError(f"token id {token_id} out of range [0, {self.vocab_size})")
    return token

  def add_special_tokens(self, tokens: Sequence[str]) -> list[int]:  # noqa: D102
    tokens = _check_new_tokens(tokens)
    added = self.backend.get_added_tokens_decoder()
    already_special = {t.content for t in added.values() if t.special}
    new = [t for t in dict.fromkeys(tokens) if t not in already_special]
    if new:
      self.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new])
    return [self.backend.token_to_id(t) for t in tokens]

  @property
  def special_ids(self) -> frozenset[int]:  # noqa: D102
    return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

  def save_hf(self, directory: str | os.PathLike) -> None:  # noqa: D102
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    backend = hf_tokenizers.Tokenizer.from_str(self.backend.to_str())
    if self.add_bos or self.add_eos:
      bos = [(self.bos_token, self.bos_id)] if self.add_bos and self.bos_id is not None else []
      eos = [(self.eos_token, self.eos_id)] if self.add_eos and self.eos_id is not None else []
      prefix = " ".join(f"{t}:0" for t, _ in bos)
      suffix = " ".join(f"{t}:0" for t, _ in eos)
      suffix1 = " ".join(f"{t}:1" for t, _ in eos)
      prefix1 = " ".join(f"{t}:1" for t, _ in bos)
      backend.post_processor = processors.TemplateProcessing(
        single=" ".join(p for p in (prefix, "$A:0", suffix) if p),
        pair=" ".join(p for p in (prefix, "$A:0", suffix, prefix1, "$B:1", suffix1) if p),
        special_tokens=bos + [e for e in eos if e not in bos],
      )
    backend.save(os.path.join(directory, "tokenizer.json"))

    added = backend.get_added_tokens_decoder()
    named = {
      "bos_token": self.bos_token,
      "eos_token": self.eos_token,
      "pad_token": self.pad_token,
      "unk_token": self.unk_token,
    }
    named = {k: v for k, v in named.items() if v is not None}
    extra = [t.content for _, t in sorted(added.items()) if t.special and t.content not in named.values()]
    config: dict[str, Any] = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      **named,
      "add_bos_token": self.add_bos,
      "add_eos_token": self.add_eos,
      "clean_up_tokenization_spaces": False,
      "model_max_length": int(1e30),
      "added_tokens_decoder": {
        str(i): {
          "content": t.content,
          "lstrip": t.lstrip,
          "normalized": t.normalized,
          "rstrip": t.rstrip,
          "single_word": t.single_word,
          "special": t.special,
        }
        for i, t in sorted(added.items())
      },
      "extra_special_tokens": extra,
    }
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, ensure_ascii=False, indent=2)
    with open(os.path.join(directory, "special_tokens_map.json"), "w", encoding="utf-8") as f:
      json.dump({**named, "additional_special_tokens": extra}, f, ensure_ascii=False, indent=2)


# --------------------------------------------------------------------------------------------
# backend: sentencepiece
# --------------------------------------------------------------------------------------------


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

  def save_hf(self, directory: str | os.PathLike) -> None:  # noqa: D102
    raise NotImplementedError(
      "save_hf is not supported for the sentencepiece backend (SentencePiece models are not "
      "expressible as a tokenizer.json without conversion); ship the .model file instead"
    )


# --------------------------------------------------------------------------------------------
# GGUF helpers
# --------------------------------------------------------------------------------------------


def _open_gguf(path_or_reader: Any) -> tuple[Any, str]:
  if isinstance(path_or_reader, (str, os.PathLike)):
    path = os.fspath(path_or_reader)
    if not os.path.isfile(path):
      raise FileNotFoundError(f"GGUF file not found: {path!r}")
    import gguf  # noqa: PLC0415 - heavy optional import

    return gguf.GGUFReader(path), path
  if not hasattr(path_or_reader, "fields"):
    raise TypeError(f"expected a GGUF path or gguf.GGUFReader, got {type(path_or_reader).__name__}")
  filename = getattr(getattr(path_or_reader, "data", None), "filename", None)
  return path_or_reader, os.fspath(filename) if filename else "<GGUFReader>"


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  if field is None:
    return default
  value = field.contents()
  return default if value is None else value


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible byte -> printable unicode character table."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _unique_vocab(keys: list[str]) -> dict[str, int]:
  vocab: dict[str, int] = {}
  for i, key in enumerate(keys):
    if key in vocab:
      warnings.warn(f"GGUF vocabulary repeats token {key!r} (ids {vocab[key]} and {i}); id {i} is unreachable")
      key = f"<|gguf_duplicate_{i}|>"
    vocab[key] = i
  return vocab


def _byte_level_bpe_from_gguf(
  name: str,
  tokens: list[str],
  token_types: list[int],
  merges: list[str] | None,
  pre_type: str | None,
  special_ids: Sequence[int],
) -> hf_tokenizers.Tokenizer:
  if merges is None:
    raise ValueError(f"{name}: GGUF tokenizer model 'gpt2' without tokenizer.ggml.merges")
  alphabet = set(_bytes_to_unicode().values())
  spell = _bytes_to_unicode()
  keys = []
  for token, token_type in zip(tokens, token_types):
    if token_type in (GGUF_TOKEN_TYPE_CONTROL, GGUF_TOKEN_TYPE_USER_DEFINED) or set(token) <= alphabet:
      keys.append(token)
    else:  # a normal token stored as raw text: write it in the byte alphabet
      keys.append("".join(spell[b] for b in token.encode("utf-8")))
  vocab = _unique_vocab(keys)
  merge_pairs = [tuple(m.split(" ", 1)) for m in merges]

  if pre_type in _GPT2_PRE_TYPES:
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    ignore_merges = False
  elif pre_type == "smollm":
    pre = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
      ]
    )
    ignore_merges = False
  elif pre_type in _SPLIT_PRE_TYPES:
    split, ignore_merges = _SPLIT_PRE_TYPES[pre_type]
    pre = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  else:
    supported = ["smollm", "gpt2", "default"] + sorted(_SPLIT_PRE_TYPES)
    raise ValueError(
      f"{name}: unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre_type!r} for byte-level BPE; "
      f"supported: {supported}"
    )

  backend = hf_tokenizers.Tokenizer(
    models.BPE(vocab=vocab, merges=merge_pairs, byte_fallback=False, ignore_merges=ignore_merges)
  )
  backend.pre_tokenizer = pre
  backend.decoder = decoders.ByteLevel()
  _register_gguf_added_tokens(backend, keys, token_types, special_types=(GGUF_TOKEN_TYPE_CONTROL,), special_ids=special_ids)
  return backend


def _sentencepiece_bpe_from_gguf(
  tokens: list[str],
  token_types: list[int],
  scores: list[float] | None,
  unk_id: int | None,
  *,
  add_space_prefix: bool,
  special_ids: Sequence[int],
) -> hf_tokenizers.Tokenizer:
  """llama.cpp's SPM tokenizer as a ``tokenizers`` BPE: merges ranked by the merged piece's score."""
  if scores is None:
    scores = [-float(i) for i in range(len(tokens))]
  vocab = _unique_vocab(list(tokens))
  mergeable = (GGUF_TOKEN_TYPE_NORMAL, GGUF_TOKEN_TYPE_USER_DEFINED)
  candidates = []
  for token, token_type, score in zip(tokens, token_types, scores):
    if token_type not in mergeable or len(token) < 2:
      continue
    for k in range(1, len(token)):
      left, right = token[:k], token[k:]
      if left in vocab and right in vocab:
        candidates.append((-score, vocab[left], vocab[right], left, right))
  candidates.sort()
  merge_pairs = [(left, right) for *_, left, right in candidates]
  has_bytes = any(t == GGUF_TOKEN_TYPE_BYTE for t in token_types)
  backend = hf_tokenizers.Tokenizer(
    models.BPE(
      vocab=vocab,
      merges=merge_pairs,
      unk_token=tokens[unk_id] if unk_id is not None else None,
      byte_fallback=has_bytes,
      fuse_unk=True,
    )
  )
  steps = [normalizers.Prepend("▁")] if add_space_prefix else []
  backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
  dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  if add_space_prefix:
    dec.append(decoders.Strip(" ", 1, 0))
  backend.decoder = decoders.Sequence(dec)
  _register_gguf_added_tokens(
    backend,
    list(tokens),
    token_types,
    special_types=(GGUF_TOKEN_TYPE_CONTROL, GGUF_TOKEN_TYPE_UNKNOWN),
    special_ids=special_ids,
  )
  return backend


def _register_gguf_added_tokens(
  backend: hf_tokenizers.Tokenizer,
  keys: list[str],
  token_types: list[int],
  special_types: Sequence[int],
  special_ids: Sequence[int],
) -> None:
  special_ids = set(special_ids)
  special = [
    AddedToken(key, special=True, normalized=False)
    for i, (key, t) in enumerate(zip(keys, token_types))
    if key and (t in special_types or i in special_ids)
  ]
  user = [
    AddedToken(key, special=False, normalized=False)
    for i, (key, t) in enumerate(zip(keys, token_types))
    if key and t == GGUF_TOKEN_TYPE_USER_DEFINED and i not in special_ids
  ]
  if special:
    backend.add_special_tokens(special)
  if user:
    backend.add_tokens(user)


# --------------------------------------------------------------------------------------------
# misc helpers
# --------------------------------------------------------------------------------------------


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _post_processor_adds(backend: hf_tokenizers.Tokenizer, bos_id: int | None, eos_id: int | None) -> tuple[bool, bool]:
  """Whether the tokenizer.json post-processor adds BOS / EOS (probed on a short text)."""
  plain = backend.encode("a", add_special_tokens=False).ids
  full = backend.encode("a", add_special_tokens=True).ids
  if len(full) <= len(plain):
    return False, False
  adds_bos = bos_id is not None and full[0] == bos_id and (not plain or plain[0] != bos_id)
  adds_eos = eos_id is not None and full[-1] == eos_id and (not plain or plain[-1] != eos_id)
  return adds_bos, adds_eos


def _check_new_tokens(tokens: Sequence[str]) -> list[str]:
  if isinstance(tokens, str):
    raise ValueError("add_special_tokens expects a list of strings, got a single str")
  tokens = list(tokens)
  for token in tokens:
    if not isinstance(token, str) or not token:
      raise ValueError(f"special tokens must be non-empty strings, got {token!r}")
  return tokens
