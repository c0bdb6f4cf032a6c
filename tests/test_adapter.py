"""Adapter files (selforch_jax/adapter.py): export of a LoRA run, reload equal to the run."""

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax import config_lib
from selforch_jax.adapter import export_adapter, load_adapter
from selforch_jax.eval.run import load_finetuned
from selforch_jax.models.transformer import causal_mask, positions_from_valid
from selforch_jax.trainers.run import train
from tests.test_train import ROOT, tiny_config

TEXT = "Natalia sold clips<promise> to 48 of her<sync/> friends in April."


def _logits(model, ids):
  toks = jnp.asarray([ids])
  valid = jnp.ones_like(toks, bool)
  return np.asarray(model(toks, positions_from_valid(valid), causal_mask(valid))[0])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 2-step LoRA run of the tiny SmolLM2 with the tags' rows (49152..49166) trained."""
  c = tiny_config(steps=2, train__train_embed_rows_from=49152, train__checkpoint_every=2)
  c.model.lora_rank, c.model.lora_alpha, c.model.tags = 4, 8.0, True
  c.optim.lr = 1e-2  # big steps, so the tuned logits clearly differ from the base's
  wd = str(tmp_path_factory.mktemp("adapter") / "lora")
  train(c, wd)
  return c, wd


@pytest.fixture(scope="module")
def adapter(run, tmp_path_factory):
  return export_adapter(run[1], str(tmp_path_factory.mktemp("adapter") / "out"))


def test_adapter_equals_the_run_and_is_small(run, adapter):
  c, wd = run
  meta = json.load(open(os.path.join(adapter, "adapter_config.json")))
  assert meta["rows_from"] == 49152 and meta["vocab_size"] == 49167
  assert meta["model"]["tags"] and meta["model"]["lora_rank"] == 4
  assert meta["added_tokens"][0] == ["<promise>", 49152] and len(meta["added_tokens"]) == 15
  assert meta["source"]["step"] == 2 and meta["training"]["train"]["steps"] == 2
  assert meta["tensors"]["embed_rows"] == [15, 64]
  assert meta["tensors"]["layers.q_proj_lora_a"] == [2, 64, 4]
  assert meta["metrics"]["train"]["step"] == 2

  model, tok = load_adapter(adapter)
  ref_model, ref_tok = load_finetuned(wd)
  ids = tok.encode(TEXT)
  assert ids == ref_tok.encode(TEXT) and 49152 in ids and 49156 in ids
  got, ref = _logits(model, ids), _logits(ref_model, ids)
  np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
  base = _logits(config_lib.load_model(c.model)[1], ids)  # same seed: the untrained model
  assert np.abs(got - base).max() > 1e-2
  a2, _ = load_finetuned(adapter)  # the eval loaders take adapter dirs
  np.testing.assert_array_equal(_logits(a2, ids), got)

  ckpt = sum(os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(os.path.join(wd, "checkpoints")) for f in fs)
  size = os.path.getsize(os.path.join(adapter, "adapter.safetensors"))
  assert size < ckpt / 20, (size, ckpt)


def test_errors(run, adapter, tmp_path):
  from safetensors.numpy import load_file, save_file
  c = tiny_config(steps=1)  # lora_rank=0
  wd = str(tmp_path / "full")
  train(c, wd)
  with pytest.raises(ValueError, match="not a LoRA run"):
    export_adapter(wd, str(tmp_path / "x"))

  bad = shutil.copytree(adapter, str(tmp_path / "shape"))
  t = load_file(os.path.join(bad, "adapter.safetensors"))
  t["layers.v_proj_lora_b"] = t["layers.v_proj_lora_b"][:, :2]
  save_file(t, os.path.join(bad, "adapter.safetensors"))
  with pytest.raises(ValueError, match="'layers.v_proj_lora_b' has shape"):
    load_adapter(bad)

  extra = shutil.copytree(adapter, str(tmp_path / "extra"))
  t = load_file(os.path.join(extra, "adapter.safetensors"))
  t["head_rows"] = np.zeros((15, 64), np.float32)  # the tiny model's head is tied
  save_file(t, os.path.join(extra, "adapter.safetensors"))
  with pytest.raises(ValueError, match="unexpected adapter tensor 'head_rows'"):
    load_adapter(extra)
  del t["head_rows"], t["layers.up_proj_lora_a"]
  save_file(t, os.path.join(extra, "adapter.safetensors"))
  with pytest.raises(ValueError, match="'layers.up_proj_lora_a' .* is missing"):
    load_adapter(extra)

  missing = shutil.copytree(adapter, str(tmp_path / "missing"))
  os.remove(os.path.join(missing, "adapter.safetensors"))
  with pytest.raises(FileNotFoundError, match="adapter.safetensors"):
    load_adapter(missing)

  ids = shutil.copytree(adapter, str(tmp_path / "ids"))
  p = os.path.join(ids, "adapter_config.json")
  meta = json.load(open(p))
  meta["added_tokens"][1][1] = 49150  # recorded as if </promise> had another id
  json.dump(meta, open(p, "w"))
  with pytest.raises(ValueError, match="'</promise>' has id 49153 .*, 49150 in the adapter"):
    load_adapter(ids)


