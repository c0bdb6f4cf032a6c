"""Segment attention: Pallas kernel (interpret mode on CPU) vs its jnp reference vs a naive loop.

Random masks come from :mod:`kernels_pallas.testing` (i.i.d. segments, packed documents,
interleaved PASTA threads with bidirectional chunks, PTD-like trees; dead keys; fully masked
rows), drawn by hypothesis together with GQA ratios, lengths that are not block multiples and
dtypes. Tolerances (atol = rtol) are ``segment_attention.TOLERANCES``: f32 1e-5, bf16 2e-2.
``KERNEL_FUZZ_EXAMPLES`` raises the number of hypothesis examples (default 15).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels_pallas import segment_attention as sa
from kernels_pallas import segment_mask as sm
from kernels_pallas import testing as kt

from tests.repo_files import load_module

EXAMPLES = int(os.environ.get("KERNEL_FUZZ_EXAMPLES", "15"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
META = ("q_segment", "kv_segment", "q_order", "kv_order", "kv_alive", "visible", "bidir")


def _meta(case):
  return tuple(jnp.asarray(case[k]) for k in META)


def _qkv(rng, B, H, K, T, S, D, dtype):
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32).astype(dtype)
  return f(B, H, T, D), f(B, K, S, D), f(B, K, S, D)


def _assert_close(out, ref, dtype):
  tol = sa.TOLERANCES[jnp.dtype(dtype)]
  out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(out32))
  np.testing.assert_allclose(out32, ref32, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# the references are right: naive per-pair Python loops on tiny inputs

def _naive_attention(q, k, v, case, scale):
  B, H, T, D = q.shape
  K, S = k.shape[1], k.shape[2]
  out = np.zeros((B, H, T, D))
  for b in range(B):
    for h in range(H):
      kh = h // (H // K)
      for t in range(T):
        seen = [kt.naive_visible(int(case["q_segment"][b, t]), int(case["q_order"][b, t]),
                                 int(case["kv_segment"][b, s]), int(case["kv_order"][b, s]),
                                 bool(case["kv_alive"][b, s]), case["visible"][b],
                                 case["bidir"][b]) for s in range(S)]
        out[b, h, t] = kt.naive_attention_row(q[b, h, t], k[b, kh], v[b, kh], seen, scale)
  return out


@pytest.mark.parametrize("kind", kt.KINDS)
def test_reference_matches_naive_loop(kind):
  rng = np.random.default_rng(7)
  for _ in range(2):
    case = kt.segment_case(rng, B=2, T=5, S=7, G=4, kind=kind, dead_frac=0.3)
    mask = np.asarray(sm.pair_visible(*[jnp.asarray(case[k]) for k in (
        "q_segment", "q_order", "kv_segment", "kv_order", "kv_alive", "visible", "bidir")]))
    for b, t, s in np.ndindex(mask.shape):
      assert mask[b, t, s] == kt.naive_visible(
          int(case["q_segment"][b, t]), int(case["q_order"][b, t]),
          int(case["kv_segment"][b, s]), int(case["kv_order"][b, s]),
          bool(case["kv_alive"][b, s]), case["visible"][b], case["bidir"][b])
    q, k, v = _qkv(rng, 2, 4, 2, 5, 7, 3, jnp.float32)
    ref = sa.segment_attention_reference(q, k, v, *_meta(case), scale=0.7)
    naive = _naive_attention(np.asarray(q), np.asarray(k), np.asarray(v), case, 0.7)
    np.testing.assert_allclose(np.asarray(ref), naive, atol=1e-5, rtol=1e-5)


def test_reference_matches_model_attention():
  # Where every query sees at least one key (a well-formed mask: tokens see themselves), the
  # reference equals the model's dense-mask attention (layout [B, T, H, D]).
  from selforch_jax.models.transformer import attention
  rng = np.random.default_rng(2)
  case = kt.segment_case(rng, B=2, T=24, S=24, G=6, kind=["pasta", "tree"])
  q, k, v = _qkv(rng, 2, 6, 2, 24, 24, 8, jnp.float32)
  mask = sm.pair_visible(*[jnp.asarray(case[k]) for k in (
      "q_segment", "q_order", "kv_segment", "kv_order", "kv_alive", "visible", "bidir")])
  assert bool(jnp.all(jnp.any(mask, axis=-1)))
  ref = sa.segment_attention_reference(q, k, v, *_meta(case))
  t = lambda x: jnp.swapaxes(x, 1, 2)
  model = t(attention(t(q), t(k), t(v), mask, jnp.float32))
  np.testing.assert_allclose(np.asarray(ref), np.asarray(model), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# kernel vs reference

@settings(FUZZ, max_examples=max(1, 2 * EXAMPLES // 3))
@given(seed=st.integers(0, 2**31 - 1),
       kinds=st.lists(st.sampled_from(kt.KINDS), min_size=4, max_size=4),
       heads=st.sampled_from([(1, 1), (3, 3), (4, 2), (6, 2)]),
       ts=st.sampled_from([(40, 40), (23, 23), (9, 37)]),
       G=st.sampled_from([4, 6, 40]), dead=st.sampled_from([0.0, 0.3, 0.9]),
       dtype=st.sampled_from(["float32", "bfloat16"]),
       block=st.sampled_from([(16, 16), (32, 16)]))
def test_kernel_matches_reference(seed, kinds, heads, ts, G, dead, dtype, block):
  # Two mask draws per example share one compilation (G in {4, 6, 40} keeps the shapes of
  # every kind equal, see kernels_pallas.testing): 2x the masks for the compile time.
  rng = np.random.default_rng(seed)
  H, K = heads
  T, S = ts
  for kind_pair, dead_frac in ((kinds[:2], dead), (kinds[2:], 0.5 - dead / 2)):
    case = kt.segment_case(rng, B=2, T=T, S=S, G=G, kind=kind_pair, dead_frac=dead_frac)
    q, k, v = _qkv(rng, 2, H, K, T, S, 8, jnp.dtype(dtype))
    out = sa.segment_attention(q, k, v, *_meta(case), interpret=True,
                               block_sizes=sa.BlockSizes(*block))
    ref = sa.segment_attention_reference(q, k, v, *_meta(case))
    assert out.shape == q.shape and out.dtype == q.dtype
    _assert_close(out, ref, dtype)


def test_rows_that_see_nothing_are_zero_not_nan():
  rng = np.random.default_rng(1)
  case = kt.segment_case(rng, B=1, T=20, S=20, G=3, kind="packed")
  case["visible"][0, 1, :] = False                   # segment 1 sees nothing
  case["q_segment"][0, 0] = -1                        # a query of no segment
  q, k, v = _qkv(rng, 1, 2, 1, 20, 20, 8, jnp.float32)
  out = np.asarray(sa.segment_attention(q, k, v, *_meta(case), interpret=True,
                                        block_sizes=sa.BlockSizes(16, 16)))
  ref = np.asarray(sa.segment_attention_reference(q, k, v, *_meta(case)))
  blind = (case["q_segment"][0] == 1) | (case["q_segment"][0] == -1)
  assert blind.any() and np.all(np.isfinite(out))
  assert np.all(out[:, :, blind] == 0) and np.all(ref[:, :, blind] == 0)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  dead = dict(case, kv_alive=np.zeros_like(case["kv_alive"]))   # everything evicted
  out = sa.segment_attention(q, k, v, *_meta(dead), interpret=True,
                             block_sizes=sa.BlockSizes(16, 16))
  assert np.all(np.asarray(out) == 0)


def test_gradients_match_reference():
  # The Pallas backward (dQ kernel + dK/dV kernel over the transposed skip map), with GQA,
  # T != S, lengths that are not block multiples, dead keys and blind rows.
  rng = np.random.default_rng(3)
  case = kt.segment_case(rng, B=2, T=21, S=37, G=6, kind=["pasta", "random"], dead_frac=0.2)
  q, k, v = _qkv(rng, 2, 4, 2, 21, 37, 8, jnp.float32)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  kern = lambda *a: jnp.sum(w * sa.segment_attention(*a, *_meta(case), interpret=True,
                                                     block_sizes=sa.BlockSizes(16, 16)))
  ref = lambda *a: jnp.sum(w * sa.segment_attention_reference(*a, *_meta(case)))
  for g1, g2 in zip(jax.grad(kern, (0, 1, 2))(q, k, v), jax.grad(ref, (0, 1, 2))(q, k, v)):
    assert np.all(np.isfinite(np.asarray(g1)))
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), atol=1e-5, rtol=1e-5)


def test_kernels_lower_for_gpu_triton():
  # Cross-platform lowering runs the Pallas -> Triton lowering on this CPU host: it checks the
  # kernels (forward and both backward kernels) are expressible on the GPU backend (power-of-two
  # tensors, supported primitives, dot shapes) without a GPU.
  rng = np.random.default_rng(0)
  case = kt.segment_case(rng, B=1, T=200, S=200, G=6, kind="pasta")
  q, k, v = _qkv(rng, 1, 9, 3, 200, 200, 40, jnp.bfloat16)
  grad = jax.grad(lambda q, k, v: jnp.sum(sa.segment_attention(
      q, k, v, *_meta(case), interpret=False, block_sizes=sa.BlockSizes(64, 32)
  ).astype(jnp.float32)), (0, 1, 2))
  try:
    text = jax.jit(grad).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
  except ImportError as e:   # a jaxlib without the Triton dialect
    pytest.skip(f"no Triton lowering in this jaxlib: {e}")
  for name in ("segment_attention_fwd", "segment_attention_dq", "segment_attention_dkv"):
    assert name in text, name


# ---------------------------------------------------------------------------------------------
# the skip pre-pass

def _dense_tiles(case, bq, bk):
  mask = np.asarray(sm.pair_visible(*[jnp.asarray(case[k]) for k in (
      "q_segment", "q_order", "kv_segment", "kv_order", "kv_alive", "visible", "bidir")]))
  B, T, S = mask.shape
  Tp, Sp = sm.round_up(T, bq), sm.round_up(S, bk)
  mask = np.pad(mask, ((0, 0), (0, Tp - T), (0, Sp - S)))
  return mask.reshape(B, Tp // bq, bq, Sp // bk, bk).any(axis=(2, 4))


@settings(max_examples=2 * EXAMPLES, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**31 - 1), kinds=st.permutations(kt.KINDS),
       ts=st.sampled_from([(64, 64), (30, 70)]), G=st.sampled_from([7, 40]),
       dead=st.sampled_from([0.0, 0.5, 0.95]), blocks=st.sampled_from([(8, 8), (16, 32)]))
def test_skip_prepass_is_conservative_and_exact(seed, kinds, ts, G, dead, blocks):
  rng = np.random.default_rng(seed)
  bq, bk = blocks
  case = kt.segment_case(rng, B=4, T=ts[0], S=ts[1], G=G, kind=kinds, dead_frac=dead)
  tiles = np.asarray(sa.visible_tiles(*_meta(case), block_q=bq, block_k=bk))
  dense = _dense_tiles(case, bq, bk)
  assert not np.any(dense & ~tiles), "a tile with a visible pair would be skipped"
  np.testing.assert_array_equal(tiles, dense)     # and the pre-pass is exact at tile level


def test_pasta_skip_ratio_eight_threads():
  meta = sm.pasta_mask_metadata(2048, 8)
  seg, order = jnp.asarray(meta["segment"]), jnp.asarray(meta["order"])
  m = (seg, seg, order, order, jnp.asarray(meta["alive"]), jnp.asarray(meta["visible"]),
       jnp.asarray(meta["bidir"]))
  r128 = sa.tile_skip_ratio(*m, block_q=128, block_k=128)
  r64 = sa.tile_skip_ratio(*m, block_q=64, block_k=64)
  # Causal alone skips 120/256 tiles at 128; threads that do not see each other skip more.
  assert 120 / 256 < r128 < 1 and r64 >= r128
  case = {"q_segment": meta["segment"], "kv_segment": meta["segment"], "q_order": meta["order"],
          "kv_order": meta["order"], "kv_alive": meta["alive"], "visible": meta["visible"],
          "bidir": meta["bidir"]}
  assert r128 == pytest.approx(1 - _dense_tiles(case, 128, 128).mean())


# ---------------------------------------------------------------------------------------------
# validation

def test_validators_name_the_bad_argument():
  rng = np.random.default_rng(0)
  case = kt.segment_case(rng, B=1, T=8, S=8, G=3, kind="packed")
  q, k, v = _qkv(rng, 1, 3, 1, 8, 8, 4, jnp.float32)
  m = list(_meta(case))
  call = lambda *a, **kw: sa.segment_attention(*a, interpret=True, **kw)
  with pytest.raises(ValueError, match=r"k and v must have the same shape"):
    call(q, k, v[:, :, :4], *m)
  with pytest.raises(ValueError, match=r"multiple of KV heads"):
    call(q, jnp.concatenate([k, k], 1), jnp.concatenate([v, v], 1), *m)
  with pytest.raises(ValueError, match=r"q must have shape \[B, H, T, D\]"):
    call(q[0], k, v, *m)
  with pytest.raises(ValueError, match=r"kv_segment must have shape \[B, S\]"):
    call(q, k, v, m[0], m[1][:, :5], *m[2:])
  with pytest.raises(ValueError, match=r"kv_alive must be bool"):
    call(q, k, v, *m[:4], m[4].astype(jnp.int32), *m[5:])
  with pytest.raises(ValueError, match=r"q_order must have an integer dtype"):
    call(q, k, v, m[0], m[1], m[2].astype(jnp.float32), *m[3:])
  with pytest.raises(ValueError, match=r"bidir must have shape \[B, G\]"):
    call(q, k, v, *m[:6], m[6][:, :2])
  with pytest.raises(ValueError, match=r"share a dtype"):
    call(q, k.astype(jnp.bfloat16), v, *m)
  with pytest.raises(ValueError, match=r"power of two"):
    sa.segment_attention(q, k, v, *m, interpret=False, block_sizes=sa.BlockSizes(24, 16))
  with pytest.raises(ValueError, match=r"kv_segment values must lie in \[0, G=3\)"):
    sa.check_values(case["q_segment"], case["kv_segment"] + 5, case["visible"])


# ---------------------------------------------------------------------------------------------
# the GPU benchmark script runs (interpret mode, tiny sizes)

def test_gpu_bench_cpu_smoke(tmp_path):
  bench = load_module("bench/kernels_gpu.py")
  out = bench.main(["--cpu_smoke", f"--out={tmp_path}", "--dtypes=float32"])
  data = json.loads((tmp_path / "kernels_gpu.json").read_text())
  assert data["all_ok"] and out["all_ok"], data["errors"]
  assert data["prefill"] and data["train"] and data["decode"] and not data["errors"]
  for c in data["prefill"] + data["train"] + data["decode"]:
    assert c["ok"] and c["kernel_ms"] > 0 and c["xla_dense_ms"] > 0
  skip = data["skip"]["pasta_ar_threads"]
  assert skip["tile_skip_ratio_block128"] > 0.5
  assert 0 <= data["skip"]["decode_pool_page_skip_ratio"] < 1
