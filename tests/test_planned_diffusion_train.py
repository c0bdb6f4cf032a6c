"""Planned Diffusion trainer (issue 21) on the tiny random SmolLM2: the row classes of an
annotated cities row, the cities records (padding, ablations), the joint loss falling, and the
end-to-end run (Orbax resume, metrics, adapter export) whose adapter decodes through the API."""

import json
import os

import numpy as np
import pytest

from selforch_jax import config_lib
from selforch_jax.api import load_config_file
from selforch_jax.data.planned_diffusion_data import cities_records
from selforch_jax.lang.tags import ASYNC_CLOSE, PAD, SYNC, TagVocab
from selforch_jax.lang.planned_diffusion import dense_round_mask
from selforch_jax.trainers.planned_diffusion import EVAL_NOISE, pd_row_masks

TV = TagVocab.appended(100, 0, digit_ids=range(48, 58))


def test_row_classes_and_dense_rounds():
  o, c, s, m, pad = TV.async_open, TV.async_close, TV.sync, TV.mask, TV.pad
  P, Q = TV.promise_open, TV.promise_close
  #        prompt   plan            chunk 0        chunk 1      sync  text
  toks = [[5, 6, P, 7, 49, Q, o, 8, 9, pad, c, o, 10, c, s, 11, 12]]
  tgts = [toks[0][1:] + [0]]
  lm = [[0, 1] + [1] * 15]
  lm[0][10] = lm[0][13] = 0                  # annotated rows: no target after </async>
  r = pd_row_masks(np.array(toks), np.array(tgts), np.array(lm), TV)
  chunk = [0] * 7 + [1, 1, 1, 0, 0, 1, 0, 0, 0, 0]
  assert r["chunk_input"][0].astype(int).tolist() == chunk
  ar = [0, 1, 1, 1, 1, 1] + [0] * 8 + [1, 1, 1]
  assert r["ar_mask"][0].astype(int).tolist() == ar
  mask = np.tril(np.ones((1, 17, 17), bool))
  dense = dense_round_mask(np.array(toks), mask, TV)[0]
  assert dense[7, 12] and dense[12, 7] and dense[6, 13] and not dense[5, 7] and not dense[15, 16]


def test_cities_records():
  count = lambda text: len(text.split())   # noqa: E731
  rows = cities_records(20, 3, count)
  for r in rows:
    text = r["messages"][1]["content"]
    assert text.endswith(SYNC) and r["annotated"]
    k = len(r["cities"])
    assert text.count(ASYNC_CLOSE) == k
    pads = [seg.count(PAD) for seg in text.split(ASYNC_CLOSE)[:-1]]
    assert all(0 <= p <= 10 for p in pads)
  assert len({tuple(seg.count(PAD) for seg in r["messages"][1]["content"].split(ASYNC_CLOSE))
              for r in rows}) > 1
  nt = cities_records(20, 3, count, no_topic=True, no_sync=True)
  assert "<promise> topic 1 " in nt[0]["messages"][1]["content"]
  assert all(SYNC not in r["messages"][1]["content"] for r in nt)
  assert rows[0]["messages"][0] == nt[0]["messages"][0]


def test_run_loss_falls_resume_and_adapter(tmp_path):
  from selforch_jax import api
  from selforch_jax.adapter import load_adapter
  from selforch_jax.trainers.run import train
  arg = "model=tiny_smollm2,steps=6,seq_len=384,batch_size=2,n=24,lr=3e-3"
  c = load_config_file("configs/planned_diffusion.py", arg)
  c.train.async_checkpoint = False
  c.train.checkpoint_every = 3
  c.train.eval_every = 6
  c.data.eval_fraction = 0.25
  out = train(c, str(tmp_path / "run"), stop_at=3)
  assert out["step"] == 3
  out = train(c, str(tmp_path / "run"))           # resumes at 3, writes the adapter
  assert out["step"] == 6 and os.path.isdir(out["adapter"])
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    rows = [json.loads(x) for x in f]
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, 7))
  ev = [r for r in rows if "eval_loss" in r]
  assert ev[-1]["eval_loss"] < ev[0]["eval_loss"]            # step 0 vs step 6, same eval rows
  assert ev[-1]["eval_diff_ce"] < ev[0]["eval_diff_ce"] and ev[-1]["eval_ar_ce"] > 0
  model, tok = load_adapter(out["adapter"])
  p = tok.encode_chat([{"role": "user", "content": "Describe each city. Velora: country "
                        "Marand, river Tesk, founded 1412, population 38200."}],
                      add_generation_prompt=True)
  a, = api.decode_ids(model, tok, [p], runtime="planned_diffusion", max_new_tokens=16,
                      tag_vocab=TagVocab.from_tokenizer(tok))
  assert a.forwards >= 1 and "critical_path" in a.figures
  with pytest.raises(config_lib.ConfigError, match="strip_tags"):
    c2 = load_config_file("configs/planned_diffusion.py", arg)
    c2.data.strip_tags = True
    train(c2, str(tmp_path / "bad"))
  # init_adapter: a run starts from the adapter's LoRA + tag rows (its one step is at warm-up
  # lr 0, so it exports them back)
  from safetensors.numpy import load_file
  c3 = load_config_file("configs/planned_diffusion.py", arg.replace("steps=6", "steps=1")
                        + f",init_adapter={out['adapter']}")
  c3.train.async_checkpoint, c3.train.eval_every = False, 0
  out3 = train(c3, str(tmp_path / "cont"))
  want = load_file(os.path.join(out["adapter"], "adapter.safetensors"))
  got = load_file(os.path.join(out3["adapter"], "adapter.safetensors"))
  assert sorted(got) == sorted(want)
  with open(os.path.join(out3["adapter"], "adapter_config.json")) as f:
    card = json.load(f)["training"]
  assert card["planned_diffusion"]["init_adapter"] == out["adapter"]
  for k in want:
    np.testing.assert_allclose(got[k], want[k], atol=1e-6, err_msg=k)
  with pytest.raises(ValueError, match="lora_rank"):
    c4 = load_config_file("configs/planned_diffusion.py", arg.replace("steps=6", "steps=1")
                          + f",lora_rank=4,init_adapter={out['adapter']}")
    train(c4, str(tmp_path / "rank4"))


