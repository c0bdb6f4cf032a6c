"""Lossless verification (selforch_jax.runtime.verify): greedy longest-prefix match by hand, and
statistical exactness of speculative sampling (chain: Leviathan et al. 2023 / Chen et al. 2023;
tree: multi-draft recursive rejection sampling, SpecInfer / SpecTr): the committed tokens are
distributed as AR sampling from the filtered target distribution (chi-square, V = 5)."""

import numpy as np
import pytest
from scipy.stats import chisquare

from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.verify import (
    greedy_chain, greedy_tree, speculative_chain, speculative_tree, target_probs, verify_chain,
    verify_tree,
)

V = 5
TRIALS = 20000
P_MIN = 1e-3   # the chi-square p-value a correct sampler passes (seeds fixed: deterministic)


def onehot_logits(ids, v=10):
  out = np.full((len(ids), v), -5.0, np.float32)
  out[np.arange(len(ids)), ids] = 5.0
  return out


def test_greedy_chain_by_hand():
  r = greedy_chain([3, 1, 4], [3, 1, 2, 9])
  assert r.path.tolist() == [0, 1] and r.tokens.tolist() == [3, 1, 2] and r.num_accepted == 2
  r = greedy_chain([3, 1, 4], onehot_logits([3, 1, 4, 7]))
  assert r.path.tolist() == [0, 1, 2] and r.tokens.tolist() == [3, 1, 4, 7]
  r = greedy_chain([3, 1, 4], [0, 1, 4, 7])
  assert r.num_accepted == 0 and r.tokens.tolist() == [0]
  r = greedy_chain([], [6])
  assert r.tokens.tolist() == [6]
  with pytest.raises(ValueError, match="K \\+ 1 = 4 target rows"):
    greedy_chain([3, 1, 4], [3, 1, 4])
  # temperature 0 through the dispatcher is the greedy match
  assert verify_chain([3, 1, 4], onehot_logits([3, 1, 2, 9]), SamplingParams()).tokens.tolist() \
      == [3, 1, 2]


def test_greedy_tree_by_hand():
  #        root(0)
  #      /        \
  #   5 (1)      6 (2)
  #   /   \         \
  # 7 (3) 8 (4)    9 (5)
  parents = [-1, 0, 0, 1, 1, 2]
  tokens = [0, 5, 6, 7, 8, 9]
  r = greedy_tree(parents, tokens, [6, 0, 9, 0, 0, 3])
  assert r.path.tolist() == [2, 5] and r.tokens.tolist() == [6, 9, 3]
  r = greedy_tree(parents, tokens, onehot_logits([5, 8, 0, 0, 2, 0]))
  assert r.path.tolist() == [1, 4] and r.tokens.tolist() == [5, 8, 2]
  r = greedy_tree(parents, tokens, [4, 0, 0, 0, 0, 0])     # no child matches at the root
  assert r.num_accepted == 0 and r.tokens.tolist() == [4]
  r = greedy_tree(parents, tokens, [5, 1, 0, 0, 0, 0])     # node 1's children are 7, 8: stop
  assert r.path.tolist() == [1] and r.tokens.tolist() == [5, 1]
  # two children with the same token: the first is taken
  r = greedy_tree([-1, 0, 0], [0, 3, 3], [3, 1, 2])
  assert r.path.tolist() == [1] and r.tokens.tolist() == [3, 1]
  assert verify_tree(parents, tokens, onehot_logits([6, 0, 9, 0, 0, 3]),
                     SamplingParams()).tokens.tolist() == [6, 9, 3]
  with pytest.raises(ValueError, match="root"):
    greedy_tree([0, 0], [1, 2], [1, 2])
  with pytest.raises(ValueError, match="earlier node"):
    greedy_tree([-1, 2, 0], [1, 2, 3], [1, 2, 3])


def _check(counts, expected_p, what):
  counts = np.asarray(counts, np.float64).reshape(-1)
  expected_p = np.asarray(expected_p, np.float64).reshape(-1)
  zero = expected_p <= 0
  assert counts[zero].sum() == 0, f"{what}: tokens with target probability 0 were committed"
  exp = expected_p[~zero] / expected_p[~zero].sum() * counts.sum()
  pv = chisquare(counts[~zero], exp).pvalue
  assert pv > P_MIN, f"{what}: chi-square p = {pv:.2e}, counts {counts.tolist()}, expected " \
                     f"{(expected_p * counts.sum()).round(1).tolist()}"


def _rand_dist(rng, n, scale=1.5):
  x = rng.normal(size=(n, V)) * scale
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
          SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05)]


