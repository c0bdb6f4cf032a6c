"""SOL's GRPO pieces (issue 22; akhauriyash/SOL ``train.py``): discounted returns, the squared-
hinge budget penalty (zero inside the tolerance), group-relative then whitened advantages (equal
rewards give 0, not NaN), the sources rule, and a short run on a tiny model whose budget error
falls."""

import json
import sys

import numpy as np
import pytest

from selforch_jax.trainers.sol_grpo import budget_gaps, budget_penalty, discounted_returns, \
    sol_advantages
from selforch_jax.trainers.sol_run import parse_sources, validate


def test_discounted_returns_by_hand():
  g = discounted_returns([[1.0, 2.0, 3.0]], 0.5)
  np.testing.assert_allclose(g, [[1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3]])


def test_penalty_is_zero_inside_the_tolerance_and_a_squared_hinge_outside():
  T = 4
  eff = np.ones((1, T), bool)
  tg = np.array([[0.5, 0.8, 0.5]])
  inside = np.tile([0.51, 0.785, 0.5199], (1, T, 1))
  assert budget_penalty(inside, eff, tg, [100, 100, 200], 0.02) == 0.0
  u = np.tile([0.6, 0.8, 0.5], (1, T, 1))
  u[0, 0, 2] = 0.5 + 4 * 0.05                      # mean bits gap 0.05 over 4 steps
  np.testing.assert_allclose(budget_gaps(u, eff, tg), [[0.1, 0.0, 0.05]], atol=1e-12)
  np.testing.assert_allclose(budget_penalty(u, eff, tg, [100, 100, 200], 0.02),
                             [100 * 0.08 ** 2 + 200 * 0.03 ** 2])
  eff[0, 0] = False                                # only controllable steps count
  np.testing.assert_allclose(budget_gaps(u, eff, tg), [[0.1, 0.0, 0.0]], atol=1e-12)


def test_equal_rewards_give_zero_advantages_not_nan():
  eff = np.ones((2, 4, 3), bool)
  A = sol_advantages(np.full((2, 4, 3), -1.7), eff)
  assert np.isfinite(A).all() and (A == 0).all()
  R = np.full((2, 4, 3), 2.0)
  R[1, :, 0] = [1.0, 2.0, 3.0, 4.0]                # one group differs: only it moves
  A = sol_advantages(R, eff)
  assert np.isfinite(A).all()
  assert (A[0] == 0).all() and (A[1, :, 1:] == 0).all()
  c = np.array([-1.5, -0.5, 0.5, 1.5])             # centred, then whitened over all 24 entries
  flat = np.zeros((2, 4, 3))
  flat[1, :, 0] = c
  np.testing.assert_allclose(A, (flat - flat.mean()) / flat.std(), rtol=1e-6)
  eff[0, 0] = False
  A = sol_advantages(np.random.default_rng(0).normal(size=(2, 4, 3)), eff)
  assert (A[0, 0] == 0).all() and abs(A[eff].mean()) < 1e-6 and abs(A[eff].std() - 1) < 1e-5
  with pytest.raises(ValueError, match="finite"):
    sol_advantages(np.full((1, 2, 1), np.nan), np.ones((1, 2, 1), bool))


def test_sources_are_training_text_only():
  assert parse_sources("gsm8k:10,alpaca:2") == [("gsm8k", 10), ("alpaca", 2)]
  for bad in ("alpaca_eval:5", "aime:3", "math500:4", "gsm8k"):
    with pytest.raises(ValueError, match="training text only"):
      parse_sources(bad)


def test_a_short_tiny_run_lowers_the_budget_error(tmp_path):
  sys.path.insert(0, ".")
  import configs.sol as sol_config
  from selforch_jax.sol_adapter import load_sol_policy
  from selforch_jax.trainers.sol_run import train_sol
  c = sol_config.get_config("model=tiny_smollm2,steps=30,w=1.0")
  s = c.sol
  s.context_len, s.rollout_len, s.rollouts, s.batch_size = 32, 8, 8, 8
  s.d_model, s.max_len, s.sparsity = 32, 64, "quest(4)"
  s.sources, s.eval_windows, s.eval_every = "gsm8k:64", 4, 30
  s.lr, s.ppo_epochs = 3e-3, 2
  s.eval_targets = "0.5,0.7,8;0.75,0.9,12;0.3,0.6,6"
  validate(c)
  out = train_sol(c, str(tmp_path))
  recs = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert [r["step"] for r in recs] == list(range(31))
  assert out["eval_budget_error_end"] < 0.8 * out["eval_budget_error_start"], out
  early = np.mean([r["penalty"] for r in recs[1:9]])
  late = np.mean([r["penalty"] for r in recs[-8:]])
  assert late < 0.7 * early, (early, late)
  pol, grid, sparsity, meta = load_sol_policy(out["adapter"])
  assert sparsity == "quest(4)" and grid.num_actions == pol.cfg.num_actions == 27
  assert meta["metrics"]["summary"]["steps"] == 30
