"""PTD (selforch_jax.runtime.schedulers.ptd) on the engine: greedy PTD equals AR greedy token for
token on 52 mixed prompts (and two 400-token answers, and upstream's tree sizes), the draft /
guess tree layout and mask against a hand-worked tree, the train = decode oracle of a tree step,
upstream's tree update rules by hand, exact sampling (chi-square against the exact AR
distribution of the first three tokens; upstream's argmax fallback fails it), EOS, tree sizing
from the step-cost curve, and PTD == AR greedy on the real SmolLM2-135M."""

import jax
import numpy as np
import pytest
from flax import nnx
from scipy.stats import chisquare

from selforch_jax.runtime import verify as verify_mod
from selforch_jax.runtime.mask import step_mask
from selforch_jax.runtime.ngram import TrieCache, graft_chain
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.scheduler import execute
from selforch_jax.runtime.schedulers import ar, make_scheduler, spec_base
from selforch_jax.runtime.schedulers.ptd import UPSTREAM, DraftTree, _Node, choose_sizes
from tests.spec_prompts import ar_greedy, engine_for, mixed_prompts, spec_run, tiny_model

PTD_CPU = dict(max_tree=15, max_guess=8, max_depth=4, min_child=2, max_child=2, pld_init=True,
               cache_from_output=True)


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def _grouped(cases):
  by_n = {}
  for k, (p, n) in enumerate(cases):
    by_n.setdefault(n, []).append(k)
  return by_n


def test_ptd_greedy_equals_ar_on_mixed_prompts(model):
  cases = mixed_prompts(52)
  ref = ar_greedy(model, cases)
  acc = 0
  for n, ks in _grouped(cases).items():       # batch > 1: one scheduler per new-token count
    s, _ = spec_run("ptd", model, [cases[k][0] for k in ks], n, **PTD_CPU)
    for k, r, st in zip(ks, s.results, s.stats):
      assert r.token_ids == ref[k].token_ids, k
      assert r.finish_reason == ref[k].finish_reason == "length"
      np.testing.assert_allclose(r.logprobs, ref[k].logprobs, atol=2e-4)
      assert st["forwards"] == 1 + len(st["accepted"])
      assert st["tokens_per_forward"] == pytest.approx(n / st["forwards"])
      assert max(st["step_tokens"]) <= 16
      acc += sum(st["accepted"])
  assert acc > 100      # repetitive prompts: the guess tree is accepted


def test_ptd_long_answers_and_upstream_sizes(model):
  cases = mixed_prompts(6, seed=3)
  long = [cases[1][0]]                                    # math-like, 400 new tokens
  ref = ar_greedy(model, [(p, 400) for p in long])
  s, _ = spec_run("ptd", model, long, 400, pages=160, **PTD_CPU)   # a page per accepting step   # relabel: a page per accepting step
  assert [r.token_ids for r in s.results] == [r.token_ids for r in ref]
  assert all(st["tokens_per_forward"] > 1.0 for st in s.stats)
  # upstream's values (max depth 6, 4 children, 4 first-level nodes, trie cap 60), a big step
  up = dict(UPSTREAM, max_tree=63, max_guess=32)
  short = [p for p, _ in cases]
  ref = ar_greedy(model, [(p, 48) for p in short])
  s, _ = spec_run("ptd", model, short, 48, **up)
  assert [r.token_ids for r in s.results] == [r.token_ids for r in ref]
  assert max(max(st["step_tokens"]) for st in s.stats) > 16
  assert sum(st["cache_fills"] for st in s.stats) > 0     # the draft tree reached max depth


def test_graft_chain_by_hand():
  # trie guess: root -> 5 -> 6, root -> 7; chain 5 8 9 shares its first node with the trie
  parents, tokens, depth = np.array([-1, 0, 0, 1]), np.array([0, 5, 7, 6]), np.array([0, 1, 1, 2])
  P, T, D = graft_chain(parents, tokens, depth, [5, 8, 9], 10)
  assert P.tolist() == [-1, 0, 1, 2, 0, 1] and T.tolist() == [0, 5, 8, 9, 7, 6]
  assert D.tolist() == [0, 1, 2, 3, 1, 2]
  P, T, _ = graft_chain(parents, tokens, depth, [5, 8, 9], 4)   # the trie's last node is dropped
  assert P.tolist() == [-1, 0, 1, 2, 0] and T.tolist() == [0, 5, 8, 9, 7]
  P, T, _ = graft_chain(parents, tokens, depth, [], 3)            # no chain: the trie as it was
  assert P.tolist() == parents.tolist() and T.tolist() == tokens.tolist()


