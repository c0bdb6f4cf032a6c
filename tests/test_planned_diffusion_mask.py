"""upstream_mask on hand-worked cases from issue 21's rules."""

import numpy as np
import pytest

from selforch_jax.lang import TagVocab
from selforch_jax.lang.planned_diffusion import planned_diffusion_layout, upstream_mask


def _m(rows):
  return np.array([[c == "1" for c in r] for r in rows])


def test_plain_causal():
  m, ar = upstream_mask(["a", "b", "c"])
  assert (m == np.tril(np.ones((3, 3), bool))).all() and ar.all()


def test_two_parallel_blocks_then_sync():
  # 0 p | 1 <async> 2 x 3 </async> | 4 <async> 5 y 6 </async> | 7 <sync/> 8 z
  toks = ["p", "<async>", "x", "</async>", "<async>", "y", "</async>", "<sync/>", "z"]
  m, ar = upstream_mask(toks, "v2")
  want = _m([
    "100000000",
    "111100000",
    "111100000",
    "111100000",
    "100011100",
    "100011100",
    "100011100",
    "111111110",
    "111111111",
  ])
  assert (m == want).all()
  assert (ar == np.array([1, 0, 0, 0, 0, 0, 0, 1, 1], bool)).all()


def test_v3_merges_back_to_back_blocks():
  toks = ["p", "<async>", "x", "</async>", "<async>", "y", "</async>", "<sync/>", "z"]
  m, _ = upstream_mask(toks, "v3")
  assert m[1:7, 1:7].all()
  assert not m[0, 1:].any() and m[7, :8].all()


def test_no_sync_hides_block_from_later_tokens():
  toks = ["p", "<async>", "x", "</async>", "q", "<|im_end|>"]
  m, ar = upstream_mask(toks)
  assert not m[4:, 1:4].any() and m[4, 0] and m[5, 4]
  assert (ar == np.array([1, 0, 0, 0, 1, 1], bool)).all()


def test_block_after_sync_sees_earlier_completed_block():
  toks = ["<async>", "x", "</async>", "<sync/>", "<async>", "y", "</async>"]
  m, _ = upstream_mask(toks)
  assert m[4:7, 0:3].all() and m[4:7, 4:7].all() and not m[0:3, 4:].any()


def test_unclosed_block_is_diffusion_to_end():
  m, ar = upstream_mask(["p", "<async>", "x", "y"])
  assert m[1:, 1:].all() and (ar == np.array([1, 0, 0, 0], bool)).all()


def test_bad_variant():
  with pytest.raises(ValueError, match="variant"):
    upstream_mask(["a"], "v9")


def test_our_format_layout_chunks_see_whole_plan_and_themselves():
  tv = TagVocab.appended(100, 4, digit_ids=range(10, 20), space_ids=[1], eos_ids=[2])
  p, cp, a, ca, s, mk, pd, x, y, z = 100, 101, 102, 103, 104, 105, 106, 50, 51, 59
  # 0 x | 1-5 promise y 1 | 6-10 promise z 1 | 11-14 chunk 0 | 15-18 chunk 1 | 19 sync | 20 x 21 EOS
  seq = [x, p, y, 1, 11, cp, p, z, 1, 11, cp, a, mk, pd, ca, a, mk, mk, ca, s, x, 2]
  m = planned_diffusion_layout(seq, tv).token_mask()
  want = np.tril(np.ones((22, 22), bool))
  want[11:15, :15] = True                      # chunk 0: prefix + whole plan + itself, bidir
  want[15:19, :11] = True                      # chunk 1: prefix + whole plan ...
  want[15:19, 11:15] = False                   # ... not its sibling
  want[15:19, 15:19] = True                    # ... and itself, bidir
  want[0:11, 11:] = False
  assert (m == want).all()
