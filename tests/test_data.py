"""Tests of selforch_jax.data: loss masks, packing, segment masks, pipeline determinism/resume."""

from __future__ import annotations

import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from selforch_jax.data import masks, packing, pipeline, sources
from selforch_jax.data.tokenize import shift_for_lm, tokenize_chat
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import causal_mask, init_model

BOT, EOT = "\x01", "\x02"  # byte-level stand-ins for <|im_start|> / <|im_end|>
SYSTEM = "You are a helpful assistant."


class ByteChatTokenizer:
  """Fake tokenizer: bytes as ids (vocab 256), a ChatML-like template like SmolLM2's."""

  eos_id = 2
  pad_id = 0
  stop_ids = (2,)

  def encode(self, text):
    return list(text.encode("utf-8"))

  def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
    out = ""
    for i, m in enumerate(messages):
      if i == 0 and m["role"] != "system":
        out += f"{BOT}system\n{SYSTEM}{EOT}\n"
      out += f"{BOT}{m['role']}\n{m['content']}{EOT}\n"
    if add_generation_prompt:
      out += f"{BOT}assistant\n"
    return self.encode(out) if tokenize else out

  def encode_chat(self, messages, add_generation_prompt=True):
    return self.encode(self.apply_chat_template(messages, add_generation_prompt))


class BosByteChatTokenizer(ByteChatTokenizer):
  """Like ByteChatTokenizer, but encode_chat prepends a BOS id 3 that encode() does not add."""

  def encode_chat(self, messages, add_generation_prompt=True):
    return [3] + super().encode_chat(messages, add_generation_prompt)


TOK = ByteChatTokenizer()


# --- tokenize -----------------------------------------------------------------------------
def test_loss_mask_on_assistant_tokens_hand_checked():
  msgs = [
      {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "yo"},
      {"role": "user", "content": "ok?"},
      {"role": "assistant", "content": "ok"},
  ]
  # The rendered conversation, piece by piece, with the expected mask of each piece.
  pieces = [
      (f"{BOT}system\n{SYSTEM}{EOT}\n", 0),
      (f"{BOT}user\nhi{EOT}\n", 0),
      (f"{BOT}assistant\n", 0),  # header: not trained
      (f"yo{EOT}", 1),           # content + end-of-turn token: trained
      ("\n", 0),                 # template text after end-of-turn: not trained
      (f"{BOT}user\nok?{EOT}\n", 0),
      (f"{BOT}assistant\n", 0),
      (f"ok{EOT}", 1),
      ("\n", 0),
  ]
  expected_ids = [b for text, _ in pieces for b in text.encode()]
  expected_mask = [m for text, m in pieces for _ in text.encode()]
  out = tokenize_chat(msgs, TOK)
  assert out["input_ids"].dtype == np.int32 and out["loss_mask"].dtype == np.int32
  assert out["input_ids"].tolist() == expected_ids
  assert out["input_ids"].tolist() == TOK.encode_chat(msgs, add_generation_prompt=False)
  assert out["loss_mask"].tolist() == expected_mask
  assert int(out["loss_mask"].sum()) == 6
  # A tokenizer whose encode_chat prepends BOS (add_bos) gets the same mask, shifted by one.
  bos = BosByteChatTokenizer()
  out_bos = tokenize_chat(msgs, bos)
  assert out_bos["input_ids"].tolist() == [3] + expected_ids
  assert out_bos["loss_mask"].tolist() == [0] + expected_mask
  # Truncation keeps the beginning.
  cut = tokenize_chat(msgs, TOK, max_len=50)
  assert cut["input_ids"].tolist() == expected_ids[:50]
  assert cut["loss_mask"].tolist() == expected_mask[:50]
  # Shift: targets are the next tokens, the mask follows the targets.
  lm = shift_for_lm(out)
  assert lm["tokens"].tolist() == expected_ids[:-1]
  assert lm["targets"].tolist() == expected_ids[1:]
  assert lm["loss_mask"].tolist() == expected_mask[1:]


def test_tokenize_errors():
  with pytest.raises(ValueError):
    tokenize_chat([], TOK)
  with pytest.raises(ValueError):
    tokenize_chat([{"role": "user", "content": "x"}], TOK, max_len=0)


