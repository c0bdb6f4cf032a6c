"""Device mesh and logical-axis sharding rules (one table for the whole project).

Parameters carry ``logical_axes`` metadata (see ``models/transformer.py``); a rules table
maps each logical name to a mesh axis (or ``None`` = replicated), as MaxText's
``logical_axis_rules`` and flax's GSPMD guide do. The mesh has the axes
``("data", "fsdp", "tensor")``; the batch is split over ``data`` and ``fsdp``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (None = replicate)
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("lora_rank", None),
)


class MeshError(ValueError):
  """The requested mesh cannot be built on the available devices."""


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int | None = None) -> tuple[int, int, int]:
  """Resolve a mesh shape; one axis may be -1 (use the remaining devices).

  Raises:
    MeshError: if the product does not equal the device count, naming the axes.
  """
  n = jax.device_count() if num_devices is None else num_devices
  dims = {"data": data, "fsdp": fsdp, "tensor": tensor}
  auto = [k for k, v in dims.items() if v == -1]
  if len(auto) > 1:
    raise MeshError(f"at most one mesh axis may be -1, got {auto}")
  for k, v in dims.items():
    if v == 0 or v < -1:
      raise MeshError(f"mesh.{k}={v} must be a positive size or -1")
  fixed = math.prod(v for v in dims.values() if v != -1)
  if auto:
    if n % fixed:
      raise MeshError(f"mesh {dims}: {n} devices are not divisible by {fixed}")
    dims[auto[0]] = n // fixed
  if math.prod(dims.values()) != n:
    raise MeshError(
        f"mesh data={dims['data']} x fsdp={dims['fsdp']} x tensor={dims['tensor']} = "
        f"{math.prod(dims.values())} devices, but {n} are available")
  return dims["data"], dims["fsdp"], dims["tensor"]


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1) -> Mesh:
  """A ``("data", "fsdp", "tensor")`` mesh over all devices (all processes)."""
  shape = mesh_shape(data, fsdp, tensor)
  devices = np.asarray(jax.devices()).reshape(shape)
  return Mesh(devices, MESH_AXES)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, Any] | Sequence = DEFAULT_RULES) -> P:
  """PartitionSpec for an array with the given logical axes.

  A dimension whose size is not divisible by its mesh axes is replicated instead (e.g.
  SmolLM2's 3 KV heads on a 2-way tensor axis); a mesh axis is used at most once.
  """
  rules = dict(rules)
  used: set[str] = set()
  spec = []
  for name, size in zip(axes, shape):
    target = rules.get(name) if name is not None else None
    names = (target,) if isinstance(target, str) else tuple(target or ())
    names = tuple(a for a in names if a not in used and mesh.shape.get(a, 1) > 1)
    if names and size % math.prod(mesh.shape[a] for a in names) == 0:
      used.update(names)
      spec.append(names[0] if len(names) == 1 else names)
    else:
      spec.append(None)
  return P(*spec)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES):
  """NamedShardings for every leaf of an NNX state, from its variables' ``logical_axes``.

  Leaves without metadata (optimizer counters, RNG keys) are replicated.
  """
  def one(x):
    if isinstance(x, nnx.Variable):
      axes = getattr(x, "logical_axes", None)
      value = x[...]
      if axes is not None and hasattr(value, "shape") and len(axes) == value.ndim:
        return x.replace(NamedSharding(mesh, logical_to_spec(axes, value.shape, mesh, rules)))
      return x.replace(NamedSharding(mesh, P()))
    return NamedSharding(mesh, P())
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Sharding of a ``[B, ...]`` batch: B over ``("data", "fsdp")``."""
  return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def put_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Place a process-local numpy batch as global arrays sharded over the batch axes.

  Single process: the batch is the global batch. Multi-process: each process passes its
  own slice (``jax.make_array_from_process_local_data``).
  """
  return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(v)), np.asarray(v))
          for k, v in batch.items()}
