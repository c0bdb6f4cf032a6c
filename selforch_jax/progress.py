"""Progress bars for long loops (eval over problems, annotation, data generation)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

__all__ = ["progress"]


def progress(iterable: Iterable, desc: str, total: int | None = None, unit: str = "it",
             **kwargs: Any) -> Iterable:
  """``iterable`` wrapped in a tqdm bar with rate and ETA, written to stderr.

  ``disable=None``: the bar is shown on a terminal and left out when stderr is not a TTY (log
  files stay clean). ``total`` defaults to ``len(iterable)`` when it has one.

  Args:
    iterable: what the loop runs over.
    desc: the bar's label, e.g. ``"tip eval"``.
    total: number of items, when ``iterable`` has no ``len``.
    unit: what one item is (``"problem"``, ``"batch"``, ...).
    **kwargs: more ``tqdm`` options.

  Returns:
    An iterable yielding the same items.
  """
  kwargs.setdefault("disable", None)
  return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True,
              **kwargs)
