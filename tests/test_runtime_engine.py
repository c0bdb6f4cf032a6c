"""Engine + AR scheduler on tiny random models: equality with an uncached reference decode,
eviction, page reuse, pool exhaustion, scratch steps and fuzzing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import KVCache, init_model
from selforch_jax.runtime.schedulers import ar
from selforch_jax.runtime.engine import Engine, bucket_size, key_window, key_windows
from selforch_jax.runtime.kv_pool import PoolExhausted
from selforch_jax.runtime.mask import SegmentTable
from selforch_jax.runtime.scheduler import Scheduler, StepPlan, execute, run
from reference_decode import ReferenceDecoder

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [200]]
ONE = (np.ones((1, 1), bool), np.zeros(1, bool))  # one causal segment


@pytest.fixture(scope="module")
def model():
  return init_model(get_preset("tiny_llama"), seed=1)


@pytest.fixture(scope="module")
def gen(model):
  return ReferenceDecoder(model)


_full = jax.jit(lambda graphdef, state, t, p, m: nnx.merge(graphdef, state)(t, p, m)[0],
                static_argnums=0)


def full_logits(model, tokens, positions, mask, pad_to=64):
  """The training forward ``model(tokens[None], positions[None], mask[None])``, padded to a
  multiple of ``pad_to`` (padding keys invisible, padding queries discarded) so that one
  compile serves every length."""
  n = len(tokens)
  N = -(-n // pad_to) * pad_to
  t = np.zeros((1, N), np.int32)
  p = np.zeros((1, N), np.int32)
  m = np.zeros((1, N, N), bool)
  t[0, :n], p[0, :n], m[0, :n, :n] = tokens, positions, mask
  graphdef, state = nnx.split(model)
  return np.asarray(_full(graphdef, state, t, p, m))[0, :n]


@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=3),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7),
], ids=["greedy", "sampled", "top_k_top_p"])
def test_ar_through_engine_equals_reference_decode(model, gen, sampling):
  # stop id 3 is produced by one row in the top-k/top-p run: rows finish at different steps
  ref, _ = gen.generate(PROMPTS, max_new_tokens=20, sampling=sampling, stop_ids=[3])
  eng = Engine(model, num_pages=16, page_size=8)
  out = ar.generate(eng, PROMPTS, max_new_tokens=20, sampling=sampling, stop_ids=[3])
  for a, b in zip(ref, out):
    assert b.token_ids == a.token_ids
    assert b.finish_reason == a.finish_reason
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
  # prefill = one step per prompt of T = len(prompt); decode = one step per new-token index
  assert eng.num_steps == len(PROMPTS) + 19
  assert eng.pool.live_tokens == 0 and eng.pool.num_free_pages == 16  # all released
  assert eng.pool.peak_live_tokens <= sum(len(p) for p in PROMPTS) + 4 * 19


def test_key_window_covers_the_used_slots_and_equals_full_attention(model, gen):
  """A pool of 640 slots: steps attend over a key window of 256 or 512 slots (the used pages
  are packed at the front); the tokens and log-probs equal the foundation's decode."""
  assert key_windows(640) == [256, 512, 640] and key_windows(100) == [100]
  mask = np.zeros((2, 640), bool)
  assert key_window(mask) == 256                       # nothing visible: the shortest window
  mask[1, 256] = True
  assert key_window(mask) == 512
  mask[0, 639] = True
  assert key_window(mask) == 640
  prompts = [list(range(7, 107)), list(range(150, 240)), list(range(20, 120))]   # 290 tokens
  eng = Engine(model, num_pages=40, page_size=16)
  sp = SamplingParams(temperature=1.0, seed=5)
  ref, _ = gen.generate(prompts, max_new_tokens=10, sampling=sp)
  out = ar.generate(eng, prompts, max_new_tokens=10, sampling=sp)
  for a, b in zip(ref, out):
    assert b.token_ids == a.token_ids
    np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-5)
  assert 512 in eng.windows_used and 640 not in eng.windows_used   # 22 pages used: < 512 slots
  # everything freed: a short prompt gets the lowest pages again, so a 256-slot window
  eng.windows_used.clear()
  ref, _ = gen.generate(PROMPTS[:1], max_new_tokens=10, sampling=sp)
  out = ar.generate(eng, PROMPTS[:1], max_new_tokens=10, sampling=sp)
  assert out[0].token_ids == ref[0].token_ids and eng.windows_used == {256}


