"""HF ``tokenizers`` backend: :class:`HFTokenizer` and loading a Hugging Face tokenizer directory."""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers as hf_tokenizers
from tokenizers import AddedToken, decoders, processors

from selforch_jax.tokenizers.base import Tokenizer, _check_new_tokens, register_loader
from selforch_jax.tokenizers.byte_table import bytes_to_unicode

__all__ = ["HFTokenizer", "load_hf_dir"]

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback piece


@functools.lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
  """Inverse of GPT-2's byte -> printable character table (byte-level BPE vocabularies)."""
  return {ch: b for b, ch in bytes_to_unicode().items()}


def _has_byte_level_decoder(backend: hf_tokenizers.Tokenizer) -> bool:
  """Whether the decoder maps tokens through GPT-2's byte table (alone or in a Sequence)."""
  dec = backend.decoder
  return isinstance(dec, decoders.ByteLevel) or (dec is not None and "ByteLevel(" in repr(dec))


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

  def token_bytes(self, token_id: int) -> bytes:  # noqa: D102
    token = self.id_to_token(token_id)
    if int(token_id) in self.backend.get_added_tokens_decoder():
      return token.encode("utf-8")
    if _has_byte_level_decoder(self.backend):
      table = _unicode_to_bytes()
      if all(ch in table for ch in token):
        return bytes(table[ch] for ch in token)
    m = _BYTE_PIECE.fullmatch(token)
    if m is not None:
      return bytes([int(m.group(1), 16)])
    return token.replace("\u2581", " ").encode("utf-8")

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


def load_hf_dir(directory: str | os.PathLike) -> HFTokenizer:
  """The body of :meth:`Tokenizer.from_hf_dir` (see there for files read, returns and errors)."""
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


register_loader("hf_dir", load_hf_dir)
