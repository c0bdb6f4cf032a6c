"""Pareto plot of speedup vs quality (issue 5: "a Pareto plot (PNG) of speedup vs quality over λ
and rounds, with the baselines")."""

from __future__ import annotations

from typing import Sequence

__all__ = ["pareto_plot"]


def pareto_plot(points: Sequence[dict], path: str, *, xlabel: str = "wall-clock speedup over AR",
                ylabel: str = "quality", title: str = "") -> str:
  """Write a speedup-vs-quality scatter (PNG) with 95% CI error bars.

  Args:
    points: dicts with ``label``, ``x`` and ``y`` (``bootstrap_ci``-style dicts with ``mean``,
      ``lo``, ``hi``) and ``kind``: ``"pasta"`` (one per finetuned run / λ / round; joined by
      a line in the given order), ``"baseline"`` (SoT, APAR: squares) or ``"reference"`` (AR:
      a star).
    path: output PNG path.
    xlabel / ylabel / title: axis labels and title.

  Returns:
    ``path``.

  Raises:
    ValueError: no points, or a point without ``x``/``y``.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if not points:
    raise ValueError("pareto_plot needs at least one point")
  fig, ax = plt.subplots(figsize=(6, 4.5))
  style = {"pasta": dict(marker="o", color="C0"), "baseline": dict(marker="s", color="C1"),
           "reference": dict(marker="*", color="k", markersize=12)}
  pasta_xy = []
  for p in points:
    if "x" not in p or "y" not in p:
      raise ValueError(f"point {p.get('label')!r} lacks x or y")
    x, y = p["x"], p["y"]
    xerr = [[x["mean"] - x["lo"]], [x["hi"] - x["mean"]]]
    yerr = [[y["mean"] - y["lo"]], [y["hi"] - y["mean"]]]
    st = style.get(p.get("kind", "pasta"), style["pasta"])
    ax.errorbar([x["mean"]], [y["mean"]], xerr=xerr, yerr=yerr, linestyle="none", capsize=3,
                **st)
    ax.annotate(p.get("label", ""), (x["mean"], y["mean"]), textcoords="offset points",
                xytext=(5, 5), fontsize=8)
    if p.get("kind", "pasta") == "pasta":
      pasta_xy.append((x["mean"], y["mean"]))
  if len(pasta_xy) > 1:
    ax.plot(*zip(*pasta_xy), color="C0", alpha=0.5)
  ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
