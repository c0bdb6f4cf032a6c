"""SOL's decode-time budget guard (our addition beyond upstream SOL; issue 22): the usage a step
will apply, predicted before it runs (against hand-worked counts and the step's own ``usage``
output), the allowed set of a hand-worked case, a compute-greedy policy held to the target by the
guard (and not without it), the guard off == the policy's own actions, and the option's checks."""

import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax import api
from selforch_jax.decoding import run as decode_run
from selforch_jax.models.config import get_preset
from selforch_jax.models.sol_policy import SolPolicyConfig, init_policy
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import run
from selforch_jax.runtime.schedulers.sol import SOLEpisodeScheduler
from selforch_jax.runtime.sol_actions import ActionGrid, parse_budget
from selforch_jax.runtime.sol_control import BudgetController, applied_usage, \
    budget_guard_option, guard_mask

GRID = ActionGrid.named("cpu")


@pytest.fixture(scope="module")
def model():
  return init_model(get_preset("tiny_llama"), seed=2)


def make_policy(model, compute_greedy=False):
  pol = init_policy(SolPolicyConfig(lm_dim=model.cfg.hidden_size, num_actions=27, d_model=32,
                                    num_heads=4, max_len=64), seed=1)
  if compute_greedy:   # logits = 10 x (kappa + rho + bits/16): the dense action first, always
    pol.pi.kernel.set_value(jnp.zeros_like(pol.pi.kernel[...]))
    pol.pi.bias.set_value(jnp.asarray(10.0 * GRID.nominal_usage(np.arange(27)).sum(-1),
                                      jnp.float32))
    pol.budget_fc2.kernel.set_value(jnp.zeros_like(pol.budget_fc2.kernel[...]))
    pol.budget_fc2.bias.set_value(jnp.zeros_like(pol.budget_fc2.bias[...]))
  return pol


def test_applied_usage_by_hand():
  g = ActionGrid((0.25, 0.5, 1.0), (0.6, 1.0), (8, 16))
  u = applied_usage(g, [49, 7, 64], "quest(8)", 576)
  k = {a: u[:, i, 0] for i, a in enumerate(g.table[:, 0])}
  # 49 keys: ceil(0.25 * 49 / 8) = 2 pages = 16 keys, ceil(0.5 * 49 / 8) = 4 pages = 32 keys;
  # 7 keys: the dense rule (<= 4 + 2 + 1); 64 keys: 2 and 4 pages exactly
  np.testing.assert_allclose(k[0.25], [16 / 49, 1.0, 16 / 64])
  np.testing.assert_allclose(k[0.5], [32 / 49, 1.0, 32 / 64])
  np.testing.assert_allclose(k[1.0], [1.0, 1.0, 1.0])
  np.testing.assert_allclose(applied_usage(g, [49], "quest_gather(8)", 576), u[:1])
  np.testing.assert_allclose(sorted(set(u[0, :, 1])), [346 / 576, 1.0])     # ceil(0.6 * 576)
  np.testing.assert_allclose(sorted(set(u[0, :, 2])), [0.5, 1.0])
  # recency(4, 2) at 20 keys: 4 sinks + max(2, ceil(0.25 * 20) = 5) newest = 9 keys
  r = applied_usage(g, [20], "recency(4,2)", 576)[0, :, 0]
  np.testing.assert_allclose(sorted(set(r)), [9 / 20, 14 / 20, 1.0])
  np.testing.assert_allclose(applied_usage(g, [20], "none", 576)[..., 0], 1.0)
  with pytest.raises(ValueError, match="kv_len"):
    applied_usage(g, [0], "quest(8)", 576)


def test_allowed_set_by_hand():
  g = ActionGrid((0.25, 0.5, 1.0), (0.6, 1.0), (8, 16))
  pred = g.nominal_usage(np.arange(g.num_actions))[None]              # [1, 12, 3]
  tg = np.array([[0.45, 0.8, 0.5]])
  # 2 steps so far, means (0.66, 0.86, 0.5), gaps (0.21, 0.06, 0); a step at the target would
  # leave 2/3 of each. kappa: 0.25 -> 0.523 (gap 0.073 <= 0.14: toward), 0.5 -> 0.607 (gap
  # 0.157: smaller than 0.21 but not toward), 1 -> 0.773 (away); rho: 0.6 -> 0.773 (gap 0.027
  # <= 0.04), 1 -> 0.907 (gap 0.107); bits: 8 -> 0.5 (gap 0), 16 -> 0.667
  S = [[1.32, 1.72, 1.0]]
  ok = guard_mask(S, [2], tg, pred, 0.02)[0]
  assert {tuple(g.table[a]) for a in np.flatnonzero(ok)} == {(0.25, 0.6, 8)}
  # tolerance 0.11: rho 1 (gap 0.107) joins; kappa 0.5 (0.157) and bits 16 (0.167) do not
  ok = guard_mask(S, [2], tg, pred, 0.11)[0]
  assert {tuple(g.table[a]) for a in np.flatnonzero(ok)} == {(0.25, 0.6, 8), (0.25, 1.0, 8)}
  # no step yet (the mean counts as the target): rho 0.75 has no value within 0.02, so the
  # closest one (0.6, gap 0.15 vs 0.25) alone; kappa 0.5 and bits 8 hit exactly
  ok = guard_mask([[0, 0, 0]], [0], [[0.5, 0.75, 0.5]], pred, 0.02)[0]
  assert {tuple(g.table[a]) for a in np.flatnonzero(ok)} == {(0.5, 0.6, 8)}
  # a wide tolerance allows everything
  assert guard_mask(S, [2], tg, pred, 1.0).all()
  # predictions that are no product (axis 0 only a0, axis 1 only a1): the smallest worst gap
  odd = np.array([[[0.5, 0.9, 0.5], [0.8, 0.5, 0.5], [0.9, 0.9, 0.5]]])
  np.testing.assert_array_equal(guard_mask([[0, 0, 0]], [0], [[0.5, 0.5, 0.5]], odd, 0.02),
                                [[False, True, False]])
  with pytest.raises(ValueError, match="tolerance"):
    guard_mask([[0, 0, 0]], [0], tg, pred, -0.1)