def test_round_step_counts_optimizer_steps_per_round(run, monkeypatch, tmp_path):
  """``export --round=R`` of a BoNBoN run with 4 updates per round restores step 4R; an SFT run
  has no rounds; a step that was not kept is named with the steps that were."""
  import selforch_jax.trainers.checkpoint as checkpoint
  from selforch_jax.trainers.restore import restore_run, round_step

  class FakeCheckpointer:
    def __init__(self, workdir, async_save=True):
      pass

    def all_steps(self):
      return [8, 12, 16]

    def restore_config(self, step=None):
      return {"trainer": "bonbon", "bonbon": {"updates_per_round": 4}}

    def close(self):
      pass

  with pytest.raises(ValueError, match="is an SFT run"):
    round_step(run[1], 1)
  with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 1 .*kept: \[2\]"):
    restore_run(run[1], 1)
  (tmp_path / "checkpoints").mkdir()
  monkeypatch.setattr(checkpoint, "Checkpointer", FakeCheckpointer)
  assert round_step(str(tmp_path), 3) == 12
  with pytest.raises(FileNotFoundError, match=r"round 1 \(step 4\); rounds kept: \[2, 3, 4\]"):
    round_step(str(tmp_path), 1)
  with pytest.raises(ValueError, match="round 0 must be >= 1"):
    round_step(str(tmp_path), 0)


def test_tag_rows_travel_when_the_run_did_not_train_them(run, monkeypatch, tmp_path):
  """A policy-optimization run (train_embed_rows_from = -1) inherits its SFT run's trained tag
  rows: the adapter still carries them, and the reload equals the run."""
  import selforch_jax.trainers.restore as restore
  from selforch_jax.trainers.restore import restore_run
  from selforch_jax.trainers.bonbon_config import bonbon_defaults
  config, m, tok, step = restore_run(run[1])
  config.train.train_embed_rows_from = -1
  config.trainer, config.bonbon = "bonbon", bonbon_defaults()   # a PO run: 2 updates per round
  config.bonbon.quality_weight = 4.0
  monkeypatch.setattr(restore, "restore_run", lambda wd, step=None: (config, m, tok, 4))
  wd = tmp_path / "wd"
  wd.mkdir()
  (wd / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": float(s)}) + "\n"
                                            for s in (1, 2, 3)))   # one record per round
  out = export_adapter(str(wd), str(tmp_path / "po"))
  meta = json.load(open(os.path.join(out, "adapter_config.json")))
  assert meta["rows_from"] == 49152 and meta["tensors"]["embed_rows"] == [15, 64]
  assert meta["source"] == {"workdir": str(wd), "step": 4, "round": 2}
  assert meta["metrics"]["train"]["step"] == 2   # round 2's record
  assert meta["training"]["bonbon"]["quality_weight"] == 4.0 and "data" not in meta["training"]
  model, tok2 = load_adapter(out)
  ids = tok2.encode(TEXT)
  ref, _ = load_finetuned(run[1])
  np.testing.assert_allclose(_logits(model, ids), _logits(ref, ids), atol=1e-6, rtol=0)


