"""Orthrus (selforch_jax.runtime.schedulers.orthrus, selforch_jax.models.orthrus) on a tiny random
model: greedy Orthrus equals AR greedy on 52 mixed prompts (untrained view and a perturbed one),
the pool never holds diffusion K/V (live slots after every step), exact speculative sampling
(chi-square against the exact AR distribution of the first three tokens; resampling from p
instead of the residual on a rejection fails it), the train = decode oracle of the diffusion pass,
EOS, the adapter round trip and the CLI-facing errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax.adapter import export_view_adapter, load_adapter
from selforch_jax.models.orthrus import (VIEW, add_orthrus, add_view_delta, apply_view_delta,
                                         dual_pass_logits, dual_pass_mask)
from selforch_jax.runtime import verify as verify_mod
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.scheduler import run
from selforch_jax.runtime.schedulers import ar, make_scheduler, spec_base
from tests.spec_prompts import ar_greedy, engine_for, mixed_prompts, spec_run, tiny_model
from tests.test_ptd import _chi2, _exact_ar

B = 8


def _perturbed(model, scale=0.5, seed=1):
  """``model`` with its diffusion view moved off the AR projections (a stand-in for training)."""
  key = jax.random.PRNGKey(seed)
  for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
    key, sub = jax.random.split(key)
    p = getattr(model.layers, f"{n}_{VIEW}")
    p[...] = p[...] * (1 + scale * jax.random.normal(sub, p.shape, p.dtype))
  return model


@pytest.fixture(scope="module")
def models():
  plain, mask_id = add_orthrus(tiny_model())
  pert, _ = add_orthrus(tiny_model())
  return plain, _perturbed(pert), mask_id


def _grouped(cases):
  by_n = {}
  for k, (_, n) in enumerate(cases):
    by_n.setdefault(n, []).append(k)
  return by_n


MODES = {"unfused": {}, "fused": dict(fused=True), "fused_at_1": dict(fused=True, fuse_at=1)}


@pytest.mark.parametrize("mode", ["unfused", "fused_at_1"])   # "fused": the long answer
def test_orthrus_greedy_equals_ar_on_mixed_prompts(models, mode):
  fused = bool(MODES[mode])
  plain, pert, mask_id = models
  short = [(q, min(n, 20)) for q, n in mixed_prompts(52)]   # the 400-token answer is below
  for model, name, cases in ((plain, "untrained", short),
                             (pert, "perturbed", mixed_prompts(8, seed=9))):
    ref = ar_greedy(model, cases)
    for n, ks in _grouped(cases).items():
      s, _ = spec_run("orthrus", model, [cases[k][0] for k in ks], n, block_size=B,
                      mask_id=mask_id, **MODES[mode])
      for k, r, st in zip(ks, s.results, s.stats):
        assert r.token_ids == ref[k].token_ids, (name, k)
        assert r.finish_reason == "length"
        np.testing.assert_allclose(r.logprobs, ref[k].logprobs, atol=2e-4)
        assert st["forwards"] == 1 + st["diffusion_forwards"] + st["verify_forwards"]
        assert st["verify_forwards"] == len(st["accepted"])
        assert st["tokens_per_forward"] == pytest.approx(n / st["forwards"])
        assert max(st["step_tokens"]) <= (2 * B if fused else B)
        assert st["fused_drafts"] <= (st["verify_forwards"] if fused else 0)


@pytest.mark.parametrize("mode", list(MODES))
def test_orthrus_long_answer_equals_ar(models, mode):
  _, pert, mask_id = models
  p = mixed_prompts(4, seed=5)[1][0]
  ref = ar_greedy(pert, [(p, 400)])[0]
  s, _ = spec_run("orthrus", pert, [p], 400, pages=160, block_size=B, mask_id=mask_id,
                  **MODES[mode])
  assert s.results[0].token_ids == ref.token_ids
  if mode == "fused_at_1":   # the perturbed view accepts a first draft often enough
    assert s.stats[0]["fused_drafts"] > 0


POOL_MODES = dict(MODES, denoise_3=dict(denoise_steps=3))


@pytest.mark.parametrize("mode", list(POOL_MODES))
def test_pool_never_holds_diffusion_kv(models, mode):
  """After a diffusion step (every pass of a multi-step draft) the pool holds exactly the
  committed tokens but the newest (the next root); after a verify step (fused or not), those
  plus the root and the verified chain (< B): O(B), whatever the sequence length."""
  _, model, mask_id = models
  for p, n in mixed_prompts(5, seed=2):
    eng = engine_for(model)
    s = make_scheduler("orthrus", eng, [p], max_new_tokens=n, block_size=B, mask_id=mask_id,
                       **POOL_MODES[mode])
    kinds = []

    def check(plan, result, s=s, eng=eng, p=p):
      kind, i, _ = plan.tag
      req = s.reqs[i]
      live = eng.pool.live_tokens
      kinds.append(kind)
      if kind == "draft":
        assert plan.scratch and plan.spec.view == VIEW
        assert live == len(p) + len(req.tokens) - 1
      elif kind == "decode" and req.finish is None:
        qv = plan.spec.query_view
        assert POOL_MODES[mode].get("fused") or qv is None
        chain = (np.size(plan.tokens) if qv is None else int(np.sum(~np.asarray(qv)))) - 1
        assert chain < B
        n_root = len(p) + len(req.tokens) - 1 - req.accepted[-1]
        assert live == n_root + chain
    run(eng, s, observer=check)
    assert s.results[0].token_ids == ar.generate(engine_for(model), [p], max_new_tokens=n)[0] \
        .token_ids
    assert kinds.count("draft") == s.stats[0]["diffusion_forwards"] > 0


def test_oracle_training_diffusion_logits_equal_runtime_pass(models):
  _, model, mask_id = models
  p = mixed_prompts(3, seed=7)[0][0]
  eng = engine_for(model)
  s = make_scheduler("orthrus", eng, [p], max_new_tokens=40, block_size=B, mask_id=mask_id)
  seen = []

  def grab(plan, result):
    if plan.tag[0] == "draft":
      seen.append((int(plan.positions[0]), np.asarray(result.logits)))
  run(eng, s, observer=grab)
  seq = p + s.results[0].token_ids
  starts = np.asarray([[st for st, _ in seen]], np.int32)
  N = len(seq)
  toks = jnp.asarray([seq], jnp.int32)
  _, diff = dual_pass_logits(model, toks, jnp.arange(N)[None], jnp.ones((1, N), bool),
                             jnp.asarray(starts), B, mask_id)
  assert len(seen) > 3
  for k, (_, rows) in enumerate(seen):
    np.testing.assert_allclose(np.asarray(diff[0, k]), rows, atol=1e-5, rtol=0)


def test_dual_pass_mask_rule():
  valid = jnp.asarray([[True] * 6 + [False] * 2])
  ar_m, dm = dual_pass_mask(valid, jnp.asarray([[2, 5]]), 3)
  ar_m, dm = np.asarray(ar_m[0]), np.asarray(dm[0])
  assert ar_m.shape == (8, 14) and not ar_m[:, 8:].any() and ar_m[3, :4].all() and not ar_m[3, 4]
  assert not ar_m[6].any()                          # padding query sees nothing
  # block 0 (start 2): AR keys 0, 1; its own block slots 8..10 (bidirectional)
  assert dm[0, :8].tolist() == [True, True] + [False] * 6
  assert dm[2, 8:].tolist() == [True] * 3 + [False] * 3
  # block 1 (start 5): AR keys 0..4; slots 11..13
  assert dm[4, :8].tolist() == [True] * 5 + [False] * 3
  assert dm[4, 11:].all() and not dm[4, 8:11].any()


def _no_residual(parents, tokens, target_logits, params, rng=None, draft_probs=None):
  """A wrong chain rule: accept d_i with min(1, p/q), but on the first rejection sample the
  correction from p itself (not the residual)."""
  p = verify_mod.target_probs(target_logits, params)
  q = np.asarray(draft_probs)
  path, node = [], 0
  for c in range(1, len(tokens)):
    x = int(tokens[c])
    if rng.random() * q[c, x] >= p[node, x]:
      return verify_mod._result(path, np.asarray(tokens), verify_mod._sample(p[node], rng))
    path.append(c)
    node = c
  return verify_mod._result(path, np.asarray(tokens), verify_mod._sample(p[node], rng))


@pytest.mark.parametrize("rule", ["exact", "no_residual"])
def test_orthrus_sampling_first_three_tokens_match_ar(rule, monkeypatch):
  V = 6
  m, mask_id = add_orthrus(tiny_model(vocab_size=V, seed=1))
  m = _perturbed(m, scale=1.0, seed=4)
  prompt = [1, 2, 3, 4, 5, 0] * 3
  params = SamplingParams(temperature=1.0, seed=3)
  if rule == "no_residual":   # on a rejection, resample from p instead of norm(max(p - q, 0))
    monkeypatch.setattr(spec_base, "verify_tree", _no_residual)
  n = 1000
  s, _ = spec_run("orthrus", m, [prompt] * n, 3, sampling=params, pages=16, block_size=4,
                  mask_id=mask_id)
  Vm = m.cfg.vocab_size
  counts = np.zeros((Vm, Vm, Vm))
  for r in s.results:
    counts[tuple(r.token_ids)] += 1
  assert sum(sum(st["accepted"]) for st in s.stats) > 0.2 * n
  pv = _chi2(counts, _exact_ar(m, prompt, params, Vm))
  if rule == "exact":
    assert pv > 1e-3, pv
  else:
    assert pv < 1e-6, pv


def test_orthrus_stops_at_the_same_eos_as_ar(models):
  _, model, mask_id = models
  prompt = mixed_prompts(4)[3][0]
  free = ar.generate(engine_for(model), [prompt], max_new_tokens=40)[0].token_ids
  stop = free[12]
  ref = ar.generate(engine_for(model), [prompt], max_new_tokens=40, stop_ids=[stop])[0]
  s, _ = spec_run("orthrus", model, [prompt], 40, stop_ids=[stop], block_size=B, mask_id=mask_id)
  assert s.results[0].finish_reason == ref.finish_reason == "stop"
  assert s.results[0].token_ids == ref.token_ids == free[:free.index(stop)]


def test_view_adapter_round_trip_and_errors(tmp_path):
  from selforch_jax import config_lib
  mc = config_lib.model_defaults()
  mc.preset, mc.weights = "tiny_llama", "random"
  _, base, tok = config_lib.load_model(mc)
  m, mask_id = add_orthrus(base, tok)
  add_view_delta(m, 4, seed=2)
  b = m.layers.o_proj_diffusion_delta_b
  b[...] = 0.05 * jax.random.normal(jax.random.PRNGKey(0), b.shape, b.dtype)
  apply_view_delta(m)
  export_view_adapter(m, tok, str(tmp_path), mc.to_dict(), block_size=B)
  m2, _ = load_adapter(str(tmp_path))
  assert m2.cfg.attn_views == (VIEW,) and m2.cfg.vocab_size == mask_id + 1
  assert not hasattr(m2.layers, "o_proj_diffusion_delta_a")
  for n in ("q_proj", "o_proj", "embed"):
    a = getattr(m.layers, f"{n}_{VIEW}", None) if n != "embed" else m.embed
    b2 = getattr(m2.layers, f"{n}_{VIEW}", None) if n != "embed" else m2.embed
    np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b2[...]))
  assert not np.allclose(np.asarray(m2.layers.o_proj_diffusion[...]),
                         np.asarray(m2.layers.o_proj[...]))
  with pytest.raises(ValueError, match="diffusion"):
    make_scheduler("orthrus", engine_for(tiny_model()), [[1, 2]], max_new_tokens=4)
  with pytest.raises(ValueError, match="block_size"):
    make_scheduler("orthrus", engine_for(m2), [[1, 2]], max_new_tokens=4, block_size=1)
  from selforch_jax import api
  with pytest.raises(api.ApiError, match="Orthrus adapter"):
    api.resolve_adapter("orthrus", "", "tiny_llama")


@pytest.mark.parametrize("fuse_at", [None, 2])
def test_fused_draft_rows_equal_training_blocks(models, fuse_at):
  """The fused step's diffusion rows equal the training forward's block that starts at its
  anchor draft, over the sequence the step assumed (committed + root + drafts up to the
  anchor), to 1e-5: the fused draft is the trained block layout, so it needs no training of
  its own."""
  _, model, mask_id = models
  checked = 0
  for p, n in mixed_prompts(4, seed=11):
    eng = engine_for(model)
    s = make_scheduler("orthrus", eng, [p], max_new_tokens=n, block_size=B, mask_id=mask_id,
                       fused=True, fuse_at=fuse_at)
    seen = []

    def grab(plan, result, seen=seen):
      qv = plan.spec.query_view
      if qv is not None and int(np.sum(qv)) == B:
        T = int(np.sum(~np.asarray(qv)))
        j = int(plan.positions[T] - plan.positions[0])      # the anchor draft
        assert j == (T - 1 if fuse_at is None else min(fuse_at, T - 1))
        seen.append((int(plan.positions[0]), np.asarray(plan.tokens[:j + 1]).tolist(),
                     np.asarray(result.logits)[T:]))
    run(eng, s, observer=grab)
    seq = p + s.results[0].token_ids
    for pos0, assumed, rows in seen[:3]:     # 3 per answer: each is a fresh trace
      hyp = seq[:pos0] + assumed                # what the fused draft assumed accepted
      N, anchor = len(hyp), len(hyp) - 1
      _, diff = dual_pass_logits(model, jnp.asarray([hyp], jnp.int32), jnp.arange(N)[None],
                                 jnp.ones((1, N), bool), jnp.asarray([[anchor]], jnp.int32), B,
                                 mask_id)
      np.testing.assert_allclose(np.asarray(diff[0, 0]), rows, atol=1e-5, rtol=0)
      checked += 1
  assert checked >= 8


def _exact_ar_joint(model, prompt, params, V, n):
  """P(t_1 .. t_n) of AR sampling, ``[V] * n``, by full forwards of every prefix."""
  from flax import nnx
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda t: nnx.merge(graphdef, state)(
      t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape),
      jnp.broadcast_to(jnp.tril(jnp.ones((t.shape[1],) * 2, bool)),
                       (t.shape[0], t.shape[1], t.shape[1])))[0][:, -1])
  P = np.ones(())
  for d in range(n):
    seqs = np.asarray([prompt + list(x) for x in itertools.product(range(V), repeat=d)],
                      np.int32)
    p = verify_mod.target_probs(fwd(seqs), params).reshape([V] * d + [V])
    P = P[..., None] * p
  return P


def test_fused_sampling_first_four_tokens_match_ar():
  """Exact speculative sampling with fused drafts: B = 2 and 4 new tokens, so the 4th token
  is verified against the draft the fused step made; the joint of the 4 tokens is AR's."""
  V = 4
  m, mask_id = add_orthrus(tiny_model(vocab_size=V, seed=1))
  m = _perturbed(m, scale=1.0, seed=4)
  prompt = [1, 2, 3, 0] * 4
  params = SamplingParams(temperature=1.0, seed=5)
  n = 1200
  s, _ = spec_run("orthrus", m, [prompt] * n, 4, sampling=params, pages=16, block_size=2,
                  mask_id=mask_id, fused=True)
  Vm = m.cfg.vocab_size
  counts = np.zeros((Vm,) * 4)
  for r in s.results:
    counts[tuple(r.token_ids)] += 1
  assert sum(st["fused_drafts"] for st in s.stats) > 0.2 * n
  pv = _chi2(counts, _exact_ar_joint(m, prompt, params, Vm, 4))
  assert pv > 1e-3, pv


