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

The package has one module per job: ``base`` (the :class:`Tokenizer` interface),
``chat_template`` (jinja2 rendering), ``hf`` (HF ``tokenizers`` backend and HF directories),
``sentencepiece`` (SentencePiece backend), ``gguf`` (builders from GGUF metadata).
"""

from selforch_jax.tokenizers.base import Tokenizer
from selforch_jax.tokenizers.chat_template import render_chat_template
from selforch_jax.tokenizers.gguf import (
  GGUF_TOKEN_TYPE_BYTE,
  GGUF_TOKEN_TYPE_CONTROL,
  GGUF_TOKEN_TYPE_NORMAL,
  GGUF_TOKEN_TYPE_UNKNOWN,
  GGUF_TOKEN_TYPE_UNUSED,
  GGUF_TOKEN_TYPE_USER_DEFINED,
)
from selforch_jax.tokenizers.hf import HFTokenizer
from selforch_jax.tokenizers.sentencepiece import SentencePieceTokenizer

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