def test_untied_head_rows_round_trip(monkeypatch, tmp_path):
  """An untied head's new columns travel as ``head_rows``; the reload equals the model."""
  import selforch_jax.trainers.restore as restore
  from selforch_jax.models.transformer import add_lora, merged_model
  from selforch_jax.trainers.run import defaults
  config = defaults()
  config.model.preset, config.model.weights = "tiny_llama", "random"
  config.model.lora_rank, config.model.lora_alpha = 2, 4.0
  config.train.train_embed_rows_from = 250
  _, m, _ = config_lib.load_model(config.model)
  m = add_lora(m, 2, 4.0, config.model.lora_targets)
  rng = np.random.default_rng(0)
  b = m.layers.o_proj_lora_b
  b[...] = jnp.asarray(rng.normal(size=b.shape), jnp.float32)
  m.embed[...] = m.embed[...].at[250:].add(1.0)
  m.lm_head[...] = m.lm_head[...].at[:, 250:].add(1.0)
  monkeypatch.setattr(restore, "restore_run", lambda wd, step=None: (config, m, None, 7))
  out = export_adapter(str(tmp_path / "wd"), str(tmp_path / "a"))
  meta = json.load(open(os.path.join(out, "adapter_config.json")))
  assert meta["tensors"]["head_rows"] == [6, 64] and meta["source"]["step"] == 7
  model, _ = load_adapter(out)
  ids = list(range(240, 256))
  np.testing.assert_allclose(_logits(model, ids), _logits(merged_model(m), ids), atol=1e-6, rtol=0)


def test_cli_writes_adapter_and_refuses_full_run_flags(run, tmp_path):
  out = str(tmp_path / "cli")
  r = subprocess.run([sys.executable, "-m", "selforch_jax.export", f"--workdir={run[1]}",
                      f"--out={out}", "--adapter"], cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  assert sorted(os.listdir(out)) == ["adapter.safetensors", "adapter_config.json"]
  r = subprocess.run([sys.executable, "-m", "selforch_jax.export", f"--workdir={run[1]}",
                      f"--out={out}", "--adapter", "--dtype=bfloat16"], cwd=ROOT,
                     capture_output=True, text=True)
  assert r.returncode == 2 and "error: --dtype does not apply" in r.stderr


def test_eval_configs_accept_adapter_dirs(adapter, tmp_path):
  from selforch_jax.eval import pasta
  c = pasta.defaults()
  c.pasta = adapter
  pasta.validate(c)
  c.pasta = str(tmp_path)
  with pytest.raises(config_lib.ConfigError, match="adapter directory"):
    pasta.validate(c)


COMMITTED = [os.path.join(ROOT, "adapters", d) for d in
             ("pasta_smollm2_135m", "pasta_baseline_smollm2_135m", "tip_smollm2_135m",
              "pd_smollm2_135m", "ar_sft_cities_smollm2_135m")]


@pytest.mark.parametrize("adapter_dir", COMMITTED, ids=os.path.basename)
def test_committed_adapters_are_under_10_mb_and_complete(adapter_dir):
  """The committed real adapters (LoRA r=8 on SmolLM2-135M + tag rows): a few MB, and the tensor
  file holds exactly the tensors (names and shapes) its config lists."""
  from safetensors.numpy import load_file
  path = os.path.join(adapter_dir, "adapter.safetensors")
  assert os.path.getsize(path) < 10_000_000
  with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
    cfg = json.load(f)
  tensors = load_file(path)
  assert {k: list(v.shape) for k, v in tensors.items()} == {k: list(v) for k, v in
                                                            cfg["tensors"].items()}
  assert cfg["model"]["lora_rank"] == 8 and cfg["rows_from"] == 49152


def test_export_model_from_an_adapter_equals_the_adapter(adapter, tmp_path):
  """``export --model=ADAPTER_DIR``: the merged HF directory gives the adapter's logits and its
  weights file is readable like the others (safetensors writes 0600)."""
  from selforch_jax.checkpoints.safetensors_io import import_hf
  from selforch_jax.adapter import export_model
  out = export_model(adapter, str(tmp_path / "hf"))
  mode = os.stat(os.path.join(out, "model.safetensors")).st_mode & 0o777
  assert mode == os.stat(os.path.join(out, "config.json")).st_mode & 0o777
  model, tok = load_adapter(adapter)
  _, hf_model = import_hf(out)
  ids = tok.encode(TEXT)
  np.testing.assert_allclose(_logits(hf_model, ids), _logits(model, ids), atol=1e-4)
  with pytest.raises(FileNotFoundError, match="not an adapter directory"):
    export_model(str(tmp_path / "nothing"), str(tmp_path / "x"))