def test_real_tokenizer_loss_mask():
  """With SmolLM2's GGUF tokenizer."""
  from selforch_jax import tokenizers
  from selforch_jax.checkpoints import assets
  tok = tokenizers.Tokenizer.from_gguf(assets.smollm2_gguf_path())
  msgs = [
      {"role": "user", "content": "What is 2+3?"},
      {"role": "assistant", "content": "2+3 = 5.\n#### 5"},
      {"role": "user", "content": "And 4+4?"},
      {"role": "assistant", "content": "It is 8."},
  ]
  out = tokenize_chat(msgs, tok)
  ids, mask = out["input_ids"].tolist(), out["loss_mask"]
  assert ids == tok.encode_chat(msgs, add_generation_prompt=False)
  # Two contiguous masked spans, each = content tokens + one end-of-turn token.
  starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
  ends = np.flatnonzero(np.diff(np.concatenate([mask, [0]])) == -1)
  assert len(starts) == 2 and len(ends) == 2
  for (s, e), content in zip(zip(starts, ends), ["2+3 = 5.\n#### 5", "It is 8."]):
    assert ids[e] in tok.stop_ids
    assert ids[s:e] == tok.encode(content)
    header = tok.encode("<|im_start|>assistant\n")
    assert ids[s - len(header):s] == header


# --- masks --------------------------------------------------------------------------------
def test_segment_mask_values():
  seg = np.array([[1, 1, 2, 2, 2, 0]], np.int32)
  m = np.asarray(masks.segment_mask(seg))[0]
  expected = np.array([
      [1, 0, 0, 0, 0, 0],
      [1, 1, 0, 0, 0, 0],
      [0, 0, 1, 0, 0, 0],
      [0, 0, 1, 1, 0, 0],
      [0, 0, 1, 1, 1, 0],
      [0, 0, 0, 0, 0, 0],
  ], bool)
  np.testing.assert_array_equal(m, expected)
  one = np.array([[1, 1, 1, 0, 0]], np.int32)
  np.testing.assert_array_equal(np.asarray(masks.segment_mask(one)),
                                np.asarray(causal_mask(jnp.asarray(one > 0))))
  with pytest.raises(ValueError):
    masks.segment_mask(np.zeros((3,), np.int32))


# --- packing ------------------------------------------------------------------------------
def _short_examples(n, seed=0):
  """Real gsm8k text, cut to varied short lengths so that several fit in one row."""
  rows = sources.read_jsonl("gsm8k/test.jsonl")[:n]
  rng = np.random.default_rng(seed)
  out = []
  for r in rows:
    q = r["question"][: int(rng.integers(5, 30))]
    a = r["answer"][: int(rng.integers(3, 40))]
    msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    out.append(shift_for_lm(tokenize_chat(msgs, TOK)))
  return out


def _collect(ds):
  return [jax.tree.map(np.asarray, row) for row in ds]


def test_packing_layout_and_positions():
  exs = _short_examples(9)
  seq_len = 160
  ds = grain.MapDataset.source(exs).to_iter_dataset()
  rows = _collect(packing.pack_dataset(ds, seq_len, num_packing_bins=3, pad_id=0))
  assert len(rows) < len(exs)  # really packed
  seen = []
  for row in rows:
    for k in packing.ROW_FEATURES:
      assert row[k].shape == (seq_len,) and row[k].dtype == np.int32
    seg = row["segment_ids"]
    k = seg.max()
    assert k >= 1
    # Segments are 1..k, contiguous, in order, then padding 0.
    nz = seg[seg > 0]
    assert np.all(np.diff(nz) >= 0) and set(nz.tolist()) == set(range(1, k + 1))
    assert np.all(seg[len(nz):] == 0)
    for s in range(1, k + 1):
      idx = np.flatnonzero(seg == s)
      np.testing.assert_array_equal(row["positions"][idx], np.arange(len(idx)))  # restart at 0
      seen.append(row["tokens"][idx].tolist())
    pad = seg == 0
    assert np.all(row["loss_mask"][pad] == 0) and np.all(row["positions"][pad] == 0)
  # Every example appears exactly once, unchanged; first fit keeps input order inside a bin set.
  assert sorted(seen) == sorted(e["tokens"].tolist() for e in exs)
  np.testing.assert_array_equal(rows[0]["tokens"][rows[0]["segment_ids"] == 1], exs[0]["tokens"])


