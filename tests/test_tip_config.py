"""configs/tip.py: every stage validates, the stages differ exactly where they should, bad
arguments fail early with a clear message, and the SFT stage's data pipeline yields TIP rows whose
mask hides killed steps."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from selforch_jax import config_lib
from selforch_jax.trainers.run import validate
from tests.repo_files import load_module

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tip():
  return load_module("configs/tip.py")


@pytest.mark.parametrize("arg", [None, "sft", "dense_sft", "sft,data=synthetic_chain",
                                 "dense_sft,data=synthetic_chain", "sft,data=synthetic_walk",
                                 "dense_sft,data=synthetic_walk", "grpo,init_from=none",
                                 "dense_grpo,init_from=none", "sft,scale=accel",
                                 "grpo,scale=accel,init_from=none", "sft,num_registers=4,steps=7"])
def test_every_stage_validates(arg):
  validate(_tip().get_config(arg), num_devices=1)


def test_stages_differ_where_they_should():
  tip = _tip()
  sft, dense = tip.get_config("sft"), tip.get_config("dense_sft")
  assert sft.trainer == dense.trainer == "sft"
  assert sft.data.annotator == "tip_gsm8k" and sft.data.annotator_args.num_registers == 8
  assert not sft.data.strip_tags
  assert dense.data.annotator is None and dense.data.strip_tags
  assert sft.data.annotated and not sft.data.packing and sft.model.tags
  assert (sft.model.lora_rank, sft.data.seq_len, sft.data.batch_size, sft.train.steps) == (8, 384, 4, 60)
  assert sft.train.train_embed_rows_from == 49152 and sft.model.weights == "smollm2_gguf"
  for k in ("seq_len", "batch_size", "name"):
    assert sft.data[k] == dense.data[k]
  assert tip.get_config(None).to_dict() == sft.to_dict()    # the default stage is sft
  chain = tip.get_config("sft,data=synthetic_chain")
  assert chain.data.name == "synthetic_chain" and chain.data.annotator is None
  walk = tip.get_config("dense_sft,data=synthetic_walk")
  assert walk.data.name == "synthetic_walk" and walk.data.annotator is None and walk.data.strip_tags
  g, dg = tip.get_config("grpo,init_from=none"), tip.get_config("dense_grpo,init_from=none")
  assert g.trainer == dg.trainer == "grpo"
  assert (g.grpo.scheduler, g.grpo.layout_mask, dg.grpo.scheduler, dg.grpo.layout_mask) == \
    ("tip", True, "ar", False)
  assert g.grpo.reward == "gsm8k" and g.grpo.format_weight > 0 and g.grpo.init_from is None
  acc = tip.get_config("sft,scale=accel")
  assert (acc.model.lora_rank, acc.data.seq_len, acc.data.batch_size) == (0, 2048, 64)
  assert acc.train.train_embed_rows_from == -1


def test_grpo_init_from_the_sft_workdir(tmp_path):
  from selforch_jax.trainers.run import validate

  tip = _tip()
  (tmp_path / "checkpoints").mkdir()
  c = tip.get_config(f"grpo,init_from={tmp_path}")
  assert c.grpo.init_from == str(tmp_path)
  validate(c)
  # checked after command-line overrides (validate), not when the config file is read
  c = tip.get_config(f"grpo,init_from={tmp_path}")
  c.grpo.init_from = str(tmp_path / "missing")
  with pytest.raises(config_lib.ConfigError, match="run the SFT stage first"):
    validate(c)


@pytest.mark.parametrize("arg,msg", [("bogus", "unknown stage 'bogus'"),
                                     ("sft,foo=1", "unknown config argument 'foo'"),
                                     ("sft,data=mmlu", "data='mmlu'"),
                                     ("sft,scale=tpu", "scale='tpu'"),
                                     ("sft,num_registers=0", "num_registers=0")])
def test_bad_arguments(arg, msg):
  with pytest.raises(config_lib.ConfigError, match=msg):
    _tip().get_config(arg)


def test_train_entry_point_fails_early_on_bad_override():
  for flags, msg in ((["--config=configs/tip.py:bogus"], "unknown stage"),
                     (["--config=configs/tip.py", "--config.data.nonsense=1"], "nonsense")):
    r = subprocess.run([sys.executable, "-m", "selforch_jax.train", *flags, "--workdir=/tmp/x"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "config error" in r.stderr and msg in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_sft_stage_rows_hide_killed_steps():
  """The SFT stage's pipeline (tip_gsm8k annotator + mask builder) on real GSM8K rows: register
  tags are in the tokens, and some later query does not see an earlier solution token (a killed
  step), while the dense stage's rows are plain causal over the same words."""
  from selforch_jax.data.pipeline import make_dataset
  from selforch_jax.lang.tags import add_tags
  tip = _tip()
  tok = config_lib.load_tokenizer("smollm2_gguf")
  tv = add_tags(tok, None, 8)
  c = tip.get_config("sft")
  c.data.max_examples = 8
  c.data.eval_fraction = 0.0
  b = next(iter(make_dataset(c.data, tok, "train", 0)))
  assert b["mask"].shape == (4, 384, 384) and b["tokens"].shape == (4, 384)
  assert np.isin(b["tokens"], tv.registers).any()
  causal = np.tril(np.ones((384, 384), bool))
  assert not (b["mask"] & ~causal).any()                 # never sees the future
  valid = b["positions"] > 0
  hidden = [(causal & ~m)[np.ix_(v, v)].sum() for m, v in zip(b["mask"], valid)]
  assert all(h > 0 for h in hidden)                      # every row evicts something
  d = tip.get_config("dense_sft")
  d.data.max_examples = 8
  d.data.eval_fraction = 0.0
  db = next(iter(make_dataset(d.data, tok, "train", 0)))
  assert not np.isin(db["tokens"], tv.registers).any()
  for m, v in zip(db["mask"], db["positions"] > 0):
    assert (m[np.ix_(v, v)] == causal[np.ix_(v, v)]).all()