DENOISE = {"denoise_2": dict(denoise_steps=2), "denoise_3": dict(denoise_steps=3)}


@pytest.mark.parametrize("mode", list(DENOISE))
def test_multi_step_denoise_greedy_equals_ar_and_counts_passes(models, mode):
  """denoise_steps = 2, 3: greedy equals AR greedy on 20 mixed prompts (untrained and perturbed
  view); each block costs min(n, k) diffusion forwards (k its drafts), all counted."""
  n_steps = DENOISE[mode]["denoise_steps"]
  plain, pert, mask_id = models
  for model, cases in ((plain, [(q, min(n, 20)) for q, n in mixed_prompts(20)]),
                       (pert, [(q, min(n, 24)) for q, n in mixed_prompts(6, seed=9)])):
    ref = ar_greedy(model, cases)
    for n, ks in _grouped(cases).items():
      s, _ = spec_run("orthrus", model, [cases[k][0] for k in ks], n, block_size=B,
                      mask_id=mask_id, **DENOISE[mode])
      for k, r, st in zip(ks, s.results, s.stats):
        assert r.token_ids == ref[k].token_ids, k
        assert st["forwards"] == 1 + st["diffusion_forwards"] + st["verify_forwards"]
        assert st["diffusion_forwards"] == sum(min(n_steps, t - 1) for t in st["step_tokens"])
        assert st["verify_forwards"] == len(st["accepted"]) and st["fused_drafts"] == 0


