"""Paged decode attention: Pallas kernel (interpret mode on CPU) vs jnp reference vs naive loop.

Random pools from :mod:`kernels_pallas.testing` (segment layouts of every kind, dead slots,
unused page-table entries, pages shared between sequences, queries that see nothing), GQA
ratios, page sizes, pages per block and flash-decoding splits, in float32 and bfloat16 with
``paged_attention.TOLERANCES`` (f32 1e-5, bf16 2e-2).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_pallas import paged_attention as pa
from kernels_pallas import testing as kt

EXAMPLES = int(os.environ.get("KERNEL_FUZZ_EXAMPLES", "15"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
META = ("page_table", "slot_alive", "slot_segment", "slot_order", "q_segment", "q_order",
        "visible", "bidir")


def _meta(case):
  return tuple(jnp.asarray(case[k]) for k in META)


def _inputs(rng, B, H, K, Tq, P, ps, D, dtype):
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32).astype(dtype)
  return f(B, H, Tq, D), f(K, P, ps, D), f(K, P, ps, D)


def _naive(q, kp, vp, case, scale):
  B, H, Tq, D = q.shape
  K, P, ps, _ = kp.shape
  out = np.zeros(q.shape)
  for b in range(B):
    slots = [(p, s) for p in case["page_table"][b] if p >= 0 for s in range(ps)]
    for h in range(H):
      kh = h // (H // K)
      for t in range(Tq):
        seen = [kt.naive_visible(int(case["q_segment"][b, t]), int(case["q_order"][b, t]),
                                 int(case["slot_segment"][p, s]), int(case["slot_order"][p, s]),
                                 bool(case["slot_alive"][p, s]), case["visible"][b],
                                 case["bidir"][b]) for p, s in slots]
        out[b, h, t] = kt.naive_attention_row(q[b, h, t], [kp[kh, p, s] for p, s in slots],
                                              [vp[kh, p, s] for p, s in slots], seen, scale)
  return out


@pytest.mark.parametrize("kind", kt.KINDS)
def test_reference_matches_naive_loop(kind):
  rng = np.random.default_rng(11)
  case = kt.paged_case(rng, B=2, Tq=3, num_pages=6, page_size=4, max_pages=4, G=4, kind=kind,
                       dead_frac=0.3)
  q, kp, vp = _inputs(rng, 2, 4, 2, 3, 6, 4, 5, jnp.float32)
  ref = pa.paged_attention_reference(q, kp, vp, *_meta(case), scale=0.6)
  naive = _naive(np.asarray(q), np.asarray(kp), np.asarray(vp), case, 0.6)
  np.testing.assert_allclose(np.asarray(ref), naive, atol=1e-5, rtol=1e-5)


@settings(FUZZ, max_examples=max(1, 2 * EXAMPLES // 3))
@given(seed=st.integers(0, 2**31 - 1), kinds=st.lists(st.sampled_from(kt.KINDS), min_size=2,
                                                      max_size=2),
       heads=st.sampled_from([(1, 1), (3, 1), (4, 2), (6, 3)]), Tq=st.sampled_from([1, 3, 8]),
       pool=st.sampled_from([(12, 4, 5), (7, 8, 6), (20, 2, 9)]),
       G=st.sampled_from([4, 40]), dead=st.sampled_from([0.0, 0.4, 0.95]),
       dtype=st.sampled_from(["float32", "bfloat16"]),
       blocks=st.sampled_from([(None, 1), (1, 3), (2, 2)]))
def test_kernel_matches_reference(seed, kinds, heads, Tq, pool, G, dead, dtype, blocks):
  # Two mask draws per example share one compilation (G in {4, 40} keeps the shapes of
  # every kind equal, see kernels_pallas.testing): 2x the masks for the compile time.
  rng = np.random.default_rng(seed)
  H, K = heads
  P, ps, mp = pool
  bs = pa.PagedBlockSizes(pages_per_block=blocks[0], num_splits=blocks[1])
  for kind, dead_frac in ((kinds[0], dead), (kinds[1], 0.5 - dead / 2)):
    case = kt.paged_case(rng, B=2, Tq=Tq, num_pages=P, page_size=ps, max_pages=mp, G=G,
                         kind=kind, dead_frac=dead_frac)
    q, kp, vp = _inputs(rng, 2, H, K, Tq, P, ps, 8, jnp.dtype(dtype))
    out = pa.paged_attention(q, kp, vp, *_meta(case), interpret=True, block_sizes=bs)
    ref = pa.paged_attention_reference(q, kp, vp, *_meta(case))
    assert out.shape == q.shape and out.dtype == q.dtype
    tol = pa.TOLERANCES[jnp.dtype(dtype)]
    out32 = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out32))
    np.testing.assert_allclose(out32, np.asarray(ref, np.float32), atol=tol, rtol=tol)


def _dense_pages(case):
  ps = case["slot_alive"].shape[1]
  B, mp = case["page_table"].shape
  out = np.zeros((B, mp), bool)
  for b, i in np.ndindex(B, mp):
    p = case["page_table"][b, i]
    if p < 0:
      continue
    out[b, i] = any(kt.naive_visible(int(case["q_segment"][b, t]), int(case["q_order"][b, t]),
                                     int(case["slot_segment"][p, s]),
                                     int(case["slot_order"][p, s]),
                                     bool(case["slot_alive"][p, s]), case["visible"][b],
                                     case["bidir"][b])
                    for t in range(case["q_segment"].shape[1]) for s in range(ps))
  return out


@settings(FUZZ, max_examples=2 * EXAMPLES)
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(kt.KINDS),
       dead=st.sampled_from([0.0, 0.5, 0.97]))
def test_page_skipping_is_conservative_and_exact(seed, kind, dead):
  rng = np.random.default_rng(seed)
  case = kt.paged_case(rng, B=3, Tq=4, num_pages=10, page_size=4, max_pages=8, G=6, kind=kind,
                       dead_frac=dead)
  pages = np.asarray(pa.visible_pages(*_meta(case)))
  dense = _dense_pages(case)
  assert not np.any(dense & ~pages), "a page with a visible slot would be skipped"
  np.testing.assert_array_equal(pages, dense)


def test_dead_and_unused_pages_are_skipped_and_blind_queries_are_zero():
  rng = np.random.default_rng(5)
  case = kt.paged_case(rng, B=2, Tq=2, num_pages=8, page_size=4, max_pages=6, G=3,
                       kind="packed", unused_frac=0.0)
  case["page_table"][0, :3] = -1
  case["page_table"][0, 3] = 8 + 3                            # out of range: treated as unused
  case["slot_alive"][case["page_table"][1, 0]] = False        # an evicted page
  case["visible"][1, :, :] = False                            # row 1 sees nothing at all
  pages = np.asarray(pa.visible_pages(*_meta(case)))
  assert not pages[0, :4].any() and not pages[1].any()
  q, kp, vp = _inputs(rng, 2, 2, 1, 2, 8, 4, 8, jnp.float32)
  out = np.asarray(pa.paged_attention(q, kp, vp, *_meta(case), interpret=True))
  ref = np.asarray(pa.paged_attention_reference(q, kp, vp, *_meta(case)))
  assert np.all(np.isfinite(out)) and np.all(out[1] == 0) and np.all(ref[1] == 0)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  assert 0 < pa.page_skip_ratio(*_meta(case)) <= 1


def test_validators_name_the_bad_argument():
  rng = np.random.default_rng(0)
  case = kt.paged_case(rng, B=1, Tq=2, num_pages=4, page_size=4, max_pages=3, G=3, kind="tree")
  q, kp, vp = _inputs(rng, 1, 2, 1, 2, 4, 4, 8, jnp.float32)
  m = list(_meta(case))
  call = lambda *a, **kw: pa.paged_attention(*a, interpret=True, **kw)
  with pytest.raises(ValueError, match=r"k_pages and v_pages must have the same shape"):
    call(q, kp, vp[:, :2], *m)
  with pytest.raises(ValueError, match=r"page_table must have shape \[B=1"):
    call(q, kp, vp, m[0][:, None], *m[1:])
  with pytest.raises(ValueError, match=r"slot_alive must have shape \[num_pages, page_size\]"):
    call(q, kp, vp, m[0], m[1][:2], *m[2:])
  with pytest.raises(ValueError, match=r"q_segment must have shape \[B, Tq\]"):
    call(q, kp, vp, *m[:4], m[4][:, :1], *m[5:])
  with pytest.raises(ValueError, match=r"multiple of KV heads"):
    call(q[:, :1], jnp.concatenate([kp, kp]), jnp.concatenate([vp, vp]), *m)
  with pytest.raises(ValueError, match=r"page_table must have an integer dtype"):
    call(q, kp, vp, m[0].astype(jnp.float32), *m[1:])
  with pytest.raises(ValueError, match=r"power-of-two page_size"):
    pa.paged_attention(q, kp, vp, *m, interpret=False,
                       block_sizes=pa.PagedBlockSizes(pages_per_block=3))
  with pytest.raises(ValueError, match=r"page_table values must lie in \[-1, num_pages=4\)"):
    pa.check_values(np.array([[0, 4]]), case["slot_segment"], case["q_segment"],
                    case["visible"])


def test_kernel_lowers_for_gpu_triton():
  # Cross-platform lowering runs the Pallas -> Triton lowering on this CPU host (see
  # test_kernels_segment.py): the paged kernel is expressible on the GPU backend.
  rng = np.random.default_rng(0)
  case = kt.paged_case(rng, B=2, Tq=16, num_pages=24, page_size=16, max_pages=12, G=18,
                       kind="pasta", dead_frac=0.3)
  q, kp, vp = _inputs(rng, 2, 9, 3, 16, 24, 16, 64, jnp.bfloat16)
  for bs in (pa.PagedBlockSizes(), pa.PagedBlockSizes(pages_per_block=2, num_splits=4)):
    f = lambda *a: pa.paged_attention(*a, interpret=False, block_sizes=bs)
    try:
      text = jax.jit(f).trace(q, kp, vp, *_meta(case)).lower(
          lowering_platforms=("cuda",)).as_text()
    except ImportError as e:
      pytest.skip(f"no Triton lowering in this jaxlib: {e}")
    assert "paged_segment_attention" in text
