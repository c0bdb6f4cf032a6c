"""Packing several examples per row, and the one-example-per-row (padded) alternative.

Input elements (from :func:`selforch_jax.data.tokenize.shift_for_lm`):
``{"tokens": int32[n], "targets": int32[n], "loss_mask": int32[n]}`` with ``n <= seq_len``.

Output rows, both modes (all ``int32[seq_len]``):

* ``tokens``      -- model input ids (``pad_id`` on padding);
* ``targets``     -- next-token ids, shifted inside each example (``pad_id`` on padding);
* ``loss_mask``   -- 1 where ``targets`` is trained on (0 on padding);
* ``segment_ids`` -- ``1..k`` for the k examples of the row, in order; 0 on padding;
* ``positions``   -- RoPE positions, restarting at 0 for every example; 0 on padding.

Packed mode is grain's first-fit packer (``grain.experimental.FirstFitPackIterDataset``,
``shuffle_bins=False``): elements are taken in order and each goes into the first of
``num_packing_bins`` open rows where it fits; when one does not fit in any, all open rows
are emitted in row order and a new set is started with that element. Its iterator state
is ``{"parent": <state>, "next_row": int, "counter": int}`` (JSON-serialisable), so resume
is exact. Feed the model ``mask = masks.segment_mask(segment_ids)`` so that packed
examples never attend to each other.
"""

from __future__ import annotations

from typing import Any, Mapping

import grain
import numpy as np

PACK_FEATURES = ("tokens", "targets", "loss_mask")
ROW_FEATURES = ("tokens", "targets", "loss_mask", "segment_ids", "positions")


def _rename_packed(row: Mapping[str, Any]) -> dict[str, np.ndarray]:
  return {
      "tokens": row["tokens"].astype(np.int32),
      "targets": row["targets"].astype(np.int32),
      "loss_mask": row["loss_mask"].astype(np.int32),
      "segment_ids": row["tokens_segment_ids"].astype(np.int32),
      "positions": row["tokens_positions"].astype(np.int32),
  }


def pack_dataset(ds: grain.IterDataset, seq_len: int, num_packing_bins: int,
                 pad_id: int = 0) -> grain.IterDataset:
  """Greedy first-fit packing of shifted examples into rows of ``seq_len`` tokens.

  Args:
    ds: IterDataset of ``{"tokens", "targets", "loss_mask"}`` 1-D arrays of equal length
      ``n`` (``1 <= n <= seq_len``); other keys are dropped.
    seq_len: row length T.
    num_packing_bins: number of rows filled at once (more bins = less padding, more
      reordering); rows are emitted in order, never shuffled.
    pad_id: id written to ``tokens`` / ``targets`` on padding.

  Returns:
    IterDataset of rows ``{tokens, targets, loss_mask, segment_ids, positions}``,
    each ``int32[seq_len]`` (see the module docstring).

  Raises:
    ValueError: at iteration time, from grain, if an element is longer than ``seq_len``;
      immediately if ``seq_len`` or ``num_packing_bins`` is < 1.
  """
  if seq_len < 1 or num_packing_bins < 1:
    raise ValueError(f"seq_len={seq_len} and num_packing_bins={num_packing_bins} must be >= 1")
  ds = ds.map(lambda ex: {k: np.asarray(ex[k], np.int32) for k in PACK_FEATURES})
  packed = grain.experimental.FirstFitPackIterDataset(
      ds,
      length_struct={k: seq_len for k in PACK_FEATURES},
      num_packing_bins=num_packing_bins,
      shuffle_bins=False,
      padding_struct={"tokens": pad_id, "targets": pad_id, "loss_mask": 0},
  )
  return packed.map(_rename_packed)


def pad_example(example: Mapping[str, Any], seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  """One shifted example as one row: padded to ``seq_len``, segment id 1, positions ``0..n-1``.

  Args:
    example: ``{"tokens", "targets", "loss_mask"}`` 1-D arrays of length ``n <= seq_len``.
    seq_len: row length T.
    pad_id: id written to ``tokens`` / ``targets`` on padding.

  Returns:
    ``{tokens, targets, loss_mask, segment_ids, positions}``, each ``int32[seq_len]``.

  Raises:
    ValueError: if ``n > seq_len``.
  """
  n = len(example["tokens"])
  if n > seq_len:
    raise ValueError(f"example of {n} tokens does not fit seq_len={seq_len}; truncate first")
  out = {}
  for k, fill in (("tokens", pad_id), ("targets", pad_id), ("loss_mask", 0)):
    row = np.full((seq_len,), fill, np.int32)
    row[:n] = np.asarray(example[k], np.int32)
    out[k] = row
  seg = np.zeros((seq_len,), np.int32)
  seg[:n] = 1
  pos = np.zeros((seq_len,), np.int32)
  pos[:n] = np.arange(n, dtype=np.int32)
  out["segment_ids"] = seg
  out["positions"] = pos
  return out


def pad_dataset(ds: grain.IterDataset, seq_len: int, pad_id: int = 0) -> grain.IterDataset:
  """The unpacked mode: :func:`pad_example` on every element (one example per row).

  Returns:
    IterDataset of rows with the same schema as :func:`pack_dataset`.
  """
  return ds.map(lambda ex: pad_example(ex, seq_len, pad_id))
