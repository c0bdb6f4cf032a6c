"""QUEST with the compute saved (issue 22, "Beyond upstream"): ``sparsity="quest_gather(P)"``
gathers each (query, KV head)'s kept pages from the cache and attends over those only. It must
give ``quest(P)``'s logits (the mask over the whole key window) up to float summation order, the
numpy QUEST forward's logits, the same usage, and a dense action must still be the plain step
exactly."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import (
    attention, init_model, quest_gather_attention, quest_key_mask,
)
from selforch_jax.runtime.engine import (
    GATHER_MAX_QUERIES, Engine, gather_bucket, quest_gather_pages,
)
from selforch_jax.runtime.step import ForwardSpec, parse_sparsity
from tests.test_sol_knobs import np_sol_forward

ONE = (np.ones((1, 1), bool), np.zeros(1, bool))
N = 48
P = 4


@pytest.fixture(scope="module", params=["unroll", "scan"])
def model(request):
  return init_model(get_preset("tiny_llama").replace(layer_loop=request.param), seed=5)


@pytest.fixture(scope="module")
def prompt():
  return np.random.default_rng(7).integers(1, 256, N)


def decode_last(model, prompt, spec=None):
  """Plain prefill of ``prompt[:-1]``, then one decode step of its last token under ``spec``."""
  eng = Engine(model, num_pages=32, page_size=4, attention="reference")
  n = len(prompt) - 1
  eng.run_step(prompt[:n], np.arange(n), np.zeros(n), 0, *ONE)
  out, _ = eng.run_step(prompt[n:], [n], [0], 0, *ONE, spec=spec)
  return out, eng


def test_gather_attention_equals_the_mask_path_directly():
  rng = np.random.default_rng(0)
  B, T, H, K, Dh, S = 2, 3, 4, 2, 8, 37        # S not a whole number of pages
  q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.float32)
  keys = jnp.asarray(rng.normal(size=(B, S, K, Dh)), jnp.float32)
  vals = jnp.asarray(rng.normal(size=(B, S, K, Dh)), jnp.float32)
  mask = rng.random((B, T, S)) < 0.7           # ragged visibility, some dead slots
  mask[:, :, 30:] = False
  mask[1, 2] = False
  mask[1, 2, :5] = True                        # a short row: the dense rule
  mask = jnp.asarray(mask)
  kf = jnp.asarray([[0.25, 0.5, 0.3], [0.1, 1.0, 0.4]], jnp.float32)
  want = attention(q, keys, vals, quest_key_mask(q, keys, mask, kf, P), jnp.float32)
  kept = quest_key_mask(q, keys, mask, kf, P).sum(-1)
  for nb in (8, 10):                           # >= every query's need (8 visible pages)
    got, n_kept = quest_gather_attention(q, keys, vals, mask, kf, P, nb, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(n_kept), np.asarray(kept))
  # fresh K/V: the step's new keys at slots 3, 17, 40 (40: outside the window, dropped)
  slots = jnp.asarray([[3, 17, 40], [0, 29, 11]], jnp.int32)
  kn = jnp.asarray(rng.normal(size=(B, T, K, Dh)), jnp.float32)
  vn = jnp.asarray(rng.normal(size=(B, T, K, Dh)), jnp.float32)
  rows = jnp.arange(B)[:, None]
  k2 = keys.at[rows, slots].set(kn, mode="drop")
  v2 = vals.at[rows, slots].set(vn, mode="drop")
  want = attention(q, k2, v2, quest_key_mask(q, k2, mask, kf, P), jnp.float32)
  got, n_kept = quest_gather_attention(q, keys, vals, mask, kf, P, 8, jnp.float32,
                                       fresh=(kn, vn, slots))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(n_kept),
                                np.asarray(quest_key_mask(q, k2, mask, kf, P).sum(-1)))
  with pytest.raises(ValueError, match="num_pages"):
    quest_gather_attention(q, keys, vals, mask, kf, P, 11, jnp.float32)


def test_decode_step_matches_the_mask_path_and_numpy(model, prompt):
  for kappa in (0.25, 0.5):
    kf = np.ones(N)
    kf[-1] = kappa
    gat, eng = decode_last(model, prompt, ForwardSpec(outputs=("logits", "usage"),
                                                      sparsity=f"quest_gather({P})",
                                                      keep_frac=kf[-1:]))
    assert any(k[2][0] == "quest_gather" for k in eng.specs_used)   # the gather program ran
    msk, _ = decode_last(model, prompt, ForwardSpec(outputs=("logits", "usage"),
                                                    sparsity=f"quest({P})", keep_frac=kf[-1:]))
    np.testing.assert_allclose(np.asarray(gat["logits"]), np.asarray(msk["logits"]),
                               rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gat["usage"]), np.asarray(msk["usage"]), atol=1e-7)
    ref, usage = np_sol_forward(model, prompt, kf, np.ones(N), np.full(N, 16))
    np.testing.assert_allclose(np.asarray(gat["logits"])[0], ref[-1], atol=2e-4)
    np.testing.assert_allclose(np.asarray(gat["usage"])[0], usage[-1], atol=1e-6)
    assert np.asarray(gat["usage"])[0, 0] < 1
    plain, _ = decode_last(model, prompt)
    assert np.abs(np.asarray(plain)[0] - ref[-1]).max() > 1e-2       # the selection mattered


def test_dense_action_is_the_plain_step_exactly(model, prompt):
  plain, _ = decode_last(model, prompt)
  out, eng = decode_last(model, prompt, ForwardSpec(outputs=("logits", "usage"),
                                                    sparsity=f"quest_gather({P})",
                                                    keep_frac=[1.0]))
  np.testing.assert_array_equal(np.asarray(out["logits"]), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(out["usage"]), np.ones((1, 3)))
  assert all(k[2][0] != "quest_gather" for k in eng.specs_used)


def test_several_queries_of_different_sequences(model):
  """Three sequences decode one token each in one step (SOL's batched decode): the gather path
  equals the mask path per query, the fresh K/V of every query patched in."""
  rng = np.random.default_rng(3)
  vis = np.eye(3, dtype=bool)
  outs = {}
  for sp in (f"quest({P})", f"quest_gather({P})"):
    eng = Engine(model, num_pages=48, page_size=4, attention="reference")
    for r, n in enumerate((30, 41, 25)):
      eng.run_step(rng.integers(1, 256, n), np.arange(n), np.full(n, r), r, vis,
                   np.zeros(3, bool))
    out, _ = eng.run_step([5, 6, 7], [30, 41, 25], [0, 1, 2], [0, 1, 2], vis, np.zeros(3, bool),
                          spec=ForwardSpec(outputs=("logits", "usage"), sparsity=sp,
                                           keep_frac=[0.25, 1.0, 0.5]))
    outs[sp] = out
    rng = np.random.default_rng(3)
  a, b = outs[f"quest({P})"], outs[f"quest_gather({P})"]
  np.testing.assert_allclose(np.asarray(b["logits"]), np.asarray(a["logits"]), rtol=1e-5,
                             atol=2e-5)
  np.testing.assert_allclose(np.asarray(b["usage"]), np.asarray(a["usage"]), atol=1e-7)


def test_page_count_buckets_and_fallbacks():
  assert [gather_bucket(n) for n in (1, 2, 3, 4, 5, 6, 7, 9, 13, 250, 251)] == \
      [1, 2, 3, 4, 6, 6, 8, 12, 16, 256, 256]
  mask = np.zeros((2, 1024), bool)
  mask[0, :801] = True                         # 801 keys: 100.1 pages of 8
  kf = np.array([0.25, 1.0], np.float32)       # the padding row: no keys, dense
  assert quest_gather_pages(mask, kf, 8) == gather_bucket(math.ceil(0.25 * 801 / 8)) == 32
  assert quest_gather_pages(mask, np.array([0.5, 1.0]), 8) == 64
  assert quest_gather_pages(mask, np.array([1.0, 1.0]), 8) is None     # all dense
  assert quest_gather_pages(mask, np.array([0.9, 1.0]), 8) == 96       # 91 pages needed
  assert quest_gather_pages(mask, np.array([0.99, 1.0]), 8) is None    # 100 -> 128 of 128
  mask[1, :801] = True
  assert quest_gather_pages(mask, np.array([0.25, 1.0]), 8) is None    # a dense row: 101 pages
  big = np.zeros((GATHER_MAX_QUERIES * 2, 1024), bool)
  big[:, :801] = True
  assert quest_gather_pages(big, np.full(len(big), 0.1), 8) is None    # too many queries


def test_parse_and_spec_errors():
  assert parse_sparsity("quest_gather(8)") == ("quest_gather", 8)
  assert parse_sparsity("quest(8)") == ("quest", 8)
  with pytest.raises(ValueError, match="page size"):
    parse_sparsity("quest_gather(0)")
  with pytest.raises(ValueError, match="attn_mass"):
    ForwardSpec(outputs=("logits", "attn_mass"), sparsity="quest_gather(8)", keep_frac=[0.5])
