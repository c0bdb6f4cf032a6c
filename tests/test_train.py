"""Training stack: config validation, resume, SIGTERM, NaN stop, LoRA, export, sharding."""

import glob
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from selforch_jax import config_lib
from selforch_jax.trainers.run import TrainingError, defaults, train, validate
from tests.repo_files import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(steps=6, **kw):
  c = load_config("configs/sft.py", f"model=tiny_smollm2,lora_rank=0,steps={steps},seq_len=64,batch_size=4")
  c.data.max_examples = 200
  c.data.num_threads = 1
  c.train.eval_every = 0
  c.train.checkpoint_every = 3
  c.train.async_checkpoint = False
  c.optim.lr = 1e-3
  c.optim.warmup_steps = 1
  for k, v in kw.items():
    sect, key = k.split("__")
    c[sect][key] = v
  return c


def metrics(workdir):
  rows = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  return [r for r in rows if "loss" in r]


# --- configs --------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_every_config_builds_and_validates(path):
  c = load_config(os.path.relpath(path, ROOT))
  assert isinstance(c, ml_collections.ConfigDict)
  if "train" in c:
    validate(c)
    assert c.train.steps >= 1
  elif c.get("kind") in ("pasta", "tip"):   # eval configs of a system (selforch_jax.eval.<kind>)
    importlib.import_module(f"selforch_jax.eval.{c.kind}").validate(c)
  else:
    from selforch_jax.decoding.run import validate as validate_decode
    from selforch_jax.eval.run import validate as validate_eval
    (validate_eval if "eval" in c else validate_decode)(c)


def test_bad_configs_fail_naming_the_key():
  c = tiny_config()
  with c.unlocked():
    c.optim.lrr = 1.0
  with pytest.raises(config_lib.ConfigError, match="optim.lrr"):
    validate(c)
  c = tiny_config()
  with pytest.raises(TypeError, match="lr"):  # ml_collections' own type lock on overrides
    c.optim.lr = "fast"
  d = tiny_config().to_dict()
  d["optim"]["lr"] = "fast"  # a config file that builds a section by hand
  with pytest.raises(config_lib.ConfigError, match="optim.lr"):
    validate(ml_collections.ConfigDict(d))
  with pytest.raises(config_lib.ConfigError, match="optim.lr=-1.0 is out of range"):
    validate(tiny_config(optim__lr=-1.0))
  c = tiny_config(mesh__fsdp=3)
  with pytest.raises(config_lib.ConfigError, match="mesh"):
    validate(c)
  c = tiny_config(model__preset="gpt5")
  with pytest.raises(config_lib.ConfigError, match="model.preset"):
    validate(c)
  with pytest.raises(config_lib.ConfigError, match="unknown config argument 'modle'"):
    load_config("configs/sft.py", "modle=x")