@nnx.jit
def _token_ce_jit(model, tokens, positions, targets, mask):
  logits, _ = model(tokens, positions, mask)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def _token_ce(model, batch, mask):
  """Per-token cross entropy ``[B, T]`` of ``targets`` (float32)."""
  return np.asarray(_token_ce_jit(model, jnp.asarray(batch["tokens"]),
                                  jnp.asarray(batch["positions"]),
                                  jnp.asarray(batch["targets"]), mask))


def _stack(rows):
  return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def test_packed_loss_equals_unpacked_loss():
  exs = _short_examples(10, seed=1)
  seq_len = 256
  model = init_model(get_preset("tiny_llama"))
  src = grain.MapDataset.source(exs).to_iter_dataset()
  packed = _stack(_collect(packing.pack_dataset(src, seq_len, num_packing_bins=4)))
  unpacked = _stack(_collect(packing.pad_dataset(src, seq_len)))
  assert packed["tokens"].shape[0] < unpacked["tokens"].shape[0]
  assert packed["loss_mask"].sum() == unpacked["loss_mask"].sum() > 0

  ce_p = _token_ce(model, packed, masks.segment_mask(packed["segment_ids"]))
  ce_u = _token_ce(model, unpacked, causal_mask(jnp.asarray(unpacked["segment_ids"] > 0)))
  lm_p, lm_u = packed["loss_mask"], unpacked["loss_mask"]
  mean_p = float((ce_p * lm_p).sum() / lm_p.sum())
  mean_u = float((ce_u * lm_u).sum() / lm_u.sum())
  assert abs(mean_p - mean_u) < 1e-5, (mean_p, mean_u)

  # Stronger: every packed segment's per-token CE equals its unpacked row's.
  by_tokens = {tuple(unpacked["tokens"][i][unpacked["segment_ids"][i] > 0]): ce_u[i]
               for i in range(len(exs))}
  for r in range(packed["tokens"].shape[0]):
    seg = packed["segment_ids"][r]
    for s in range(1, seg.max() + 1):
      idx = np.flatnonzero(seg == s)
      ref = by_tokens[tuple(packed["tokens"][r][idx])]
      np.testing.assert_allclose(ce_p[r][idx], ref[: len(idx)], atol=1e-5)

  # Control: a plain causal mask over the packed row lets examples see each other.
  leak = _token_ce(model, packed, causal_mask(jnp.asarray(packed["segment_ids"] > 0)))
  assert abs(float((leak * lm_p).sum() / lm_p.sum()) - mean_u) > 1e-4


# --- pipeline -----------------------------------------------------------------------------
def _cfg(**kw):
  base = dict(name="gsm8k", seq_len=1024, batch_size=2, packing=True, num_packing_bins=3,
              max_examples=48, num_epochs=None, num_threads=2, prefetch_buffer_size=8)
  base.update(kw)
  return base


def _take(it, n):
  return [next(it) for _ in range(n)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def test_pipeline_batches_schema():
  ds = pipeline.make_dataset(_cfg(), TOK, "train", seed=0)
  b = next(iter(ds))
  assert sorted(b) == sorted(packing.ROW_FEATURES)
  for k in b:
    assert b[k].shape == (2, 1024) and b[k].dtype == np.int32
  valid = b["segment_ids"] > 0
  np.testing.assert_array_equal(b["targets"][:, :-1][valid[:, 1:] & (b["segment_ids"][:, 1:] ==
                                                                  b["segment_ids"][:, :-1])],
                                b["tokens"][:, 1:][valid[:, 1:] & (b["segment_ids"][:, 1:] ==
                                                                b["segment_ids"][:, :-1])])
  assert b["loss_mask"].sum() > 0 and np.all(b["loss_mask"][~valid] == 0)
  # Unpacked mode: one example per row.
  bu = next(iter(pipeline.make_dataset(_cfg(packing=False), TOK, "train", seed=0)))
  assert set(np.unique(bu["segment_ids"]).tolist()) <= {0, 1}


def test_pipeline_shuffle_deterministic():
  a = _take(iter(pipeline.make_dataset(_cfg(), TOK, "train", seed=3)), 4)
  b = _take(iter(pipeline.make_dataset(_cfg(), TOK, "train", seed=3)), 4)
  c = _take(iter(pipeline.make_dataset(_cfg(), TOK, "train", seed=4)), 4)
  _assert_same(a, b)
  assert any(not np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))
  # Same multiset of examples per epoch; unshuffled order is the file order.
  first = _take(iter(pipeline.make_dataset(_cfg(shuffle=False, packing=False), TOK, "train")), 1)
  q0 = sources.read_jsonl("gsm8k/train.jsonl")[0]["question"]
  row = first[0]["tokens"][0][first[0]["segment_ids"][0] > 0]
  assert q0.encode() in bytes(row.astype(np.uint8).tolist())