def test_warm_up_compiles_each_window_and_refuses_a_pool_in_use(model):
  eng = Engine(model, num_pages=40, page_size=16)                   # 640 slots
  eng.warm_up([1, 300])        # bucket 1: every window; bucket 512: only windows >= 512
  assert eng.windows_used == {256, 512, 640} and eng.buckets_used == {1, 512}
  assert eng.num_steps == 0 and eng.pool.used_pages == 0
  small = Engine(model, num_pages=3, page_size=100)                 # 300 slots < bucket 512
  small.warm_up([300])
  assert small.buckets_used == {512} and small.windows_used == {300}
  eng.allocate([0])
  with pytest.raises(ValueError, match="empty pool"):
    eng.warm_up([1])


def test_ar_single_prompts_and_pool_reuse(model, gen):
  eng = Engine(model, num_pages=4, page_size=32)  # 128 slots
  sp = SamplingParams(temperature=1.0, seed=11)
  for p in PROMPTS:
    ref, _ = gen.generate([p], max_new_tokens=12, sampling=sp)
    out = ar.generate(eng, [p], max_new_tokens=12, sampling=sp)
    assert out[0].token_ids == ref[0].token_ids
  assert eng.pool.num_free_pages == 4
  with pytest.raises(PoolExhausted, match="KV pool exhausted"):   # raised before any compile
    ar.generate(eng, [list(range(1, 200))], max_new_tokens=8)


def test_bucketing_and_padding_never_write_other_slots(model):
  assert [bucket_size(n) for n in (1, 2, 3, 4, 5, 17, 32)] == [1, 2, 4, 4, 8, 32, 32]
  eng = Engine(model, num_pages=4, page_size=4)
  rng = np.random.default_rng(0)
  eng.cache = KVCache(k=jnp.asarray(rng.normal(size=eng.cache.k.shape), jnp.float32),
                      v=jnp.asarray(rng.normal(size=eng.cache.v.shape), jnp.float32))
  k0, v0 = np.asarray(eng.cache.k), np.asarray(eng.cache.v)
  slots = np.array([9, 2, 14])
  mask = np.zeros((3, 16), bool)
  mask[np.arange(3), slots] = True
  logits = eng.step([4, 5, 6], [0, 1, 2], slots, mask)   # padded to 4 queries
  assert logits.shape == (3, model.cfg.vocab_size)
  assert eng.buckets_used == {4}
  k1, v1 = np.asarray(eng.cache.k), np.asarray(eng.cache.v)
  other = np.setdiff1d(np.arange(16), slots)
  np.testing.assert_array_equal(k1[:, :, other], k0[:, :, other])
  np.testing.assert_array_equal(v1[:, :, other], v0[:, :, other])
  assert not np.allclose(k1[:, :, slots], k0[:, :, slots])
  # each query saw only itself: equals three separate one-token forwards
  for t in range(3):
    ref = full_logits(model, [4 + t], [t], np.ones((1, 1), bool))
    np.testing.assert_allclose(np.asarray(logits[t]), ref[0], atol=1e-5)
  with pytest.raises(ValueError, match="distinct"):
    eng.step([1, 2], [0, 1], [3, 3], np.zeros((2, 16), bool))
  with pytest.raises(ValueError, match="token ids"):
    eng.step([10 ** 6], [0], [0], np.zeros((1, 16), bool))


def _prefill(eng, tokens, owner=0, seg=0, vis=ONE):
  return eng.run_step(tokens, np.arange(len(tokens)), np.full(len(tokens), seg), owner, *vis)