def test_cli_rejects_unknown_override_before_work(tmp_path):
  r = subprocess.run([sys.executable, "-m", "selforch_jax.train", "--config=configs/sft.py:model=tiny_smollm2",
                      "--config.optim.nope=1", f"--workdir={tmp_path}/w"],
                     cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert r.returncode != 0
  assert "config error" in r.stderr and "nope" in r.stderr and "Traceback" not in r.stderr
  assert not os.path.exists(tmp_path / "w" / "checkpoints")


# --- resume / preemption / NaN ------------------------------------------------------------
def test_resume_gives_same_losses_and_batches(tmp_path):
  straight = train(tiny_config(steps=6), str(tmp_path / "a"))
  assert straight["step"] == 6
  s1 = train(tiny_config(steps=6), str(tmp_path / "b"), stop_at=3)
  assert s1["step"] == 3
  s2 = train(tiny_config(steps=6), str(tmp_path / "b"))
  assert s2["step"] == 6
  a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
  assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
  assert [r["batch_crc32"] for r in a] == [r["batch_crc32"] for r in b]
  np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=0, atol=1e-6)
  assert a[-1]["loss"] < a[0]["loss"]  # it learns


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
  c = tiny_config(steps=12, optim__lr=1e12, optim__clip_norm=0.0, optim__warmup_steps=0,
                  train__checkpoint_every=1)
  with pytest.raises(TrainingError, match="non-finite"):
    train(c, str(tmp_path))
  rows = metrics(tmp_path)
  assert all(np.isfinite(r["loss"]) for r in rows)
  from selforch_jax.trainers.checkpoint import Checkpointer
  ck = Checkpointer(str(tmp_path), async_save=False)
  assert ck.latest_step() == len(rows) >= 1  # the last finite step, not the NaN one
  ck.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_leaves_restorable_checkpoint(tmp_path, sig):
  """SIGTERM (TPU preemption) and Ctrl-C (SIGINT) save a checkpoint and exit 0."""
  wd = tmp_path / "w"
  cmd = [sys.executable, "-m", "selforch_jax.train", "--config=configs/sft.py:model=tiny_smollm2,lora_rank=0,steps=100000,seq_len=64,batch_size=4",
         "--config.train.checkpoint_every=100000", "--config.train.eval_every=0",
         "--config.data.max_examples=200", f"--workdir={wd}"]
  p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 240
  while time.time() < deadline:
    if os.path.exists(wd / "metrics.jsonl") and len(metrics(wd)) >= 2:
      break
    time.sleep(0.5)
  p.send_signal(sig)
  out, err = p.communicate(timeout=120)
  assert p.returncode == 0, err[-2000:]
  summary = json.loads(out[out.index("{"):])
  assert summary["preempted"] is True and summary["step"] >= 2
  # resuming continues from exactly that step
  s = train(tiny_config(steps=summary["step"] + 1), str(wd))
  assert s["step"] == summary["step"] + 1
  assert [r["step"] for r in metrics(wd)][-1] == summary["step"] + 1


# --- LoRA + export -----------------------------------------------------------------------------
def test_lora_trains_only_adapters_and_new_rows_and_merged_export_matches(tmp_path):
  from flax import nnx

  from selforch_jax import sharding as shd
  from selforch_jax.checkpoints.safetensors_io import import_hf
  from selforch_jax.trainers.restore import export_run, restore_run
  from selforch_jax.models.transformer import causal_mask, positions_from_valid
  c = tiny_config(steps=4, train__train_embed_rows_from=49152)
  c.model.lora_rank = 4
  c.model.lora_alpha = 8.0
  c.model.tags = True  # the orchestration tags: 15 new rows 49152..49166, trained
  wd = str(tmp_path / "lora")
  train(c, wd)
  _, base, _ = config_lib.load_model(c.model)  # same seed -> the initial weights
  _, tuned, tok, _ = restore_run(wd)
  b = nnx.to_pure_dict(nnx.state(base, nnx.Param))
  t = nnx.to_pure_dict(nnx.state(tuned, nnx.Param))
  for k in b["layers"]:
    np.testing.assert_array_equal(np.asarray(b["layers"][k]), np.asarray(t["layers"][k]), err_msg=k)
  np.testing.assert_array_equal(np.asarray(b["final_norm"]), np.asarray(t["final_norm"]))
  eb, et = np.asarray(b["embed"]), np.asarray(t["embed"])
  assert eb.shape == et.shape == (49167, 64)
  np.testing.assert_array_equal(eb[:49152], et[:49152])
  assert np.abs(eb[49152:] - et[49152:]).max() > 0
  assert tok.token_to_id("<sync/>") == 49156
  assert max(float(np.abs(np.asarray(v)).max()) for k, v in t["layers"].items() if k.endswith("_lora_b")) > 0

  out = export_run(wd, str(tmp_path / "hf"))
  _, reloaded = import_hf(out)
  from selforch_jax.tokenizers import Tokenizer
  assert Tokenizer.from_hf_dir(out).encode("a<sync/>b")[1] == 49156
  toks = jnp.asarray([tok.encode("Natalia sold clips to 48 of her friends in April.")])
  valid = jnp.ones_like(toks, bool)
  args = (toks, positions_from_valid(valid), causal_mask(valid))
  np.testing.assert_allclose(np.asarray(reloaded(*args)[0]), np.asarray(tuned(*args)[0]), atol=1e-5)

  import torch
  import transformers
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
  with torch.no_grad():
    ref = hf(torch.tensor(np.asarray(toks))).logits.numpy()
  np.testing.assert_allclose(ref, np.asarray(tuned(*args)[0]), atol=1e-4)