def test_eval_noise_is_fixed_across_steps(tmp_path):
  """Eval losses at different steps see the same noisy inputs (batch j's noise is (seed, eval
  stream, j), not the step's): same params -> same eval loss at step 0 and step 7; training
  steps still draw per step."""
  import itertools

  from selforch_jax.trainers.planned_diffusion_run import build_pd
  c = load_config_file("configs/planned_diffusion.py",
                       "model=tiny_smollm2,steps=8,seq_len=384,batch_size=2,n=16")
  c.data.eval_fraction = 0.25
  trainer, _, _, eval_ds, ckpt = build_pd(c, str(tmp_path / "run"))
  ckpt.close()
  batches = list(itertools.islice(iter(eval_ds), 2))
  at0 = trainer.eval_loss(batches)
  trainer.step = 7
  at7 = trainer.eval_loss(batches)
  assert at0 == at7 and at0["eval_diff_ce"] > 0
  assert not np.array_equal(trainer.noise_key(0, 2), trainer.noise_key(7, 2))
  # suffix_p: evaluation keeps the i.i.d. figures (same params, same batches -> the same values)
  # and adds the CE of suffix-masked chunks, another number
  cs = load_config_file("configs/planned_diffusion.py",
                        "model=tiny_smollm2,steps=8,seq_len=384,batch_size=2,n=16,suffix_p=0.5")
  cs.data.eval_fraction = 0.25
  assert cs.planned_diffusion.suffix_p == 0.5
  trainer_s, _, _, _, ckpt_s = build_pd(cs, str(tmp_path / "run_s"))
  ckpt_s.close()
  got = trainer_s.eval_loss(batches)
  assert {k: got[k] for k in at0} == pytest.approx(at0, rel=1e-6)
  sums = [0.0, 0.0]     # the suffix CE by hand: every row suffix-masked (suffix_p=1)
  for j, b in enumerate(batches):
    b = dict(b, noise_key=trainer_s.noise_key(j, 2, EVAL_NOISE))
    m = trainer_s.terms(trainer_s.params, trainer_s.frozen, trainer_s.put_batch(b), 1.0)
    sums[0] += float(m["diff_sum"])
    sums[1] += float(m["diff_n"])
  assert got["eval_suffix_diff_ce"] == pytest.approx(sums[0] / sums[1], rel=1e-5)
  assert got["eval_suffix_diff_ce"] != pytest.approx(at0["eval_diff_ce"], rel=1e-3)
  # a training step's terms use the trainer's suffix_p (0.5), not the i.i.d. rule
  b = trainer_s.put_batch(dict(batches[0], noise_key=trainer_s.noise_key(3, 2)))
  train_terms = trainer_s.terms(trainer_s.params, trainer_s.frozen, b)
  for sp in (0.5, 0.0):
    m = trainer_s.terms(trainer_s.params, trainer_s.frozen, b, sp)
    same = float(m["diff_n"]) == float(train_terms["diff_n"])
    assert same == (sp == 0.5)
  from selforch_jax.trainers.run import validate
  cs.planned_diffusion.suffix_p = 1.5
  with pytest.raises(config_lib.ConfigError, match="suffix_p=1.5 must be in"):
    validate(cs)
  with pytest.raises(config_lib.ConfigError, match="suffix_p > 0 needs the diffusion loss"):
    validate(load_config_file("configs/planned_diffusion.py",
                              "ar_only,model=tiny_smollm2,suffix_p=0.5"))


def test_full_fine_tune(tmp_path):
  """lora_rank=0 is a full fine-tune: the joint loss falls, no adapter is exported (the Orbax
  checkpoint holds the weights); a negative rank is a config error."""
  from selforch_jax.trainers.run import train
  c = load_config_file("configs/planned_diffusion.py",
                       "model=tiny_smollm2,steps=4,seq_len=384,batch_size=2,n=24,lr=3e-3,"
                       "lora_rank=0")
  assert c.model.lora_rank == 0
  c.train.async_checkpoint, c.train.eval_every, c.data.eval_fraction = False, 4, 0.25
  out = train(c, str(tmp_path / "full"))
  assert out["step"] == 4 and "adapter" not in out and os.path.isdir(out["checkpoint"])
  with open(tmp_path / "full" / "metrics.jsonl") as f:
    ev = [r for r in map(json.loads, f) if "eval_loss" in r]
  assert ev[-1]["eval_loss"] < ev[0]["eval_loss"]
  from selforch_jax.api import ApiError
  with pytest.raises(ApiError, match="lora_rank >= 0"):
    load_config_file("configs/planned_diffusion.py", "lora_rank=-1")
