"""Every ``python -m selforch_jax.X`` entry point (selforch_jax/cli.py): ``--help`` exits 0 and
lists its flags (and, given ``--config``, that config's keys); a missing config file or a missing
required flag is one stderr line, exit 2, no traceback. Also the per-runtime answer budget."""

import os
import subprocess
import sys

import pytest

from selforch_jax import api

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module, *args):
  p = subprocess.run([sys.executable, "-m", f"selforch_jax.{module}", *args], cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
  return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("module, flag", [("train", "--workdir"), ("eval", "--workdir"),
                                          ("export", "--model"), ("decode", "--prompts_file")])
def test_help_exits_0_and_lists_the_flags(module, flag):
  rc, out, err = _run(module, "--help")
  assert rc == 0, err
  assert f"  {flag}  " in out and "Traceback" not in out + err


def test_train_help_with_a_config_lists_its_keys():
  rc, out, err = _run("train", "--config=configs/sft.py", "--help")
  assert rc == 0, err
  assert "--config.trainer='sft'" in out and "--config.optim.lr=" in out


@pytest.mark.parametrize("module, args, needle", [
    ("train", ["--config=configs/nope.py", "--workdir=/tmp/x"], "configs/nope.py"),
    ("eval", ["--config=configs/nope.py"], "configs/nope.py"),
    ("train", ["--workdir=/tmp/x"], "--config is required"),
    ("export", ["--out=/tmp/x"], "one of --workdir"),
    ("export", ["--model=/no/such", "--out=/tmp/x"], "not an adapter directory"),
])
def test_errors_are_one_line_exit_2(module, args, needle):
  rc, out, err = _run(module, *args)
  lines = err.strip().splitlines()
  assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
  assert needle in lines[0]


def test_decode_help_names_every_runtime():
  rc, out, _ = _run("decode", "--help")
  line = next(l for l in out.splitlines() if l.startswith("  --config.runtime="))
  assert all(r in line for r in api.RUNTIMES)


def test_default_answer_budget_per_runtime():
  assert api.default_max_new_tokens("pasta") == 512 == api.default_max_new_tokens("tip", 0)
  assert api.default_max_new_tokens("ar") == 128
  assert api.default_max_new_tokens("pasta", 64) == 64
