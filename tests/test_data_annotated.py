"""Annotated SFT rows (selforch_jax.data.annotated): the shift, the loss rule after ``</async>``,
positions and mask drawn from DESIGN.md §3, the grain pipeline and a short training run.

Toy vocabulary as in tests/test_lang_mask.py: text ids < 100 (digits "0".."9" = ids 10..19,
space = 1, EOS = 2), tags at 100: <promise> 100, </promise> 101, <async> 102, </async> 103,
<sync/> 104, <|mask|> 105, [PAD] 106, <reg_0..3> 107..110.
"""

import json

import numpy as np
import pytest

from selforch_jax.data.annotated import annotated_example
from selforch_jax.lang import TagVocab
from tests.repo_files import load_config

TV = TagVocab.appended(100, 4, digit_ids=range(10, 20), space_ids=[1], eos_ids=[2])
P, CP, A, CA, S = 100, 101, 102, 103, 104
R0, R1 = 107, 108
x, y, t, a, b, c, d, e = 50, 51, 60, 70, 71, 72, 73, 74
EOS = 2

# idx:   0  1  2  3  4  5       6   7  8  9       10  11 12 13  14 15 16  17 18 19
PASTA = [x, y, t, P, a, 10 + 2, CP, P, b, 10 + 1, CP, A, c, CA, A, d, CA, S, e, EOS]
PASTA_AM = [0, 0] + [1] * 18  # prompt x y; the rest is the assistant's


def test_pasta_row_shift_positions_mask_and_loss_rule():
  row = annotated_example(PASTA, PASTA_AM, TV, seq_len=24, pad_id=0)
  n = len(PASTA) - 1
  np.testing.assert_array_equal(row["tokens"][:n], PASTA[:-1])
  np.testing.assert_array_equal(row["targets"][:n], PASTA[1:])
  # positions (DESIGN.md §3): PLAN 0..10, base = 11; chunk 1 (N=2) from 11, chunk 2 (N=1) from
  # 11 + 20 = 31, <sync/> at 11 + 20 + 10 = 41, then 42 (the EOS is only a target)
  np.testing.assert_array_equal(row["positions"][:n],
                                list(range(11)) + [11, 12, 13, 31, 32, 33, 41, 42])
  # trained targets: every assistant target except the one after each </async> (runtime-written)
  want_loss = np.array(PASTA_AM[1:]) * (np.array(PASTA[:-1]) != CA)
  np.testing.assert_array_equal(row["loss_mask"][:n], want_loss)
  assert row["loss_mask"][12] == 1 and row["loss_mask"][13] == 0 and row["loss_mask"][16] == 0
  m = row["mask"]
  # chunk 1 (rows 11-13) sees prefix + PLAN up to the end of promise 1 (0..6) and itself
  np.testing.assert_array_equal(np.flatnonzero(m[12]), list(range(7)) + [11, 12])
  # chunk 2 (rows 14-16) sees the whole PLAN (0..10), not chunk 1
  np.testing.assert_array_equal(np.flatnonzero(m[15]), list(range(11)) + [14, 15])
  # the PLAN does not see ahead; <sync/> and after see everything before them
  np.testing.assert_array_equal(np.flatnonzero(m[10]), range(11))
  np.testing.assert_array_equal(np.flatnonzero(m[17]), range(18))
  np.testing.assert_array_equal(np.flatnonzero(m[18]), range(19))
  # padding rows see only themselves (no NaN softmax) and are not trained
  assert m[n:].sum() == 24 - n and all(m[i, i] for i in range(n, 24))
  assert not m[:n, n:].any() and row["loss_mask"][n:].sum() == 0


def test_tip_row_evicted_step_is_invisible_after_reuse():
  # <reg_0> x y <reg_1> a <reg_0> b c EOS: the second <reg_0> (idx 5) kills the step 0..2
  seq = [R0, x, y, R1, a, R0, b, c, EOS]
  row = annotated_example(seq, [1] * len(seq), TV, seq_len=8)
  m = row["mask"]
  np.testing.assert_array_equal(np.flatnonzero(m[4]), range(5))     # before the reuse: all
  np.testing.assert_array_equal(np.flatnonzero(m[5]), [3, 4, 5])    # the killing tag: step 0 gone
  np.testing.assert_array_equal(np.flatnonzero(m[7]), [3, 4, 5, 6, 7])
  np.testing.assert_array_equal(row["positions"], range(8))         # registers keep positions
  assert row["loss_mask"].sum() == 8


def test_cut_and_nothing_to_learn():
  assert annotated_example(PASTA, [0] * len(PASTA), TV, seq_len=24) is None
  row = annotated_example(PASTA, PASTA_AM, TV, seq_len=8)             # cut to 9 tokens
  np.testing.assert_array_equal(row["tokens"], PASTA[:8])
  np.testing.assert_array_equal(row["targets"], PASTA[1:9])
  with pytest.raises(ValueError, match="differ in length"):
    annotated_example(PASTA, PASTA_AM[:-1], TV, seq_len=8)
  with pytest.raises(ValueError, match="seq_len"):
    annotated_example(PASTA, PASTA_AM, TV, seq_len=0)


# --- with the real SmolLM2 tokenizer -------------------------------------------------------------

ANNOTATED = ("Two tips.<promise> sleep 1</promise><promise> food 1</promise><async> Sleep eight "
             "hours.</async><async> Eat greens.</async><sync/> Done.")
PLAIN = "Two tips. Sleep eight hours. Eat greens. Done."


@pytest.fixture(scope="module")
def tok_tv():
  from selforch_jax import tokenizers
  from selforch_jax.checkpoints import assets
  from selforch_jax.lang import add_tags

  tok = tokenizers.Tokenizer.from_gguf(assets.smollm2_gguf_path())
  return tok, add_tags(tok, None, 4)


