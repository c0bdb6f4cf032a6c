r"""Merge TIP evals run as shards over disjoint problem ranges into one report (issue 6).

A TIP eval's cost grows with problems x systems x tokens; on a machine with several cores or
hosts, run it as shards with the same config and contiguous ``eval.offset`` / ``eval.n`` ranges,
then merge::

  python -m selforch_jax.eval --config=configs/eval_tip.py:n=50,offset=0,datasets=synthetic_walk \
      --workdir=out/walk_a &
  python -m selforch_jax.eval --config=configs/eval_tip.py:n=50,offset=50,datasets=synthetic_walk \
      --workdir=out/walk_b &
  wait
  python -m selforch_jax.eval.tip_merge --out=out/walk out/walk_a out/walk_b

The merged ``tip_eval.json`` reports what one run over the union would, given the same outputs:
every figure is recomputed from the shards' per-problem records (accuracy CIs, paired
differences TIP - each system, live KV, the reduction vs dense), decode seconds are summed
(``shard_seconds`` keeps each shard's wall time), the teacher-forced figures are averaged
weighted by each shard's n, and ``config.eval`` gets the union's offset and n. The outputs
themselves can differ from one run's: with greedy decoding a problem is decoded beside other
neighbours in its batch, which changes float rounding and can, rarely, flip an argmax; when
sampling, each decode step draws one key for the whole batch, so a problem's sample depends on
its place in the batch unless shard offsets are multiples of ``eval.batch_size``. Also writes the
merged per-problem JSONL files and the plot.
"""

from __future__ import annotations

import json
import os

import numpy as np

from selforch_jax.eval.shards import check_contiguous, check_same_config, load_reports, merge_cli
from selforch_jax.eval.tip import (
    TEACHER_FORCED_MEANS, compare_systems, plot, question_texts, summary, system_summary,
    teacher_forced_figures,
)

__all__ = ["merge", "main"]

def _merge_teacher_forced(ds: str, parts: list[tuple[str, dict]]) -> dict | None:
  have = [d for d, p in parts if "teacher_forced" in p]
  if not have:
    return None
  if len(have) != len(parts):
    raise ValueError(f"{ds}: only {have} of the shards have teacher-forced figures")
  tfs = []
  for d, p in parts:
    missing = [k for k in TEACHER_FORCED_MEANS if k not in p["teacher_forced"]]
    if missing:
      raise ValueError(f"{d}: teacher-forced figures lack {missing} (written by an older "
                       "version: re-run that shard)")
    tfs.append(p["teacher_forced"])
  n = np.array([t["n"] for t in tfs], np.float64)
  means = {k: float(np.dot(n, [t[k] for t in tfs]) / n.sum()) for k in TEACHER_FORCED_MEANS}
  return teacher_forced_figures({"n": int(n.sum()), **means,
                                 "decode_s": round(sum(t["decode_s"] for t in tfs), 2)})


def _records(d: str, ds: str, system: str, part: dict, questions: list[str]) -> list[dict]:
  """A shard's records of one system, checked against its report and the test file."""
  path = os.path.join(d, f"tip_{ds}_{system}.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{d}: no {os.path.basename(path)}")
  with open(path, encoding="utf-8") as f:
    recs = [json.loads(line) for line in f if line.strip()]
  if [r["question"] for r in recs] != questions:
    raise ValueError(f"{path}: its {len(recs)} records are not the test problems "
                     f"{part['subset']} of {ds} (a stale or foreign records file, or other data)")
  return recs


