"""What every ``python -m selforch_jax.X`` entry point shares before its ``main`` runs.

:func:`flags_parser` builds the absl ``flags_parser`` of an entry point (train, decode, eval,
export): ``--help`` prints the entry point's usage, its flags and, given ``--config=FILE``, every
key of that config with its value, then exits 0 (absl's own ``--help`` exits 1); a missing or
unknown config file is one line naming it and exit status 2; a bad ``--config.a.b=v`` override
is one line too (:func:`selforch_jax.config_lib.parse_flags`). :func:`fail` is the one-line error
every entry point prints.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn

import ml_collections

from selforch_jax import config_lib

HELP_FLAGS = ("--help", "-h", "--helpshort", "--helpfull", "-?")


def fail(msg: object) -> NoReturn:
  """Print ``error: <msg>`` on one line to stderr and exit with status 2."""
  print("error: " + " ".join(str(msg).split()), file=sys.stderr)
  sys.exit(2)


def config_arg(argv: list[str]) -> str | None:
  """The value of ``--config=SPEC`` / ``--config SPEC`` in ``argv`` (None when absent)."""
  for i, a in enumerate(argv):
    if a.startswith("--config="):
      return a.split("=", 1)[1]
    if a == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return None


def _flag_lines(defined: list[str]) -> str:
  from absl import flags
  lines = []
  for name in defined:
    f = flags.FLAGS[name]
    default = "" if f.default is None else f" (default {f.default!r})"
    lines.append(f"  --{name}  {f.help}{default}")
  return "\n".join(lines)


def flags_parser(doc: str, flag_names: list[str], *, config: bool = True,
                 keys_help: Callable[[ml_collections.ConfigDict | None], str] | None = None
                 ) -> Callable[[list[str]], list[str]]:
  """An absl ``flags_parser`` for an entry point.

  Args:
    doc: the entry point's module docstring (``--help`` prints it).
    flag_names: the absl flags it defines, in the order ``--help`` lists them.
    config: whether it takes ``--config=FILE[:arg]`` (required then; a missing file is an error).
    keys_help: ``config -> text`` listing its keys (``None`` -> the defaults, shown when no
      ``--config`` is given); default :func:`selforch_jax.config_lib.key_lines` of the
      config file, without descriptions.

  Returns:
    ``parse(argv) -> remaining argv``; it exits 0 after ``--help`` and 2 (one line on stderr)
    for a missing ``--config``, a config file that does not exist or fails to load, or a bad
    override.
  """
  def parse(argv: list[str]) -> list[str]:
    spec = config_arg(argv[1:]) if config else None
    if any(a in HELP_FLAGS for a in argv[1:]):
      print(doc.strip())
      print("\nflags:\n" + _flag_lines(flag_names))
      if config:
        if spec is None and keys_help is not None:
          print("\nconfig keys (defaults):")
          print(keys_help(None))
        elif spec is None:
          print("\n(give --config=FILE --help to list that config's keys and values)")
        else:
          try:
            c = config_lib.load_config_file(spec)
          except Exception as e:  # noqa: BLE001 - help still prints; the run will name it
            print(f"\n(config {spec!r} does not load: {' '.join(str(e).split())})")
          else:
            print(f"\nconfig keys (values of {spec}):")
            print(keys_help(c) if keys_help else config_lib.key_lines(c))
      sys.exit(0)
    if config:
      if spec is None:
        fail("--config is required, e.g. --config=configs/<name>.py (--help lists the flags)")
      path = spec.split(":", 1)[0]
      if not os.path.isfile(path):
        fail(f"config file {path!r} not found")
    return config_lib.parse_flags(argv)

  return parse
