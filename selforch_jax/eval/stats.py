"""Bootstrap confidence intervals (DESIGN §7: every headline number carries a 95% CI and its n).

* :func:`bootstrap_ci` — percentile bootstrap CI of a statistic (default: the mean) of one sample.
* :func:`paired_bootstrap_diff` — CI of the mean difference ``mean(a - b)`` of paired samples
  (same prompts, two systems), resampling prompts.
* :func:`format_ci` — ``"0.412 [0.330, 0.497] (n=100)"``.

Vectorised numpy: resample indices are drawn as one ``(n_boot, n)`` integer matrix (in chunks of
at most about 4M entries, so memory stays bounded for large n); the result depends only on the
data, ``n_boot``, ``alpha``, ``seed`` and ``stat``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

__all__ = ["bootstrap_ci", "paired_bootstrap_diff", "format_ci"]

_CHUNK_ELEMENTS = 1 << 22


def _as_1d(values: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
  x = np.asarray(values, dtype=np.float64)
  if x.ndim != 1:
    raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
  if x.size == 0:
    raise ValueError(f"{name} is empty: a confidence interval needs at least one value")
  if not np.all(np.isfinite(x)):
    raise ValueError(f"{name} contains NaN or inf")
  return x


def _stat_rows(stat: Callable, samples: np.ndarray) -> np.ndarray:
  """``stat`` of each row of ``samples``; uses ``axis=1`` when ``stat`` supports it."""
  try:
    out = np.asarray(stat(samples, axis=1), dtype=np.float64)
    if out.shape == (samples.shape[0],):
      return out
  except TypeError:
    pass
  return np.array([stat(row) for row in samples], dtype=np.float64)


def bootstrap_ci(values: Sequence[float] | np.ndarray, n_boot: int = 10000, alpha: float = 0.05,
                 seed: int = 0, stat: Callable = np.mean) -> dict:
  """Percentile-bootstrap confidence interval of ``stat(values)``.

  Draws ``n_boot`` resamples of ``values`` with replacement (``np.random.default_rng(seed)``),
  computes ``stat`` on each (``stat(samples, axis=1)`` when ``stat`` accepts ``axis``, else row by
  row), and returns the ``alpha/2`` and ``1 - alpha/2`` quantiles.

  Args:
    values: 1-D finite numbers (e.g. per-example 0/1 correctness); at least one.
    n_boot: number of bootstrap resamples.
    alpha: 1 - confidence level (0.05 gives a 95% interval).
    seed: RNG seed; the same seed gives the same interval.
    stat: statistic, default ``np.mean``.

  Returns:
    ``dict(mean=stat(values), lo=..., hi=..., n=len(values))`` (floats, ``n`` an int);
    ``mean`` is the statistic on the full sample, whatever ``stat`` is. A constant vector
    gives ``lo == hi == mean``.
  """
  x = _as_1d(values, "values")
  if n_boot < 1:
    raise ValueError(f"n_boot={n_boot} must be >= 1")
  if not 0.0 < alpha < 1.0:
    raise ValueError(f"alpha={alpha} must be in (0, 1)")
  n = x.size
  rng = np.random.default_rng(seed)
  rows_per_chunk = max(1, _CHUNK_ELEMENTS // n)
  boots = []
  for start in range(0, n_boot, rows_per_chunk):
    rows = min(rows_per_chunk, n_boot - start)
    idx = rng.integers(0, n, size=(rows, n))
    boots.append(_stat_rows(stat, x[idx]))
  boot = np.concatenate(boots)
  lo, hi = np.quantile(boot, [alpha / 2.0, 1.0 - alpha / 2.0])
  return dict(mean=float(stat(x)), lo=float(lo), hi=float(hi), n=int(n))


def paired_bootstrap_diff(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
                          n_boot: int = 10000, alpha: float = 0.05, seed: int = 0,
                          stat: Callable = np.mean) -> dict:
  """Bootstrap CI of ``stat(a - b)`` (default the mean difference) on paired samples.

  ``a[i]`` and ``b[i]`` are two systems' scores on the same example ``i``; examples (pairs) are
  resampled together, which is what makes the interval tighter than comparing two independent
  intervals. Same arguments and return dict as :func:`bootstrap_ci` (``mean`` is
  ``stat(a - b)``); identical arrays give ``[0, 0]``.
  """
  x, y = _as_1d(a, "a"), _as_1d(b, "b")
  if x.shape != y.shape:
    raise ValueError(f"paired samples differ in length: {x.size} vs {y.size}")
  return bootstrap_ci(x - y, n_boot=n_boot, alpha=alpha, seed=seed, stat=stat)


def format_ci(d: dict, digits: int = 3) -> str:
  """``"0.412 [0.330, 0.497] (n=100)"`` from a :func:`bootstrap_ci` result (``digits`` decimals)."""
  return f"{d['mean']:.{digits}f} [{d['lo']:.{digits}f}, {d['hi']:.{digits}f}] (n={d['n']})"