def test_lookup_chain_is_lossless_and_verified(model):
  """The grafted prompt-lookup branch (lookup_ngram=3) changes what is guessed, never the output."""
  cases = mixed_prompts(12, seed=5)
  prompts = [p for p, _ in cases]
  ref = ar_greedy(model, [(p, 64) for p in prompts])
  acc = {}
  for ng in (0, 3):
    s, _ = spec_run("ptd", model, prompts, 64, **dict(PTD_CPU, lookup_ngram=ng))
    assert [r.token_ids for r in s.results] == [r.token_ids for r in ref]
    acc[ng] = sum(sum(st["accepted"]) for st in s.stats)
  assert acc[3] != acc[0], acc       # the branch was really proposed (a different acceptance)
  with pytest.raises(ValueError, match="lookup_ngram"):
    spec_run("ptd", model, prompts[:1], 4, **dict(PTD_CPU, lookup_ngram=-1))


def _hand_tree(tree):
  #   A(10) -> B(11) -> C(12);  A -> D(13);   E(20) -> F(21);   H(30)
  A, B, C, D, E, F, H = (_Node(t) for t in (10, 11, 12, 13, 20, 21, 30))
  A.children, B.children, E.children = [B, D], [C], [F]
  tree.first = [A, E, H]
  return A, B, C, D, E, F, H


def test_draft_tree_layout_by_hand():
  tree = DraftTree([1, 2, 3], np.random.default_rng(0))
  A, B, C, D, E, F, H = _hand_tree(tree)
  nodes, d = tree.layout(100)
  assert nodes == [A, E, H, B, F, C, D]            # main chains first, then by depth
  assert d.tokens == [10, 20, 30, 11, 21, 12, 13]
  assert d.offsets == [1, 2, 3, 2, 3, 3, 2]        # depth d of subtree i: d + i
  assert d.sees == [[], [0], [0, 1], [0], [0, 1], [0, 3], [0]]
  nodes, d = tree.layout(4)                        # a prefix: closed under what nodes see
  assert d.tokens == [10, 20, 30, 11] and d.sees[3] == [0]


def test_tree_step_mask_positions_and_train_equals_decode(model):
  """One PTD step over a hand guess tree and the hand draft tree: every query sees exactly the
  prompt, the root, its ancestors (and the first-level chain) and itself, at the right
  positions, and its logits equal a causal forward over prompt + root + its path."""
  prompt = [5, 17, 33, 2, 40, 9]
  eng = engine_for(model)
  s = make_scheduler("ptd", eng, [prompt], max_new_tokens=20, max_tree=20, max_guess=8)
  plan = s.next_step()
  s.on_step(plan, execute(eng, plan))
  req = s.reqs[0]
  t0 = req.tokens[0]
  cache = TrieCache()
  cache.insert(t0, [50, 51])
  cache.insert(t0, [60])
  req.extra["cache"] = cache
  _hand_tree(req.extra["tree"])
  plan = s.next_step()
  L = len(prompt)
  assert plan.tokens.tolist() == [t0, 60, 50, 51, 10, 20, 30, 11, 21, 12, 13]
  assert (plan.positions - L).tolist() == [0, 1, 1, 2, 1, 2, 3, 2, 3, 3, 2]
  res = execute(eng, plan)
  sl = res.slots
  mask = step_mask(eng.pool, plan.segments, eng.pool.order[sl], plan.visible, plan.bidir)
  past = set(eng.pool.sequence(int(s.seq_owners[0]))[:L].tolist())
  # what each query sees, as query indices of this step (besides the prompt)
  sees = [[0], [0, 1], [0, 2], [0, 2, 3], [0, 4], [0, 4, 5], [0, 4, 5, 6], [0, 4, 7],
          [0, 4, 5, 8], [0, 4, 7, 9], [0, 4, 10]]
  for q, want in enumerate(sees):
    got = set(np.flatnonzero(mask[q]).tolist())
    assert got == past | set(sl[want].tolist()), q
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda t, p, m: nnx.merge(graphdef, state)(t, p, m)[0])
  logits = np.asarray(res.logits)
  for q, want in enumerate(sees):
    seq = prompt + [int(plan.tokens[j]) for j in want]
    n = len(seq)
    ref = np.asarray(fwd(np.asarray(seq, np.int32)[None], np.arange(n, dtype=np.int32)[None],
                         np.tril(np.ones((n, n), bool))[None]))[0, -1]
    assert np.abs(logits[q] - ref).max() < 1e-5, q
    assert int(plan.positions[q]) == n - 1