@pytest.mark.parametrize("packing_on", [True, False])
def test_pipeline_iterator_resume(packing_on):
  cfg = _cfg(packing=packing_on)
  it = iter(pipeline.make_dataset(cfg, TOK, "train", seed=7))
  _take(it, 2)  # 4 rows; packing fills 3 rows at a time, so this stops inside a bin set
  state = it.get_state()
  if packing_on:
    assert state["next_row"] == 1
  expected = _take(it, 4)
  it2 = iter(pipeline.make_dataset(cfg, TOK, "train", seed=7))
  it2.set_state(state)
  _assert_same(_take(it2, 4), expected)
  it3 = iter(pipeline.make_dataset(cfg, TOK, "train", seed=7))
  it3.set_state(json.loads(json.dumps(state)))
  _assert_same(_take(it3, 4), expected)


def test_pipeline_orbax_checkpoint_manager(tmp_path):
  """The trainer's recipe (pipeline module docstring): iterator saved beside the train state."""
  ocp = pytest.importorskip("orbax.checkpoint")
  cfg = _cfg()
  train_state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "step": np.array(5, np.int32)}

  def manager():
    return ocp.CheckpointManager(
        tmp_path / "ckpt", item_names=("state", "data_iter"),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "data_iter": grain.checkpoint.CheckpointHandler()})

  it = iter(pipeline.make_dataset(cfg, TOK, "train", seed=11))
  _take(it, 5)
  with manager() as mngr:
    mngr.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                         data_iter=grain.checkpoint.CheckpointSave(it)))
    expected = _take(it, 3)  # training goes on while an async save may still run
    mngr.wait_until_finished()
  with manager() as mngr:
    assert mngr.latest_step() == 5
    it2 = iter(pipeline.make_dataset(cfg, TOK, "train", seed=11))
    restored = mngr.restore(5, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(train_state),
        data_iter=grain.checkpoint.CheckpointRestore(it2)))
  np.testing.assert_array_equal(restored["state"]["w"], train_state["w"])
  assert restored["data_iter"] is it2
  _assert_same(_take(it2, 3), expected)


def test_pipeline_epochs_and_heldout():
  cfg = pipeline.DataConfig(name="gsm8k", eval_fraction=0.1, eval_split_seed=0)
  train = pipeline.split_examples(cfg, "train")
  held = pipeline.split_examples(cfg, "eval")
  assert len(train) + len(held) == 7473 and len(held) == 747
  qs_t = {e["messages"][0]["content"] for e in train}
  assert not qs_t & {e["messages"][0]["content"] for e in held}
  test = pipeline.split_examples(pipeline.DataConfig(name="gsm8k"), "eval")
  assert len(test) == 1319  # no fraction: the official test file
  # Finite epochs: unpacked, batch 1, no drop: exactly num_epochs * N rows.
  ds = pipeline.make_dataset(_cfg(packing=False, batch_size=1, max_examples=5, num_epochs=2,
                                  drop_remainder=False), TOK, "train", seed=0)
  rows = [b["tokens"][0] for b in ds]
  assert len(rows) == 10
  assert sorted(r.tobytes() for r in rows[:5]) == sorted(r.tobytes() for r in rows[5:])
  with pytest.raises(ValueError):
    pipeline.DataConfig.from_any({"seq_lenn": 3})