def merge(shard_dirs: list[str], out_dir: str) -> dict:
  """Merge the shards' ``tip_eval.json`` and JSONL records into ``out_dir`` (module docstring).

  Args:
    shard_dirs: eval workdirs, each with ``tip_eval.json`` and ``tip_<dataset>_<system>.jsonl``.
    out_dir: where the merged ``tip_eval.json``, JSONL files and plot go (created).

  Returns:
    The merged report (the ``tip_eval.json`` dict; ``shards`` lists the inputs).

  Raises:
    FileNotFoundError: a shard without ``tip_eval.json`` or a records file.
    ValueError: fewer than two shards; ``out_dir`` is one of them; shards whose configs differ
      beyond ``eval.offset`` / ``eval.n``, that cover different datasets or systems, or whose
      problem ranges overlap or leave a gap; records that are not the test file's problems of
      their shard's range; teacher-forced figures in only some shards.
  """
  from selforch_jax.data.sources import load_examples
  shards = load_reports(shard_dirs, out_dir, "tip_eval.json", "TIP")
  first = shards[0][1]
  check_same_config(shards, "eval")
  for d, s in shards[1:]:
    if list(s["datasets"]) != list(first["datasets"]):
      raise ValueError(f"{d}: datasets {list(s['datasets'])} != {list(first['datasets'])}")
  ec = first["config"]["eval"]
  merged: dict[str, list[dict]] = {}   # records file name -> records, written once all is checked
  out = {k: v for k, v in first.items() if k not in ("datasets", "seconds")}
  out["shards"] = [d for d, _ in shards]
  out["shard_seconds"] = [s.get("seconds", 0.0) for _, s in shards]
  out["seconds"] = round(sum(out["shard_seconds"]), 1)   # summed: shards may run in parallel
  out["datasets"] = {}
  for ds in first["datasets"]:
    parts = check_contiguous([(d, s["datasets"][ds]) for d, s in shards], ds)
    systems = list(parts[0][1]["systems"])
    for d, p in parts:
      if list(p["systems"]) != systems:
        raise ValueError(f"{ds}: {d} ran systems {list(p['systems'])}, not {systems}")
    res = {"n": sum(p["n"] for _, p in parts),
           "subset": [parts[0][1]["subset"][0], parts[-1][1]["subset"][1]], "systems": {}}
    if "models" in parts[0][1]:
      res["models"] = parts[0][1]["models"]
    tf = _merge_teacher_forced(ds, parts)
    if tf is not None:
      res["teacher_forced"] = tf
    rows = load_examples(ds, split="test", max_examples=res["subset"][1])
    questions = {d: question_texts(rows[p["subset"][0]:p["subset"][1]], ec["prompt_suffix"])
                 for d, p in parts}
    correct = {}
    for system in systems:
      recs = []
      for d, p in parts:
        recs += _records(d, ds, system, p, questions[d])
      merged[f"tip_{ds}_{system}.jsonl"] = recs
      decode_s = sum(p["systems"][system]["decode_s"] for _, p in parts)
      res["systems"][system] = system_summary(recs, decode_s, ec["n_boot"], ec["seed"])
      correct[system] = np.array([r["correct"] for r in recs], np.float64)
    compare_systems(res, correct, ec["n_boot"], ec["seed"])
    out["datasets"][ds] = res
  spans = [r["subset"] for r in out["datasets"].values()]
  out["config"]["eval"]["offset"] = min(a for a, _ in spans)
  out["config"]["eval"]["n"] = max(b - a for a, b in spans)
  os.makedirs(out_dir, exist_ok=True)
  for name, recs in merged.items():
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
      for r in recs:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
  plot(out, os.path.join(out_dir, "tip_accuracy_vs_live_kv.png"))
  with open(os.path.join(out_dir, "tip_eval.json"), "w") as f:
    json.dump(out, f, indent=2)
  return out


def main(argv=None) -> None:
  """CLI: ``python -m selforch_jax.eval.tip_merge --out=DIR SHARD_DIR SHARD_DIR ...``."""
  merge_cli(argv, "python -m selforch_jax.eval.tip_merge", "TIP",
            "tip_eval.json, the per-problem tip_<dataset>_<system>.jsonl files and "
            "tip_accuracy_vs_live_kv.png", merge, summary)


if __name__ == "__main__":
  main()