def test_draft_tree_update_rules_by_hand():
  tree = DraftTree([1], np.random.default_rng(0), max_depth=3, max_child=2, min_child=3)
  A, B, E = _Node(10), _Node(11), _Node(20)
  A.children = [B]
  tree.first = [A, E]
  fed, d = tree.layout(10)
  assert fed == [A, E, B]
  cache = TrieCache()
  # argmax: A -> 11 (already a child), E -> 21 (new child), B -> 12 (new child)
  assert tree.update(fed, [11, 21, 12], cache)
  # E's new child 21 moved up to the first level (2 < min_child); A -> B -> C reached depth 3:
  # the cache got every fed node's subtree (+ its argmax), then A gave way to its first child
  assert [n.token for n in tree.first] == [11, 20, 21]
  assert tree.first[0] is B and [c.token for c in B.children] == [12] and E.children == []
  flat = lambda t: cache.guess(t, 60)[1][1:].tolist()   # noqa: E731
  assert flat(10) == [11, 12] and flat(20) == [21] and flat(11) == [12]
  # a stop id is never added; more than min_child first-level nodes: the oldest goes
  tree2 = DraftTree([1], np.random.default_rng(0), max_depth=6, min_child=1, stop_ids=[99])
  X, Y = _Node(1), _Node(2)
  tree2.first = [X, Y]
  tree2.update([X, Y], [99, 5], None)
  assert tree2.first == [Y] and X.children == [] and [c.token for c in Y.children] == [5]


def _exact_ar(model, prompt, params, V):
  """P(t1, t2, t3) of AR sampling: three levels of full forwards."""
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda t: nnx.merge(graphdef, state)(
      t, jax.numpy.broadcast_to(jax.numpy.arange(t.shape[1]), t.shape),
      jax.numpy.broadcast_to(jax.numpy.tril(jax.numpy.ones((t.shape[1],) * 2, bool)),
                             (t.shape[0], t.shape[1], t.shape[1])))[0][:, -1])
  P = np.zeros((V, V, V))
  p1 = verify_mod.target_probs(fwd(np.asarray([prompt], np.int32)), params)[0]
  seq2 = np.asarray([prompt + [a] for a in range(V)], np.int32)
  p2 = verify_mod.target_probs(fwd(seq2), params)
  seq3 = np.asarray([prompt + [a, b] for a in range(V) for b in range(V)], np.int32)
  p3 = verify_mod.target_probs(fwd(seq3), params).reshape(V, V, V)
  return p1[:, None, None] * p2[:, :, None] * p3


def _chi2(counts, expected_p):
  counts, expected_p = counts.reshape(-1), expected_p.reshape(-1)
  assert counts[expected_p <= 0].sum() == 0
  keep = expected_p * counts.sum() >= 5
  exp = np.append(expected_p[keep], expected_p[~keep].sum()) * counts.sum()
  obs = np.append(counts[keep], counts[~keep].sum())
  return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def _upstream_fallback(parents, tokens, target_logits, params, rng=None, draft_probs=None):
  """MINE-USTC/PTD's ``dfs_logest_prefix_match_with_sample_2``: accept child c with p(c), else
  zero it and renormalise; when every child is rejected, the argmax of the residual."""
  if params.greedy:
    return verify_mod.greedy_tree(parents, tokens, target_logits)
  parents, tokens, children = verify_mod._check_tree(parents, tokens, len(target_logits))
  p = verify_mod.target_probs(target_logits, params)
  node, path = 0, []
  while True:
    r, acc = p[node].copy(), None
    for c in reversed(children[node]):
      if rng.random() < r[tokens[c]]:
        acc = c
        break
      r[tokens[c]] = 0
      r /= r.sum()
    if acc is None:
      last = int(r.argmax()) if children[node] else verify_mod._sample(r, rng)
      return verify_mod._result(path, tokens, last)
    path.append(acc)
    node = acc


