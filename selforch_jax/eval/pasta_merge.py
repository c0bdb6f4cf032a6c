r"""Merge PASTA evals run as shards over disjoint AlpacaEval prompt ranges into one report
(issue 5).

A PASTA eval runs every system (and every ``pareto`` run) on each prompt at batch 1, so its cost
is prompts x systems; on a machine with several cores, run it as shards with the same config and
contiguous ``offset`` / ``n`` ranges (one core each), then merge::

  taskset -c 0 python -m selforch_jax.eval --config=configs/eval_pasta.py --config.n=50 \
      --config.offset=0 --config.pasta=... --config.baseline=... --workdir=out/pasta_a &
  taskset -c 1 python -m selforch_jax.eval --config=configs/eval_pasta.py --config.n=50 \
      --config.offset=50 --config.pasta=... --config.baseline=... --workdir=out/pasta_b &
  wait
  python -m selforch_jax.eval.pasta_merge --out=out/pasta out/pasta_a out/pasta_b

Every figure of the merged ``pasta_eval.json`` is recomputed from the shards' per-prompt records
(:func:`selforch_jax.eval.pasta.summarize`: geometric-mean wall speedups with bootstrap CIs,
parse rates, NLL and its paired difference to AR, ...), so it is what one run over the union
reports given the same outputs. Each prompt's wall-clock ratio is measured within one shard (AR
and the system on the same core, one after the other), so shards on different cores compare
like with like; ``total_wall_s`` is the shards' sum and ``shard_wall_s`` keeps each. Judge win
rates and the forced-plan figures are not in the records: shards run with a judge or with
``forced.n > 0`` are refused. Writes the merged ``pasta_eval_records.jsonl`` and
``pasta_pareto.png`` too.
"""

from __future__ import annotations

import json
import os

import ml_collections

from selforch_jax.eval.pasta import pareto_figure, summarize, summary
from selforch_jax.eval.shards import check_contiguous, check_same_config, load_reports, merge_cli

__all__ = ["merge", "main"]


def _records(d: str, part: dict) -> dict[str, list[dict]]:
  """A shard's records by system, each checked to hold exactly the shard's prompts in order."""
  path = os.path.join(d, "pasta_eval_records.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{d}: no pasta_eval_records.jsonl")
  by: dict[str, list[dict]] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        by.setdefault(r["system"], []).append(r)
  want = list(range(*part["subset"]))
  for s in part["systems"]:
    if s not in by:
      raise ValueError(f"{path} has no records of system {s!r} (a stale or foreign records "
                       "file; pareto runs' records are named pasta[LABEL] since this merge "
                       "exists)")
    got = [r["prompt_index"] for r in by[s]]
    if got != want:
      raise ValueError(f"{path}: the {s} records are prompts {got[:3]}...{got[-3:]} "
                       f"({len(got)}), not {part['subset']} (a stale or foreign records file)")
  return by


def merge(shard_dirs: list[str], out_dir: str) -> dict:
  """Merge the shards' ``pasta_eval.json`` and records into ``out_dir`` (module docstring).

  Args:
    shard_dirs: PASTA eval workdirs, each with ``pasta_eval.json`` and
      ``pasta_eval_records.jsonl``.
    out_dir: where the merged ``pasta_eval.json``, records and ``pasta_pareto.png`` go (created).

  Returns:
    The merged report (the ``pasta_eval.json`` dict; ``shards`` lists the inputs).

  Raises:
    FileNotFoundError: a shard without ``pasta_eval.json`` or its records.
    ValueError: fewer than two shards; ``out_dir`` is one of them; configs that differ beyond
      ``offset`` / ``n``; a judge or ``forced.n > 0`` in the config; shards that ran other
      systems; prompt ranges that overlap or leave a gap; records that are not their shard's
      prompts.
  """
  shards = load_reports(shard_dirs, out_dir, "pasta_eval.json", "PASTA")
  first = shards[0][1]
  cfg = first["config"]
  check_same_config(shards)
  for d, s in shards[1:]:
    if list(s["systems"]) != list(first["systems"]):
      raise ValueError(f"{d}: systems {list(s['systems'])} != {list(first['systems'])}")
  if cfg["judge"]["backend"] not in ("", "none"):
    raise ValueError("judge win rates are not in the records, so judged shards cannot be "
                     "merged: run a judged eval unsharded (or shard with judge.backend='')")
  if cfg["forced"]["n"] > 0:
    raise ValueError("forced-plan figures are not in the records: run the shards with forced.n=0")
  parts = check_contiguous([(d, s) for d, s in shards], "AlpacaEval")
  recs: dict[str, list[dict]] = {s: [] for s in first["systems"]}
  for d, p in parts:
    by = _records(d, p)
    for s in recs:
      recs[s] += by[s]
  ec = ml_collections.ConfigDict(cfg)
  lo, hi = parts[0][1]["subset"][0], parts[-1][1]["subset"][1]
  out = {"n": hi - lo, "subset": [lo, hi], "file": first["file"],
         "config": {**cfg, "offset": lo, "n": hi - lo}, "machine": first["machine"],
         "models": first["models"], "systems": {}, "shards": [d for d, _ in parts],
         "shard_wall_s": [p.get("total_wall_s", 0.0) for _, p in parts]}
  for s, rs in recs.items():
    out["systems"][s] = summarize(rs, recs["ar"], ec)
  os.makedirs(out_dir, exist_ok=True)
  pareto_figure(out, False, out_dir)
  out["total_wall_s"] = sum(out["shard_wall_s"])   # summed: shards may run in parallel
  with open(os.path.join(out_dir, "pasta_eval_records.jsonl"), "w", encoding="utf-8") as f:
    for rs in recs.values():
      for r in rs:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
  with open(os.path.join(out_dir, "pasta_eval.json"), "w") as f:
    json.dump(out, f, indent=2)
  return out


def main(argv=None) -> None:
  """CLI: ``python -m selforch_jax.eval.pasta_merge --out=DIR SHARD_DIR SHARD_DIR ...``."""
  merge_cli(argv, "python -m selforch_jax.eval.pasta_merge", "PASTA",
            "pasta_eval.json, pasta_eval_records.jsonl and pasta_pareto.png", merge, summary)


if __name__ == "__main__":
  main()
