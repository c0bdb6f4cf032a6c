"""Pool operations of the lossless and diffusion systems (DESIGN.md §2.5) on a tiny random model,
checked with the train = decode oracle: relabel (a tree step's accepted path joins the sequence,
no K/V copy), eviction / release of the rest of the tree, rollback of a relabeled suffix, and
rewrite in place (diffusion re-denoising). Logits equal a plain causal (or chunk-bidirectional)
forward over the committed sequence within 1e-5 in float32.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.kv_pool import ALIVE, DEAD, FREE
from selforch_jax.runtime.scheduler import execute
from selforch_jax.runtime.step import StepPlan

V = 64
PROMPT = np.array([5, 17, 33, 2, 40, 9], np.int32)
# the draft tree, BFS order: three branches from the prompt's end (parent -1)
#   a1 -> a2 -> a3,   b1 -> b2,   c1
TREE_TOK = np.array([11, 21, 31, 12, 22, 13], np.int32)
TREE_PAR = np.array([-1, -1, -1, 0, 1, 3])
A_PATH = [0, 3, 5]   # a1, a2, a3
TREE_OWNER = 100


@pytest.fixture(scope="module")
def model_fwd():
  model = init_model(get_preset("tiny_llama", vocab_size=V), seed=7)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  return model, state, fwd


def forward(model_fwd, tokens, mask=None):
  """The training forward over one sequence: causal unless ``mask`` (bool [N, N]) is given."""
  _, state, fwd = model_fwd
  n = len(tokens)
  mask = np.tril(np.ones((n, n), bool)) if mask is None else mask
  return np.asarray(fwd(state, np.asarray(tokens, np.int32)[None],
                        np.arange(n, dtype=np.int32)[None], mask[None]))[0]


def tree_tables():
  """Segment 0 = the sequence; segment 1 + i = tree node i (sees 0, its ancestors, itself)."""
  G = 1 + TREE_TOK.size
  vis = np.zeros((G, G), bool)
  vis[0, 0] = True
  depth = np.zeros(TREE_TOK.size, int)
  for i, p in enumerate(TREE_PAR):
    vis[1 + i, 0] = vis[1 + i, 1 + i] = True
    j = p
    while j >= 0:
      vis[1 + i, 1 + j] = True
      j = TREE_PAR[j]
    depth[i] = 1 if p < 0 else depth[p] + 1
  return vis, np.zeros(G, bool), depth


def path_tokens(i):
  out = []
  while i >= 0:
    out.append(int(TREE_TOK[i]))
    i = TREE_PAR[i]
  return out[::-1]


def prefill_and_tree(engine):
  """Prompt (owner 0, segment 0) then the tree step (owner TREE_OWNER); returns the tree's
  logits and slots."""
  vis, bidir, depth = tree_tables()
  execute(engine, StepPlan(PROMPT, np.arange(PROMPT.size), np.zeros(PROMPT.size), 0, vis, bidir))
  res = execute(engine, StepPlan(TREE_TOK, PROMPT.size - 1 + depth, 1 + np.arange(TREE_TOK.size),
                                 TREE_OWNER, vis, bidir))
  return np.asarray(res.logits), res.slots


def decode(engine, tokens, start, owner=0):
  """Decode ``tokens`` one per step in segment 0 at positions ``start, start + 1, ...``."""
  vis, bidir, _ = tree_tables()
  out = []
  for k, t in enumerate(tokens):
    res = execute(engine, StepPlan([t], [start + k], [0], owner, vis, bidir))
    out.append(np.asarray(res.logits)[0])
  return np.stack(out)


@pytest.mark.parametrize("drop", ["free_owner", "evict"])
def test_tree_step_relabel_accepted_path_then_decode_equals_causal_forward(model_fwd, drop):
  model, _, _ = model_fwd
  engine = Engine(model, num_pages=16, page_size=4, attention="reference")
  pool = engine.pool
  tree_logits, tslots = prefill_and_tree(engine)
  # every tree node's logits = a causal forward over the prompt + its root-to-node path
  for i in range(TREE_TOK.size):
    ref = forward(model_fwd, list(PROMPT) + path_tokens(i))
    assert np.abs(tree_logits[i] - ref[-1]).max() < 1e-5, i
  # the accepted path a1 a2 a3 spans two tree pages (slots 8, 11, 13 of pages 2 and 3)
  path = tslots[A_PATH]
  assert len(set((path // 4).tolist())) == 2
  rest = np.setdiff1d(tslots, path)
  more = [3, 50, 7, 7, 61, 0, 28, 19]
  vis, bidir, _ = tree_tables()
  plan = StepPlan([more[0]], [PROMPT.size + len(A_PATH)], [0], 0, vis, bidir,
                  relabel=[(path, 0, 0)],
                  free_owners=(TREE_OWNER,) if drop == "free_owner" else (),
                  evict=rest if drop == "evict" else ())
  first = np.asarray(execute(engine, plan).logits)[0]
  out = np.concatenate([first[None], decode(engine, more[1:], PROMPT.size + len(A_PATH) + 1)])
  seq = list(PROMPT) + [int(TREE_TOK[i]) for i in A_PATH] + more
  ref = forward(model_fwd, seq)
  np.testing.assert_allclose(out, ref[PROMPT.size + len(A_PATH):], atol=1e-5, rtol=0)
  # the relabeled slots are the owner's: segment 0, positions kept, in its sequence
  assert np.all(pool.owner[path] == 0) and np.all(pool.segment[path] == 0)
  assert pool.position[path].tolist() == [6, 7, 8]
  own = pool.sequence(0)
  assert own[PROMPT.size:PROMPT.size + 3].tolist() == path.tolist() and own.size == len(seq)
  assert set((path // 4).tolist()) <= set(pool.page_table(0).tolist())
  # live KV: the committed sequence only; the rest of the tree is dead or released
  assert pool.live_tokens == len(seq) == np.count_nonzero(pool.state == ALIVE)
  assert not np.any(pool.state[rest] == ALIVE)
  if drop == "free_owner":
    assert pool.sequence(TREE_OWNER).size == 0 and pool.page_table(TREE_OWNER).size == 0
  else:
    assert np.all(pool.state[rest] == DEAD)
    pool.free_owner(TREE_OWNER)          # the dead siblings go; the owner's pages stay
    assert np.all(pool.state[rest] == FREE) and pool.live_tokens == len(seq)
  pool.check_invariants()
  pool.free_owner(0)
  assert pool.num_free_pages == pool.num_pages and pool.live_tokens == 0
  pool.check_invariants()


def test_relabel_then_rollback_of_the_target_owner(model_fwd):
  model, _, _ = model_fwd
  engine = Engine(model, num_pages=16, page_size=4, attention="reference")
  pool = engine.pool
  _, tslots = prefill_and_tree(engine)
  path = tslots[A_PATH]
  rest = np.setdiff1d(tslots, path)
  pool.relabel(path, 0, 0)
  pool.evict(rest)
  pool.check_invariants()
  free0 = pool.num_free_pages
  # crop a2 and a3 (the newest two of the sequence): the page of a3 (all its other slots dead)
  # goes back; a2's page keeps a1
  got = pool.rollback(0, 2)
  assert got.tolist() == path[1:].tolist()
  assert np.all(pool.state[path[1:]] == FREE) and pool.state[path[0]] == ALIVE
  assert pool.num_free_pages == free0 + 1
  pool.check_invariants()
  # decoding goes on after a1: same logits as a causal forward over prompt + a1 + new tokens
  more = [44, 1, 60, 8]
  out = decode(engine, more, PROMPT.size + 1)
  ref = forward(model_fwd, list(PROMPT) + [int(TREE_TOK[0])] + more)
  np.testing.assert_allclose(out, ref[PROMPT.size + 1:], atol=1e-5, rtol=0)
  assert pool.live_tokens == PROMPT.size + 1 + len(more)
  # roll back everything past the prompt: the decoded tokens, then a1 (its page released)
  pool.rollback(0, len(more) + 1)
  assert pool.sequence(0).tolist() == list(range(PROMPT.size))
  pool.free_owner(TREE_OWNER)
  assert pool.used_pages == 2 and pool.live_tokens == PROMPT.size
  pool.check_invariants()
  with pytest.raises(ValueError, match="rollback"):
    pool.rollback(0, PROMPT.size + 1)


def test_rewrite_in_place_equals_fresh_write_and_does_not_allocate(model_fwd):
  """Diffusion re-denoising: a bidirectional chunk after the prompt is written with one set of
  tokens, then rewritten in place with another; logits equal a fresh engine that wrote the
  second set directly, and no page is taken."""
  model, _, _ = model_fwd
  vis = np.array([[1, 0], [1, 1]], bool)
  bidir = np.array([False, True])
  n, c = PROMPT.size, 4
  chunk_pos, chunk_ord = n + np.arange(c), n + np.arange(c)
  first, second = np.array([63, 63, 63, 63]), np.array([14, 63, 2, 30])

  def setup():
    e = Engine(model, num_pages=8, page_size=4, attention="reference")
    execute(e, StepPlan(PROMPT, np.arange(n), np.zeros(n), 0, vis, bidir))
    return e

  fresh = setup()
  ref = np.asarray(execute(fresh, StepPlan(second, chunk_pos, np.ones(c), 1, vis, bidir,
                                           orders=chunk_ord)).logits)
  engine = setup()
  slots = execute(engine, StepPlan(first, chunk_pos, np.ones(c), 1, vis, bidir,
                                   orders=chunk_ord)).slots
  stats = engine.pool.stats()
  seq1 = engine.pool.sequence(1).copy()
  res = execute(engine, StepPlan(second, chunk_pos, np.ones(c), 1, vis, bidir, orders=chunk_ord,
                                 write_slots=slots))
  assert res.slots.tolist() == slots.tolist()
  np.testing.assert_allclose(np.asarray(res.logits), ref, atol=1e-5, rtol=0)
  assert engine.pool.stats() == stats          # free pages, live tokens unchanged
  assert engine.pool.sequence(1).tolist() == seq1.tolist()
  # and against the training forward: prompt causal, chunk bidirectional over the prompt
  m = np.tril(np.ones((n + c, n + c), bool))
  m[n:, n:] = True
  train = forward(model_fwd, list(PROMPT) + second.tolist(), mask=m)
  np.testing.assert_allclose(np.asarray(res.logits), train[n:], atol=1e-5, rtol=0)
  # re-record metadata: the rewritten slots may take a new segment / order
  vis3 = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
  bid3 = np.array([False, True, False])
  execute(engine, StepPlan(second[:2], chunk_pos[:2], [2, 2], 1, vis3, bid3,
                           orders=[100, 101], write_slots=slots[:2]))
  assert engine.pool.segment[slots].tolist() == [2, 2, 1, 1]
  assert engine.pool.order[slots[:2]].tolist() == [100, 101]
  engine.pool.check_invariants()


def test_pool_op_errors_are_clear_value_errors(model_fwd):
  model, _, _ = model_fwd
  engine = Engine(model, num_pages=8, page_size=4, attention="reference")
  pool = engine.pool
  vis, bidir = np.ones((1, 1), bool), np.zeros(1, bool)
  slots = execute(engine, StepPlan(PROMPT[:3], np.arange(3), np.zeros(3), 0, vis, bidir)).slots
  other = execute(engine, StepPlan(PROMPT[:2], np.arange(2), np.zeros(2), 1, vis, bidir)).slots
  before = (pool.state.copy(), pool.owner.copy(), pool.segment.copy(), pool.stats())

  def unchanged():
    assert np.array_equal(pool.state, before[0]) and np.array_equal(pool.owner, before[1])
    assert np.array_equal(pool.segment, before[2]) and pool.stats() == before[3]

  with pytest.raises(ValueError, match=r"relabel: slots \[3\] are not ALIVE \(states \['free'\]"):
    pool.relabel([slots[0], 3], 2, 0)      # slot 3 was never allocated
  unchanged()
  with pytest.raises(ValueError, match="not ALIVE"):
    execute(engine, StepPlan([1], [3], [0], 0, vis, bidir, relabel=[([30], 0, 0)]))
  unchanged()
  with pytest.raises(ValueError, match="repeated"):
    pool.relabel([slots[0], slots[0]], 2, 0)
  pool.evict(slots[2:])
  with pytest.raises(ValueError, match=r"not ALIVE \(states \['dead'\]"):
    pool.relabel(slots[2:], 2, 0)
  before = (pool.state.copy(), pool.owner.copy(), pool.segment.copy(), pool.stats())
  # write_slots held by another owner / dead / free / wrong length
  with pytest.raises(ValueError, match=r"slot 4 is not held ALIVE by the query's owner 0 "
                                       r"\(it is alive, owner 1\)"):
    execute(engine, StepPlan([1, 2], [0, 1], [0, 0], 0, vis, bidir, write_slots=[slots[0], 4]))
  with pytest.raises(ValueError, match=r"not held ALIVE.*it is dead"):
    engine.run_step([1], [2], [0], 0, vis, bidir, write_slots=slots[2:])
  with pytest.raises(ValueError, match=r"not held ALIVE.*it is free"):
    engine.run_step([1], [2], [0], 0, vis, bidir, write_slots=[7])
  with pytest.raises(ValueError, match=r"write_slots \(1,\) != \[2\]"):
    engine.run_step([1, 2], [0, 1], [0, 0], 0, vis, bidir, write_slots=[0])
  with pytest.raises(ValueError, match="scratch step cannot rewrite in place"):
    execute(engine, StepPlan([1], [0], [0], 0, vis, bidir, write_slots=[0], scratch=True))
  unchanged()
  # a step that fails after the rewrite was recorded puts the metadata back
  with pytest.raises(ValueError, match="token ids"):
    engine.run_step([V + 5], [9], [0], 0, vis, bidir, orders=[77], write_slots=slots[:1])
  assert pool.position[slots[0]] == 0 and pool.order[slots[0]] == 0
  unchanged()
  pool.check_invariants()
