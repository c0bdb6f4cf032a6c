"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import os
import platform
from typing import Any, Sequence

import jax
import numpy as np


def loadavg() -> list[float] | None:
  """1/5/15-minute load averages (other processes compete for the same cores)."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def machine_info(modules: Sequence[str] = ("flax",)) -> dict[str, Any]:
  """CPU count and model, platform, python/jax/numpy versions, JAX backend and devices, and
  the versions of ``modules`` (None when not installed)."""
  info: dict[str, Any] = {
      "cpu_count": os.cpu_count(),
      "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "cpu_model": None,
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jax_backend": jax.default_backend(),
      "jax_devices": [f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()],
      "numpy": np.__version__,
  }
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          info["cpu_model"] = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  for mod in modules:
    try:
      info[mod] = __import__(mod).__version__
    except Exception:  # not installed
      info[mod] = None
  return info


def write_result(result: dict[str, Any], out_dir: str, name: str) -> str:
  """Write ``result`` as ``<out_dir>/<name>`` (pretty JSON), print it, return the path."""
  import json
  import sys
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, name)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))
  print(f"wrote {path}", file=sys.stderr)
  return path
