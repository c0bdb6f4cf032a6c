"""Confidence-ordered unmasking for masked-diffusion chunks (Planned Diffusion, issue 21).

Follows the Dream / Planned Diffusion sampler: going from noise level t to s < t, a chunk with
``masked`` still-masked positions commits ``max(1, int(masked * (1 - s / t)))`` of them, the most
confident first (confidence: negative entropy, top-1 minus top-2 probability margin, or top-1
probability). Host-side numpy on one chunk's logits.

:func:`select_spread` is the *spread* variant of the order: the same greedy walk down the
confidence order, but a position next to one already picked in the same step is skipped, so no
two adjacent positions of a chunk are committed together (two neighbours predicted from the same
masked context often disagree, e.g. both write the same word or split one number).
"""

import numpy as np

__all__ = ["unmask_count", "confidence", "select_unmask", "select_spread"]

CONFIDENCES = ("entropy", "margin", "prob")


def unmask_count(masked: int, s: float, t: float) -> int:
  """Positions to commit going from noise level t to s (``0 <= s < t <= 1``).

  Returns ``max(1, int(masked * (1 - s / t)))`` capped at ``masked`` (0 when nothing is masked).

  Raises:
    ValueError: ``masked < 0`` or not ``0 <= s < t <= 1``.
  """
  if masked < 0:
    raise ValueError(f"unmask_count: masked must be >= 0, got {masked}")
  if not 0.0 <= s < t <= 1.0:
    raise ValueError(f"unmask_count: need 0 <= s < t <= 1, got s={s}, t={t}")
  if masked == 0:
    return 0
  return min(masked, max(1, int(masked * (1.0 - s / t))))


def confidence(logits: np.ndarray, kind: str = "entropy") -> np.ndarray:
  """Per-position confidence, higher = more confident.

  Args:
    logits: float [L, V].
    kind: "entropy" (negative entropy, nats), "margin" (p1 - p2) or "prob" (p1).

  Returns:
    float64 [L].

  Raises:
    ValueError: unknown kind or logits not 2-D.
  """
  if kind not in CONFIDENCES:
    raise ValueError(f"confidence: kind must be one of {CONFIDENCES}, got {kind!r}")
  x = np.asarray(logits, dtype=np.float64)
  if x.ndim != 2:
    raise ValueError(f"confidence: logits must be [L, V], got shape {x.shape}")
  x = x - x.max(axis=-1, keepdims=True)
  logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
  p = np.exp(logp)
  if kind == "entropy":
    return (p * logp).sum(axis=-1)
  top = np.sort(p, axis=-1)
  if kind == "prob":
    return top[:, -1]
  return top[:, -1] - top[:, -2]


def select_unmask(logits: np.ndarray, is_masked: np.ndarray, count: int,
                  kind: str = "entropy") -> tuple[np.ndarray, np.ndarray]:
  """Greedy tokens and the ``count`` most confident masked positions to commit.

  Args:
    logits: float [L, V] of one chunk.
    is_masked: bool [L], positions still ``<|mask|>``.
    count: positions to commit (clipped to the masked count); ties break to the lower index.
    kind: confidence measure, see :func:`confidence`.

  Returns:
    (tokens int32 [L] argmax, commit bool [L], a subset of ``is_masked`` with ``count`` True).

  Raises:
    ValueError: shapes disagree or count < 0.
  """
  is_masked = np.asarray(is_masked, dtype=bool)
  if is_masked.shape != (np.shape(logits)[0],):
    raise ValueError(f"select_unmask: is_masked {is_masked.shape} vs logits {np.shape(logits)}")
  if count < 0:
    raise ValueError(f"select_unmask: count must be >= 0, got {count}")
  tokens = np.asarray(logits).argmax(axis=-1).astype(np.int32)
  conf = np.where(is_masked, confidence(logits, kind), -np.inf)
  order = np.argsort(-conf, kind="stable")[:min(count, int(is_masked.sum()))]
  commit = np.zeros_like(is_masked)
  commit[order] = True
  return tokens, commit


def select_spread(conf: np.ndarray, candidates: np.ndarray, count: int) -> np.ndarray:
  """At most ``count`` candidate positions, most confident first, no two of them adjacent.

  Walks the candidates in descending ``conf`` (ties to the lower index) and picks each one unless
  its left or right neighbour (index ``j - 1`` or ``j + 1``) was already picked by this call;
  stops after ``count`` picks. When the non-adjacency rule leaves fewer than ``count`` eligible
  candidates, the result has fewer than ``count`` True entries (it never relaxes the rule): the
  caller commits the rest at later steps. Positions already committed (not candidates) never
  block a neighbour. The first pick is always the most confident candidate, so the result is
  non-empty whenever ``count >= 1`` and a candidate exists.

  Args:
    conf: float [L], confidence per position (higher = more confident; see :func:`confidence`).
    candidates: bool [L], positions that may be picked (e.g. the still-masked ones).
    count: most positions to pick (>= 0).

  Returns:
    bool [L]: the picked positions, a subset of ``candidates``.

  Raises:
    ValueError: ``conf`` / ``candidates`` not the same 1-D shape, or ``count < 0``.
  """
  conf = np.asarray(conf, dtype=np.float64)
  candidates = np.asarray(candidates, dtype=bool)
  if conf.ndim != 1 or candidates.shape != conf.shape:
    raise ValueError(f"select_spread: conf {conf.shape} and candidates {candidates.shape} must "
                     "be the same 1-D shape")
  if count < 0:
    raise ValueError(f"select_spread: count must be >= 0, got {count}")
  L = conf.size
  picked = np.zeros(L, bool)
  if count == 0:
    return picked
  k = 0
  idx = np.flatnonzero(candidates)
  for j in idx[np.argsort(-conf[idx], kind="stable")]:
    if (j > 0 and picked[j - 1]) or (j + 1 < L and picked[j + 1]):
      continue
    picked[j] = True
    k += 1
    if k == count:
      break
  return picked
