"""Planned Diffusion attention masks in the upstream data format (issue 21).

Follows planned-diffusion/planned-diffusion's v2 / v3 mask rules, restated in issue 21: tokens are
strings in our tag names (upstream ``<promise>-<topic>`` / ``</topic>`` are our ``<promise>`` /
``</promise>``, ``<|im_end|>`` is EOS, anything else an ordinary token).
"""

import numpy as np

from selforch_jax.lang.mask import build_layout
from selforch_jax.lang.tags import ASYNC_CLOSE, ASYNC_OPEN, SYNC, TagVocab

__all__ = ["upstream_mask", "planned_diffusion_layout", "dense_round_mask"]


def planned_diffusion_layout(token_ids, tag_vocab, **kwargs):
  """The Planned Diffusion training = decoding layout of our tag format, from the one mask builder.

  A chunk sees the prefix, the whole plan of its round and itself (bidirectionally); nothing
  outside a chunk sees it until ``<sync/>``; after ``<sync/>`` every completed chunk is visible.
  This is :func:`~selforch_jax.lang.mask.build_layout` with ``async_sees_full_plan=True`` and
  ``chunk_bidirectional=True``.

  Args:
    token_ids: ``int[N]`` token ids.
    tag_vocab: the vocabulary's :class:`~selforch_jax.lang.tags.TagVocab`.
    **kwargs: other :func:`build_layout` options (doc_ids, eos_ids, cap, length_unit).

  Returns:
    :class:`~selforch_jax.lang.mask.Layout` (``token_mask()`` is the bool [N, N] mask).

  Raises:
    ValueError: as :func:`build_layout`.
  """
  return build_layout(token_ids, tag_vocab, async_sees_full_plan=True, chunk_bidirectional=True,
                      **kwargs)


def _blocks(tokens, variant):
  """[(start, end_inclusive, closed)] of ``<async>``..``</async>`` regions (tags included)."""
  blocks, start = [], None
  for i, tok in enumerate(tokens):
    if tok == ASYNC_OPEN and start is None:
      start = i
    elif tok == ASYNC_CLOSE and start is not None:
      blocks.append([start, i, True])
      start = None
  if start is not None:
    blocks.append([start, len(tokens) - 1, False])
  if variant == "v3":
    merged = []
    for b in blocks:
      if merged and merged[-1][2] and b[0] == merged[-1][1] + 1:
        merged[-1][1], merged[-1][2] = b[1], b[2]
      else:
        merged.append(b)
    blocks = merged
  return [tuple(b) for b in blocks]


def upstream_mask(tokens, variant="v2"):
  """Upstream Planned Diffusion attention mask and AR mask.

  Args:
    tokens: list of n token strings.
    variant: "v2" (every ``<async>`` block its own region) or "v3" (back-to-back blocks,
      ``</async><async>``, merged into one region).

  Returns:
    (attention_mask, ar_mask): bool [n, n] (row i may attend column j) and bool [n] (False
    exactly on block positions, tags and PAD inside included).

  Rules: causal start; a block is bidirectional inside; no row outside a block sees its columns
  until a ``<sync/>`` after the block's end, at or before the row; parallel blocks never see each
  other; an unclosed block is diffusion from its ``<async>`` to the end.

  Raises:
    ValueError: unknown variant or tokens not a list of strings.
  """
  if variant not in ("v2", "v3"):
    raise ValueError(f"upstream_mask: variant must be 'v2' or 'v3', got {variant!r}")
  if not all(isinstance(t, str) for t in tokens):
    raise ValueError("upstream_mask: tokens must be a list of strings")
  n = len(tokens)
  mask = np.tril(np.ones((n, n), dtype=bool))
  ar_mask = np.ones((n,), dtype=bool)
  syncs = [i for i, t in enumerate(tokens) if t == SYNC]
  rows = np.arange(n)
  for start, end, _ in _blocks(tokens, variant):
    ar_mask[start:end + 1] = False
    later_syncs = [s for s in syncs if s > end]
    visible_from = later_syncs[0] if later_syncs else n
    outside = (rows < start) | (rows > end)
    hidden_rows = outside & (rows < visible_from)
    mask[np.ix_(hidden_rows, np.arange(start, end + 1))] = False
    mask[start:end + 1, start:end + 1] = True
  return mask, ar_mask


def dense_round_mask(tokens: np.ndarray, mask: np.ndarray, tv: TagVocab) -> np.ndarray:
  """Upstream's dense-attention ablation ("full attention", v3's merged blocks, for a round):
  ``mask`` with every chunk of a round (``<async>``..``</async>``, tags included) seeing every
  other chunk of the same round (rounds end at ``<sync/>``).

  Args:
    tokens: int ``[B, T]`` token ids (training rows' inputs, or whole sequences).
    mask: bool ``[B, T, T]`` query x key (e.g. :func:`planned_diffusion_layout`'s).
    tv: the tag vocab.

  Returns:
    bool ``[B, T, T]``.
  """
  tokens = np.asarray(tokens)
  opens = np.cumsum(tokens == tv.async_open, axis=1)
  closes = np.cumsum(tokens == tv.async_close, axis=1)
  in_chunk = ((opens - closes) > 0) | (tokens == tv.async_close)
  rnd = np.cumsum(tokens == tv.sync, axis=1)
  dense = (in_chunk[:, :, None] & in_chunk[:, None, :]
           & (rnd[:, :, None] == rnd[:, None, :]))
  return np.asarray(mask, bool) | dense
