"""The engine's ForwardSpec (DESIGN.md §2.5) on tiny random float32 models: the plain spec is the
plain program; hidden / attention-mass outputs; QUEST and recency key selection against numpy
references (SOL / QUEST rules, dense rule for short kv); MLP channel keep and MLP-output
fake-quant against a forward written out by hand; attention views; the layer loop switch."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from selforch_jax.checkpoints.hf_layout import load_params_into
from selforch_jax.models.config import get_preset
from selforch_jax.models.rope import apply_rope, rope_inv_freq
from selforch_jax.models.transformer import (
    param_dict,
    SPARSE_DENSE_SINKS, SPARSE_DENSE_WINDOW, add_attn_view, causal_mask, fake_quant, init_model,
    quest_key_mask, recency_key_mask,
)
from selforch_jax.runtime import engine as engine_mod
from selforch_jax.runtime.engine import PLAIN_KEY, Engine, spec_key
from selforch_jax.runtime.scheduler import execute
from selforch_jax.runtime.step import PLAIN, ForwardSpec, StepPlan

ONE = (np.ones((1, 1), bool), np.zeros(1, bool))
N = 40  # prompt tokens of the engine tests


@pytest.fixture(scope="module")
def model():
  return init_model(get_preset("tiny_llama").replace(layer_loop="scan"), seed=3)


@pytest.fixture(scope="module")
def prompt():
  return np.random.default_rng(0).integers(1, 256, N)


def prefill(model, prompt, spec=None, **kw):
  """One engine step of the whole prompt (slots 0..N-1, causal); returns run_step's output."""
  eng = Engine(model, num_pages=16, page_size=4, attention="reference", **kw)
  out, _ = eng.run_step(prompt, np.arange(len(prompt)), np.zeros(len(prompt)), 0, *ONE,
                        spec=spec)
  return out, eng


def full_forward(model, prompt, **kw):
  t = jnp.asarray(prompt)[None]
  n = t.shape[1]
  return model(t, jnp.arange(n)[None], causal_mask(jnp.ones((1, n), bool)), **kw)