def episodes(model, ctl, seqs, Lc):
  eng = Engine(model, num_pages=160, page_size=8, attention="reference")
  ep = SOLEpisodeScheduler(seqs, Lc, ctl, GRID, reference=False)
  run(eng, ep)
  return ep


@pytest.mark.parametrize("budget", ["0.5,0.8,8", "0.6,0.7,6"])
def test_guard_holds_a_compute_greedy_policy_to_the_target(model, budget):
  pol = make_policy(model, compute_greedy=True)
  rng = np.random.default_rng(5)
  B, Lc, T, tol = 3, 40, 40, 0.02
  seqs = rng.integers(1, 256, (B, Lc + T + 1))
  tg = np.tile(parse_budget(budget), (B, 1))
  emb = model.embed[...]
  free = BudgetController(pol, GRID, tg, T, emb, greedy=True)
  episodes(model, free, seqs, Lc)
  np.testing.assert_array_equal(np.stack(free.history), GRID.dense_idx)   # dense, unguarded
  ctl = BudgetController(pol, GRID, tg, T, emb, greedy=True, budget_guard=tol)
  ep = episodes(model, ctl, seqs, Lc)
  # the running mean of the usage the steps applied, after each step
  run_mean = np.cumsum(ep.usage[:, 0], 1) / np.arange(1, T + 1)[None, :, None]   # [B, T, 3]
  assert ep.eff.all() and (ctl.eff_steps == T).all()
  err = np.abs(run_mean - tg[:, None])
  assert err[:, T // 4:].max() <= tol + 1e-6, err[:, T // 4:].max((0, 1))
  np.testing.assert_allclose(ctl.achieved(), run_mean[:, -1], atol=1e-6)
  # rho and bits are predicted exactly; kappa's prediction is an upper bound of what it kept
  pred = ctl.predicted_sum / T
  np.testing.assert_allclose(pred[:, 1:], ctl.achieved()[:, 1:], atol=1e-6)
  assert (pred[:, 0] >= ctl.achieved()[:, 0] - 1e-6).all()
  # among the allowed actions the policy's preference decides: never below the target on
  # every axis at once
  assert (ctl.achieved() >= tg - tol - 1e-6).all()


def test_guard_off_is_the_policys_own_action(model):
  pol = make_policy(model)
  rng = np.random.default_rng(7)
  B, Lc, T = 4, 24, 12
  seqs = rng.integers(1, 256, (B, Lc + T + 1))
  tg = np.tile(parse_budget("0.5,0.8,8"), (B, 1))
  emb = model.embed[...]
  runs = []
  for guard in (None, 1.0):     # tolerance 1: every action allowed, nothing masked
    ctl = BudgetController(pol, GRID, tg, T, emb, temperature=1.3, seed=3, record=True,
                           budget_guard=guard)
    ep = episodes(model, ctl, seqs, Lc)
    runs.append((np.stack(ctl.history), np.stack([l["logp"] for l in ctl.log]), ep.logp))
  (a0, lp0, ll0), (a1, lp1, ll1) = runs
  np.testing.assert_array_equal(a0, a1)
  np.testing.assert_array_equal(lp0, lp1)
  np.testing.assert_array_equal(ll0, ll1)
  assert len(np.unique(a0)) > 3                  # a sampling policy, varied actions
  ctl = BudgetController(pol, GRID, tg, T, emb)  # the guard is off by default (training)
  assert ctl.budget_guard is None
  ctl.act(seqs[:, 0], np.ones(B, bool))          # no kv_len needed without the guard
  on = BudgetController(pol, GRID, tg, T, emb, budget_guard=0.02)
  with pytest.raises(ValueError, match="kv_len"):
    on.act(seqs[:, 0], np.ones(B, bool))
  for bad in (-0.01, float("nan")):
    with pytest.raises(ValueError, match="budget_guard"):
      BudgetController(pol, GRID, tg, T, emb, budget_guard=bad)


def test_option_parsing_and_decode_config():
  assert budget_guard_option(None) is None and budget_guard_option(0) is None
  assert budget_guard_option("0.05") == 0.05
  for bad in (-1, "x", float("inf")):
    with pytest.raises(ValueError, match="budget_guard"):
      budget_guard_option(bad)
  c = decode_run.defaults()
  c.runtime = "sol"
  assert c.sol.budget_guard == 0.02
  c.sol.budget_guard = -0.5
  with pytest.raises(Exception, match="sol.budget_guard"):
    decode_run.validate(c)
  assert "sol.budget_guard" in decode_run.help_text()