def test_evicted_slot_has_no_effect_on_later_logits(model):
  rng = np.random.default_rng(1)
  prompt = rng.integers(0, 256, 12)
  later = rng.integers(0, 256, 4)
  dead = np.array([2, 3, 7])   # page 1 (slots 2, 3) dies whole and is reused below

  def run_once(perturb: bool, evict: bool):
    eng = Engine(model, num_pages=8, page_size=2)
    _, slots = _prefill(eng, prompt)
    if evict:
      assert eng.pool.evict(slots[dead]) == [1]
    if perturb:
      big = jnp.asarray(rng.normal(size=(model.cfg.num_layers, len(dead), 2, 16)) * 1e3,
                        jnp.float32)
      eng.cache = KVCache(k=eng.cache.k.at[:, 0, slots[dead]].set(big),
                          v=eng.cache.v.at[:, 0, slots[dead]].set(-big))
    out = []
    for i in range(0, 4, 2):   # two tokens per step
      lg, _ = eng.run_step(later[i:i + 2], 12 + np.arange(i, i + 2), [0, 0], 0, *ONE)
      out.append(np.asarray(lg))
    return np.concatenate(out), eng

  clean, eng = run_once(perturb=False, evict=True)
  perturbed, _ = run_once(perturb=True, evict=True)
  np.testing.assert_array_equal(perturbed, clean)          # bit-identical
  assert eng.pool.live_tokens == 12 + 4 - 3
  assert int(np.count_nonzero(eng.pool.alive)) == eng.pool.live_tokens
  # negative control: the same perturbation without eviction changes the logits
  unevicted, _ = run_once(perturb=True, evict=False)
  assert np.abs(unevicted - clean).max() > 1e-2
  # and evicted == full forward with those keys hidden from the later queries
  toks = np.concatenate([prompt, later])
  mask = np.tril(np.ones((16, 16), bool))
  mask[12:, dead] = False
  np.testing.assert_allclose(clean, full_logits(model, toks, np.arange(16), mask)[12:],
                             atol=1e-5)