# --- sharding --------------------------------------------------------------------------------
SHARDED_SCRIPT = r"""
import json, sys
sys.path.insert(0, {root!r})
import jax
from tests.test_train import tiny_config
from selforch_jax.trainers.run import train
c = tiny_config(steps=3, mesh__data={data}, mesh__fsdp={fsdp}, mesh__tensor={tensor})
c.data.batch_size = 8
c.train.checkpoint_every = 3
s = train(c, {workdir!r})
rows = [json.loads(l) for l in open({workdir!r} + "/metrics.jsonl")]
print("LOSSES", json.dumps([r["loss"] for r in rows if "loss" in r]), jax.device_count())
"""


def run_sharded(tmp_path, name, devices, data, fsdp, tensor):
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  script = SHARDED_SCRIPT.format(root=ROOT, workdir=str(tmp_path / name), data=data, fsdp=fsdp,
                                 tensor=tensor)
  r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  line = [l for l in r.stdout.splitlines() if l.startswith("LOSSES")][0]
  losses, ndev = line[len("LOSSES "):].rsplit(" ", 1)
  assert int(ndev) == devices
  return json.loads(losses)


def test_8_devices_fsdp_tensor_equals_1_device(tmp_path):
  one = run_sharded(tmp_path, "one", 1, 1, 1, 1)
  eight = run_sharded(tmp_path, "eight", 8, 1, 4, 2)
  assert len(one) == len(eight) == 3
  np.testing.assert_allclose(eight, one, rtol=0, atol=1e-5)


def test_checkpoint_restores_on_another_mesh(tmp_path):
  """Saved on 2x4 (fsdp x tensor) and 8 devices, restored on 4x2 and on 1 device."""
  run_sharded(tmp_path, "m", 8, 1, 2, 4)
  script = r"""
import sys, json
sys.path.insert(0, {root!r})
import jax, numpy as np
from tests.test_train import tiny_config
from selforch_jax.trainers.run import build
c = tiny_config(steps=3, mesh__data=1, mesh__fsdp={fsdp}, mesh__tensor={tensor})
c.data.batch_size = 8
tr, tok, ds, _, ck = build(c, {workdir!r})
step = ck.restore(tr, iter(ds))
emb = np.asarray(jax.device_get(tr.params["embed"][...]))
print("RESTORED", step, float(np.abs(emb).sum()), len(tr.params["embed"][...].sharding.device_set))
"""
  outs = []
  for devices, fsdp, tensor in ((8, 4, 2), (1, 1, 1)):
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", script.format(root=ROOT, workdir=str(tmp_path / "m"),
                                                            fsdp=fsdp, tensor=tensor)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [l for l in r.stdout.splitlines() if l.startswith("RESTORED")][0].split()
    outs.append((int(line[1]), float(line[2]), int(line[3])))
  assert outs[0][0] == outs[1][0] == 3
  assert outs[0][1] == outs[1][1]
  assert outs[0][2] == 8 and outs[1][2] == 1


