r"""One Pareto plot of several Planned Diffusion variants on the cities task (issue 21), from the
JSONs of ``bench/planned_diffusion.py`` runs on the same examples (same ``--seed``).

Two panels, item exact-match accuracy (95% bootstrap CI) on the y axis of both:
critical path / AR's (sequential forwards after the prefill; lower = fewer steps) and wall-clock
speedup over AR (AR wall / PD wall; higher = faster), each with its paired 95% CI, as the runs
recorded them (``vs_ar``). A point's label: its unmask settings and n (answers). AR-SFT is drawn
once, from the run with the most answers (its accuracy on that run's examples).

Also prints, per run, its figures on the examples every run reached (the common prefix: the
runs decode the examples in the same order and stop at their time cap), so variants with
different n can be compared on the same examples.

Run:
  python bench/planned_diffusion_pareto.py bench/results/planned_diffusion_cities_pd235_*_cpu.json \
      --out=bench/results/planned_diffusion_cities_pareto_cpu.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def variant_label(args: dict) -> str:
  """Short name of a run's unmask settings, e.g. ``ratio 0.5, pad_last, spread``."""
  parts = [f"ratio {args['steps_ratio']:g}"]
  if args.get("threshold"):
    parts = [f"threshold {args['threshold']:g}"]
  parts += [k for k in ("pad_last", "spread", "pad_tail", "seed_topic") if args.get(k)]
  if args.get("window"):
    parts.append(f"window {args['window']}")
  return ", ".join(parts)


def load_runs(paths: list[str]) -> list[dict]:
  """The runs' JSONs (``path`` added), checked to be cities runs with PD and AR records.

  Raises:
    ValueError: a run of another task, or without ``vs_ar["pd"]`` / AR records, or runs of
      different evaluation seeds (other examples).
  """
  runs = []
  for p in paths:
    with open(p, encoding="utf-8") as f:
      d = json.load(f)
    if d.get("task") != "cities" or "pd" not in d.get("vs_ar", {}) or "ar" not in d["records"]:
      raise ValueError(f"{p}: not a cities run with PD and AR records")
    d["path"] = p
    runs.append(d)
  seeds = {d["args"]["seed"] for d in runs}
  if len(seeds) != 1:
    raise ValueError(f"runs of different --seed (other examples): {sorted(seeds)}")
  return runs


def common_prefix(runs: list[dict]) -> list[dict]:
  """Per run, item accuracy and critical-path ratio on the first ``m`` examples, ``m`` = the
  fewest answers of any run: ``[{"label", "n", "items", "item_accuracy", "cp_ratio"}]``."""
  m = min(len(d["records"]["pd"]) for d in runs)
  rows = []
  for d in runs:
    pd, ar = d["records"]["pd"][:m], d["records"]["ar"][:m]
    items = sum(r["items"] for r in pd)
    rows.append(dict(label=variant_label(d["args"]), n=m, items=items,
                     item_accuracy=sum(r["items_correct"] for r in pd) / items,
                     cp_ratio=float(np.mean([r["critical_path"] for r in pd])
                                    / np.mean([r["critical_path"] for r in ar]))))
  return rows


def plot(runs: list[dict], path: str) -> str:
  """Write the two-panel PNG (module docstring); returns ``path``."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
  ref = max(runs, key=lambda d: d["systems"]["ar"]["n_answers"])
  ar_acc = ref["systems"]["ar"]["item_accuracy"]
  for ax, key, xlabel in ((axes[0], "critical_path_ratio", "critical path / AR (lower = fewer "
                           "sequential forwards)"),
                          (axes[1], "speedup", "wall-clock speedup over AR (batch 1, 2 CPU cores)")):
    for i, d in enumerate(runs):
      x, y = d["vs_ar"]["pd"][key], d["systems"]["pd"]["item_accuracy"]
      ax.errorbar([x["mean"]], [y["mean"]], xerr=[[x["mean"] - x["lo"]], [x["hi"] - x["mean"]]],
                  yerr=[[y["mean"] - y["lo"]], [y["hi"] - y["mean"]]], linestyle="none",
                  marker="o", capsize=3, color=f"C{i}",
                  label=f"PD {variant_label(d['args'])} (n={d['n_done']})")
    ax.errorbar([1.0], [ar_acc["mean"]], yerr=[[ar_acc["mean"] - ar_acc["lo"]],
                                               [ar_acc["hi"] - ar_acc["mean"]]],
                marker="*", markersize=12, color="k", linestyle="none", capsize=3,
                label=f"AR-SFT (n={ref['systems']['ar']['n_answers']})")
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    if key == "critical_path_ratio":
      ax.axvline(0.5, color="C3", linewidth=0.8, linestyle="--")
    ax.set_xlabel(xlabel, fontsize=9)
  axes[0].set_ylabel("item exact-match accuracy")
  axes[0].legend(fontsize=7, loc="lower right")
  fig.suptitle("cities (seed %d), Planned Diffusion unmask variants, greedy, batch 1"
               % runs[0]["args"]["seed"], fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("runs", nargs="+", help="bench/planned_diffusion.py cities JSONs")
  ap.add_argument("--out", default="bench/results/planned_diffusion_cities_pareto_cpu.png")
  args = ap.parse_args(argv)
  runs = load_runs(args.runs)
  for d in runs:
    s, v = d["systems"]["pd"], d["vs_ar"]["pd"]
    ia, cp, sp = s["item_accuracy"], v["critical_path_ratio"], v["speedup"]
    print(f"{os.path.basename(d['path'])}: {variant_label(d['args'])}: n={d['n_done']} "
          f"items={s['n_items']} item_acc {ia['mean']:.3f} [{ia['lo']:.3f}, {ia['hi']:.3f}] "
          f"cp {cp['mean']:.3f} [{cp['lo']:.3f}, {cp['hi']:.3f}] "
          f"speedup {sp['mean']:.3f} [{sp['lo']:.3f}, {sp['hi']:.3f}] "
          f"load {d['load_before']} -> {d['load_after']}")
  for r in common_prefix(runs):
    print(f"first {r['n']} examples ({r['items']} items): {r['label']}: item_acc "
          f"{r['item_accuracy']:.3f} cp {r['cp_ratio']:.3f}")
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  print(f"wrote {plot(runs, args.out)}", file=sys.stderr)


if __name__ == "__main__":
  main()