def test_freed_pages_are_reused_and_stale_kv_is_never_seen(model):
  rng = np.random.default_rng(2)
  eng = Engine(model, num_pages=4, page_size=4)
  a = rng.integers(0, 256, 11)
  _, sa = _prefill(eng, a, owner=0)                 # pages 0, 1, 2 (one slot left)
  assert eng.pool.page_table(0).tolist() == [0, 1, 2]
  released = eng.pool.evict(sa[:4])                 # page 0 all dead -> free
  assert released == [0]
  tab = SegmentTable()
  s0, s1 = tab.new(), tab.new()                     # a second, independent sequence
  b = rng.integers(0, 256, 6)
  lg, sb = eng.run_step(b, np.arange(6), np.full(6, s1), 1, *tab.tables())
  assert sorted(set((sb // 4).tolist())) == [0, 3]  # the freed page 0 is reused first
  np.testing.assert_allclose(np.asarray(lg), full_logits(model, b, np.arange(6),
                                                         np.tril(np.ones((6, 6), bool))),
                             atol=1e-5)
  # sequence 0 continues: it sees its 4 surviving tokens, never the reused page's new data
  lg, _ = eng.run_step([17], [11], [s0], 0, *tab.tables())
  toks = np.concatenate([a, [17]])
  mask = np.tril(np.ones((12, 12), bool))
  mask[11, :4] = False
  np.testing.assert_allclose(np.asarray(lg), full_logits(model, toks, np.arange(12), mask)[11:],
                             atol=1e-5)
  with pytest.raises(PoolExhausted):
    eng.run_step(rng.integers(0, 256, 5), np.arange(5), np.full(5, s1), 1, *tab.tables())


def test_exhaustion_is_atomic_and_scheduler_can_evict_instead(model):
  eng = Engine(model, num_pages=4, page_size=4)
  _prefill(eng, list(range(1, 15)))                 # 14 tokens: 2 slots left in page 3
  state = eng.pool.state.copy()
  with pytest.raises(PoolExhausted, match=r"owners \[0, 1\] need\(s\) 3 slot"):
    eng.run_step([7, 8, 9], [14, 15, 0], [0, 0, 0], [0, 0, 1], *ONE)  # owner 1 needs a page
  np.testing.assert_array_equal(eng.pool.state, state)
  assert eng.pool.page_table(1).size == 0

  class Evicting(Scheduler):
    def __init__(self):
      self.plans = [StepPlan([9, 9, 9], [0, 1, 2], [0, 0, 0], 2, *ONE)]
      self.exhausted = 0
      self.logits = None

    def next_step(self):
      return self.plans.pop() if self.plans else None

    def on_step(self, plan, result):
      self.logits = np.asarray(result.logits)

    def on_exhausted(self, plan, error):
      self.exhausted += 1
      return StepPlan(plan.tokens, plan.positions, plan.segments, plan.owners, plan.visible,
                      plan.bidir, free_owners=(0,), evict=())

  s = Evicting()
  run(eng, s)
  assert s.exhausted == 1 and eng.pool.live_tokens == 3
  np.testing.assert_allclose(s.logits, full_logits(model, [9, 9, 9], [0, 1, 2],
                                                   np.tril(np.ones((3, 3), bool))), atol=1e-5)


def test_scratch_step_and_rollback(model):
  eng = Engine(model, num_pages=4, page_size=4)
  _prefill(eng, [1, 2, 3, 4, 5])
  live = eng.pool.live_tokens
  draft = StepPlan([6, 7, 8], [5, 6, 7], [0, 0, 0], 0, *ONE, scratch=True)
  r = execute(eng, draft)
  assert eng.pool.live_tokens == live                     # nothing written back
  ref = full_logits(model, [1, 2, 3, 4, 5, 6, 7, 8], np.arange(8), np.tril(np.ones((8, 8), bool)))
  np.testing.assert_allclose(np.asarray(r.logits), ref[5:], atol=1e-5)
  # a committed draft, then a rejection of its last two tokens, then a different token
  r = execute(eng, StepPlan([6, 7, 8], [5, 6, 7], [0, 0, 0], 0, *ONE))
  r2 = execute(eng, StepPlan([9], [6], [0], 0, *ONE, rollback={0: 2}))
  assert eng.pool.live_tokens == 7 and r2.slots[0] == r.slots[1]   # the cropped slot reused
  ref = full_logits(model, [1, 2, 3, 4, 5, 6, 9], np.arange(7), np.tril(np.ones((7, 7), bool)))
  np.testing.assert_allclose(np.asarray(r2.logits), ref[6:], atol=1e-5)


class FuzzScheduler(Scheduler):
  """Random steps over several threads (owners = segments), random evictions and frees.

  Keeps a shadow history (token, position, segment, order, alive) to check live counts and,
  every few steps, the step's logits against one full forward over the whole history.
  """

  def __init__(self, engine, model, rng, steps=40, threads=3, check_every=8):
    self.eng, self.model, self.rng = engine, model, rng
    self.left, self.check_every = steps, check_every
    self.tab = SegmentTable()
    root = self.tab.new()
    self.threads = [root] + [self.tab.new(sees=[root]) for _ in range(threads - 1)]
    self.next_pos = {s: 0 for s in self.threads}
    self.hist = []            # dicts: tok, pos, seg, order, slot, alive
    self.steps = 0
    self.checked = 0
    self.exhausted = 0
    self.live_trace = []

  def next_step(self):
    if self.left == 0:
      return None
    self.left -= 1
    rng = self.rng
    T = int(rng.integers(1, 9))
    segs = rng.choice(self.threads, size=T)
    toks = rng.integers(0, 256, T)
    pos = []
    for s in segs:
      pos.append(self.next_pos[s])
      self.next_pos[s] += 1
    alive = [h for h in self.hist if h["alive"]]
    ev = ()
    if alive and rng.random() < 0.5:
      pick = rng.choice(len(alive), size=min(len(alive), int(rng.integers(1, 6))), replace=False)
      ev = [alive[i]["slot"] for i in pick]
    if rng.random() < 0.1:
      self.tab.new(sees=[self.threads[0]])   # a fork that stays empty: grows the table
    self._mark_dead(ev)                      # execute() applies evictions before the step
    return StepPlan(toks, np.array(pos), segs, segs, *self.tab.tables(), evict=np.array(ev))

  def on_exhausted(self, plan, error):
    """Evict the oldest half of the live tokens; with none left, release every thread."""
    self.exhausted += 1
    alive = sorted((h for h in self.hist if h["alive"]), key=lambda h: h["order"])
    if not alive:
      for h in self.hist:
        h["alive"] = False
      return dataclasses.replace(plan, evict=(), free_owners=tuple(self.eng.pool.owners()))
    ev = [h["slot"] for h in alive[:max(1, len(alive) // 2)]]
    self._mark_dead(ev)
    return dataclasses.replace(plan, evict=np.array(ev), free_owners=())

  def _mark_dead(self, slots):
    s = set(int(x) for x in slots)
    for h in self.hist:
      if h["alive"] and h["slot"] in s:
        h["alive"] = False

  def on_step(self, plan, result):
    order0 = self.eng.next_order - len(plan.tokens)
    new = [dict(tok=int(t), pos=int(p), seg=int(s), order=order0 + i, slot=int(sl), alive=True)
           for i, (t, p, s, sl) in enumerate(zip(plan.tokens, plan.positions, plan.segments,
                                                 result.slots))]
    self.hist += new
    vis, _ = self.tab.tables()
    for hq in new:   # what each new query saw: the §2 rule over the history at this step
      hq["seen"] = [k for k, hk in enumerate(self.hist)
                    if hk["alive"] and vis[hq["seg"], hk["seg"]] and
                    (hq["seg"] != hk["seg"] or hk["order"] <= hq["order"])]
    pool = self.eng.pool
    assert pool.live_tokens >= 0
    assert pool.live_tokens == sum(h["alive"] for h in self.hist)
    assert pool.live_bytes == pool.live_tokens * pool.bytes_per_token
    pool.check_invariants()
    self.live_trace.append(pool.live_tokens)
    self.steps += 1
    if self.steps % self.check_every == 0:
      self._check(result, len(new))

  def _check(self, result, t):
    """One training-style forward over the whole history, each token with the keys it saw."""
    n = len(self.hist)
    mask = np.zeros((n, n), bool)
    for q, h in enumerate(self.hist):
      mask[q, h["seen"]] = True
    ref = full_logits(self.model, [h["tok"] for h in self.hist], [h["pos"] for h in self.hist],
                      mask)[n - t:]
    np.testing.assert_allclose(np.asarray(result.logits), ref, atol=1e-5)
    self.checked += 1


def test_fuzz_random_streams_never_raise_and_match_full_forward(model):
  for seed in range(2):
    rng = np.random.default_rng(100 + seed)
    eng = Engine(model, num_pages=8, page_size=2)
    s = FuzzScheduler(eng, model, rng, steps=40)
    n = run(eng, s)
    assert n == 40 and s.checked == 5
    assert min(s.live_trace) >= 0 and max(s.live_trace) <= eng.num_slots
    assert s.exhausted > 0             # the pool (16 slots) filled up and the scheduler evicted
    assert eng.pool.peak_live_tokens <= eng.num_slots


def test_two_ar_jobs_share_one_pool_without_seeing_each_other(model, gen):
  """A second generate() on an engine that still holds another sequence gets fresh owner and
  segment ids: its output equals the solo run."""
  eng = Engine(model, num_pages=16, page_size=8)
  other = ar.ARScheduler([[7, 7, 7, 7]], 4)
  run(eng, other)                                    # stays in the pool (not freed)
  assert eng.pool.live_tokens == 4 + 3
  ref, _ = gen.generate(PROMPTS[:1], max_new_tokens=20, stop_ids=[3])
  out = ar.generate(eng, PROMPTS[:1], max_new_tokens=20, stop_ids=[3])
  assert out[0].token_ids == ref[0].token_ids
  assert eng.pool.live_tokens == 4 + 3               # the other sequence is untouched
