"""Tokenizers built from GGUF ``tokenizer.*`` metadata (byte-level BPE and llama.cpp's SPM)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import tokenizers as hf_tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from selforch_jax.tokenizers.base import register_loader
from selforch_jax.tokenizers.byte_table import bytes_to_unicode as _bytes_to_unicode
from selforch_jax.tokenizers.hf import HFTokenizer

__all__ = [
  "load_gguf",
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



def load_gguf(path_or_reader: str | os.PathLike | Any) -> HFTokenizer:
  """The body of :meth:`Tokenizer.from_gguf` (see there for supported models, returns and errors)."""
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


register_loader("gguf", load_gguf)