def test_multi_step_passes_equal_training_blocks_with_reveal(models):
  """Every pass of a 3-step draft equals the training forward's block with the pass's fixed
  drafts revealed (``dual_pass_logits(reveal=...)``), to 1e-5; each pass fixes more slots, the
  first is the single-step block, and a pass never unfixes a slot."""
  _, model, mask_id = models
  p = mixed_prompts(3, seed=7)[0][0]
  eng = engine_for(model)
  s = make_scheduler("orthrus", eng, [p], max_new_tokens=30, block_size=B, mask_id=mask_id,
                     denoise_steps=3)
  seen = []

  def grab(plan, result):
    if plan.tag[0] == "draft":
      seen.append((int(plan.positions[0]), np.asarray(plan.tokens).tolist(),
                   np.asarray(result.logits)))
  run(eng, s, observer=grab)
  seq = p + s.results[0].token_ids
  assert len(seen) >= 6 and seen[0][1][1:] == [mask_id] * (B - 1)
  N = len(seq) + B                    # one padded length: one compiled forward
  fwd = jax.jit(lambda t, v, s0, r: dual_pass_logits(model, t, jnp.arange(N)[None], v, s0, B,
                                                     mask_id, reveal=r)[1])
  for (s0, toks, rows), nxt in zip(seen, seen[1:] + [None]):
    hyp = seq[:s0] + toks
    t = np.zeros((1, N), np.int32)
    t[0, :len(hyp)] = hyp
    diff = fwd(jnp.asarray(t), jnp.asarray(np.arange(N) < len(hyp))[None],
               jnp.asarray([[s0]], jnp.int32), jnp.asarray([[np.asarray(toks) != mask_id]]))
    np.testing.assert_allclose(np.asarray(diff[0, 0]), rows, atol=1e-5, rtol=0)
    if nxt is not None and nxt[0] == s0:          # the next pass of the same block
      assert sum(t != mask_id for t in nxt[1]) > sum(t != mask_id for t in toks)
      assert all(a == b for a, b in zip(toks, nxt[1]) if a != mask_id)


