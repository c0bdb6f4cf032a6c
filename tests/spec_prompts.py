"""Shared fixtures of the lossless speculative tests (tests/test_ptd.py, tests/test_pld_lookahead.py):
a tiny random float32 model and >= 50 prompts of mixed kinds on its 256-token vocabulary."""

import numpy as np

from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import run
from selforch_jax.runtime.schedulers import ar, make_scheduler

V = 256


def tiny_model(vocab_size=V, seed=0):
  return init_model(get_preset("tiny_llama", vocab_size=vocab_size), seed=seed)


def mixed_prompts(n=52, seed=0):
  """``n`` prompts with their new-token counts: chat-like (a fixed header, a random body, a
  fixed footer), math-like (digits and operators), code-like (brackets / keywords repeated),
  repetitive (a short motif repeated) and random, 3..60 tokens, 16..64 new tokens."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    kind = i % 5
    if kind == 0:                                   # chat
      body = rng.integers(20, V, size=rng.integers(3, 20)).tolist()
      p = [1, 7, 9, 2] + body + [3, 7, 8]
    elif kind == 1:                                 # math: digits 10..19, ops 30..33
      p = []
      for _ in range(rng.integers(2, 6)):
        p += rng.integers(10, 20, size=2).tolist() + [int(rng.integers(30, 34))]
      p += [34]
    elif kind == 2:                                 # code: keywords + brackets repeated
      kw = rng.integers(40, 60, size=3).tolist()
      p = (kw + [5, 6]) * int(rng.integers(2, 6)) + [kw[0]]
    elif kind == 3:                                 # repetitive motif
      motif = rng.integers(0, V, size=rng.integers(1, 5)).tolist()
      p = motif * int(rng.integers(3, 12))
    else:                                           # random
      p = rng.integers(0, V, size=rng.integers(3, 60)).tolist()
    out.append((p[:60], int(rng.integers(16, 65))))
  return out


def engine_for(model, pages=64):
  return Engine(model, num_pages=pages, page_size=16, attention="reference")


def ar_greedy(model, cases, stop_ids=()):
  """AR greedy answers of ``cases`` (grouped by new-token count: one batched run per count)."""
  res = {}
  by_n = {}
  for k, (p, n) in enumerate(cases):
    by_n.setdefault(n, []).append(k)
  for n, ks in by_n.items():
    eng = engine_for(model, pages=(2 + (n + 60) // 16) * len(ks) + 4)
    for k, r in zip(ks, ar.generate(eng, [cases[k][0] for k in ks], max_new_tokens=n,
                                    stop_ids=stop_ids)):
      res[k] = r
  return [res[k] for k in range(len(cases))]


def spec_run(name, model, prompts, max_new_tokens, stop_ids=(), pages=64, **opts):
  """Run scheduler ``name``; returns (scheduler, engine) after freeing every owner (the pool is
  then checked empty)."""
  eng = engine_for(model, pages)
  s = make_scheduler(name, eng, prompts, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                     **opts)
  run(eng, s)
  for o in s.owners:
    eng.pool.free_owner(int(o))
  eng.pool.check_invariants()
  assert eng.pool.live_tokens == 0
  return s, eng
