"""Segment-visibility metadata shared by the attention kernels (DESIGN.md §2).

The rule (one place, used by both kernels and both references): query ``q`` sees key ``k`` iff

    alive[k] and visible[seg(q), seg(k)]
    and (seg(q) != seg(k) or bidir[seg(q)] or order(k) <= order(q))

Segment ids outside ``[0, G)`` (e.g. ``-1``, used for padding) belong to no segment: such a
query sees nothing and such a key is seen by no query.

What lives here (all pure ``jnp``, jittable, no Pallas):

* :func:`pair_visible` — the dense ``[B, T, S]`` mask (the oracle of the references);
* :func:`query_visibility_words` / :func:`query_bidir` — per-query-row metadata the kernels
  use so that the in-kernel mask is elementwise only (no gathers): bit ``g % 32`` of word
  ``g // 32`` of a query row is ``visible[seg(q), g]``;
* :func:`tile_visibility` — the block-sparse pre-pass: per (q tile, kv tile), whether *any*
  pair in it is visible. It works from per-tile summaries (the set of segments in each tile,
  the largest query order and the smallest alive key order per segment), costs
  ``O((T + S) * G + nq * nk * G + nq * G^2)`` instead of ``O(T * S)``, and is *exact* at tile
  granularity (hence conservative: it never drops a tile holding a visible pair);
* :func:`compact_tiles` — the per-row list of visible tiles the kernels iterate over
  (the "data_next" idea of JAX's splash attention, as a compacted list instead);
* :func:`pasta_mask_metadata` — a PASTA-shaped layout (prefix, plan of promises, N
  asynchronous threads, sync tail) for benchmarks and skip-ratio figures.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

# Large finite negative logit for masked entries (as JAX's Pallas attention ops); the
# kernels also zero masked probabilities explicitly, so a row that sees nothing gives 0.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

_INT_MIN = np.iinfo(np.int32).min
_INT_MAX = np.iinfo(np.int32).max


def next_power_of_2(n: int) -> int:
  """Smallest power of two >= ``n`` (>= 1)."""
  n = int(n)
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


def round_up(n: int, m: int) -> int:
  return -(-int(n) // int(m)) * int(m)


def _take_rows(table: jax.Array, idx: jax.Array) -> jax.Array:
  """``table[b, idx[b, t]]`` with out-of-range ids giving ``False`` rows.

  table: ``[B, G, ...]``; idx: ``[B, T]`` -> ``[B, T, ...]``.
  """
  G = table.shape[1]
  ok = (idx >= 0) & (idx < G)
  safe = jnp.where(ok, idx, 0)
  rows = jax.vmap(lambda tb, ib: tb[ib])(table, safe)
  ok = ok.reshape(ok.shape + (1,) * (rows.ndim - 2))
  return rows & ok


@jax.jit
def pair_visible(q_segment, q_order, kv_segment, kv_order, kv_alive, visible, bidir):
  """Dense visibility mask ``[B, T, S]`` (bool) of DESIGN.md §2.

  Args:
    q_segment, q_order: ``[B, T]`` integer segment id / sequence order of each query.
    kv_segment, kv_order: ``[B, S]`` integer segment id / sequence order of each key.
    kv_alive: ``[B, S]`` bool.
    visible: ``[B, G, G]`` bool, ``visible[b, i, j]``: segment i may see segment j.
    bidir: ``[B, G]`` bool, attention inside the segment is bidirectional.
  """
  rows = _take_rows(visible, q_segment)                      # [B, T, G]
  G = visible.shape[-1]
  k_ok = (kv_segment >= 0) & (kv_segment < G)
  k_safe = jnp.where(k_ok, kv_segment, 0)
  vis = jnp.take_along_axis(
      rows, jnp.broadcast_to(k_safe[:, None, :], rows.shape[:2] + k_safe.shape[1:]), axis=2)
  vis = vis & k_ok[:, None, :]
  q_bidir = _take_rows(bidir, q_segment)                     # [B, T]
  same = q_segment[:, :, None] == kv_segment[:, None, :]
  causal_ok = kv_order[:, None, :] <= q_order[:, :, None]
  return kv_alive[:, None, :] & vis & (~same | q_bidir[:, :, None] | causal_ok)


def query_visibility_words(q_segment: jax.Array, visible: jax.Array,
                           num_words: int | None = None) -> jax.Array:
  """Bit-packed visibility rows ``[B, W, T]`` int32 of each query.

  Bit ``g % 32`` of word ``g // 32`` is ``visible[b, q_segment[b, t], g]`` (0 for an
  out-of-range query segment). ``W = num_words`` (default ``ceil(G / 32)``; extra words are 0).
  """
  B, T = q_segment.shape
  G = visible.shape[-1]
  W = max(1, -(-G // 32))
  num_words = W if num_words is None else num_words
  if num_words < W:
    raise ValueError(f"num_words={num_words} < ceil(G/32)={W} for G={G}")
  rows = _take_rows(visible, q_segment)                      # [B, T, G]
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, num_words * 32 - G)))
  rows = rows.reshape(B, T, num_words, 32).astype(jnp.uint32)
  words = jnp.sum(rows << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
  words = jax.lax.bitcast_convert_type(words, jnp.int32)     # [B, T, W]
  return jnp.transpose(words, (0, 2, 1))


def query_bidir(q_segment: jax.Array, bidir: jax.Array) -> jax.Array:
  """``bidir[b, q_segment[b, t]]`` as ``[B, T]`` bool (False for out-of-range ids)."""
  return _take_rows(bidir, q_segment)


def tile_visibility(q_segment, q_order, q_valid, kv_segment, kv_order, kv_alive, visible,
                    bidir, *, block_q: int, block_k: int) -> jax.Array:
  """Per-tile visibility ``[B, T // block_q, S // block_k]`` (bool), exact at tile level.

  ``T`` and ``S`` must be multiples of the block sizes (pad first: padded queries with
  ``q_valid=False``, padded keys with ``kv_alive=False``). A tile is True iff some pair
  (q, k) in it is visible under :func:`pair_visible`. From per-tile summaries:

  * cross-segment pairs: the tile holds a query of segment ``a`` and an alive key of segment
    ``b != a`` with ``visible[a, b]``;
  * same-segment pairs: both hold segment ``g``, ``visible[g, g]`` and (``bidir[g]`` or the
    smallest alive key order of ``g`` in the kv tile <= the largest query order of ``g`` in
    the q tile).

  Both conditions are exact since queries and keys of one tile pair combine freely.
  """
  B, T = q_segment.shape
  S = kv_segment.shape[1]
  G = visible.shape[-1]
  if T % block_q or S % block_k:
    raise ValueError(f"tile_visibility needs T={T} % block_q={block_q} == 0 and "
                     f"S={S} % block_k={block_k} == 0 (pad first)")
  nq, nk = T // block_q, S // block_k
  q_oh = jax.nn.one_hot(q_segment, G, dtype=jnp.bool_) & q_valid[..., None]     # [B,T,G]
  k_oh = jax.nn.one_hot(kv_segment, G, dtype=jnp.bool_) & kv_alive[..., None]   # [B,S,G]
  present_q = q_oh.reshape(B, nq, block_q, G).any(axis=2)                        # [B,nq,G]
  present_k = k_oh.reshape(B, nk, block_k, G).any(axis=2)                        # [B,nk,G]
  q_max = jnp.where(q_oh, q_order[..., None].astype(jnp.int32), _INT_MIN)
  q_max = q_max.reshape(B, nq, block_q, G).max(axis=2)                            # [B,nq,G]
  k_min = jnp.where(k_oh, kv_order[..., None].astype(jnp.int32), _INT_MAX)
  k_min = k_min.reshape(B, nk, block_k, G).min(axis=2)                            # [B,nk,G]
  eye = jnp.eye(G, dtype=jnp.bool_)
  off_diag = (visible & ~eye).astype(jnp.int32)
  # cross[b, i, g]: tile i holds a query of some segment a != g with visible[a, g].
  cross = jnp.einsum("bia,bag->big", present_q.astype(jnp.int32), off_diag) > 0
  diag = jnp.diagonal(visible, axis1=1, axis2=2)                                  # [B,G]
  same = (present_q[:, :, None, :] & diag[:, None, None, :]
          & (bidir[:, None, None, :] | (k_min[:, None, :, :] <= q_max[:, :, None, :])))
  hit = present_k[:, None, :, :] & (cross[:, :, None, :] | same)                 # [B,nq,nk,G]
  return hit.any(axis=-1)


def compact_tiles(tile_map: jax.Array, length: int | None = None):
  """Compacted visible-tile lists of a ``[..., n]`` bool map.

  Returns ``(ids, counts)``: ``ids[..., :counts]`` are the indices of the True entries in
  increasing order (the rest are the False entries, to be ignored); ``ids`` has ``length``
  entries (default ``n``; extra entries repeat index 0), ``counts`` is int32.
  """
  n = tile_map.shape[-1]
  ids = jnp.argsort(~tile_map, axis=-1, stable=True).astype(jnp.int32)
  counts = jnp.sum(tile_map, axis=-1, dtype=jnp.int32)
  if length is not None and length > n:
    pad = [(0, 0)] * (ids.ndim - 1) + [(0, length - n)]
    ids = jnp.pad(ids, pad)
  return ids, counts


def pasta_mask_metadata(seq_len: int, num_threads: int = 8, *, batch: int = 1,
                        prefix_len: int | None = None, promise_len: int = 16,
                        tail_len: int | None = None, bidir_chunks: bool = False,
                        chunks_see_full_plan: bool = False) -> dict:
  """A PASTA-shaped training layout (DESIGN.md §3), as numpy metadata.

  ``prefix · PLAN(promise_1 … promise_n) · chunk_1 … chunk_n · tail`` with segments
  ``0`` = prefix, ``1..n`` = promise k, ``n+1..2n`` = chunk k, ``2n+1`` = tail (after
  ``<sync/>``). Prefix and plan are causal and see what precedes them; chunk k sees the
  prefix, the plan up to promise k (all of it with ``chunks_see_full_plan``) and itself (causal,
  or bidirectional with ``bidir_chunks``, as Planned Diffusion), not its siblings; the tail sees
  everything. Orders are the training positions ``0..seq_len-1``.

  Returns a dict of ``segment [B, S] int32``, ``order [B, S] int32``, ``alive [B, S] bool``,
  ``visible [B, G, G] bool``, ``bidir [B, G] bool`` (``G = 2n + 2``) and ``lengths``.
  """
  n = int(num_threads)
  prefix_len = max(1, seq_len // 16) if prefix_len is None else prefix_len
  tail_len = max(1, seq_len // 16) if tail_len is None else tail_len
  plan_len = n * promise_len
  chunk_total = seq_len - prefix_len - plan_len - tail_len
  if chunk_total < n:
    raise ValueError(f"seq_len={seq_len} too short for {n} threads with prefix {prefix_len}, "
                     f"plan {plan_len} and tail {tail_len}")
  chunk_lens = [chunk_total // n + (1 if k < chunk_total % n else 0) for k in range(n)]
  G = 2 * n + 2
  seg = [0] * prefix_len
  for k in range(n):
    seg += [1 + k] * promise_len
  for k in range(n):
    seg += [1 + n + k] * chunk_lens[k]
  seg += [G - 1] * tail_len
  seg = np.asarray(seg, np.int32)
  vis = np.zeros((G, G), bool)
  vis[0, 0] = True
  for k in range(n):
    p = 1 + k
    vis[p, 0] = True
    vis[p, 1:p + 1] = True                       # earlier promises and itself (causal)
    c = 1 + n + k
    vis[c, 0] = True
    vis[c, 1:(n + 1 if chunks_see_full_plan else p + 1)] = True
    vis[c, c] = True
  vis[G - 1, :] = True
  bid = np.zeros((G,), bool)
  if bidir_chunks:
    bid[1 + n:1 + 2 * n] = True
  rep = lambda a: np.broadcast_to(a, (batch,) + a.shape).copy()
  return dict(segment=rep(seg), order=rep(np.arange(seq_len, dtype=np.int32)),
              alive=np.ones((batch, seq_len), bool), visible=rep(vis), bidir=rep(bid),
              lengths=dict(prefix=prefix_len, plan=plan_len, chunks=chunk_lens, tail=tail_len))
