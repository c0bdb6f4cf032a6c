"""Load a repository file that is not part of the package (a bench script, a config file, the TPU
launcher) as a module, by its path from the repository root."""

import importlib.util
import os
import types

from selforch_jax import config_lib

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_module(rel_path: str, name: str | None = None) -> types.ModuleType:
  """Execute ``REPO_ROOT/rel_path`` as a fresh module and return it.

  Args:
    rel_path: a path from the repository root, e.g. ``"bench/engine_step.py"``.
    name: the module's name (default: ``rel_path`` without ``.py``, ``/`` as ``_``).

  Raises:
    FileNotFoundError: no such file.
  """
  path = os.path.join(REPO_ROOT, rel_path)
  if not os.path.isfile(path):
    raise FileNotFoundError(path)
  if name is None:
    name = os.path.splitext(rel_path)[0].replace("/", "_")
  spec = importlib.util.spec_from_file_location(name, path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def load_config(rel_path: str, arg: str | None = None):
  """``get_config(arg)`` of the config file ``rel_path`` (e.g. ``"configs/sft.py"``), by
  :func:`selforch_jax.config_lib.load_config_file` (raises its ``ConfigError``)."""
  return config_lib.load_config_file(os.path.join(REPO_ROOT, rel_path), arg)
