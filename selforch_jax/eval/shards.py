"""Shared checks of the shard mergers (:mod:`selforch_jax.eval.tip_merge`,
:mod:`selforch_jax.eval.pasta_merge`): an eval run as shards over contiguous ranges of the same
test file, with one config, merged into the report one run over the union would write."""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

__all__ = ["load_reports", "config_diff", "check_same_config", "check_contiguous", "merge_cli"]


def load_reports(shard_dirs: list[str], out_dir: str, report: str,
                 what: str) -> list[tuple[str, dict]]:
  """``[(shard_dir, report dict)]``: each shard's finished ``report`` (e.g. ``tip_eval.json``;
  ``what`` names the eval in errors, e.g. "TIP").

  Raises:
    ValueError: fewer than two shards, or ``out_dir`` is one of them (the merge would overwrite
      it).
    FileNotFoundError: a shard without ``report`` (not a finished eval workdir).
  """
  if len(shard_dirs) < 2:
    raise ValueError(f"merge needs at least two shard directories, got {len(shard_dirs)}")
  if os.path.realpath(out_dir) in {os.path.realpath(d) for d in shard_dirs}:
    raise ValueError(f"--out={out_dir} is one of the shards: the merge would overwrite it")
  shards = []
  for d in shard_dirs:
    path = os.path.join(d, report)
    if not os.path.exists(path):
      raise FileNotFoundError(f"{d}: no {report} (not a finished {what} eval workdir)")
    with open(path) as f:
      shards.append((d, json.load(f)))
  return shards


def config_diff(a: dict, b: dict, section: str | None = None) -> list[str]:
  """The dotted keys whose values differ between two saved eval configs, ignoring ``offset``
  and ``n`` (of ``section``, or top-level when None); empty when the shards may merge."""
  def flat(c, prefix=""):
    out = {}
    for k, v in c.items():
      if isinstance(v, dict):
        out.update(flat(v, f"{prefix}{k}."))
      else:
        out[f"{prefix}{k}"] = v
    return out
  skip = {f"{section}.{k}" if section else k for k in ("offset", "n")}
  fa, fb = flat(a), flat(b)
  return sorted(k for k in set(fa) | set(fb) if k not in skip and fa.get(k) != fb.get(k))


def check_same_config(shards: list[tuple[str, dict]], section: str | None = None) -> None:
  """Every shard's saved ``config`` equals the first's beyond ``offset`` / ``n`` (of ``section``).

  Raises:
    ValueError: naming the shard and the dotted keys that differ.
  """
  (d0, first), where = shards[0], f"{section}.offset/n" if section else "offset/n"
  for d, s in shards[1:]:
    diff = config_diff(first["config"], s["config"], section)
    if diff:
      raise ValueError(f"{d}: its config differs from {d0}'s beyond {where}: {', '.join(diff)}")


def check_contiguous(parts: list[tuple[str, dict]], what: str) -> list[tuple[str, dict]]:
  """``parts`` (``(shard_dir, figures with "subset": [lo, hi])``) sorted by ``lo``.

  Raises:
    ValueError: two shards' ranges overlap or leave a gap (names ``what`` and both shards).
  """
  parts = sorted(parts, key=lambda x: x[1]["subset"][0])
  for (d0, a), (d1, b) in zip(parts, parts[1:]):
    if a["subset"][1] != b["subset"][0]:
      twice = " (one directory given twice)" if os.path.realpath(d0) == os.path.realpath(d1) else ""
      raise ValueError(f"{what}: ranges {a['subset']} ({d0}) and {b['subset']} ({d1}) "
                       f"{'overlap' if b['subset'][0] < a['subset'][1] else 'leave a gap'}"
                       f"{twice}: shards must cover contiguous offset/n ranges, each once")
  return parts


def merge_cli(argv, prog: str, what: str, outputs: str, merge: Callable[[list[str], str], dict],
              summary: Callable[[dict], str]) -> None:
  """The mergers' CLI: ``python -m PROG --out=DIR SHARD_DIR SHARD_DIR ...``; prints
  ``summary(merge(shards, out))``, or exits with ``error: ...`` on a ValueError /
  FileNotFoundError (``what``: the eval's name; ``outputs``: the files it writes)."""
  ap = argparse.ArgumentParser(
      prog=prog, description=f"Merge {what} evals run as shards over disjoint, contiguous ranges "
                             f"of the test file into one report: {outputs} in --out.")
  ap.add_argument("--out", required=True, help="directory for the merged report (not a shard)")
  ap.add_argument("shards", nargs="+", help=f"two or more finished {what} eval workdirs")
  a = ap.parse_args(argv)
  try:
    print(summary(merge(a.shards, a.out)))
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None
