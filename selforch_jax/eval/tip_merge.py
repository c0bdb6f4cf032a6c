r"""Merge TIP evals run as shards over disjoint problem ranges into one report (issue 6).

A TIP eval's cost grows with problems x systems x tokens; on a machine with several cores or
hosts, run it as shards with the same config and contiguous ``eval.offset`` / ``eval.n`` ranges,
then merge::

  python -m selforch_jax.eval --config=configs/eval_tip.py:n=50,datasets=synthetic_walk \
      --config.eval.offset=0 --workdir=out/walk_a &
  python -m selforch_jax.eval --config=configs/eval_tip.py:n=50,datasets=synthetic_walk \
      --config.eval.offset=50 --workdir=out/walk_b &
  wait
  python -m selforch_jax.eval.tip_merge --out=out/walk out/walk_a out/walk_b

The merged ``tip_eval.json`` is what one run over the union would report: every figure is
recomputed from the shards' per-problem records (accuracy CIs, paired differences TIP - each
system, live KV, the reduction vs dense), decode seconds are summed, and the teacher-forced
figures are averaged weighted by each shard's n. Greedy decoding (or the same seed) makes a
problem's output independent of its shard, except for batch composition (a problem is decoded
beside different neighbours, which changes float rounding only). Also writes the merged per-problem
JSONL files and the plot.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from selforch_jax.eval.tip import compare_systems, plot, summary, system_summary

__all__ = ["merge", "main"]

_TF_MEANS = ("tip_live_kv_mean_tokens", "tip_live_kv_peak_tokens", "dense_live_kv_mean_tokens",
             "dense_live_kv_peak_tokens", "tip_response_live_kv_mean_tokens",
             "dense_response_live_kv_mean_tokens", "mean_logprob", "killed_share")


def _same_config(a: dict, b: dict) -> bool:
  strip = lambda c: {**c, "eval": {k: v for k, v in c["eval"].items()  # noqa: E731
                                   if k not in ("offset", "n")}}
  return strip(a) == strip(b)


def _merge_teacher_forced(parts: list[dict]) -> dict:
  n = np.array([p["n"] for p in parts], np.float64)
  out = {"n": int(n.sum())}
  for k in _TF_MEANS:
    out[k] = float(np.dot(n, [p[k] for p in parts]) / n.sum())
  out["reduction_mean"] = 1.0 - out["tip_live_kv_mean_tokens"] / out["dense_live_kv_mean_tokens"]
  out["reduction_peak"] = 1.0 - out["tip_live_kv_peak_tokens"] / out["dense_live_kv_peak_tokens"]
  out["response_reduction_mean"] = 1.0 - (out["tip_response_live_kv_mean_tokens"]
                                          / max(out["dense_response_live_kv_mean_tokens"], 1e-9))
  out["decode_s"] = round(sum(p["decode_s"] for p in parts), 2)
  return out


def merge(shard_dirs: list[str], out_dir: str) -> dict:
  """Merge the shards' ``tip_eval.json`` and JSONL records into ``out_dir`` (module docstring).

  Args:
    shard_dirs: eval workdirs, each with ``tip_eval.json`` and ``tip_<dataset>_<system>.jsonl``.
    out_dir: where the merged ``tip_eval.json``, JSONL files and plot go (created).

  Returns:
    The merged report (the ``tip_eval.json`` dict; ``shards`` lists the inputs).

  Raises:
    FileNotFoundError: a shard without ``tip_eval.json`` or a records file.
    ValueError: fewer than two shards; shards whose configs differ beyond ``eval.offset`` /
      ``eval.n``, that cover different datasets or systems, or whose problem ranges overlap or
      leave a gap.
  """
  if len(shard_dirs) < 2:
    raise ValueError(f"merge needs at least two shard directories, got {len(shard_dirs)}")
  shards = []
  for d in shard_dirs:
    path = os.path.join(d, "tip_eval.json")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{d}: no tip_eval.json (not a finished TIP eval workdir)")
    with open(path) as f:
      shards.append((d, json.load(f)))
  first = shards[0][1]
  for d, s in shards[1:]:
    if not _same_config(first["config"], s["config"]):
      raise ValueError(f"{d}: its config differs from {shard_dirs[0]}'s beyond eval.offset/n")
    if list(s["datasets"]) != list(first["datasets"]):
      raise ValueError(f"{d}: datasets {list(s['datasets'])} != {list(first['datasets'])}")
  os.makedirs(out_dir, exist_ok=True)
  ec = first["config"]["eval"]
  out = {k: v for k, v in first.items() if k not in ("datasets", "seconds")}
  out["shards"] = [d for d, _ in shards]
  out["seconds"] = round(sum(s.get("seconds", 0.0) for _, s in shards), 1)
  out["datasets"] = {}
  for ds in first["datasets"]:
    parts = sorted(((d, s["datasets"][ds]) for d, s in shards), key=lambda x: x[1]["subset"][0])
    for (d0, a), (d1, b) in zip(parts, parts[1:]):
      if a["subset"][1] != b["subset"][0]:
        raise ValueError(f"{ds}: problems {a['subset']} ({d0}) and {b['subset']} ({d1}) "
                         "overlap or leave a gap")
    systems = list(parts[0][1]["systems"])
    for d, p in parts:
      if list(p["systems"]) != systems:
        raise ValueError(f"{ds}: {d} ran systems {list(p['systems'])}, not {systems}")
    res = {"n": sum(p["n"] for _, p in parts),
           "subset": [parts[0][1]["subset"][0], parts[-1][1]["subset"][1]], "systems": {}}
    if "models" in parts[0][1]:
      res["models"] = parts[0][1]["models"]
    if all("teacher_forced" in p for _, p in parts):
      res["teacher_forced"] = _merge_teacher_forced([p["teacher_forced"] for _, p in parts])
    correct = {}
    for system in systems:
      recs = []
      for d, _ in parts:
        path = os.path.join(d, f"tip_{ds}_{system}.jsonl")
        if not os.path.exists(path):
          raise FileNotFoundError(f"{d}: no {os.path.basename(path)}")
        with open(path, encoding="utf-8") as f:
          recs += [json.loads(line) for line in f if line.strip()]
      with open(os.path.join(out_dir, f"tip_{ds}_{system}.jsonl"), "w", encoding="utf-8") as f:
        for r in recs:
          f.write(json.dumps(r, ensure_ascii=False) + "\n")
      decode_s = sum(p["systems"][system]["decode_s"] for _, p in parts)
      res["systems"][system] = system_summary(recs, decode_s, ec["n_boot"], ec["seed"])
      correct[system] = np.array([r["correct"] for r in recs], np.float64)
    compare_systems(res, correct, ec["n_boot"], ec["seed"])
    out["datasets"][ds] = res
  plot(out, os.path.join(out_dir, "tip_accuracy_vs_live_kv.png"))
  with open(os.path.join(out_dir, "tip_eval.json"), "w") as f:
    json.dump(out, f, indent=2)
  return out


def main(argv=None) -> None:
  """CLI: ``python -m selforch_jax.eval.tip_merge --out=DIR SHARD_DIR SHARD_DIR ...``."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="directory for the merged report")
  ap.add_argument("shards", nargs="+", help="TIP eval workdirs over contiguous problem ranges")
  a = ap.parse_args(argv)
  try:
    print(summary(merge(a.shards, a.out)))
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
  main()
