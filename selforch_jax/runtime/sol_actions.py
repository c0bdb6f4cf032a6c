"""SOL's composite action space (Akhauri & Abdelfattah 2026, "Compute Where it Counts",
akhauriyash/SOL ``utils/actions.py``): the Cartesian product of token-attention keep fractions
kappa, MLP input channel keep fractions rho and MLP-output bit-widths b, flattened into one
categorical (kappa major, then rho, then bits), with the dense action ``(1, 1, 16)``; and the
:class:`~selforch_jax.runtime.step.ForwardSpec` that applies one action per query of a step.

Budgets and usage are in *usage units* ``[kappa, rho, bits / 16]`` (upstream's ``C_tok, C_pru,
C_q``; the step's ``usage`` output, :class:`~selforch_jax.runtime.step.ForwardSpec`).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from selforch_jax.runtime.step import ForwardSpec

# upstream grids (official_configs/All_Variants_Llama3B.yml and the README example) and the
# small CPU grid (issue 22 / seed_systems.md §6.3)
UPSTREAM_GRID = (tuple(round(0.1 * i, 2) for i in range(1, 11)),
                 tuple(round(0.40 + 0.05 * i, 2) for i in range(13)),
                 tuple(range(5, 17)))
README_GRID = ((0.2, 1.0), (1.0, 0.8, 0.6), (8, 16))
CPU_GRID = ((0.25, 0.5, 1.0), (0.6, 0.8, 1.0), (6, 8, 16))
GRIDS = {"upstream": UPSTREAM_GRID, "readme": README_GRID, "cpu": CPU_GRID}
DEFAULT_SPARSITY = "quest(8)"   # upstream quest_page_size 8


@dataclasses.dataclass(frozen=True)
class ActionGrid:
  """kappa x rho x bits flattened to ``A = |kappa| |rho| |bits|`` actions.

  Attributes:
    kappas: token-attention keep fractions in (0, 1]. rhos: MLP input channel keep fractions in
      (0, 1]. bits: MLP-output bit-widths in [2, 16] (16 = no quantisation).
    table: float64 ``[A, 3]``: action a's ``(kappa, rho, bits)``; dense_idx: the index of
      ``(1, 1, 16)``.

  Raises:
    ValueError: an empty axis, a value out of range, repeated values, or no dense action.
  """

  kappas: tuple[float, ...]
  rhos: tuple[float, ...]
  bits: tuple[int, ...]

  def __post_init__(self):
    for name, vals, lo, hi in (("kappa", self.kappas, 0.0, 1.0), ("rho", self.rhos, 0.0, 1.0),
                               ("bits", self.bits, 2, 16)):
      if not vals or len(set(vals)) != len(vals):
        raise ValueError(f"SOL grid: {name} values must be non-empty and distinct, got {vals}")
      if any(not (lo < float(v) <= hi if name != "bits" else lo <= v <= hi) for v in vals):
        raise ValueError(f"SOL grid: {name} values must be in ({lo}, {hi}], got {vals}")
    if 1.0 not in map(float, self.kappas) or 1.0 not in map(float, self.rhos) or 16 not in self.bits:
      raise ValueError("SOL grid needs the dense action: kappa 1, rho 1 and bits 16")

  @classmethod
  def named(cls, name: str) -> "ActionGrid":
    """``"upstream"`` (10 x 13 x 12 = 1560 actions), ``"readme"`` (2 x 3 x 2) or ``"cpu"``
    (3 x 3 x 3 = 27).

    Raises:
      ValueError: another name."""
    if name not in GRIDS:
      raise ValueError(f"unknown SOL grid {name!r}; known: {sorted(GRIDS)}")
    k, r, b = GRIDS[name]
    return cls(tuple(map(float, k)), tuple(map(float, r)), tuple(map(int, b)))

  @property
  def table(self) -> np.ndarray:
    return np.array(list(itertools.product(self.kappas, self.rhos, self.bits)), np.float64)

  @property
  def num_actions(self) -> int:
    return len(self.kappas) * len(self.rhos) * len(self.bits)

  @property
  def dense_idx(self) -> int:
    t = self.table
    return int(np.flatnonzero((t[:, 0] == 1) & (t[:, 1] == 1) & (t[:, 2] == 16))[0])

  def tags(self) -> list[str]:
    """Upstream's action names, e.g. ``k050-s070-q8``."""
    return [f"k{round(k * 100):03d}-s{round(r * 100):03d}-q{int(b)}" for k, r, b in self.table]

  def values(self, actions) -> np.ndarray:
    """float64 ``[N, 3]`` ``(kappa, rho, bits)`` of int actions ``[N]``.

    Raises:
      ValueError: an action outside ``[0, A)``."""
    a = np.asarray(actions, np.int64).reshape(-1)
    if a.size and (a.min() < 0 or a.max() >= self.num_actions):
      raise ValueError(f"SOL actions must be in [0, {self.num_actions}), got {a.min()}..{a.max()}")
    return self.table[a]

  def nominal_usage(self, actions) -> np.ndarray:
    """float64 ``[N, 3]`` nominal usage ``(kappa, rho, bits / 16)`` of actions ``[N]``."""
    v = self.values(actions)
    return np.stack([v[:, 0], v[:, 1], v[:, 2] / 16.0], -1)

  def low(self) -> np.ndarray:
    """The smallest usage each axis can ask for, ``(min kappa, min rho, min bits / 16)``."""
    return np.array([min(self.kappas), min(self.rhos), min(self.bits) / 16.0])

  def spec(self, actions, sparsity: str = DEFAULT_SPARSITY,
           outputs: Sequence[str] = ("logits", "hidden", "usage")) -> ForwardSpec:
    """The :class:`ForwardSpec` that applies action ``actions[t]`` to query t of a step:
    ``sparsity`` (QUEST page top-k or recency) at ``keep_frac = kappa``, the top ``ceil(rho
    D)`` MLP input channels by |h|, and MLP-output fake-quant to ``bits``. The dense action
    is the plain forward exactly (tests/test_sol_knobs.py)."""
    v = self.values(actions)
    return ForwardSpec(outputs=tuple(outputs), sparsity=sparsity,
                       keep_frac=v[:, 0].astype(np.float32),
                       mlp_keep_frac=v[:, 1].astype(np.float32),
                       query_bits=v[:, 2].astype(np.float32))


def parse_budget(text) -> np.ndarray:
  """``"0.5,0.8,8"`` (kappa, rho, bits) or a 3-sequence -> float64 usage-unit target
  ``[kappa, rho, bits / 16]``.

  Raises:
    ValueError: not three numbers, kappa / rho outside (0, 1], bits outside [2, 16]."""
  try:
    vals = [float(x) for x in str(text).split(",")] if isinstance(text, str) else \
        [float(x) for x in text]
  except (TypeError, ValueError):
    vals = []
  if len(vals) != 3:
    raise ValueError(f"SOL budget must be 'kappa,rho,bits' (e.g. 0.5,0.8,8), got {text!r}")
  k, r, b = vals
  if not (0 < k <= 1 and 0 < r <= 1 and 2 <= b <= 16):
    raise ValueError(f"SOL budget kappa and rho must be in (0, 1] and bits in [2, 16], got {text!r}")
  return np.array([k, r, b / 16.0])


def budget_triple(usage) -> list[float]:
  """Usage units ``[kappa, rho, bits / 16]`` -> ``[kappa, rho, bits]`` (rounded to 4 places), the
  form answers report."""
  u = np.asarray(usage, np.float64).reshape(3)
  return [round(float(u[0]), 4), round(float(u[1]), 4), round(float(u[2]) * 16.0, 4)]
