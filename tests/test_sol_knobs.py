"""SOL's three knobs in the jitted step (issue 22; akhauriyash/SOL ``utils/masks.py``), per query,
against a forward written out in numpy (float64) on a tiny random model: QUEST page top-k per
(query, KV head), top-|h| MLP input channel keep, per-token absmax MLP-output fake-quant; the
usage the step reports equals what the numpy forward applied; the dense action is the plain
forward exactly."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax.models.config import get_preset
from selforch_jax.models.rope import apply_rope, rope_inv_freq
from selforch_jax.models.transformer import (
    SPARSE_DENSE_SINKS, SPARSE_DENSE_WINDOW, channel_keep_mask, fake_quant, fake_quant_rows,
    init_model,
)
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.step import ForwardSpec

ONE = (np.ones((1, 1), bool), np.zeros(1, bool))
N = 48
P = 4


@pytest.fixture(scope="module")
def model():
  return init_model(get_preset("tiny_llama").replace(layer_loop="scan"), seed=5)


@pytest.fixture(scope="module")
def prompt():
  return np.random.default_rng(7).integers(1, 256, N)


def np_quest(q, keys, mask, keep_frac, P):
  """QUEST page top-k with loops (q [T,H,Dh], keys [S,K,Dh], mask [T,S]) -> [K, T, S]."""
  T, H, Dh = q.shape
  S, K, _ = keys.shape
  G = H // K
  NP = -(-S // P)
  used = mask.any(0)
  out = np.zeros((K, T, S), bool)
  for t in range(T):
    n = int(mask[t].sum())
    if n <= SPARSE_DENSE_SINKS + SPARSE_DENSE_WINDOW + 1 or keep_frac[t] >= 1:
      out[:, t] = mask[t]
      continue
    for kh in range(K):
      scores = []
      for pg in range(NP):
        sl = slice(pg * P, min(S, (pg + 1) * P))
        if not mask[t, sl].any():
          scores.append(-np.inf)
          continue
        u = used[sl]
        kmax, kmin = keys[sl][u, kh].max(0), keys[sl][u, kh].min(0)
        qs = q[t, kh * G:(kh + 1) * G]
        scores.append(float(np.maximum(qs * kmax, qs * kmin).sum()))
      top = sorted(range(NP), key=lambda j: (-scores[j], j))[:math.ceil(keep_frac[t] * n / P)]
      for pg in top:
        out[kh, t, pg * P:(pg + 1) * P] = mask[t, pg * P:(pg + 1) * P]
  return out


def np_sol_forward(model, prompt, kappa, rho, bits):
  """The causal llama forward in numpy with SOL's knobs per query t: QUEST(P) keep ``kappa[t]``
  per layer from that layer's q/k, the top ``ceil(rho[t] * D)`` MLP input channels by |h|, the
  MLP output fake-quantised to ``bits[t]``. Returns (logits [T, V], usage [T, 3])."""
  cfg = model.cfg
  p = {k: np.asarray(v, np.float64) for k, v in model.layers.stacked().items()}
  T, D = len(prompt), cfg.hidden_size
  mask = np.tril(np.ones((T, T), bool))
  x = np.asarray(model.embed[...], np.float64)[np.asarray(prompt)]
  pos = jnp.arange(T)[None]
  inv = rope_inv_freq(cfg)
  H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  kept, chan = np.zeros(T), np.zeros(T)

  def norm(v, w):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

  def rope(v):
    return np.asarray(apply_rope(jnp.asarray(v[None], jnp.float32), pos, inv)[0], np.float64)

  for i in range(cfg.num_layers):
    h = norm(x, p["attn_norm"][i])
    q = rope(np.einsum("td,dhk->thk", h, p["q_proj"][i]))
    k = rope(np.einsum("td,dhk->thk", h, p["k_proj"][i]))
    v = np.einsum("td,dhk->thk", h, p["v_proj"][i])
    sel = np_quest(q, k, mask, kappa, P)                          # [K, T, S]
    kept += sel.sum(-1).mean(0) / mask.sum(-1)
    m = np.repeat(sel, H // K, axis=0)                            # [H, T, S]
    kr, vr = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
    s = np.einsum("thd,shd->hts", q, kr) / math.sqrt(Dh)
    s = np.where(m, s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    x = x + np.einsum("thd,hdm->tm", np.einsum("hts,shd->thd", pr, vr), p["o_proj"][i])
    h = norm(x, p["mlp_norm"][i])
    for t in range(T):
      n = math.ceil(rho[t] * D)
      keep = np.zeros(D)
      keep[np.argsort(-np.abs(h[t]), kind="stable")[:n]] = 1.0
      h[t] *= keep
      chan[t] += n / D
    g, u = h @ p["gate_proj"][i], h @ p["up_proj"][i]
    y = (g / (1 + np.exp(-g)) * u) @ p["down_proj"][i]
    for t in range(T):
      if bits[t] < 16:
        sc = np.abs(y[t]).max() / (2 ** (bits[t] - 1) - 1)
        y[t] = np.round(y[t] / sc) * sc
    x = x + y
  x = norm(x, np.asarray(model.final_norm[...], np.float64))
  L = cfg.num_layers
  usage = np.stack([kept / L, chan / L, np.asarray(bits, np.float64) / 16], -1)
  return x @ np.asarray(model.lm_head[...], np.float64), usage


def prefill(model, prompt, spec=None):
  eng = Engine(model, num_pages=16, page_size=4, attention="reference")
  out, _ = eng.run_step(prompt, np.arange(len(prompt)), np.zeros(len(prompt)), 0, *ONE,
                        spec=spec)
  return out


def test_channel_keep_mask_matches_numpy():
  rng = np.random.default_rng(0)
  h = rng.normal(size=(2, 5, 24)).astype(np.float32)
  frac = np.array([[0.6, 0.8, 1.0, 0.01, 0.5], [0.25, 1.5, 0.0, 0.9, 0.61]], np.float32)
  got = np.asarray(channel_keep_mask(jnp.asarray(h), jnp.asarray(frac)))
  for b in range(2):
    for t in range(5):
      n = min(max(math.ceil(float(frac[b, t]) * 24), 1), 24)
      want = np.zeros(24)
      want[np.argsort(-np.abs(h[b, t]), kind="stable")[:n]] = 1
      np.testing.assert_array_equal(got[b, t], want)
  assert got[0, 0].sum() == math.ceil(np.float32(0.6) * 24) and got[0, 2].sum() == 24


def test_fake_quant_rows_is_fake_quant_per_row():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(1, 4, 32)), jnp.float32)
  bits = jnp.asarray([[6, 8, 16, 3]])
  got = np.asarray(fake_quant_rows(x, bits))
  for t, b in enumerate([6, 8, 16, 3]):
    np.testing.assert_array_equal(got[0, t], np.asarray(fake_quant(x[:, t], b))[0])
  np.testing.assert_array_equal(got[0, 2], np.asarray(x)[0, 2])     # 16 bits = identity
  assert np.abs(got[0, 0] - np.asarray(x)[0, 0]).max() > 1e-3        # 6 bits changed it


def test_per_query_actions_match_the_numpy_forward_and_usage(model, prompt):
  rng = np.random.default_rng(3)
  kappa = rng.choice([0.25, 0.5, 1.0], N)
  rho = rng.choice([0.6, 0.8, 1.0], N)
  bits = rng.choice([6, 8, 16], N)
  spec = ForwardSpec(outputs=("logits", "usage"), sparsity=f"quest({P})", keep_frac=kappa,
                     mlp_keep_frac=rho, query_bits=bits)
  out = prefill(model, prompt, spec)
  ref, usage = np_sol_forward(model, prompt, kappa, rho, bits)
  err = np.abs(np.asarray(out["logits"]) - ref).max(-1)
  # float32 vs float64: a value at a fake-quant rounding boundary may round the other way in
  # one row (one quantisation step, ~1e-3 here; the knobs themselves move logits by 0.1 - 5)
  assert (err < 5e-4).sum() >= N - 1 and err.max() < 1e-2, err
  np.testing.assert_allclose(np.asarray(out["usage"]), usage, atol=1e-6)
  u = np.asarray(out["usage"])
  late = np.arange(N) > SPARSE_DENSE_SINKS + SPARSE_DENSE_WINDOW   # past the dense rule
  assert (u[late & (kappa < 1), 0] < 1).all() and (u[~late, 0] == 1).all()
  dense = np.asarray(prefill(model, prompt))
  assert np.abs(dense - ref).max(-1)[late].min() > 5e-2             # the knobs mattered


def test_dense_action_is_the_plain_forward_exactly(model, prompt):
  plain = np.asarray(prefill(model, prompt))
  for sparsity in (f"quest({P})", "recency(4, 2)"):
    spec = ForwardSpec(outputs=("logits", "hidden", "usage"), sparsity=sparsity,
                       keep_frac=np.ones(N), mlp_keep_frac=np.ones(N),
                       query_bits=np.full(N, 16))
    out = prefill(model, prompt, spec)
    np.testing.assert_array_equal(np.asarray(out["logits"]), plain)
    np.testing.assert_array_equal(np.asarray(out["usage"]), np.ones((N, 3)))


def test_recency_usage_counts_the_kept_keys(model, prompt):
  kf = np.full(N, 0.25)
  out = prefill(model, prompt, ForwardSpec(outputs=("usage",), sparsity="recency(4, 2)",
                                           keep_frac=kf))
  u = np.asarray(out["usage"])
  for t in range(N):
    n = t + 1
    want = 1.0 if n <= 7 else min(n, 4 + max(2, math.ceil(0.25 * n))) / n
    assert u[t, 0] == pytest.approx(want, abs=1e-6)
  np.testing.assert_array_equal(u[:, 1:], np.ones((N, 2)))


def test_bad_knob_arrays_are_one_line_errors(model, prompt):
  with pytest.raises(ValueError, match="query_bits"):
    ForwardSpec(query_bits=np.array([1, 8]))
  with pytest.raises(ValueError, match="mlp_keep_frac"):
    prefill(model, prompt, ForwardSpec(mlp_keep_frac=np.ones(3)))
