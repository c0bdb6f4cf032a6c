"""The PTD baselines on the engine: prompt-lookup decoding (Saxena 2023) and Lookahead decoding
(Fu et al., ICML 2024) equal AR greedy token for token on 52 mixed prompts (batch > 1), the
n-gram trie cache and prompt lookup by hand, the Lookahead window layout by hand, and exact
sampling of the first tokens under PLD (chi-square against the exact AR distribution)."""

import numpy as np
import pytest

from selforch_jax.runtime.ngram import Trie, TrieCache, prompt_lookup
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.schedulers.lookahead import window_draft
from tests.spec_prompts import ar_greedy, mixed_prompts, spec_run, tiny_model
from tests.test_ptd import _chi2, _exact_ar


@pytest.fixture(scope="module")
def model():
  return tiny_model()


@pytest.fixture(scope="module")
def cases_and_ref(model):
  cases = mixed_prompts(52, seed=1)
  return cases, ar_greedy(model, cases)


@pytest.mark.parametrize("name,opts", [("pld", dict(max_tree=15)),
                                       ("lookahead", dict(window=3, ngram=3, guesses=3))])
def test_greedy_equals_ar_on_mixed_prompts(model, cases_and_ref, name, opts):
  cases, ref = cases_and_ref
  by_n = {}
  for k, (p, n) in enumerate(cases):
    by_n.setdefault(n, []).append(k)
  acc = 0
  for n, ks in by_n.items():
    s, _ = spec_run(name, model, [cases[k][0] for k in ks], n, **opts)
    for k, r, st in zip(ks, s.results, s.stats):
      assert r.token_ids == ref[k].token_ids, (name, k)
      np.testing.assert_allclose(r.logprobs, ref[k].logprobs, atol=2e-4)
      assert st["forwards"] == 1 + len(st["accepted"])
      acc += sum(st["accepted"])
  assert acc > 100


def test_trie_cache_by_hand():
  c = TrieCache(max_nodes=4)
  c.insert(7, [1, 2, 3])
  c.insert(7, [1, 5])
  assert c.tries[7].size == 4
  parents, toks, depth = c.guess(7, 10)
  assert toks.tolist() == [0, 1, 5, 2, 3] and parents.tolist() == [-1, 0, 1, 1, 3]
  assert depth.tolist() == [0, 1, 2, 2, 3]
  assert c.guess(7, 2)[1].tolist() == [0, 1, 5]          # BFS prefix, newest child first
  c.insert(7, [9])                                       # 5 nodes > cap 4: oldest branch goes
  assert list(c.tries[7].children) == [9] and c.tries[7].size == 1
  assert c.guess(8, 5)[0].tolist() == [-1]               # unknown key: just the root
  c2 = TrieCache(60)
  c2.add_ngrams([4, 5, 6, 4, 5, 8], 3)
  assert c2.guess(4, 10)[1].tolist() == [0, 5, 8, 6]
  t = Trie()
  t.merge({1: {2: {}}, 3: {}})
  assert t.size == 3
  with pytest.raises(ValueError):
    TrieCache(0)


def test_prompt_lookup_by_hand():
  ctx = [1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3]
  assert prompt_lookup(ctx, 3, 4) == [9, 9, 1, 2]        # the earliest match of [1, 2, 3]
  assert prompt_lookup([5, 6, 7, 6], 3, 2) == [7, 6]     # falls back to a 1-gram
  assert prompt_lookup([1, 2, 3], 3, 5) == []
  assert prompt_lookup([4, 4], 2, 3) == [4]
  with pytest.raises(ValueError):
    prompt_lookup(ctx, 0, 3)


def test_lookahead_window_layout_by_hand():
  lv = np.array([[10, 11, 12], [20, 21, 22]])            # N - 1 = 2 levels, W = 3 diagonals
  d = window_draft(lv)
  assert d.tokens == [10, 11, 12, 20, 21, 22]
  assert d.offsets == [1, 2, 3, 2, 3, 4]                  # (r, k) at 1 + k + r
  assert d.sees == [[], [0], [0, 1], [0], [0, 1], [0, 1, 2]]   # offset = len(sees) + 1


def test_pld_sampling_first_three_tokens_match_ar():
  V = 6
  m = tiny_model(vocab_size=V, seed=1)
  prompt = [1, 2, 3, 4, 5, 0] * 3
  params = SamplingParams(temperature=1.0, seed=5)
  n = 2000
  s, _ = spec_run("pld", m, [prompt] * n, 3, sampling=params, pages=16, max_tree=4)
  counts = np.zeros((V, V, V))
  for r in s.results:
    counts[tuple(r.token_ids)] += 1
  assert sum(sum(st["accepted"]) for st in s.stats) > 0.1 * n
  assert _chi2(counts, _exact_ar(m, prompt, params, V)) > 1e-3
