"""SOL policy adapters: the trained compute policy of a frozen LM (issue 22).

A SOL adapter directory holds

* ``adapter.safetensors`` (float32): every :class:`~selforch_jax.models.sol_policy.SolPolicy`
  parameter, named by its path (``policy.block_0.qkv.kernel``, ...);
* ``adapter_config.json``: ``"kind": "sol"``, ``model`` (the frozen LM's config section, what
  :func:`selforch_jax.adapter.load_adapter` rebuilds unchanged), ``policy`` (the
  :class:`~selforch_jax.models.sol_policy.SolPolicyConfig`), ``grid`` (kappas, rhos, bits),
  ``sparsity``, ``tensors`` (name -> shape) and ``source`` / ``training`` / ``metrics`` for a
  model card.
"""

from __future__ import annotations

import json
import os

import numpy as np

from selforch_jax.adapter import CONFIG_FILE, TENSORS_FILE, write_adapter_files

KIND = "sol"


def _flat(policy) -> dict[str, np.ndarray]:
  from flax import nnx
  from flax.traverse_util import flatten_dict
  flat = flatten_dict(nnx.to_pure_dict(nnx.state(policy, nnx.Param)), sep=".")
  return {f"policy.{k}": np.asarray(v, np.float32) for k, v in flat.items()}


def export_sol_adapter(policy, grid, sparsity: str, model_section: dict, out_dir: str, *,
                       source: dict | None = None, training: dict | None = None,
                       metrics: dict | None = None) -> str:
  """Write ``policy`` (for ``grid`` and ``sparsity``) over the LM ``model_section`` to
  ``out_dir`` (created; files overwritten). Returns ``out_dir``."""
  tensors = _flat(policy)
  meta = {"format": "selforch_jax.adapter/1", "kind": KIND, "model": dict(model_section),
          "policy": policy.cfg.to_dict(),
          "grid": {"kappas": list(grid.kappas), "rhos": list(grid.rhos), "bits": list(grid.bits)},
          "sparsity": str(sparsity),
          "tensors": {k: list(v.shape) for k, v in sorted(tensors.items())},
          "source": source or {}, "training": training or {}, "metrics": metrics or {}}
  return write_adapter_files(out_dir, tensors, meta)


def load_sol_policy(adapter_dir: str):
  """``(policy, grid, sparsity, meta)`` of a SOL adapter directory.

  Raises:
    FileNotFoundError: a file is missing.
    ValueError: not a SOL adapter, or a tensor missing / unexpected / of the wrong shape.
  """
  import jax.numpy as jnp
  from flax import nnx
  from flax.traverse_util import unflatten_dict
  from safetensors.numpy import load_file

  from selforch_jax.models.sol_policy import SolPolicyConfig, init_policy
  from selforch_jax.runtime.sol_actions import ActionGrid

  for name in (CONFIG_FILE, TENSORS_FILE):
    if not os.path.exists(os.path.join(adapter_dir, name)):
      raise FileNotFoundError(f"{os.path.join(adapter_dir, name)} is missing")
  with open(os.path.join(adapter_dir, CONFIG_FILE)) as f:
    meta = json.load(f)
  if meta.get("kind") != KIND:
    raise ValueError(f"adapter {adapter_dir!r} is not a SOL policy adapter (kind "
                     f"{meta.get('kind', 'lora')!r})")
  policy = init_policy(SolPolicyConfig(**meta["policy"]))
  g = meta["grid"]
  grid = ActionGrid(tuple(map(float, g["kappas"])), tuple(map(float, g["rhos"])),
                    tuple(map(int, g["bits"])))
  tensors = load_file(os.path.join(adapter_dir, TENSORS_FILE))
  expected = {k: v.shape for k, v in _flat(policy).items()}
  for k in sorted(set(expected) | set(tensors)):
    if k not in tensors or k not in expected or tuple(tensors[k].shape) != tuple(expected[k]):
      raise ValueError(f"SOL adapter tensor {k!r}: missing, unexpected or of the wrong shape")
  state = nnx.state(policy, nnx.Param)
  nnx.replace_by_pure_dict(state, unflatten_dict(
      {k[len("policy."):]: jnp.asarray(v) for k, v in tensors.items()}, sep="."))
  nnx.update(policy, state)
  return policy, grid, meta["sparsity"], meta
