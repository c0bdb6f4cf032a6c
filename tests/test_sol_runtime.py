"""SOL on the engine (issue 22): the action grid, the policy (cached step == whole-sequence
forward), the decode scheduler (dense schedule == AR greedy token for token; the budget a row
reports == the usage the steps applied) and the teacher-forced episodes (fork the prefix, no
K/V copy; dense rollouts == the dense reference; rewards and usage recorded per step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from selforch_jax.models.config import get_preset
from selforch_jax.models.sol_policy import SolPolicyConfig, init_policy
from selforch_jax.models.transformer import causal_mask, init_model
from selforch_jax.runtime.build import make_engine
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import run
from selforch_jax.runtime.schedulers import available, make_scheduler
from selforch_jax.runtime.schedulers.ar import generate
from selforch_jax.runtime.schedulers.sol import SOLEpisodeScheduler
from selforch_jax.runtime.sol_actions import ActionGrid, budget_triple, parse_budget
from selforch_jax.runtime.sol_control import BudgetController, ScheduleActor

GRID = ActionGrid.named("cpu")


@pytest.fixture(scope="module")
def model():
  return init_model(get_preset("tiny_llama"), seed=2)


@pytest.fixture(scope="module")
def policy(model):
  return init_policy(SolPolicyConfig(lm_dim=model.cfg.hidden_size, num_actions=27, d_model=32,
                                     num_heads=4, max_len=64), seed=1)


def prompts(n=3, seed=0):
  rng = np.random.default_rng(seed)
  return [list(rng.integers(1, 256, int(rng.integers(12, 30)))) for _ in range(n)]


def test_grids_and_budget_parsing():
  assert ActionGrid.named("upstream").num_actions == 10 * 13 * 12 == 1560
  assert GRID.num_actions == 27 and tuple(GRID.table[GRID.dense_idx]) == (1.0, 1.0, 16.0)
  assert GRID.tags()[0] == "k025-s060-q6" and GRID.tags()[GRID.dense_idx] == "k100-s100-q16"
  sp = GRID.spec([0, GRID.dense_idx])
  np.testing.assert_allclose(sp.keep_frac, [0.25, 1.0])
  np.testing.assert_allclose(sp.query_bits, [6, 16])
  np.testing.assert_allclose(parse_budget("0.5,0.8,8"), [0.5, 0.8, 0.5])
  assert budget_triple([0.5, 0.8, 0.5]) == [0.5, 0.8, 8.0]
  for bad in ("0.5,0.8", "0,0.8,8", "0.5,0.8,17"):
    with pytest.raises(ValueError, match="SOL budget"):
      parse_budget(bad)
  for bad in ("0.5;0.8;8", "a,b,c", None):   # not numbers: the message shows the format
    with pytest.raises(ValueError, match=r"'kappa,rho,bits' \(e.g. 0.5,0.8,8\)"):
      parse_budget(bad)
  with pytest.raises(ValueError, match="dense action"):
    ActionGrid((0.5,), (1.0,), (16,))
  with pytest.raises(ValueError, match="actions must be in"):
    GRID.values([27])


def test_policy_cached_step_equals_the_whole_sequence_forward(policy):
  rng = np.random.default_rng(0)
  N, T, D = 3, 7, policy.cfg.lm_dim
  h, e = rng.normal(size=(N, T, D)), rng.normal(size=(N, T, D))
  sc = rng.normal(size=(N, T, 8))
  prev = rng.integers(0, 28, (N, T))
  full = np.asarray(policy(jnp.asarray(h), jnp.asarray(e), jnp.asarray(sc), jnp.asarray(prev)))
  from selforch_jax.models.sol_policy import PolicyCache
  cache = PolicyCache.zeros(policy.cfg, N)
  for t in range(T):
    lg, cache = policy.step(jnp.asarray(h[:, t]), jnp.asarray(e[:, t]), jnp.asarray(sc[:, t]),
                            jnp.asarray(prev[:, t]), cache, t)
    np.testing.assert_allclose(np.asarray(lg), full[:, t], atol=2e-5)
  with pytest.raises(ValueError, match="max_len"):
    policy(jnp.zeros((1, 65, D)), jnp.zeros((1, 65, D)), jnp.zeros((1, 65, 8)),
           jnp.zeros((1, 65), jnp.int32))


def decode(model, ps, actor, n_new=12, observer=None):
  eng = make_engine(model, [len(p) for p in ps], n_new, page_size=8, attention="reference")
  s = make_scheduler("sol", eng, ps, grid=GRID, actor=actor, max_new_tokens=n_new)
  run(eng, s, observer=observer)
  return s


def test_sol_is_registered_and_the_dense_schedule_is_ar_greedy(model):
  assert "sol" in available()
  ps = prompts()
  eng = make_engine(model, [len(p) for p in ps], 12, page_size=8, attention="reference")
  ar = generate(eng, ps, max_new_tokens=12)
  s = decode(model, ps, ScheduleActor(GRID, np.full((3, 12), GRID.dense_idx)))
  for j in range(3):
    assert s.results[j].token_ids == ar[j].token_ids
    assert s.budget(j)["achieved_budget"] == [1.0, 1.0, 16.0]


def test_reported_budget_is_the_usage_the_steps_applied(model, policy):
  ps = prompts(seed=1)
  seen = []

  def observer(plan, result):
    if plan.tag[0] == "decode":
      seen.append((list(plan.tag[1]), np.asarray(result.usage), np.asarray(plan.spec.keep_frac)))

  emb = model.embed[...]
  tg = np.tile(parse_budget("0.5,0.8,8"), (3, 1))
  ctl = BudgetController(policy, GRID, tg, 12, emb, temperature=1.3, seed=4)
  s = decode(model, ps, ctl, observer=observer)
  for j in range(3):
    us = np.concatenate([u[r.index(j)][None] for r, u, _ in seen if j in r])
    b = s.budget(j)
    assert b["target_budget"] == [0.5, 0.8, 8.0] and b["controlled_steps"] == len(us)
    np.testing.assert_allclose(b["achieved_budget"], budget_triple(us.mean(0)), atol=1e-4)
    acts = GRID.values(s.actions[j])
    D = model.cfg.hidden_size     # channels and bits are exactly what was asked
    np.testing.assert_allclose(b["achieved_budget"][1:],
                               [(np.ceil(acts[:, 1] * D) / D).mean(), acts[:, 2].mean()],
                               atol=1e-4)
  assert len({a for j in range(3) for a in s.actions[j]}) > 3    # a sampling policy varied
  # the next observation's gaps are the running applied usage minus the target
  np.testing.assert_allclose(ctl.scalars(np.ones(3, bool))[:, 5:8], ctl.achieved() - tg,
                             atol=1e-6)


def test_episodes_fork_the_prefix_and_dense_rollouts_equal_the_reference(model):
  rng = np.random.default_rng(5)
  B, K, Lc, T = 2, 3, 20, 6
  seqs = rng.integers(1, 256, (B, Lc + T + 1))
  acts = np.full((B * K, T), GRID.dense_idx)
  acts[1] = 0                                   # rollout 1 of sequence 0: cheapest action
  actor = ScheduleActor(GRID, acts)
  eng = Engine(model, num_pages=64, page_size=4, attention="reference")
  ep = SOLEpisodeScheduler(seqs, Lc, actor, GRID, rollouts=K)
  pages = []
  run(eng, ep, observer=lambda p, r: pages.append(eng.pool.used_pages))
  # prefix pages once per sequence; each rollout holds only its own T slots
  assert pages[0] == B * -(-Lc // 4) and pages[-1] == pages[0] + B * K * -(-T // 4)
  # teacher-forced dense log-probs from the plain forward of the whole sequence
  full, _ = model(jnp.asarray(seqs), jnp.tile(jnp.arange(Lc + T + 1), (B, 1)),
                  causal_mask(jnp.ones(seqs.shape, bool)))
  lsm = np.asarray(jax.nn.log_softmax(full, -1))
  want = np.take_along_axis(lsm[:, Lc:Lc + T], seqs[:, Lc + 1:, None], -1)[..., 0]
  np.testing.assert_allclose(ep.dense_logp, want, atol=1e-4)
  dense = [(b, k) for b in range(B) for k in range(K) if (b, k) != (0, 1)]
  for b, k in dense:
    np.testing.assert_allclose(ep.logp[b, k], want[b], atol=1e-4)
    np.testing.assert_allclose(ep.kl[b, k], 0.0, atol=1e-4)
    np.testing.assert_array_equal(ep.usage[b, k], np.ones((T, 3)))
  assert np.abs(ep.logp[0, 1] - want[0]).max() > 1e-3 and (ep.kl[0, 1] > 1e-5).all()
  D = model.cfg.hidden_size
  np.testing.assert_allclose(ep.usage[0, 1, :, 1:], np.tile([np.ceil(0.6 * D) / D, 6 / 16], (T, 1)),
                             atol=1e-6)
  assert (ep.usage[0, 1, :, 0] < 1).all() and ep.eff.all()
  np.testing.assert_allclose(actor.achieved()[1], ep.usage[0, 1].mean(0), atol=1e-6)
