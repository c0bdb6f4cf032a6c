"""The decode CLI (``python -m selforch_jax.decode``): ``--help`` exits 0 and lists the config
keys; every usage error is one stderr line naming the problem, exit status 2, no traceback
(raised before any model loads, except the context check, which needs the tokenizer)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--config=configs/smollm2_135m.py", "--config.model.preset=tiny_smollm2",
        "--config.model.weights=random", "--config.model.tokenizer=smollm2_gguf"]


def cli(*args, cwd=ROOT):
  p = subprocess.run([sys.executable, "-m", "selforch_jax.decode", *args], cwd=cwd,
                     capture_output=True, text=True, timeout=300)
  return p.returncode, p.stdout, p.stderr


def test_help_exits_0_and_lists_every_key_with_its_default():
  rc, out, err = cli("--help")
  assert rc == 0, err
  assert "--config.runtime='ar'" in out and "decoding system" in out
  assert "--config.sampling.temperature=0.0  0 = greedy" in out
  assert "--config.pasta.max_threads=16" in out
  from selforch_jax.decoding.run import defaults, help_text
  n_keys = len([l for l in help_text(defaults()).splitlines()])
  assert n_keys == len([l for l in out.splitlines() if l.startswith("  --config.")])
  assert n_keys >= 30


def _adapter(tmp_path, preset, tags=True):
  d = tmp_path / f"adapter_{preset}"
  d.mkdir()
  (d / "adapter_config.json").write_text(json.dumps({"model": {"preset": preset, "tags": tags}}))
  return str(d)


ERRORS = {
    "missing_config": (["--config=configs/no_such.py", "--prompt=hi"], "no_such.py"),
    "unknown_key": ([*TINY, "--config.temprature=1", "--prompt=hi"], "temprature"),
    "unknown_runtime": ([*TINY, "--config.runtime=beam", "--prompt=hi"],
                        "valid: ar, pasta, tip, sot, apar, streaming_llm, h2o"),
    "empty_prompt": ([*TINY, "--prompt=   "], "empty"),
    "prompt_and_file": ([*TINY, "--prompt=hi", "--prompts_file=x.jsonl"], "not both"),
    "tip_without_adapter": ([*TINY, "--config.runtime=tip", "--prompt=hi"], "adapter"),
    "adapter_missing": ([*TINY, "--config.adapter=/no/such/adapter", "--prompt=hi"],
                        "/no/such/adapter"),
    # orthrus options fail before the adapter or the model loads (the adapter does not exist)
    "orthrus_fuse_at": ([*TINY, "--config.runtime=orthrus", "--config.adapter=/no/such",
                         "--config.orthrus.fused=True", "--config.orthrus.fuse_at=99",
                         "--prompt=hi"], "[1, 7] (block_size=8), got 99"),
    "orthrus_fuse_at_unfused": ([*TINY, "--config.runtime=orthrus", "--config.adapter=/no/such",
                                 "--config.orthrus.fuse_at=1", "--prompt=hi"],
                                "needs fused=True"),
    "orthrus_denoise_fused": ([*TINY, "--config.runtime=orthrus", "--config.adapter=/no/such",
                               "--config.orthrus.fused=True", "--config.orthrus.denoise_steps=2",
                               "--prompt=hi"], "denoise_steps=2"),
    # planned_diffusion options too (they failed after the model had loaded)
    "pd_steps_ratio": ([*TINY, "--config.runtime=planned_diffusion", "--config.adapter=/no/such",
                        "--config.planned_diffusion.steps_ratio=-1", "--prompt=hi"],
                       "steps_ratio must be > 0, got -1"),
    "pd_threshold": ([*TINY, "--config.runtime=planned_diffusion", "--config.adapter=/no/such",
                      "--config.planned_diffusion.threshold=1.5", "--prompt=hi"],
                     "0 on the command line), got 1.5"),
    "pd_confidence": ([*TINY, "--config.runtime=planned_diffusion", "--config.adapter=/no/such",
                       "--config.planned_diffusion.confidence=bogus", "--prompt=hi"],
                      "confidence must be one of"),
    "pd_full_diffusion": ([*TINY, "--config.runtime=planned_diffusion",
                           "--config.adapter=/no/such",
                           "--config.planned_diffusion.full_diffusion=-3", "--prompt=hi"],
                          "full_diffusion must be >= 1"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_usage_errors_are_one_line_exit_2(case, tmp_path):
  args, needle = ERRORS[case]
  rc, out, err = cli(*args, f"--workdir={tmp_path / 'wd'}")
  lines = err.strip().splitlines()
  assert rc == 2, (rc, err)
  assert len(lines) == 1 and "Traceback" not in err, err
  assert needle in lines[0], lines[0]
  assert not (tmp_path / "wd").exists()   # nothing was written


def test_workdir_errors_and_adapter_for_another_model(tmp_path):
  f = tmp_path / "a_file"
  f.write_text("x")
  rc, _, err = cli(*TINY, "--prompt=hi", f"--workdir={f}")
  assert rc == 2 and len(err.strip().splitlines()) == 1 and "is a file" in err, err
  ro = tmp_path / "ro"
  ro.mkdir()
  os.chmod(ro, 0o500)
  try:
    if not os.access(ro, os.W_OK):   # (root may write anywhere)
      rc, _, err = cli(*TINY, "--prompt=hi", f"--workdir={ro / 'out'}")
      assert rc == 2 and "not writable" in err and len(err.strip().splitlines()) == 1, err
  finally:
    os.chmod(ro, 0o700)
  other = _adapter(tmp_path, "tiny_llama")
  rc, _, err = cli(*TINY, f"--config.adapter={other}", "--prompt=hi", f"--workdir={tmp_path}/w")
  assert rc == 2 and len(err.strip().splitlines()) == 1, err
  assert "is for model 'tiny_llama', not 'tiny_smollm2'" in err


def test_prompt_longer_than_the_context(tmp_path):
  rc, _, err = cli(*TINY, "--config.max_new_tokens=8", "--prompt=" + "word " * 3000,
                   f"--workdir={tmp_path / 'wd'}")
  lines = err.strip().splitlines()
  assert rc == 2 and len(lines) == 1, err
  assert "max_new_tokens=8" in lines[0] and "context of" in lines[0]
  assert not (tmp_path / "wd").exists()