@pytest.mark.parametrize("rule", ["exact", "upstream"])
def test_ptd_sampling_first_three_tokens_match_ar(rule, monkeypatch):
  V = 6
  m = tiny_model(vocab_size=V, seed=1)
  prompt = [1, 2, 3, 4, 5, 0] * 3
  params = SamplingParams(temperature=1.0, seed=3)
  if rule == "upstream":
    monkeypatch.setattr(spec_base, "verify_tree", _upstream_fallback)
  n = 2000
  s, _ = spec_run("ptd", m, [prompt] * n, 3, sampling=params, pages=16, max_tree=7,
                  max_guess=6, pld_init=True, cache_from_output=True)
  counts = np.zeros((V, V, V))
  for r in s.results:
    counts[tuple(r.token_ids)] += 1
  accepted = sum(sum(st["accepted"]) for st in s.stats)
  assert accepted > 0.1 * n          # the tree carries tokens 2-3 in many trials
  pv = _chi2(counts, _exact_ar(m, prompt, params, V))
  if rule == "exact":
    assert pv > 1e-3, pv
  else:
    assert pv < 1e-6, pv


def test_ptd_stops_at_the_same_eos_as_ar(model):
  prompt = mixed_prompts(4)[3][0]
  free = ar.generate(engine_for(model), [prompt], max_new_tokens=40)[0].token_ids
  stop = free[12]
  first = free.index(stop)
  ref = ar.generate(engine_for(model), [prompt], max_new_tokens=40, stop_ids=[stop])[0]
  s, _ = spec_run("ptd", model, [prompt], 40, stop_ids=[stop], **PTD_CPU)
  r = s.results[0]
  assert r.finish_reason == ref.finish_reason == "stop"
  assert r.token_ids == ref.token_ids == free[:first]
  assert stop not in r.token_ids


def test_choose_sizes_from_the_step_cost_curve():
  ms = {1: 30.0, 2: 36.0, 4: 38.0, 8: 44.0, 16: 55.0, 32: 85.0}
  acc = {0: 1.0, 4: 1.5, 8: 1.9, 16: 2.2, 24: 2.3}
  best = choose_sizes(ms, acc)
  # rates: 1/30=.033, 1.5/44=.0341 (T=8), 1.9/55=.0345 (T=16), 2.3/85=.027 (T=32)
  assert (best["bucket"], best["max_guess"], best["max_tree"]) == (16, 8, 15)
  assert best["tokens_per_s"] == pytest.approx(1000 * 1.9 / 55)
  assert choose_sizes(ms, {0: 1.0, 4: 1.01})["bucket"] == 1      # no gain: plain AR
  with pytest.raises(ValueError):
    choose_sizes({}, acc)


def test_ptd_equals_ar_greedy_on_smollm2():
  from selforch_jax.checkpoints.assets import smollm2_gguf_path
  from selforch_jax.checkpoints.gguf_import import load_gguf
  from selforch_jax.runtime.engine import Engine
  from selforch_jax.runtime.scheduler import run
  from selforch_jax.tokenizers import HFTokenizer
  path = smollm2_gguf_path()
  _, m, _ = load_gguf(path)
  tok = HFTokenizer.from_gguf(path)
  texts = ["List the first five prime numbers.", "Repeat after me: a b c, a b c, a b c.",
           "What is 12 times 7? Answer step by step."]
  prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
  eng = Engine(m, num_pages=48, page_size=16)
  ref = ar.generate(eng, prompts, max_new_tokens=48, stop_ids=tok.stop_ids)
  s = make_scheduler("ptd", eng, prompts, max_new_tokens=48, stop_ids=tok.stop_ids, **PTD_CPU)
  run(eng, s)
  assert [r.token_ids for r in s.results] == [r.token_ids for r in ref]
  assert [r.finish_reason for r in s.results] == [r.finish_reason for r in ref]
  assert sum(st["forwards"] for st in s.stats) < sum(len(r.token_ids) + 1 for r in ref)
