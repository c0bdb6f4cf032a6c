"""Random segment-mask cases for kernel tests and fuzzing (numpy only, deterministic per rng).

Layout kinds (``KINDS``):

* ``"random"``: i.i.d. segment ids in ``[-1, G)`` (``-1`` = no segment), random orders and a
  random ``visible`` matrix — the adversarial case (many fully masked rows, ties in order);
* ``"packed"``: contiguous documents, each a segment seeing only itself (causal), as packed
  training batches;
* ``"pasta"``: prefix, plan of promises, ``n`` threads and a sync tail with PASTA's
  visibility (:func:`kernels_pallas.segment_mask.pasta_mask_metadata`), chunks randomly
  bidirectional (Planned Diffusion), threads *interleaved* in slot order (as a decode pool);
* ``"tree"``: one segment per node of a random tree, each node seeing its ancestors (PTD).

Every case may add dead keys (``dead_frac``).
"""

from __future__ import annotations

import math

import numpy as np

KINDS = ("random", "packed", "pasta", "tree")


def _pasta(rng, S, G):
  n = max(1, (G - 2) // 2)
  G = 2 * n + 2
  prefix = max(1, S // 6)
  plan = max(n, S // 6)
  tail = max(0, S // 8)
  rest = S - prefix - plan - tail
  if rest < n:
    return None
  seg = np.empty(S, np.int32)
  seg[:prefix] = 0
  seg[prefix:prefix + plan] = 1 + np.sort(rng.integers(0, n, plan))     # promises in order
  seg[prefix + plan:prefix + plan + rest] = 1 + n + rng.integers(0, n, rest)  # interleaved
  seg[S - tail:] = G - 1
  vis = np.zeros((G, G), bool)
  vis[0, 0] = True
  for k in range(n):
    vis[1 + k, 0] = True
    vis[1 + k, 1:2 + k] = True
    c = 1 + n + k
    vis[c, 0] = True
    vis[c, 1:2 + k] = True
    vis[c, c] = True
  vis[G - 1] = True
  bid = np.zeros(G, bool)
  bid[1 + n:1 + 2 * n] = rng.random(n) < 0.5
  return seg, vis, bid


def _tree(rng, S, G):
  parent = np.full(G, -1)
  for g in range(1, G):
    parent[g] = rng.integers(0, g)
  vis = np.zeros((G, G), bool)
  for g in range(G):
    a = g
    while a >= 0:
      vis[g, a] = True
      a = parent[a]
  # tokens: nodes in order, each node a run of tokens
  seg = np.sort(rng.integers(0, G, S)).astype(np.int32)
  return seg, vis, np.zeros(G, bool)


def _packed(rng, S, G):
  seg = np.sort(rng.integers(0, G, S)).astype(np.int32)
  return seg, np.eye(G, dtype=bool), np.zeros(G, bool)


def sequence_metadata(rng: np.random.Generator, S: int, G: int, kind: str):
  """One sequence of ``S`` tokens: ``(segment [S], order [S], visible [G', G'], bidir [G'])``.

  ``G'`` may differ from ``G`` for ``"pasta"`` (rounded to ``2n + 2``).
  """
  if kind == "random":
    seg = rng.integers(-1, G, S).astype(np.int32)
    order = rng.integers(0, max(2, S // 2), S).astype(np.int32)
    return seg, order, rng.random((G, G)) < 0.5, rng.random(G) < 0.3
  if kind == "pasta":
    r = _pasta(rng, S, max(G, 4))
    if r is None:
      return sequence_metadata(rng, S, G, "packed")
    seg, vis, bid = r
  elif kind == "tree":
    seg, vis, bid = _tree(rng, S, G)
  elif kind == "packed":
    seg, vis, bid = _packed(rng, S, G)
  else:
    raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
  return seg, np.arange(S, dtype=np.int32), vis, bid


def segment_case(rng: np.random.Generator, *, B: int, T: int, S: int, G: int, kind: str,
                 dead_frac: float = 0.0) -> dict:
  """Metadata of :func:`kernels_pallas.segment_attention.segment_attention` (numpy).

  ``kind``: one of :data:`KINDS`, or a sequence of ``B`` kinds (one per batch row).
  Keys are the ``S`` tokens of a sequence; queries are its last ``T`` tokens when ``T <= S``
  (prefill of a suffix / training with ``T == S``), else ``T`` tokens drawn with replacement.
  Returns ``q_segment, q_order [B, T]``, ``kv_segment, kv_order, kv_alive [B, S]``,
  ``visible [B, G', G']``, ``bidir [B, G']``.
  """
  kinds = [kind] * B if isinstance(kind, str) else list(kind)
  if len(kinds) != B:
    raise ValueError(f"kind must be a str or {B} kinds (one per row), got {kind!r}")
  rows = [sequence_metadata(rng, S, G, kd) for kd in kinds]
  Gs = max(r[2].shape[0] for r in rows)
  out = {k: [] for k in ("q_segment", "q_order", "kv_segment", "kv_order", "kv_alive",
                         "visible", "bidir")}
  for seg, order, vis, bid in rows:
    g = vis.shape[0]
    v = np.zeros((Gs, Gs), bool)
    v[:g, :g] = vis
    b = np.zeros(Gs, bool)
    b[:g] = bid
    idx = np.arange(S - T, S) if T <= S else rng.integers(0, S, T)
    out["q_segment"].append(seg[idx])
    out["q_order"].append(order[idx])
    out["kv_segment"].append(seg)
    out["kv_order"].append(order)
    out["kv_alive"].append(rng.random(S) >= dead_frac)
    out["visible"].append(v)
    out["bidir"].append(b)
  return {k: np.stack(v) for k, v in out.items()}


def paged_case(rng: np.random.Generator, *, B: int, Tq: int, num_pages: int, page_size: int,
               max_pages: int, G: int, kind: str, dead_frac: float = 0.0,
               unused_frac: float = 0.2) -> dict:
  """Metadata of :func:`kernels_pallas.paged_attention.paged_attention` (numpy).

  The pool holds one random layout of ``num_pages * page_size`` slots (segment/order per slot);
  each sequence's page table draws pages from the pool (shared pages allowed, as forks share
  a prefix) with ``unused_frac`` entries ``-1``; queries take segments/orders of random pool
  slots (orders shifted to the end, as new tokens), one random ``visible``/``bidir`` per row
  for ``"random"``, the pool layout's for the others.
  """
  n = num_pages * page_size
  seg, order, vis, bid = sequence_metadata(rng, n, G, kind)
  Gs = vis.shape[0]
  pt = rng.integers(0, num_pages, (B, max_pages)).astype(np.int32)
  pt[rng.random((B, max_pages)) < unused_frac] = -1
  idx = rng.integers(0, n, (B, Tq))
  q_seg = seg[idx]
  if kind != "random":
    q_seg = np.where(q_seg < 0, 0, q_seg)
  q_order = (order[idx] + (0 if kind == "random" else rng.integers(0, 3, (B, Tq)))).astype(
      np.int32)
  if kind == "random":
    visible = rng.random((B, Gs, Gs)) < 0.5
    bidir = rng.random((B, Gs)) < 0.3
  else:
    visible = np.broadcast_to(vis, (B, Gs, Gs)).copy()
    bidir = np.broadcast_to(bid, (B, Gs)).copy()
  return dict(page_table=pt,
              slot_alive=(rng.random(n) >= dead_frac).reshape(num_pages, page_size),
              slot_segment=seg.reshape(num_pages, page_size),
              slot_order=order.reshape(num_pages, page_size),
              q_segment=q_seg.astype(np.int32), q_order=q_order, visible=visible, bidir=bidir)


def naive_visible(qs: int, qo: int, ks: int, ko: int, alive: bool, visible, bidir) -> bool:
  """The DESIGN.md §2 rule for one (query, key) pair, in plain Python."""
  G = len(bidir)
  if not alive or not (0 <= qs < G) or not (0 <= ks < G):
    return False
  if not visible[qs][ks]:
    return False
  return qs != ks or bool(bidir[qs]) or ko <= qo


def naive_attention_row(q_vec, keys, values, seen, scale: float) -> np.ndarray:
  """One query row of softmax attention by a per-key Python loop (the tests' ground truth).

  Args:
    q_vec: ``[D]`` query; ``keys``, ``values``: sequences of ``[D]`` vectors;
    seen: sequence of bools, whether the query sees each key; scale: logit scale.

  Returns:
    ``[D]`` float64; zeros when the query sees no key (the kernels' convention).
  """
  logits = [scale * float(np.dot(q_vec, k)) for k, s in zip(keys, seen) if s]
  vals = [np.asarray(v, np.float64) for v, s in zip(values, seen) if s]
  if not logits:
    return np.zeros(np.shape(q_vec))
  m = max(logits)
  w = [math.exp(x - m) for x in logits]
  return sum(wi * vi for wi, vi in zip(w, vals)) / sum(w)
