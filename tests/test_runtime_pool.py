"""KV pool bookkeeping, the step mask rule and step planning (numpy only, no model)."""

import numpy as np
import pytest

from selforch_jax.models.config import get_preset
from selforch_jax.runtime.kv_pool import ALIVE, DEAD, FREE, RESERVED, KVPool, PoolExhausted
from selforch_jax.runtime.mask import SegmentTable, sequence_mask, step_mask
from selforch_jax.runtime.oracle import plan_groups


def _write(pool, slots, seg=0, start=0):
  n = len(slots)
  pool.write(slots, np.arange(start, start + n), np.full(n, seg), np.arange(start, start + n))


def test_allocate_fills_pages_in_order_and_page_tables():
  pool = KVPool(num_pages=4, page_size=4)
  a = pool.allocate(owner=0, n_tokens=3)
  b = pool.allocate(owner=1, n_tokens=2)
  c = pool.allocate(owner=0, n_tokens=3)  # 1 slot left in its page, then a new page
  assert a.tolist() == [0, 1, 2]
  assert b.tolist() == [4, 5]
  assert c.tolist() == [3, 8, 9]
  assert pool.page_table(0).tolist() == [0, 2] and pool.page_table(1).tolist() == [1]
  assert np.all(pool.state[[0, 1, 2, 3, 8, 9, 4, 5]] == RESERVED)
  assert pool.live_tokens == 0  # reserved is not live until written
  _write(pool, a)
  assert pool.live_tokens == 3 and np.all(pool.state[a] == ALIVE)
  assert pool.position[a].tolist() == [0, 1, 2] and pool.owner[a].tolist() == [0, 0, 0]
  pool.check_invariants()


def test_live_bytes_formula_matches_model_config():
  cfg = get_preset("tiny_llama")
  pool = KVPool.for_model_config(cfg, 2, 8)
  assert pool.bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
  _write(pool, pool.allocate(0, 5))
  assert pool.live_bytes == 5 * pool.bytes_per_token
  bf = KVPool.for_model_config(cfg.replace(dtype="bfloat16"), 2, 8)
  assert bf.bytes_per_token * 2 == pool.bytes_per_token


def test_exhaustion_raises_clear_error_and_changes_nothing():
  pool = KVPool(num_pages=2, page_size=4)
  _write(pool, pool.allocate(0, 6))
  before = (pool.state.copy(), pool.page_table(0).copy(), pool.num_free_pages)
  assert not pool.can_allocate(1, 5)
  msg = r"owner 1 need\(s\) 5 slot\(s\) = 2 new page\(s\).*only 0 of 2 pages"
  with pytest.raises(PoolExhausted, match=msg):
    pool.allocate(1, 5)
  try:
    pool.allocate(1, 5)
  except PoolExhausted as e:
    assert (e.needed_pages, e.free_pages, e.live_tokens) == (2, 0, 6)
  assert np.array_equal(pool.state, before[0]) and np.array_equal(pool.page_table(0), before[1])
  assert pool.num_free_pages == before[2]
  # the owner's own last page still has room for 2
  assert pool.allocate(0, 2).tolist() == [6, 7]
  pool.check_invariants()


def test_evict_frees_whole_dead_pages_which_are_reused():
  pool = KVPool(num_pages=3, page_size=4)
  s0 = pool.allocate(0, 8)       # pages 0, 1
  _write(pool, s0)
  s1 = pool.allocate(1, 4)       # page 2
  _write(pool, s1)
  assert pool.num_free_pages == 0
  assert pool.evict(s0[:3]) == []            # page 0 still has a live slot
  assert pool.live_tokens == 9 and np.all(pool.state[s0[:3]] == DEAD)
  assert pool.evict(s0[3:4]) == [0]          # now page 0 is all dead -> free list
  assert pool.page_table(0).tolist() == [1] and np.all(pool.state[0:4] == FREE)
  with pytest.raises(ValueError, match="FREE"):   # a released slot cannot be evicted again
    pool.evict(s0[:1])
  assert pool.evict(s0[4:5]) == [] and pool.evict(s0[4:5]) == []  # DEAD again: idempotent
  s2 = pool.allocate(2, 4)
  assert s2.tolist() == [0, 1, 2, 3]         # the freed page is reused
  _write(pool, s2, seg=2)
  assert pool.live_tokens == 11   # 3 (owner 0: page 1, one dead) + 4 (owner 1) + 4 (owner 2)
  pool.check_invariants()


