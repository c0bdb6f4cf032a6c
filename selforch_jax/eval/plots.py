"""Pareto plot of speedup vs quality (issue 5: "a Pareto plot (PNG) of speedup vs quality over λ
and rounds, with the baselines")."""

from __future__ import annotations

from typing import Sequence

__all__ = ["pareto_plot"]


def pareto_plot(points: Sequence[dict], path: str, *, xlabel: str = "wall-clock speedup over AR",
                ylabel: str = "quality", title: str = "",
                series: dict[str, Sequence[str]] | None = None) -> str:
  """Write a speedup-vs-quality scatter (PNG) with 95% CI error bars.

  Args:
    points: dicts with ``label``, ``x`` and ``y`` (``bootstrap_ci``-style dicts with ``mean``,
      ``lo``, ``hi``) and ``kind``: ``"pasta"`` (one per finetuned run / λ / round; joined by
      a line in the given order unless ``series`` is given), ``"baseline"`` (SoT, APAR:
      squares) or ``"reference"`` (AR: a star).
    path: output PNG path.
    xlabel / ylabel / title: axis labels and title.
    series: name -> the labels of the points to join, in order (e.g. one λ's rounds, starting at
      the SFT model), one line and legend entry each; None joins every ``"pasta"`` point.

  Returns:
    ``path``.

  Raises:
    ValueError: no points, a point without ``x``/``y``, or a series naming an unknown label.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if not points:
    raise ValueError("pareto_plot needs at least one point")
  fig, ax = plt.subplots(figsize=(6, 4.5))
  style = {"pasta": dict(marker="o", color="C0"), "baseline": dict(marker="s", color="C1"),
           "reference": dict(marker="*", color="k", markersize=12)}
  by_label = {}
  for p in points:
    if "x" not in p or "y" not in p:
      raise ValueError(f"point {p.get('label')!r} lacks x or y")
    x, y = p["x"], p["y"]
    by_label[p.get("label", "")] = (x["mean"], y["mean"])
    xerr = [[x["mean"] - x["lo"]], [x["hi"] - x["mean"]]]
    yerr = [[y["mean"] - y["lo"]], [y["hi"] - y["mean"]]]
    st = style.get(p.get("kind", "pasta"), style["pasta"])
    ax.errorbar([x["mean"]], [y["mean"]], xerr=xerr, yerr=yerr, linestyle="none", capsize=3,
                **st)
    ax.annotate(p.get("label", ""), (x["mean"], y["mean"]), textcoords="offset points",
                xytext=(5, 5), fontsize=8)
  if series is None:
    series = {"": [p.get("label", "") for p in points if p.get("kind", "pasta") == "pasta"]}
  for i, (name, labels) in enumerate(series.items()):
    unknown = [lab for lab in labels if lab not in by_label]
    if unknown:
      raise ValueError(f"series {name!r} names unknown points {unknown}")
    if len(labels) > 1:
      ax.plot(*zip(*(by_label[lab] for lab in labels)), color=f"C{i + 2}" if name else "C0",
              alpha=0.6, label=name or None)
  if any(series):
    ax.legend(fontsize=8)
  ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title:
    ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