def write_chat(path, n):
  with open(path, "w") as f:
    for i in range(n):
      f.write(json.dumps({"messages": [{"role": "user", "content": f"Give me tips {i}."},
                                       {"role": "assistant", "content": ANNOTATED}]}) + "\n")
  return str(path)


def test_pipeline_annotated_and_strip_tags(tmp_path, tok_tv):
  from selforch_jax.data.pipeline import DataConfig, make_dataset

  tok, tv = tok_tv
  path = write_chat(tmp_path / "chat.jsonl", 4)
  cfg = dict(name="chat", path=path, seq_len=96, batch_size=2, packing=False, annotated=True,
             shuffle=False, num_threads=1)
  batch = next(iter(make_dataset(cfg, tok, "train")))
  assert set(batch) == {"tokens", "targets", "loss_mask", "positions", "mask", "valid"}
  assert batch["mask"].shape == (2, 96, 96) and batch["mask"].dtype == bool
  ids = batch["tokens"][0]
  i_sync = int(np.flatnonzero(ids == tv.sync)[0])
  opens = np.flatnonzero(ids == tv.async_open)
  closes = np.flatnonzero(ids == tv.async_close)
  # the second chunk does not see the first; <sync/> sees both
  assert not batch["mask"][0, opens[1] + 1, opens[0]:closes[0] + 1].any()
  assert batch["mask"][0, i_sync, opens[0]:closes[1] + 1].all()
  assert batch["loss_mask"][0, closes].tolist() == [0, 0]
  plain = next(iter(make_dataset(dict(cfg, strip_tags=True), tok, "train")))
  n = int(plain["loss_mask"][0].nonzero()[0].max()) + 1
  assert not np.isin(plain["tokens"][0, :n], list(tv.tag_ids)).any()
  np.testing.assert_array_equal(plain["mask"][0, :n, :n], np.tril(np.ones((n, n), bool)))
  text = tok.decode(plain["tokens"][0, :n].tolist())
  assert "Sleep eight hours." in text and "Eat greens." in text and "sleep 1" not in text
  with pytest.raises(ValueError, match="packing=False"):
    DataConfig.from_any(dict(cfg, packing=True))
  with pytest.raises(ValueError, match="annotated=True"):
    DataConfig.from_any(dict(cfg, annotated=False, strip_tags=True))


def test_train_on_annotated_rows(tmp_path):
  from selforch_jax.config_lib import ConfigError
  from selforch_jax.trainers.run import train, validate

  c = load_config("configs/sft.py", "model=tiny_smollm2,lora_rank=0,steps=4,seq_len=96,batch_size=2")
  c.data.name, c.data.path = "chat", write_chat(tmp_path / "chat.jsonl", 8)
  c.data.eval_fraction, c.data.num_threads, c.data.packing = 0.0, 1, False
  c.data.annotated = True
  c.train.eval_every, c.train.checkpoint_every, c.train.async_checkpoint = 0, 4, False
  c.optim.lr, c.optim.warmup_steps = 3e-3, 1
  with pytest.raises(ConfigError, match="model.tags"):
    validate(c)
  c.model.tags, c.model.num_registers = True, 4
  c.data.annotator = "no_such_annotator"
  with pytest.raises(ConfigError, match="no_such_annotator"):
    validate(c)
  c.data.annotator = None
  out = train(c, str(tmp_path / "run"))
  rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 4 and all(np.isfinite(losses))
  assert losses[-1] < losses[0]  # the same 8 examples over and over: the loss must fall
  assert out is not None


def test_new_rows_lr_mult_scales_only_the_new_rows_update():
  """Adam's first update is ~lr * sign(g) per coordinate: with new_rows_lr_mult=10 the new rows
  move 10x as far as with 1, the old rows not at all."""
  import ml_collections
  from flax import nnx

  from selforch_jax import sharding as shd
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import add_lora, init_model
  from selforch_jax.trainers.optim import optim_defaults
  from selforch_jax.trainers.sft import SFTTrainer

  oc = optim_defaults()
  oc.lr, oc.warmup_steps, oc.schedule, oc.weight_decay, oc.clip_norm = 1e-3, 0, "constant", 0.0, 0.0
  rng = np.random.default_rng(0)
  T = 16
  batch = {"tokens": rng.integers(0, 300, (2, T)).astype(np.int32),
           "targets": rng.integers(250, 300, (2, T)).astype(np.int32),   # favour the "new" rows
           "loss_mask": np.ones((2, T), np.int32), "positions": np.tile(np.arange(T), (2, 1)),
           "segment_ids": np.ones((2, T), np.int32)}
  moved = {}
  for mult in (1.0, 10.0):
    model = add_lora(init_model(get_preset("tiny_llama", vocab_size=300), seed=0), 2, 4.0,
                     "q_proj,v_proj", seed=0)
    before = np.asarray(model.embed[...]).copy()
    tr = SFTTrainer(model, shd.make_mesh(), oc, 1, lora=True, train_embed_rows_from=250,
                    new_rows_lr_mult=mult)
    tr.train_step(batch)
    after = np.asarray(tr.model().embed[...])
    np.testing.assert_array_equal(after[:250], before[:250])
    moved[mult] = np.abs(after[250:] - before[250:]).mean()
  assert moved[1.0] > 0
  np.testing.assert_allclose(moved[10.0] / moved[1.0], 10.0, rtol=1e-3)
  with pytest.raises(ValueError, match="new_rows_lr_mult"):
    SFTTrainer(init_model(get_preset("tiny_llama"), seed=0), shd.make_mesh(), oc, 1,
               new_rows_lr_mult=0.0)