def test_new_pages_are_the_lowest_free_ones():
  """The free list is a min-heap: whatever order pages are freed in, a new page is the
  lowest-numbered free one, so used slots stay packed at the front of the pool."""
  pool = KVPool(num_pages=6, page_size=2)
  for o in range(6):
    _write(pool, pool.allocate(o, 2), seg=o)
  pool.free_owner(4)
  pool.free_owner(1)
  pool.free_pages([3])
  assert [pool.allocate(10 + i, 2)[0] // 2 for i in range(3)] == [1, 3, 4]
  pool.check_invariants()


def test_evict_keeps_owners_partly_filled_last_page():
  pool = KVPool(num_pages=2, page_size=4)
  s = pool.allocate(0, 2)
  _write(pool, s)
  assert pool.evict(s) == []                 # the owner is still filling page 0
  assert pool.allocate(0, 2).tolist() == [2, 3]
  pool.free_owner(0)
  assert pool.num_free_pages == 2 and pool.live_tokens == 0
  pool.check_invariants()


def test_evict_rejects_free_slots_and_out_of_range():
  pool = KVPool(num_pages=2, page_size=4)
  with pytest.raises(ValueError, match="FREE"):
    pool.evict([0])
  with pytest.raises(ValueError, match="in \\[0, 8\\)"):
    pool.evict([8])
  with pytest.raises(ValueError, match="not RESERVED"):
    pool.write([0], [0], [0], [0])


def test_free_pages_and_rollback():
  pool = KVPool(num_pages=4, page_size=2)
  s = pool.allocate(0, 5)          # pages 0,1,2 (last holds one)
  _write(pool, s)
  assert pool.rollback(0, 2).tolist() == [3, 4]
  assert pool.page_table(0).tolist() == [0, 1] and pool.num_free_pages == 2
  assert pool.allocate(0, 1).tolist() == [3]   # reuses the cropped slot
  pool.free_pages([0])
  assert pool.page_table(0).tolist() == [1] and pool.state[0] == FREE
  with pytest.raises(ValueError, match="already free"):
    pool.free_pages([0])
  with pytest.raises(ValueError, match="rollback"):
    pool.rollback(0, 99)
  pool.check_invariants()


def test_random_operations_keep_invariants_and_brute_force_counts():
  rng = np.random.default_rng(0)
  pool = KVPool(num_pages=6, page_size=3, bytes_per_token=10)
  written: dict[int, int] = {}  # slot -> owner, for ALIVE slots (brute force)
  order = 0
  for _ in range(600):
    op = rng.integers(0, 5)
    owner = int(rng.integers(0, 4))
    if op <= 1:
      n = int(rng.integers(1, 6))
      try:
        s = pool.allocate(owner, n)
      except PoolExhausted:
        assert pool.pages_needed(owner, n) > pool.num_free_pages
        continue
      pool.write(s, np.arange(n), np.full(n, owner), order + np.arange(n))
      order += n
      written.update({int(x): owner for x in s})
    elif op == 2 and written:
      ev = rng.choice(list(written), size=min(len(written), int(rng.integers(1, 4))),
                      replace=False)
      pool.evict(ev)
      for x in ev:
        written.pop(int(x))
    elif op == 3:
      pool.free_owner(owner)
      written = {k: v for k, v in written.items() if v != owner}
    elif op == 4:
      n = int(rng.integers(0, 3))
      table = pool.page_table(owner)
      if table.size:
        try:
          got = pool.rollback(owner, n)
        except ValueError:
          continue
        for x in got:
          written.pop(int(x), None)
    pool.check_invariants()
    assert pool.live_tokens == len(written) >= 0
    assert pool.live_bytes == 10 * len(written)
    assert set(np.flatnonzero(pool.alive).tolist()) == set(written)
    assert pool.peak_live_tokens >= pool.live_tokens


def test_step_mask_equals_brute_force_rule():
  rng = np.random.default_rng(1)
  pool = KVPool(num_pages=5, page_size=4)
  G = 4
  visible = rng.random((G, G)) < 0.6
  visible[np.arange(G), np.arange(G)] = True
  bidir = np.array([False, True, False, True])
  slots = pool.allocate(0, 14)
  segs = rng.integers(0, G, 14)
  orders = rng.permutation(14)
  pool.write(slots, np.arange(14), segs, orders)
  pool.evict(slots[[2, 5]])
  qseg = rng.integers(0, G, 6)
  qord = rng.integers(0, 16, 6)
  m = step_mask(pool, qseg, qord, visible, bidir)
  assert m.shape == (6, pool.num_slots)
  for t in range(6):
    for s in range(pool.num_slots):
      exp = bool(pool.state[s] == ALIVE and visible[qseg[t], pool.segment[s]] and
                 (qseg[t] != pool.segment[s] or bidir[qseg[t]] or pool.order[s] <= qord[t]))
      assert m[t, s] == exp, (t, s)
  keep = np.ones(pool.num_slots, bool)
  keep[slots[0]] = False
  assert not step_mask(pool, qseg, qord, visible, bidir, key_keep=keep)[:, slots[0]].any()
  with pytest.raises(ValueError, match="segment ids"):
    step_mask(pool, [G], [0], visible, bidir)


def test_sequence_mask_rule():
  # prompt (seg 0), two threads (1, 2) that see the prompt, a join (3) that sees all
  seg = np.array([0, 0, 1, 1, 2, 2, 3])
  vis = np.eye(4, dtype=bool)
  vis[1:, 0] = True
  vis[3, :] = True
  m = sequence_mask(seg, vis, np.zeros(4, bool), kill_at=[7, 7, 6, 7, 7, 7, 7])
  assert m[3].tolist() == [1, 1, 1, 1, 0, 0, 0]
  assert m[4].tolist() == [1, 1, 0, 0, 1, 0, 0]
  assert m[6].tolist() == [1, 1, 0, 1, 1, 1, 1]   # token 2 died at index 6
  mb = sequence_mask(seg, vis, np.array([0, 1, 0, 0], bool))
  assert mb[2, 3]   # bidirectional thread 1 sees its later token


def test_segment_table_grows():
  t = SegmentTable(capacity=2)
  p = t.new()
  a = t.new(sees=[p])
  b = t.new(sees=[p], bidir=True)
  j = t.new(sees=[p, a, b])
  vis, bid = t.tables()
  assert vis.shape == (4, 4) and bid.tolist() == [False, False, True, False]
  assert vis[a].tolist() == [True, True, False, False] and vis[j].all()
  with pytest.raises(ValueError, match="unknown"):
    t.new(sees=[9])


def test_plan_groups_respects_dependencies_and_kills():
  rng = np.random.default_rng(2)
  seg = np.array([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
  vis = np.eye(4, dtype=bool)
  vis[1:, 0] = True
  vis[3, :] = True
  bidir = np.array([False, False, True, False])
  kill = np.full(10, 10)
  kill[3] = 5                     # thread token 3 dies for queries >= 5
  tmask = sequence_mask(seg, vis, bidir, kill)
  nokill = sequence_mask(seg, vis, bidir)
  for order in ("index", "threads"):
    for _ in range(20):
      groups = plan_groups(seg, vis, bidir, kill, rng=rng, max_group=3, order=order)
      assert np.array_equal(np.sort(np.concatenate(groups)), np.arange(10))
      step_of = np.empty(10, int)
      for s, g in enumerate(groups):
        step_of[g] = s
      assert step_of[6] == step_of[7]             # a bidirectional segment is one step
      for q in range(10):
        for k in np.flatnonzero(tmask[q]):
          assert step_of[k] <= step_of[q]         # keys written no later than their query
        for k in np.flatnonzero(nokill[q] & ~tmask[q]):   # q must not see k: k evicted before
          readers = np.flatnonzero(tmask[:, k])
          assert step_of[readers].max() < step_of[q]
  with pytest.raises(ValueError, match="kill_at"):
    plan_groups(seg, vis, bidir, np.zeros(10, int))


def test_relabel_moves_whole_pages_into_the_target_sequence():
  """A tree step's kept slots join a sequence by page transfer (no K/V copy); the target keeps
  filling its own last page; foreign slots on moved pages never die with the wrong owner."""
  pool = KVPool(num_pages=6, page_size=4)
  seq = pool.allocate(0, 6)                    # pages 0, 1 (slots 4, 5 of page 1)
  _write(pool, seq)
  tree = pool.allocate(100, 7)                 # pages 2, 3 (slots 8..14)
  pool.write(tree, [6, 6, 7, 7, 8, 8, 9], np.arange(1, 8), np.arange(6, 13))
  live = pool.live_tokens
  pool.relabel([8, 11], owner=0, segment=0)
  assert pool.live_tokens == live               # relabel moves no K/V and kills nothing
  assert pool.page_table(0).tolist() == [0, 2, 1] and pool.page_table(100).tolist() == [3]
  assert pool.sequence(0).tolist() == [0, 1, 2, 3, 4, 5, 8, 11]
  assert pool.sequence(100).tolist() == [9, 10, 12, 13, 14]
  assert pool.segment[[8, 11]].tolist() == [0, 0] and pool.position[[8, 11]].tolist() == [6, 7]
  assert pool.order[[8, 11]].tolist() == [6, 9]
  assert pool.allocate(0, 2).tolist() == [6, 7]     # owner 0 still fills page 1
  pool.check_invariants()
  # the tree owner's own pages still work: roll back one, evict the rest
  assert pool.rollback(100, 1).tolist() == [14]
  pool.evict([12, 13])                 # page 3 stays: the tree owner is still filling it
  assert pool.page_table(100).tolist() == [3] and pool.sequence(100).tolist() == [9, 10, 12, 13]
  # freeing the sequence while tree slots 9, 10 are alive on its page 2: the page goes to the
  # tree owner, only owner 0's slots on it (8, 11) become holes
  pool.free_owner(0)
  assert pool.page_table(100).tolist() == [2, 3] and pool.state[9] == ALIVE == pool.state[10]
  assert pool.state[8] == FREE == pool.state[11] and pool.live_tokens == 2
  pool.check_invariants()
  pool.free_owner(100)
  assert pool.num_free_pages == 6 and pool.live_tokens == 0
  pool.check_invariants()


def test_relabel_rollback_and_errors():
  pool = KVPool(num_pages=4, page_size=2)
  _write(pool, pool.allocate(0, 3))              # pages 0, 1 (slot 3 not allocated)
  t = pool.allocate(7, 3)                        # pages 2, 3: slots 4, 5, 6
  pool.write(t, [3, 3, 4], [1, 2, 3], [3, 4, 5])
  with pytest.raises(ValueError, match=r"relabel: slots \[3\] are not ALIVE \(states \['free'\]"):
    pool.relabel([4, 3], 0, 0)
  with pytest.raises(ValueError, match="repeated"):
    pool.relabel([4, 4], 0, 0)
  with pytest.raises(ValueError, match="must be in"):
    pool.relabel([8], 0, 0)
  pool.evict([5])
  with pytest.raises(ValueError, match="dead"):
    pool.relabel([5], 0, 0)
  assert pool.sequence(0).tolist() == [0, 1, 2] and pool.owner[4] == 7   # nothing changed
  pool.relabel([4, 6], 0, 0)
  assert pool.page_table(0).tolist() == [0, 2, 3, 1]
  pool.free_owner(7)                             # its dead slot 5 becomes a hole on page 2
  assert pool.state[5] == FREE and pool.live_tokens == 5
  # rollback crops the relabeled slots first, then the owner's own; emptied pages go back
  assert pool.rollback(0, 1).tolist() == [6] and pool.page_table(0).tolist() == [0, 2, 1]
  assert pool.rollback(0, 2).tolist() == [2, 4]
  assert pool.page_table(0).tolist() == [0] and pool.num_free_pages == 3   # pages 1-3 empty
  assert pool.allocate(0, 2).tolist() == [2, 3]  # a fresh page: the lowest free one, page 1
  pool.check_invariants()


def test_rewrite_in_place_rerecords_metadata_of_held_slots():
  pool = KVPool(num_pages=2, page_size=4)
  s = pool.allocate(0, 3)
  _write(pool, s)
  stats = pool.stats()
  before = pool.rewrite(s[1:], 0, [9, 8], [2, 2], [20, 21])
  assert [b.tolist() for b in before] == [[1, 2], [0, 0], [1, 2]]
  assert pool.position[s].tolist() == [0, 9, 8] and pool.segment[s].tolist() == [0, 2, 2]
  assert pool.stats() == stats and pool.sequence(0).tolist() == s.tolist()
  pool.restore_metadata(s[1:], before)
  assert pool.position[s].tolist() == [0, 1, 2] and pool.order[s].tolist() == [0, 1, 2]
  with pytest.raises(ValueError, match=r"slot 3 is not held ALIVE by the query's owner 0 "
                                       r"\(it is free, owner -1\)"):
    pool.rewrite([0, 3], 0, [0, 0], [0, 0], [0, 0])
  with pytest.raises(ValueError, match="owner 1"):
    pool.rewrite([0], 1, [0], [0], [0])
  with pytest.raises(ValueError, match="repeat"):
    pool.rewrite([0, 0], 0, [0, 0], [0, 0], [0, 0])


def test_random_operations_with_relabel_keep_sequences_and_live_slots():
  """Fuzz allocate / write / evict / free_owner / rollback / relabel against a brute-force
  model of each owner's sequence: no ALIVE slot is ever lost or freed except by its own
  owner's free / rollback, sequences keep their order, rollback crops their ends."""
  rng = np.random.default_rng(5)
  pool = KVPool(num_pages=8, page_size=3, bytes_per_token=4)
  seqs: dict[int, list[int]] = {}
  alive: set[int] = set()
  counts = dict(relabel=0, handed=0)
  order = 0
  for it in range(1500):
    op = int(rng.integers(0, 6))
    owner = int(rng.integers(0, 5))
    if op <= 1:
      n = int(rng.integers(1, 5))
      try:
        s = pool.allocate(owner, n)
      except PoolExhausted:
        continue
      assert not set(s.tolist()) & {x for q in seqs.values() for x in q}
      pool.write(s, np.arange(n), np.full(n, owner), order + np.arange(n))
      order += n
      seqs.setdefault(owner, []).extend(s.tolist())
      alive |= set(s.tolist())
    elif op == 2 and alive:
      ev = rng.choice(sorted(alive), size=min(len(alive), int(rng.integers(1, 4))), replace=False)
      pool.evict(ev)
      alive -= set(ev.tolist())
    elif op == 3:
      tables_before = {o: pool.page_table(o).tolist() for o in pool.owners()}
      pool.free_owner(owner)
      mine = set(seqs.pop(owner, []))
      alive -= mine
      counts["handed"] += sum(p in pool.page_table(o).tolist() for o in pool.owners()
                              for p in tables_before.get(owner, []))
    elif op == 4 and seqs.get(owner):
      n = int(rng.integers(0, min(4, len(seqs[owner])) + 1))
      got = pool.rollback(owner, n).tolist()
      assert got == seqs[owner][len(seqs[owner]) - n:]
      del seqs[owner][len(seqs[owner]) - n:]
      alive -= set(got)
    elif op == 5 and alive:
      pick = rng.choice(sorted(alive), size=min(len(alive), int(rng.integers(1, 4))),
                        replace=False).tolist()
      seg = int(rng.integers(0, 4))
      for q in seqs.values():
        for x in pick:
          if x in q:
            q.remove(x)
      seqs.setdefault(owner, []).extend(pick)
      pool.relabel(pick, owner, seg)
      assert pool.segment[pick].tolist() == [seg] * len(pick)
      counts["relabel"] += 1
    # pages released with dead slots drop those from their sequences
    for o in list(seqs):
      seqs[o] = [x for x in seqs[o] if pool.state[x] != FREE]
    pool.check_invariants()
    assert set(np.flatnonzero(pool.alive).tolist()) == alive, it
    assert pool.live_tokens == len(alive) and pool.live_bytes == 4 * len(alive)
    for o, q in seqs.items():
      assert pool.sequence(o).tolist() == q, (it, o)
      assert np.all(pool.owner[q] == o)
  assert counts["relabel"] > 100 and counts["handed"] > 0