def test_multi_step_sampling_first_three_tokens_match_ar():
  """Exact speculative sampling with 2 denoise passes (B = 4: 3 drafts, fixed 1 then 2 by
  confidence; the verified prefix is the one fixed in non-decreasing pass order)."""
  V = 6
  m, mask_id = add_orthrus(tiny_model(vocab_size=V, seed=1))
  m = _perturbed(m, scale=1.0, seed=4)
  prompt = [1, 2, 3, 4, 5, 0] * 3
  params = SamplingParams(temperature=1.0, seed=3)
  n = 1000
  s, _ = spec_run("orthrus", m, [prompt] * n, 3, sampling=params, pages=16, block_size=4,
                  mask_id=mask_id, denoise_steps=2)
  Vm = m.cfg.vocab_size
  counts = np.zeros((Vm, Vm, Vm))
  for r in s.results:
    counts[tuple(r.token_ids)] += 1
  assert sum(sum(st["accepted"]) for st in s.stats) > 0.2 * n
  assert all(st["diffusion_forwards"] >= 2 for st in s.stats)
  pv = _chi2(counts, _exact_ar(m, prompt, params, Vm))
  assert pv > 1e-3, pv


def test_denoise_steps_errors(models):
  _, model, mask_id = models
  with pytest.raises(ValueError, match="denoise_steps"):
    make_scheduler("orthrus", engine_for(model), [[1, 2]], max_new_tokens=4, mask_id=mask_id,
                   denoise_steps=0)
  with pytest.raises(ValueError, match="fused"):
    make_scheduler("orthrus", engine_for(model), [[1, 2]], max_new_tokens=4, mask_id=mask_id,
                   fused=True, denoise_steps=2)