@pytest.mark.parametrize("params", PARAMS[:2])
def test_speculative_chain_first_two_tokens_are_ar_distributed(params):
  """Chain of 2 stochastic drafts (x1 ~ q0, x2 ~ q1[x1]) against targets that depend on the
  prefix; the first two generated tokens (the second from a plain AR draw when the step
  commits only one) are distributed as p0(t1) * p1(t2 | t1)."""
  rng = np.random.default_rng(0)
  L0 = rng.normal(size=(V,)) * 1.5
  L1 = rng.normal(size=(V, V)) * 1.5            # target logits after t1
  L2 = rng.normal(size=(V, V, V)) * 1.5         # after t1 t2
  q0 = _rand_dist(rng, 1)[0]
  q1 = _rand_dist(rng, V)                       # draft distribution after x1
  p0 = target_probs(L0[None], params)[0]
  p1 = target_probs(L1, params)
  counts = np.zeros((V, V))
  acc = 0
  for _ in range(TRIALS):
    x1 = rng.choice(V, p=q0)
    x2 = rng.choice(V, p=q1[x1])
    r = speculative_chain([x1, x2], np.stack([q0, q1[x1]]),
                          np.stack([L0, L1[x1], L2[x1, x2]]), params, rng)
    t = r.tokens.tolist()
    if len(t) < 2:
      t.append(rng.choice(V, p=p1[t[0]]))
    counts[t[0], t[1]] += 1
    acc += r.num_accepted
  assert 0.3 < acc / TRIALS < 1.9      # drafts are accepted and rejected
  _check(counts.sum(1), p0, "first token")
  _check(counts, p0[:, None] * p1, "first two tokens")


@pytest.mark.parametrize("params", PARAMS)
def test_speculative_tree_one_hot_children(params):
  """Deterministic drafts (q one-hot, PTD / PLD / Lookahead): root children with tokens 2, 0, 4
  (a 3-branch tree; child 0 has its own children 1, 3). First token ~ p_root; second token
  given the first, for accepted branches, ~ the target at that node."""
  rng = np.random.default_rng(1)
  parents = [-1, 0, 0, 0, 1, 1]
  tokens = [0, 2, 0, 4, 1, 3]
  logits = rng.normal(size=(6, V)) * 1.5
  p = target_probs(logits, params)
  counts = np.zeros(V)
  second = {2: np.zeros(V), 0: np.zeros(V), 4: np.zeros(V)}
  for _ in range(TRIALS):
    r = speculative_tree(parents, tokens, logits, params, rng)
    t = r.tokens.tolist()
    counts[t[0]] += 1
    if len(t) >= 2:
      second[t[0]][t[1]] += 1
    if r.num_accepted:
      assert r.path[0] in (1, 2, 3) and tokens[r.path[0]] == t[0]
  _check(counts, p[0], "first token")
  for tok, node in ((2, 1), (0, 2), (4, 3)):
    if p[0][tok] > 0.05:
      _check(second[tok], p[node], f"second token after {tok}")


# drafts that disagree with each other and with the target: both children are often rejected
# and a residual computed from p instead of the running residual is off by TV ~0.1
P_HAND = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
Q_HAND = np.array([[0.7, 0.2, 0.05, 0.03, 0.02], [0.05, 0.05, 0.7, 0.1, 0.1],
                   [0.1, 0.6, 0.1, 0.1, 0.1]])


@pytest.mark.parametrize("k,design", [(2, "hand"), (3, "hand"), (3, "random")])
def test_speculative_tree_stochastic_children(k, design):
  """k children at the root, each drawn independently from its own draft distribution q_c
  (redrawn every trial): the first committed token ~ p_root (SpecInfer's multi-step
  speculative sampling with the residual updated after each rejection)."""
  rng = np.random.default_rng(2 + k)
  if design == "hand":
    params = PARAMS[0]
    logits = np.log(np.concatenate([P_HAND[None], _rand_dist(rng, k)]))
    q = np.concatenate([np.full((1, V), 1.0 / V), Q_HAND[:k]])
  else:
    params = PARAMS[1]
    logits = rng.normal(size=(1 + k, V)) * 1.5
    q = np.concatenate([np.full((1, V), 1.0 / V), _rand_dist(rng, k)])
  p = target_probs(logits, params)
  counts = np.zeros(V)
  acc = 0
  for _ in range(TRIALS):
    toks = [0] + [rng.choice(V, p=q[c]) for c in range(1, 1 + k)]
    r = speculative_tree([-1] + [0] * k, toks, logits, params, rng, draft_probs=q)
    counts[r.tokens[0]] += 1
    acc += r.num_accepted
  assert 0.2 < acc / TRIALS < 1.0
  _check(counts, p[0], f"first token, {k} stochastic children")


def test_speculative_validation():
  params = SamplingParams(temperature=1.0)
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="draft_probs must be"):
    speculative_tree([-1, 0], [0, 1], np.zeros((2, V)), params, rng, draft_probs=np.ones((1, V)))
  q = np.full((2, V), 0.2)
  q[1, 1] = 0.0
  with pytest.raises(ValueError, match="probability 0"):
    speculative_tree([-1, 0], [0, 1], np.zeros((2, V)), params, rng, draft_probs=q)
  with pytest.raises(ValueError, match="draft_probs must be \\[K, V\\]"):
    speculative_chain([1], np.ones((2, V)) / V, np.zeros((2, V)), params, rng)
  with pytest.raises(ValueError, match="needs an rng"):
    verify_chain([1], np.zeros((2, V)), params)
  with pytest.raises(ValueError, match="temperature > 0"):
    target_probs(np.zeros((1, V)), SamplingParams())
  # the chain equals the one-path tree under the same random stream
  lg = np.random.default_rng(5).normal(size=(3, V))
  a = speculative_chain([1, 2], None, lg, params, np.random.default_rng(9))
  b = speculative_tree([-1, 0, 1], [0, 1, 2], lg, params, np.random.default_rng(9))
  assert a.tokens.tolist() == b.tokens.tolist() and (a.path + 1).tolist() == b.path.tolist()
