"""An exported model stops in transformers where ours stops: every stop id is in the HF configs.

A tiny random model is exported with a real :class:`~selforch_jax.tokenizers.HFTokenizer`
(word-level vocabulary, one word per id) whose EOS and end-of-turn ids are chosen from what our
greedy decode emits, then greedy-decoded by ``transformers`` from the exported directory.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tokenizers as hf_tokenizers  # noqa: E402

from selforch_jax.checkpoints.safetensors_io import export_hf, special_ids_for_hf  # noqa: E402
from selforch_jax.models.config import get_preset  # noqa: E402
from selforch_jax.models.transformer import init_model  # noqa: E402
from selforch_jax.runtime.engine import Engine  # noqa: E402
from selforch_jax.runtime.schedulers import ar  # noqa: E402
from selforch_jax.tokenizers import HFTokenizer  # noqa: E402

PROMPT = [5, 17, 42, 99, 3]
N_NEW = 16


def _word_tokenizer(vocab_size: int, eos_id: int, eot_id: int) -> HFTokenizer:
  """A word-level HFTokenizer: id i is the word ``w{i}``, except EOS ``</s>`` and ``<|im_end|>``."""
  words = [f"w{i}" for i in range(vocab_size)]
  words[eos_id], words[eot_id], words[1] = "</s>", "<|im_end|>", "<s>"
  backend = hf_tokenizers.Tokenizer(
    hf_tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
  backend.pre_tokenizer = hf_tokenizers.pre_tokenizers.WhitespaceSplit()
  template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
  return HFTokenizer(backend, bos_id=1, eos_id=eos_id, chat_template=template)


def _first_new(seq: list[int], start: int, avoid: set[int]) -> int:
  """Index of the first token of ``seq`` at or after ``start`` not seen before it nor in ``avoid``."""
  for k in range(start, len(seq)):
    if seq[k] not in seq[:k] and seq[k] not in avoid:
      return k
  raise AssertionError(f"no fresh token in {seq}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  cfg = get_preset("tiny_llama")
  model = init_model(cfg, seed=3)
  free = ar.generate(Engine(model, num_pages=8, page_size=8), [PROMPT], max_new_tokens=N_NEW)[0]
  assert free.finish_reason == "length" and len(free.token_ids) == N_NEW
  g = free.token_ids
  # the end-of-turn id is the greedy choice at step k (first time it appears); EOS is never emitted
  avoid = set(PROMPT) | {1}
  k = _first_new(g, 3, avoid)
  eot_id = g[k]
  eos_id = next(i for i in range(2, cfg.vocab_size) if i not in g and i not in avoid)
  tok = _word_tokenizer(cfg.vocab_size, eos_id, eot_id)
  out = export_hf(model, cfg, tmp_path_factory.mktemp("export"), tokenizer=tok)
  return dict(model=model, cfg=cfg, tok=tok, g=g, k=k, eos_id=eos_id, eot_id=eot_id, out=out)


def test_generation_config_lists_every_stop_id(setup):
  tok = setup["tok"]
  assert tok.stop_ids == (setup["eos_id"], setup["eot_id"])
  for name in ("generation_config.json", "config.json"):
    with open(os.path.join(setup["out"], name)) as f:
      gen = json.load(f)
    assert gen["eos_token_id"] == [setup["eos_id"], setup["eot_id"]], name
    assert gen["bos_token_id"] == 1
    assert gen["pad_token_id"] == setup["eos_id"]  # no pad token: falls back to EOS
  loaded = transformers.GenerationConfig.from_pretrained(setup["out"])
  assert list(loaded.eos_token_id) == [setup["eos_id"], setup["eot_id"]]


def test_transformers_greedy_matches_ours_and_stops_at_end_of_turn(setup):
  ours = ar.generate(Engine(setup["model"], num_pages=8, page_size=8), [PROMPT],
                     max_new_tokens=N_NEW, stop_ids=setup["tok"].stop_ids)[0]
  k = setup["k"]
  assert ours.finish_reason == "stop"
  assert ours.token_ids == setup["g"][:k]  # ours drops the stop token

  hf = transformers.AutoModelForCausalLM.from_pretrained(setup["out"], torch_dtype=torch.float32).eval()
  with torch.no_grad():
    seq = hf.generate(torch.tensor([PROMPT]), max_new_tokens=N_NEW, do_sample=False,
                      attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
  new = seq[0, len(PROMPT):].tolist()
  # transformers stops at the end-of-turn id (k < N_NEW tokens) and keeps it as the last token
  assert new == setup["g"][:k] + [setup["eot_id"]]
  assert len(new) < N_NEW


def test_special_ids_for_hf_reads_both_namings():
  class HFStyle:
    bos_token_id, eos_token_id = 1, 2

  assert special_ids_for_hf(HFStyle()) == {"bos_token_id": 1, "eos_token_id": 2}
  assert special_ids_for_hf(None) == {}
  tok = _word_tokenizer(16, eos_id=2, eot_id=7)
  assert special_ids_for_hf(tok) == {"bos_token_id": 1, "pad_token_id": 2, "eos_token_id": [2, 7]}
