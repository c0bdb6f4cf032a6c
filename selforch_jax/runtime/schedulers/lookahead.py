"""Lookahead decoding (Fu, Bailis, Stoica, Zhang, ICML 2024, "Break the Sequential Dependency of
LLM Inference Using Lookahead Decoding"; hao-ai-lab/LookaheadDecoding) on the engine, lossless.

One forward carries the last committed token, the *lookahead branch* (a 2-D Jacobi window of
``W`` columns x ``N - 1`` levels) and the *verification branch* (up to ``G`` pool n-grams that
start with the last committed token). In diagonal coordinates, window node (r, k) (level r of
diagonal k) sits at ``last_pos + 1 + k + r`` and sees level 0 of diagonals ``0..k-1`` and levels
``0..r-1`` of its own diagonal (the paper's lookahead mask; PTD's first-level chain is its level
0). After the step, diagonal k yields the n-gram ``(level 0..N-2 of k, argmax at (N-2, k))``,
recorded in the pool under its first token (most recent ``G`` kept per key); the levels shift up
(level r <- level r + 1) and the last level becomes the argmax at the old last level. Levels
start as random prompt tokens. The verification branch is the trie of the key's candidates
(candidates sharing a prefix share nodes, so greedy verification accepts the longest matching
candidate, as the paper's per-candidate check does, with fewer queries), verified by
:mod:`selforch_jax.runtime.verify` (greedy longest-prefix match, or exact speculative sampling
with the residual rule). Accepted K/V are relabeled into the sequence
(:class:`~selforch_jax.runtime.schedulers.spec_base.SpecScheduler`).
"""

from __future__ import annotations

import numpy as np

from selforch_jax.runtime.ngram import Trie
from selforch_jax.runtime.registry import register
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.schedulers.spec_base import Draft, SpecScheduler, spec_factory


def window_draft(levels: np.ndarray) -> Draft:
  """The lookahead branch of ``levels`` (int ``[N - 1, W]``: level r, diagonal k) as a
  :class:`Draft`, level-major order (level 0 of every diagonal first): node (r, k) has offset
  ``1 + k + r`` and sees (0, 0..k-1) and (0..r-1, k)."""
  R, W = levels.shape
  idx = lambda r, k: r * W + k  # noqa: E731
  toks, offs, sees = [], [], []
  for r in range(R):
    for k in range(W):
      toks.append(int(levels[r, k]))
      offs.append(1 + k + r)
      sees.append([idx(0, j) for j in range(k)] + [idx(q, k) for q in range(r)])
  return Draft(toks, offs, sees)


class LookaheadScheduler(SpecScheduler):
  """Lookahead decoding (module docstring). Args as :class:`SpecScheduler`, plus ``window`` (W),
  ``ngram`` (N >= 2) and ``guesses`` (G). ``max_tree`` defaults to
  ``W (N - 1) + G (N - 1)``; the guess budget is what the window leaves.

  Raises:
    ValueError: as :class:`SpecScheduler`; ``W < 1``, ``N < 2`` or ``G < 0``.
  """

  name = "lookahead"

  def __init__(self, prompts, max_new_tokens, sampling=SamplingParams(), stop_ids=(),
               owner_base=0, segment_base=0, *, window=5, ngram=4, guesses=5, max_tree=None,
               max_pos=1 << 30):
    if window < 1 or ngram < 2 or guesses < 0:
      raise ValueError(f"need window >= 1, ngram >= 2, guesses >= 0; got {window}, {ngram}, "
                       f"{guesses}")
    self.W, self.N, self.G = int(window), int(ngram), int(guesses)
    mt = self.W * (self.N - 1) + self.G * (self.N - 1) if max_tree is None else int(max_tree)
    super().__init__(prompts, max_new_tokens, sampling, stop_ids, owner_base, segment_base,
                     max_tree=mt, max_guess=self.G * (self.N - 1), max_pos=max_pos)

  def start(self, req):
    p = np.asarray(req.prompt, np.int64)
    req.extra["levels"] = p[req.rng.integers(p.size, size=(self.N - 1, self.W))]
    req.extra["pool"] = {}

  def propose(self, req, budget):
    draft = window_draft(req.extra["levels"])
    nd = min(len(draft), budget)
    gbudget = max(0, min(self.max_guess, budget - len(draft)))
    trie = Trie()
    for cand in req.extra["pool"].get(req.tokens[-1], ()):
      trie.insert(cand)
    parents, toks, _ = trie.flatten(gbudget, max_depth=self.max_new - len(req.tokens))
    return parents, toks, Draft(draft.tokens[:nd], draft.offsets[:nd], draft.sees[:nd])

  def observe(self, req, draft, draft_argmax, committed):
    lv = req.extra["levels"]
    R, W = lv.shape
    if len(draft) < R * W:       # the window did not fit (end of context): keep it
      return
    am = np.asarray(draft_argmax, np.int64).reshape(R, W)
    pool = req.extra["pool"]
    for k in range(W):
      gram = tuple(int(t) for t in lv[:, k]) + (int(am[R - 1, k]),)
      if any(t in self.stops for t in gram[1:]):
        continue
      cands = pool.setdefault(gram[0], [])
      if gram[1:] in cands:
        cands.remove(gram[1:])
      cands.append(gram[1:])
      del cands[:-max(self.G, 1)]
    req.extra["levels"] = np.concatenate([lv[1:], am[R - 1:]], axis=0)
    req.extra["stats"] = dict(pool_keys=len(pool))


register("lookahead")(spec_factory(LookaheadScheduler))
