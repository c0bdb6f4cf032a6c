r"""A held-out metric vs training steps, from a training run's ``metrics.jsonl``.

Every trainer (``python -m selforch_jax.train``) appends one JSON row per logged step to
``<workdir>/metrics.jsonl``; eval rows carry ``eval_*`` keys (Orthrus: ``eval_accept_len``, the
teacher-forced acceptance length of the diffusion view's block drafts on held-out continuations,
bonus token included; ``eval_match``, the fraction of draft positions equal to the AR argmax).
This script collects the chosen keys per eval step (the last row wins when a resumed run logged
a step twice), writes them as JSON with where the curve flattens, and plots them.

"Flattens" is reported as the first eval step ``s`` with ``value(s) >= (1 - flat_tol) *
max(values)``: training past it gained less than ``flat_tol`` (relative).

Run:
  python bench/training_curve.py --metrics=out/orthrus_long/metrics.jsonl \
      --keys=eval_accept_len,eval_match --out=bench/results/orthrus_curve_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import write_result  # noqa: E402


def read_curve(path: str, keys: list[str]) -> dict[str, list]:
  """``{"step": [int], key: [float] ...}`` over the rows of ``path`` that carry every key,
  sorted by step, one value per step (the last logged).

  Raises:
    ValueError: ``path`` holds no row with all of ``keys``.
  """
  by_step: dict[int, dict] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      row = json.loads(line)
      if all(k in row for k in keys):
        by_step[int(row["step"])] = row
  if not by_step:
    raise ValueError(f"{path}: no row carries all of {keys}")
  steps = sorted(by_step)
  out: dict[str, list] = {"step": steps}
  for k in keys:
    out[k] = [float(by_step[s][k]) for s in steps]
  return out


def flattens_at(steps: list[int], values: list[float], tol: float) -> int:
  """The first step whose value is within ``tol`` (relative) of the curve's maximum."""
  best = max(values)
  return next(s for s, v in zip(steps, values) if v >= (1.0 - tol) * best)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--metrics", required=True, help="a training run's metrics.jsonl")
  ap.add_argument("--keys", default="eval_accept_len,eval_match")
  ap.add_argument("--flat_tol", type=float, default=0.05)
  ap.add_argument("--out", required=True, help="JSON path; the PNG goes beside it")
  a = ap.parse_args(argv)
  keys = [k for k in a.keys.split(",") if k]
  try:
    curve = read_curve(a.metrics, keys)
  except (OSError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  result = dict(metrics=a.metrics, keys=keys, flat_tol=a.flat_tol, curve=curve,
                max={k: max(curve[k]) for k in keys},
                max_step={k: curve["step"][curve[k].index(max(curve[k]))] for k in keys},
                final={k: curve[k][-1] for k in keys},
                flattens_at={k: flattens_at(curve["step"], curve[k], a.flat_tol) for k in keys})
  write_result(result, os.path.dirname(a.out) or ".", os.path.basename(a.out))
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.4), squeeze=False)
  for ax, k in zip(axes[0], keys):
    ax.plot(curve["step"], curve[k], marker="o")
    ax.axvline(result["flattens_at"][k], color="gray", ls=":", label="within "
               f"{a.flat_tol:.0%} of max")
    ax.set_xlabel("training step")
    ax.set_ylabel(k)
    ax.legend(fontsize=8)
  fig.tight_layout()
  png = os.path.splitext(a.out)[0] + ".png"
  fig.savefig(png, dpi=110)
  print(f"wrote {png}", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