def ref_forward(model, prompt, mask=None, mlp_keep=None, act_bits=16):
  """The llama forward written out in numpy (float64) from the model's parameters: RMSNorm,
  GQA attention under ``mask [T, T]`` (default causal), SwiGLU MLP whose input is multiplied by
  ``mlp_keep [D]`` and whose output is absmax fake-quantised to ``act_bits`` per token."""
  cfg = model.cfg
  p = {k: np.asarray(v, np.float64) for k, v in model.layers.stacked().items()}
  T = len(prompt)
  mask = np.tril(np.ones((T, T), bool)) if mask is None else mask
  x = np.asarray(model.embed[...], np.float64)[np.asarray(prompt)]
  pos = jnp.arange(T)[None]
  inv = rope_inv_freq(cfg)
  H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def norm(v, w):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

  def rope(v):
    return np.asarray(apply_rope(jnp.asarray(v[None], jnp.float32), pos, inv)[0], np.float64)

  for i in range(cfg.num_layers):
    h = norm(x, p["attn_norm"][i])
    q = rope(np.einsum("td,dhk->thk", h, p["q_proj"][i]))
    k = rope(np.einsum("td,dhk->thk", h, p["k_proj"][i]))
    v = np.einsum("td,dhk->thk", h, p["v_proj"][i])
    k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / math.sqrt(Dh)
    s = np.where(mask[None], s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    a = np.einsum("hts,shd->thd", pr, v)
    x = x + np.einsum("thd,hdm->tm", a, p["o_proj"][i])
    h = norm(x, p["mlp_norm"][i])
    if mlp_keep is not None:
      h = h * mlp_keep
    g, u = h @ p["gate_proj"][i], h @ p["up_proj"][i]
    y = (g / (1 + np.exp(-g)) * u) @ p["down_proj"][i]
    if act_bits < 16:
      sc = np.abs(y).max(-1, keepdims=True) / (2 ** (act_bits - 1) - 1)
      y = np.round(y / sc) * sc
    x = x + y
  x = norm(x, np.asarray(model.final_norm[...], np.float64))
  return x @ np.asarray(model.lm_head[...], np.float64)


# --- the plain spec is the plain program ----------------------------------------------------
def test_plain_spec_compiles_to_the_plain_program(model):
  gd, st = nnx.split(model)
  eng = Engine(model, num_pages=16, page_size=4)
  T, W = 4, eng.num_slots
  args = (np.zeros(T, np.int32), np.arange(T, dtype=np.int32), np.arange(T, dtype=np.int32),
          np.tril(np.ones((T, W), bool)))
  plain = engine_mod._jitted_step.lower(gd, st, eng.cache, *args).as_text()
  spec = engine_mod._jitted_spec_step.lower(gd, PLAIN_KEY, st, eng.cache, *args, {}).as_text()
  strip = lambda s: s.replace("jit__jitted_spec_step", "M").replace("jit__jitted_step", "M")
  assert strip(plain) == strip(spec)
  # a spec that asks for more is another program
  other = engine_mod._jitted_spec_step.lower(
      gd, spec_key(ForwardSpec(act_bits=4)), st, eng.cache, *args, {}).as_text()
  assert strip(other) != strip(plain)


def test_plain_spec_equals_no_spec_and_old_outputs(model, prompt):
  old, _ = prefill(model, prompt)                 # no spec: today's call, logits only
  new, eng = prefill(model, prompt, spec=PLAIN)
  assert set(new) == {"logits", "hidden", "attn_mass", "usage"}
  assert new["hidden"] is None and new["attn_mass"] is None and new["usage"] is None
  np.testing.assert_array_equal(np.asarray(old), np.asarray(new["logits"]))
  assert not eng.specs_used                       # the plain program ran
  ref, _ = full_forward(model, prompt)
  np.testing.assert_allclose(np.asarray(new["logits"]), np.asarray(ref[0]), atol=2e-5)


# --- outputs ---------------------------------------------------------------------------------
def test_hidden_output_is_the_models_return_hidden(model, prompt):
  out, _ = prefill(model, prompt, spec=ForwardSpec(outputs=("logits", "hidden")))
  hid, _ = full_forward(model, prompt, return_hidden=True)
  assert out["hidden"].shape == (N, model.cfg.hidden_size)
  np.testing.assert_allclose(np.asarray(out["hidden"]), np.asarray(hid[0]), atol=2e-5)
  plain, _ = prefill(model, prompt)
  np.testing.assert_allclose(np.asarray(out["logits"]), np.asarray(plain), atol=1e-5)
  only, _ = prefill(model, prompt, spec=ForwardSpec(outputs=("hidden",)))
  assert only["logits"] is None and only["attn_mass"] is None
  np.testing.assert_array_equal(np.asarray(only["hidden"]), np.asarray(out["hidden"]))


def test_attn_mass_output_is_what_h2o_read_before(model, prompt):
  # before: the engine's side channel = the model's return_attn_mass over the step's keys
  out, eng = prefill(model, prompt, spec=ForwardSpec(outputs=("logits", "attn_mass")))
  _, _, mass = full_forward(model, prompt, return_attn_mass=True)
  got = np.asarray(out["attn_mass"])
  assert got.shape == (eng.num_slots,)
  np.testing.assert_allclose(got[:N], np.asarray(mass[0]), rtol=1e-5, atol=1e-5)
  assert np.all(got[N:] == 0)
  L, H = model.cfg.num_layers, model.cfg.num_heads
  assert got.sum() == pytest.approx(N * L * H, rel=1e-5)


def test_execute_returns_every_requested_output(model, prompt):
  eng = Engine(model, num_pages=16, page_size=4)
  plan = StepPlan(tokens=prompt, positions=np.arange(N), segments=np.zeros(N), owners=0,
                  visible=ONE[0], bidir=ONE[1],
                  spec=ForwardSpec(outputs=("hidden", "attn_mass")))
  res = execute(eng, plan)
  assert res.logits is None
  assert res.hidden.shape == (N, model.cfg.hidden_size) and res.attn_mass.shape == (64,)


# --- sparsity ---------------------------------------------------------------------------------
def np_quest(q, keys, mask, keep_frac, P):
  """QUEST (Tang et al. 2024) page top-k for one row, written with loops: q [T,H,Dh], keys
  [S,K,Dh], mask [T,S]; group heads summed; returns [K, T, S]."""
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
        u = used[sl]
        if not mask[t, sl].any():
          scores.append(-np.inf)
          continue
        kmax, kmin = keys[sl][u, kh].max(0), keys[sl][u, kh].min(0)
        qs = q[t, kh * G:(kh + 1) * G]
        scores.append(float(np.maximum(qs * kmax, qs * kmin).sum()))
      nk = math.ceil(keep_frac[t] * n / P)
      top = sorted(range(NP), key=lambda j: (-scores[j], j))[:nk]
      for pg in top:
        out[kh, t, pg * P:(pg + 1) * P] = mask[t, pg * P:(pg + 1) * P]
  return out


def test_quest_selection_matches_numpy_reference():
  rng = np.random.default_rng(1)
  T, S, H, K, Dh, P = 6, 37, 4, 2, 8, 4
  q = rng.normal(size=(T, H, Dh)).astype(np.float32)
  keys = rng.normal(size=(S, K, Dh)).astype(np.float32)
  mask = np.zeros((T, S), bool)
  for t, n in enumerate([37, 30, 20, 7, 12, 33]):   # query 3 sees 7 keys: dense rule
    mask[t, :n] = True
  mask[5, 3:9] = False                              # holes: a partly visible page
  kf = np.array([0.3, 0.25, 0.5, 0.1, 1.0, 0.2], np.float32)
  got = np.asarray(quest_key_mask(q[None], keys[None], mask[None], kf[None], P))[0]
  want = np_quest(q, keys, mask, kf, P)
  np.testing.assert_array_equal(got, want)
  # the rule did select: fewer keys than visible, at most the page budget per query and head
  assert got[:, 0].sum(-1).max() <= math.ceil(0.3 * 37 / P) * P < 37
  np.testing.assert_array_equal(got[:, 3], np.broadcast_to(mask[3], (K, S)))    # dense rule
  np.testing.assert_array_equal(got[:, 4], np.broadcast_to(mask[4], (K, S)))    # keep_frac 1
  dense = np.asarray(quest_key_mask(q[None], keys[None], mask[None], np.ones((1, T)), P))[0]
  np.testing.assert_array_equal(dense, np.broadcast_to(mask, (K, T, S)))


def np_recency(mask, keep_frac, sinks, window, order):
  T, S = mask.shape
  out = np.zeros_like(mask)
  for t in range(T):
    vis = sorted(np.flatnonzero(mask[t]), key=lambda s: (order[s], s))
    n = len(vis)
    if n <= sinks + window + 1 or keep_frac[t] >= 1:
      out[t] = mask[t]
      continue
    recent = max(window, math.ceil(keep_frac[t] * n))
    for s in vis[:sinks] + vis[n - recent:]:
      out[t, s] = True
  return out


def test_recency_selection_matches_numpy_reference():
  rng = np.random.default_rng(2)
  T, S = 5, 30
  mask = rng.random((T, S)) < 0.7
  mask[3] = False
  mask[3, :6] = True                                # 6 keys <= 4 + 1 + 1: dense
  order = rng.permutation(S)                        # ages not in slot order
  kf = np.array([0.2, 0.5, 0.01, 0.1, 0.3], np.float32)
  got = np.asarray(recency_key_mask(mask[None], kf[None], 4, 1, order[None]))[0]
  want = np_recency(mask, kf, 4, 1, order)
  np.testing.assert_array_equal(got, want)
  assert got[2].sum() == 4 + 1                      # sinks + window floor
  np.testing.assert_array_equal(got[3], mask[3])


def test_engine_recency_equals_the_dense_forward_under_the_reference_mask(model, prompt):
  kf = np.full(N, 0.25)
  spec = ForwardSpec(sparsity="recency(4, 2)", keep_frac=kf)
  out, eng = prefill(model, prompt, spec=spec)
  mask = np_recency(np.tril(np.ones((N, N), bool)), kf, 4, 2, np.arange(N))
  assert mask.sum() < np.tril(np.ones((N, N))).sum()            # keys were dropped
  ref = ref_forward(model, prompt, mask=mask)
  np.testing.assert_allclose(np.asarray(out["logits"]), ref, atol=1e-4)
  dense, _ = prefill(model, prompt)
  assert np.abs(np.asarray(dense) - ref).max() > 1e-3            # and it mattered


def test_engine_quest_equals_the_model_forward_and_keep_frac_one_is_dense(model, prompt):
  kf = np.linspace(0.1, 0.6, N)
  spec = ForwardSpec(sparsity="quest(4)", keep_frac=kf)
  out, _ = prefill(model, prompt, spec=spec)
  ref, _ = full_forward(model, prompt, sparsity=("quest", 4), keep_frac=jnp.asarray(kf)[None])
  np.testing.assert_allclose(np.asarray(out["logits"]), np.asarray(ref[0]), atol=2e-5)
  dense, _ = prefill(model, prompt)
  # the dense rule: the first 7 queries see <= 4 + 2 + 1 keys, so they are unchanged ...
  np.testing.assert_allclose(np.asarray(out["logits"])[:7], np.asarray(dense)[:7], atol=1e-5)
  # ... and later ones are not
  assert np.abs(np.asarray(out["logits"])[20:] - np.asarray(dense)[20:]).max() > 1e-3
  one, _ = prefill(model, prompt, spec=ForwardSpec(sparsity="quest(4)", keep_frac=np.ones(N)))
  np.testing.assert_allclose(np.asarray(one["logits"]), np.asarray(dense), atol=1e-5)


def test_sparsity_needs_keep_frac(model, prompt):
  with pytest.raises(ValueError, match="keep_frac"):
    prefill(model, prompt, spec=ForwardSpec(sparsity="quest(4)"))


def test_query_key_keep_hides_keys_per_query(model, prompt):
  qkk = np.ones((N, 64), bool)
  qkk[N - 1, 5:20] = False                          # only the last query loses keys 5..19
  out, _ = prefill(model, prompt, spec=ForwardSpec(query_key_keep=qkk))
  mask = np.tril(np.ones((N, N), bool))
  mask[N - 1, 5:20] = False
  ref = ref_forward(model, prompt, mask=mask)
  np.testing.assert_allclose(np.asarray(out["logits"]), ref, atol=1e-4)


# --- MLP channel keep and fake-quant ---------------------------------------------------------
def test_mlp_keep_ones_is_plain_and_zeros_match_the_hand_forward(model, prompt):
  D = model.cfg.hidden_size
  plain, _ = prefill(model, prompt)
  ones, _ = prefill(model, prompt, spec=ForwardSpec(mlp_keep=np.ones(D)))
  np.testing.assert_array_equal(np.asarray(ones["logits"]), np.asarray(plain))
  keep = np.ones(D)
  keep[::3] = 0.0
  out, _ = prefill(model, prompt, spec=ForwardSpec(mlp_keep=keep))
  ref = ref_forward(model, prompt, mlp_keep=keep)
  np.testing.assert_allclose(np.asarray(out["logits"]), ref, atol=1e-4)
  assert np.abs(np.asarray(plain) - ref).max() > 1e-3
  per_token, _ = prefill(model, prompt, spec=ForwardSpec(mlp_keep=np.tile(keep, (N, 1))))
  np.testing.assert_allclose(np.asarray(per_token["logits"]), np.asarray(out["logits"]),
                             atol=1e-6)


def test_act_bits_16_is_plain_and_4_matches_the_hand_forward(model, prompt):
  plain, _ = prefill(model, prompt)
  b16, _ = prefill(model, prompt, spec=ForwardSpec(act_bits=16))
  np.testing.assert_array_equal(np.asarray(b16["logits"]), np.asarray(plain))
  out, _ = prefill(model, prompt, spec=ForwardSpec(act_bits=4))
  ref = ref_forward(model, prompt, act_bits=4)
  np.testing.assert_allclose(np.asarray(out["logits"]), ref, atol=2e-4)
  assert np.abs(np.asarray(plain) - ref).max() > 1e-2
  x = jnp.asarray([[0.7, -1.4, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]])
  np.testing.assert_allclose(np.asarray(fake_quant(x, 2)), [[0.0, -1.4, 0.0, 0.0], [0] * 4])


# --- views -----------------------------------------------------------------------------------
def test_views(model, prompt):
  mv = add_attn_view(model, "diffusion")
  assert mv.cfg.attn_views == ("diffusion",)
  plain, _ = prefill(model, prompt)
  base, _ = prefill(mv, prompt, spec=ForwardSpec(view="base"))
  view, _ = prefill(mv, prompt, spec=ForwardSpec(view="diffusion"))
  np.testing.assert_array_equal(np.asarray(base["logits"]), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(view["logits"]), np.asarray(plain))
  mv.layers.q_proj_diffusion[...] = mv.layers.q_proj_diffusion[...] * 1.5
  mv.layers.v_proj_diffusion[...] = -mv.layers.v_proj_diffusion[...]
  base2, _ = prefill(mv, prompt, spec=ForwardSpec(view="base"))
  view2, _ = prefill(mv, prompt, spec=ForwardSpec(view="diffusion"))
  np.testing.assert_array_equal(np.asarray(base2["logits"]), np.asarray(plain))
  assert np.abs(np.asarray(view2["logits"]) - np.asarray(plain)).max() > 1e-2
  with pytest.raises(ValueError, match="unknown view"):
    prefill(mv, prompt, spec=ForwardSpec(view="nope"))
  with pytest.raises(ValueError, match="already"):
    add_attn_view(mv, "diffusion")


def test_view_on_qwen3_copies_the_qk_norms():
  m = init_model(get_preset("tiny_qwen3"), seed=0)
  mv = add_attn_view(m, "d")
  assert {"q_norm_d", "k_norm_d", "o_proj_d"} <= set(mv.layers.stacked())
  t = jnp.arange(1, 9)[None]
  a, _ = m(t, jnp.arange(8)[None], causal_mask(jnp.ones((1, 8), bool)))
  b, _ = mv(t, jnp.arange(8)[None], causal_mask(jnp.ones((1, 8), bool)), view="d")
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mv.layers.k_norm_d[...] = mv.layers.k_norm_d[...] * 3.0
  c, _ = mv(t, jnp.arange(8)[None], causal_mask(jnp.ones((1, 8), bool)), view="d")
  assert np.abs(np.asarray(c) - np.asarray(a)).max() > 1e-3


# --- layer loop ------------------------------------------------------------------------------
def test_unrolled_layers_equal_the_scan_in_decode_and_training(model, prompt):
  unrolled = init_model(model.cfg.replace(layer_loop="unroll"), seed=3)
  a, _ = prefill(model, prompt)
  b, _ = prefill(unrolled, prompt)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

  def loss(m):
    lg, _ = full_forward(m, prompt)
    return jnp.mean(jax.nn.logsumexp(lg, -1))
  la, ga = nnx.value_and_grad(loss)(model)
  lb, gb = nnx.value_and_grad(loss)(unrolled)
  assert float(la) == pytest.approx(float(lb), rel=1e-6)
  np.testing.assert_allclose(np.asarray(ga.layers.q_proj[...]), np.asarray(gb.layers.q_proj[...]),
                             atol=1e-6)
  with pytest.raises(ValueError, match="layer_loop"):
    model.cfg.replace(layer_loop="while")


def test_warm_up_compiles_spec_programs(model):
  eng = Engine(model, num_pages=16, page_size=4)
  spec = ForwardSpec(outputs=("hidden",), sparsity="quest(4)", keep_frac=np.ones(1),
                     mlp_keep=np.ones(64))
  eng.warm_up([1], attn_mass=(False, True), specs=(spec,))
  assert eng.specs_used == {spec_key(spec), spec_key(ForwardSpec(outputs=("logits", "attn_mass")))}
  assert eng.num_steps == 0


def test_a_model_with_a_view_round_trips_through_its_param_dict(model):
  mv = add_attn_view(model, "diffusion")
  mv.layers.q_proj_diffusion[...] = mv.layers.q_proj_diffusion[...] * 2.0
  fresh = add_attn_view(init_model(model.cfg, seed=9), "diffusion")
  load_params_into(fresh, param_dict(mv))
  np.testing.assert_array_equal(np.asarray(fresh.layers.q_proj_diffusion[...]),
                                np.asarray(mv.layers.q_proj_diffusion[...]))
  np.testing.assert_array_equal(np.asarray(fresh.layers.q_proj[...]),
                                np.asarray(model.layers.q_proj[...]))