# --- sources ------------------------------------------------------------------------------
def test_gsm8k_converter_real_rows():
  rows = sources.read_jsonl("gsm8k/train.jsonl")
  assert len(rows) == 7473
  ex = sources.gsm8k_to_messages(rows[0])
  assert ex["messages"][0] == {"role": "user", "content": rows[0]["question"]}
  assert ex["messages"][0]["content"].startswith("Natalia sold clips to 48 of her friends")
  assert ex["messages"][1]["role"] == "assistant"
  assert ex["messages"][1]["content"] == rows[0]["answer"]
  assert ex["messages"][1]["content"].endswith("#### 72")
  assert ex["answer"] == "72"
  test = sources.load_examples("gsm8k", split="test")
  assert len(test) == 1319 and all(e["messages"][1]["content"].rstrip().splitlines()[-1]
                                   .startswith("####") for e in test)
  assert sources.gsm8k_final_answer("x\n#### 1,234") == "1234"
  with pytest.raises(ValueError):
    sources.gsm8k_final_answer("no final line")


def test_alpaca_converters_real_rows():
  rows = sources.read_json("alpaca/alpaca_en_demo.json")
  assert len(rows) == 999
  ex = sources.alpaca_to_messages(rows[0])
  assert ex["messages"] == [
      {"role": "user", "content": "Describe a process of making crepes."},
      {"role": "assistant", "content": rows[0]["output"]},
  ]
  with_input = next(r for r in rows if r["input"].strip())
  ex = sources.alpaca_to_messages(with_input)
  assert ex["messages"][0]["content"] == (with_input["instruction"].strip() + "\n\n" +
                                          with_input["input"].strip())
  prompts = sources.load_examples("alpaca_eval", split="test")
  assert len(prompts) == 805
  assert prompts[0]["messages"] == [{
      "role": "user",
      "content": "What are the names of some famous actors that started their careers on Broadway?"}]
  assert prompts[0]["reference"].startswith("Several famous actors started their careers")
  assert prompts[0]["dataset"] == "helpful_base"


def test_data_dir_env_override(tmp_path, monkeypatch):
  assert (sources.data_dir() / "gsm8k" / "PROVENANCE.md").exists()
  (tmp_path / "x.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
  monkeypatch.setenv("SELFORCH_DATA_DIR", str(tmp_path))
  assert sources.data_dir() == tmp_path
  assert sources.load_examples("chat", "x.jsonl")[0]["messages"][0]["content"] == "a"
  with pytest.raises(FileNotFoundError):
    sources.load_examples("gsm8k")


def test_annotated_repeats_oversamples_train_only(tmp_path):
  rows = [{"messages": [{"role": "user", "content": f"q{i}"},
                        {"role": "assistant", "content": f"a{i}"}], "annotated": i % 3 == 0}
          for i in range(30)]
  path = tmp_path / "recs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  base = dict(name="chat", path=str(path), eval_fraction=0.2)
  train1 = pipeline.split_examples(pipeline.DataConfig(**base), "train")
  train3 = pipeline.split_examples(pipeline.DataConfig(**base, annotated_repeats=3), "train")
  n_ann = sum(bool(e["annotated"]) for e in train1)
  assert 0 < n_ann < len(train1)
  assert len(train3) == len(train1) + 2 * n_ann
  assert sum(bool(e["annotated"]) for e in train3) == 3 * n_ann
  # every annotated example appears exactly three times, every plain one once
  counts = {}
  for e in train3:
    counts[e["messages"][0]["content"]] = counts.get(e["messages"][0]["content"], 0) + 1
  assert all(counts[e["messages"][0]["content"]] == (3 if e["annotated"] else 1) for e in train1)
  # the held-out split is never repeated and is the same slice
  assert (pipeline.split_examples(pipeline.DataConfig(**base, annotated_repeats=3), "eval")
          == pipeline.split_examples(pipeline.DataConfig(**base), "eval"))
  with pytest.raises(ValueError, match="annotated_repeats"):
    pipeline.DataConfig(**base, annotated_repeats=0)
