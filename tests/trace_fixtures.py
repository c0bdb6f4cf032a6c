"""Shared by tests/test_trace.py and tests/test_api_runtimes.py: a byte-level fake tokenizer with
the orchestration tags appended (ids 256..266: 7 fixed tags, 4 registers) and a tiny random
Llama over that vocabulary, so every runtime (tagged ones included) runs in seconds on CPU."""

import pytest

from selforch_jax.lang import Promise, Round, TagVocab, serialize, tag_strings
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model

BASE = 256
TV = TagVocab.appended(BASE, 4, eos_ids=[2], digit_ids=range(48, 58), space_ids=[32])
RUNTIMES = ("ar", "pasta", "tip", "sot", "apar", "streaming_llm", "h2o")


class ByteTagTokenizer:
  """Bytes as ids 0..255 (id 2 = EOS), the tags after them; a ChatML-like chat template."""

  stop_ids = (2,)
  eos_id = 2
  pad_id = 0

  def __init__(self):
    self.tags = dict(zip(range(BASE, BASE + 11), tag_strings(4)))

  def token_to_id(self, s):
    return next((i for i, t in self.tags.items() if t == s), None)

  def encode(self, text):
    return list(text.encode("utf-8"))

  def encode_chat(self, messages, add_generation_prompt=True):
    out = "".join(f"\x01{m['role']}\n{m['content']}\x02\n" for m in messages)
    return self.encode(out + ("\x01assistant\n" if add_generation_prompt else ""))

  def decode(self, ids, skip_special_tokens=False):
    out = b""
    for i in (int(x) for x in ids):
      if i < BASE:
        out += bytes([i])
      elif not skip_special_tokens:
        out += self.tags.get(i, f"<{i}>").encode()
    return out.decode("utf-8", errors="replace")


def forced_plan_prompt(tok):
  """A chat prompt whose assistant turn holds a PLAN of three promises (lengths 1, 2, 1)
  followed by ``<async>``: PASTA forks three threads at once."""
  plan = [75, Promise((80, 81), 1), 76, Promise((82,), 2), Promise((83, 84), 1), 77]
  head = tok.encode_chat([{"role": "user", "content": "List three things."}])
  return head + serialize([Round(plan=tuple(plan), sync=False)], TV) + [TV.async_open]


@pytest.fixture(scope="module")
def tiny():
  """``(model, tokenizer)``: tiny_llama with a 267-token vocabulary (random weights)."""
  return init_model(get_preset("tiny_llama", vocab_size=BASE + 11), seed=5), ByteTagTokenizer()
