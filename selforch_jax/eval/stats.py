"""Bootstrap confidence intervals (DESIGN §7: every headline number carries a 95% CI and its n).

* :func:`bootstrap_ci` — percentile bootstrap CI of a statistic (default: the mean) of one sample.
* :func:`paired_bootstrap_diff` — CI of the mean difference ``mean(a - b)`` of paired samples
  (same prompts, two systems), resampling prompts.
* :func:`format_ci` — ``"0.412 [0.330, 0.497] (n=100)"``.

Both are ``scipy.stats.bootstrap`` (``method="percentile"``; the paired one with
``paired=True``, which resamples the pairs together), in batches of at most about 4M resampled
entries so memory stays bounded for large n; the result depends only on the data, ``n_boot``,
``alpha``, ``seed`` and ``stat``. A sample of one value (which scipy refuses) gives
``lo == hi == mean``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from scipy import stats as _scipy_stats

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


def _vectorized(stat: Callable) -> Callable:
  """``stat`` as scipy wants it: ``f(*samples, axis=-1)`` reducing the last axis; uses
  ``stat(x, axis=-1)`` when ``stat`` supports it, else row by row."""

  def f(x, axis=-1):
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    try:
      out = np.asarray(stat(x, axis=-1), dtype=np.float64)
      if out.shape == x.shape[:-1]:
        return out
    except TypeError:
      pass
    flat = x.reshape(-1, x.shape[-1])
    return np.array([stat(row) for row in flat], dtype=np.float64).reshape(x.shape[:-1])

  return f


def _scipy_ci(data: tuple[np.ndarray, ...], statistic: Callable, n_boot: int, alpha: float,
              seed: int, paired: bool) -> tuple[float, float]:
  n = data[0].size
  res = _scipy_stats.bootstrap(
      data, statistic, n_resamples=n_boot, confidence_level=1.0 - alpha, method="percentile",
      paired=paired, vectorized=True, batch=max(1, _CHUNK_ELEMENTS // n),
      random_state=np.random.default_rng(seed))
  return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _check_args(n_boot: int, alpha: float) -> None:
  if n_boot < 1:
    raise ValueError(f"n_boot={n_boot} must be >= 1")
  if not 0.0 < alpha < 1.0:
    raise ValueError(f"alpha={alpha} must be in (0, 1)")


def bootstrap_ci(values: Sequence[float] | np.ndarray, n_boot: int = 10000, alpha: float = 0.05,
                 seed: int = 0, stat: Callable = np.mean) -> dict:
  """Percentile-bootstrap confidence interval of ``stat(values)``.

  ``scipy.stats.bootstrap`` with ``method="percentile"``: ``n_boot`` resamples of ``values``
  with replacement (``np.random.default_rng(seed)``), ``stat`` on each (``stat(x, axis=-1)``
  when ``stat`` accepts ``axis``, else row by row), and the ``alpha/2`` and ``1 - alpha/2``
  quantiles.

  Args:
    values: 1-D finite numbers (e.g. per-example 0/1 correctness); at least one.
    n_boot: number of bootstrap resamples.
    alpha: 1 - confidence level (0.05 gives a 95% interval).
    seed: RNG seed; the same seed gives the same interval.
    stat: statistic, default ``np.mean``.

  Returns:
    ``dict(mean=stat(values), lo=..., hi=..., n=len(values))`` (floats, ``n`` an int);
    ``mean`` is the statistic on the full sample, whatever ``stat`` is. A constant vector
    gives ``lo == hi == mean``; so does a single value.

  Raises:
    ValueError: ``values`` is not 1-D, empty or not finite; ``n_boot`` < 1; ``alpha`` not in (0, 1).
  """
  x = _as_1d(values, "values")
  _check_args(n_boot, alpha)
  mean = float(stat(x))
  if x.size == 1:
    return dict(mean=mean, lo=mean, hi=mean, n=1)
  lo, hi = _scipy_ci((x,), _vectorized(stat), n_boot, alpha, seed, paired=False)
  return dict(mean=mean, lo=lo, hi=hi, n=int(x.size))


def paired_bootstrap_diff(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
                          n_boot: int = 10000, alpha: float = 0.05, seed: int = 0,
                          stat: Callable = np.mean) -> dict:
  """Bootstrap CI of ``stat(a - b)`` (default the mean difference) on paired samples.

  ``a[i]`` and ``b[i]`` are two systems' scores on the same example ``i``; examples (pairs) are
  resampled together (``scipy.stats.bootstrap(..., paired=True)``), which is what makes the
  interval tighter than comparing two independent intervals. Same arguments and return dict as
  :func:`bootstrap_ci` (``mean`` is ``stat(a - b)``); identical arrays give ``[0, 0]``.

  Raises:
    ValueError: as :func:`bootstrap_ci`, or ``a`` and ``b`` differ in length.
  """
  x, y = _as_1d(a, "a"), _as_1d(b, "b")
  if x.shape != y.shape:
    raise ValueError(f"paired samples differ in length: {x.size} vs {y.size}")
  _check_args(n_boot, alpha)
  mean = float(stat(x - y))
  if x.size == 1:
    return dict(mean=mean, lo=mean, hi=mean, n=1)
  diff = _vectorized(stat)
  lo, hi = _scipy_ci((x, y), lambda u, v, axis=-1: diff(u - v, axis=axis), n_boot, alpha, seed,
                     paired=True)
  return dict(mean=mean, lo=lo, hi=hi, n=int(x.size))


def format_ci(d: dict, digits: int = 3) -> str:
  """``"0.412 [0.330, 0.497] (n=100)"`` from a :func:`bootstrap_ci` result (``digits`` decimals)."""
  return f"{d['mean']:.{digits}f} [{d['lo']:.{digits}f}, {d['hi']:.{digits}f}] (n={d['n']})"