def test_two_processes_agree_on_loss(tmp_path):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  procs = []
  for pid in range(2):
    cmd = [sys.executable, "-m", "selforch_jax.train",
           "--config=configs/sft.py:model=tiny_smollm2,lora_rank=0,steps=1,seq_len=64,batch_size=4",
           "--config.train.eval_every=0", "--config.data.max_examples=200",
           "--config.train.async_checkpoint=False",
           f"--workdir={tmp_path}/w", f"--coordinator_address=localhost:{port}",
           "--num_processes=2", f"--process_id={pid}"]
    procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True))
  outs = [p.communicate(timeout=400) for p in procs]
  for p, (o, e) in zip(procs, outs):
    assert p.returncode == 0, e[-3000:]
  losses = [json.loads(o[o.index("{"):])["loss"] for o, _ in outs]
  assert losses[0] == losses[1]
  one = train(tiny_config(steps=1), str(tmp_path / "single"))
  np.testing.assert_allclose(losses[0], one["loss"], atol=1e-5)


def test_grad_accumulation_and_schedule():
  from selforch_jax import sharding as shd
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  from selforch_jax.trainers.optim import make_schedule, optim_defaults
  from selforch_jax.trainers.sft import SFTTrainer
  rng = np.random.default_rng(0)
  B, T = 4, 16
  seg = np.ones((B, T), np.int32)
  seg[:, 12:] = 2  # two packed examples per row
  pos = np.concatenate([np.arange(12), np.arange(4)])[None].repeat(B, 0).astype(np.int32)
  batch = dict(tokens=rng.integers(0, 256, (B, T)).astype(np.int32),
               targets=rng.integers(0, 256, (B, T)).astype(np.int32),
               loss_mask=(rng.random((B, T)) < 0.7).astype(np.int32), segment_ids=seg, positions=pos)
  losses = {}
  for accum in (1, 2, 4):
    oc = optim_defaults()
    oc.lr, oc.warmup_steps, oc.grad_accum = 1e-2, 0, accum
    tr = SFTTrainer(init_model(get_preset("tiny_llama"), 0), shd.make_mesh(), oc, 5)
    losses[accum] = [tr.train_step(batch)["loss"] for _ in range(3)]
  np.testing.assert_allclose(losses[2], losses[1], atol=1e-5)
  np.testing.assert_allclose(losses[4], losses[1], atol=1e-5)
  assert losses[1][2] < losses[1][0]
  oc = optim_defaults()
  oc.lr, oc.warmup_steps, oc.end_lr_frac = 1.0, 10, 0.1
  s = make_schedule(oc, 110)
  assert float(s(0)) == 0.0 and abs(float(s(5)) - 0.5) < 1e-6 and abs(float(s(10)) - 1.0) < 1e-6
  assert abs(float(s(110)) - 0.1) < 1e-6 and abs(float(s(60)) - 0.55) < 1e-6  # cosine midpoint
  oc.schedule = "linear"
  assert abs(float(make_schedule(oc, 110)(60)) - 0.55) < 1e-6


def test_resume_refuses_a_different_model_or_data_config(tmp_path):
  train(tiny_config(steps=2), str(tmp_path))
  with pytest.raises(config_lib.ConfigError, match=r"data.seq_len: checkpoint 64, now 128"):
    c = tiny_config(steps=4)
    c.data.seq_len = 128
    train(c, str(tmp_path))
  with pytest.raises(config_lib.ConfigError, match="data.name"):
    validate(tiny_config(data__name="gsm9k"))
  s = train(tiny_config(steps=3, optim__lr=5e-4), str(tmp_path))  # optim/train may change
  assert s["step"] == 3
  assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]


def test_resume_diffs_treat_a_key_the_checkpoint_lacks_as_its_default():
  from selforch_jax.trainers.run import resume_diffs
  now = json.loads(tiny_config().to_json())
  old = json.loads(tiny_config().to_json())
  del old["data"]["chunk_bidirectional"]          # a key added after the checkpoint was written
  assert resume_diffs(old, now) == []
  now["data"]["chunk_bidirectional"] = True       # ... but set away from its default now
  assert resume_diffs(old, now) == ["data.chunk_bidirectional: checkpoint False, now True"]
  now["data"]["seq_len"] += 1
  assert "data.seq_len" in " ".join(resume_diffs(old, now))
  now["data"]["num_threads"] = 7                  # execution detail: may change
  assert not any("num_threads" in d for d in resume_diffs(old, now))