def test_reveal_none_and_nothing_revealed_are_the_same_block(models):
  """block_inputs / dual_pass_logits with a reveal mask of anchors only equal the single-step
  path exactly; a revealed slot carries the sequence's token."""
  from selforch_jax.models.orthrus import block_inputs
  _, model, mask_id = models
  rng = np.random.default_rng(0)
  toks = jnp.asarray(rng.integers(0, 200, (2, 20)), jnp.int32)
  starts = jnp.asarray([[2, 9], [0, 11]], jnp.int32)
  none = np.zeros((2, 2, 4), bool)
  a = block_inputs(toks, starts, 4, mask_id)
  b = block_inputs(toks, starts, 4, mask_id, jnp.asarray(none))
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  some = none.copy()
  some[0, 1, 2] = True
  bt = np.asarray(block_inputs(toks, starts, 4, mask_id, jnp.asarray(some))[0])
  assert bt[0, 4:8].tolist() == [int(toks[0, 9]), mask_id, int(toks[0, 11]), mask_id]
  pos, valid = jnp.broadcast_to(jnp.arange(20), (2, 20)), jnp.ones((2, 20), bool)
  _, d0 = dual_pass_logits(model, toks, pos, valid, starts, 4, mask_id)
  _, d1 = dual_pass_logits(model, toks, pos, valid, starts, 4, mask_id, reveal=jnp.asarray(none))
  np.testing.assert_array_equal(np.asarray(d0), np.asarray(d1))
  with pytest.raises(ValueError, match="reveal"):
    block_inputs(toks, starts, 4, mask_id, jnp.zeros((2, 2, 3), bool))
