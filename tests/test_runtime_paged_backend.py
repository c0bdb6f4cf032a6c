"""The engine's kernel path (runtime.paged_backend): the Pallas paged attention kernel (interpret
mode on CPU) inside the engine step gives the same logits as the dense reference path and as the
training forward, on annotated sequences with forks, joins, bidirectional chunks and evictions."""

import jax
import numpy as np
import pytest
from flax import nnx

from selforch_jax.lang import TagVocab, batch_layouts
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.annotated import random_layout
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.oracle import plan_groups, replay
from selforch_jax.runtime.paged_backend import PagedAttentionMask, build_paged_mask
from selforch_jax.runtime.mask import step_mask

BASE_VOCAB = 256
TV = TagVocab.appended(BASE_VOCAB, 4, eos_ids=[2], digit_ids=range(48, 58), space_ids=[32])
TEXT = np.array([i for i in range(3, BASE_VOCAB) if not 48 <= i < 58 and i != 32])
PAD_TO = 64


@pytest.fixture(scope="module")
def setup():
  model = init_model(get_preset("tiny_llama", vocab_size=BASE_VOCAB + 11), seed=5)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  ref = Engine(model, num_pages=24, page_size=4)
  ker = Engine(model, num_pages=24, page_size=4, attention="paged", interpret=True)
  return state, fwd, ref, ker


def _replay(engine, lay, groups):
  out = replay(engine, lay.token_ids, lay.positions, lay.segment_ids, lay.visible, lay.bidir,
               lay.kill_at, groups=groups)
  for o in engine.pool.owners():
    engine.pool.free_owner(o)
  return out


@pytest.mark.parametrize("kind", ["pasta", "diffusion", "threads_tip"])
def test_kernel_engine_equals_reference_engine_and_training(setup, kind):
  state, fwd, ref_engine, ker_engine = setup
  rng = np.random.default_rng(11)
  lay = random_layout(kind, rng, TV, TEXT, max_tokens=PAD_TO)
  groups = plan_groups(lay.segment_ids, lay.visible, lay.bidir, lay.kill_at, rng=rng,
                       max_group=24 if kind == "diffusion" else 6, order="threads")
  a = _replay(ref_engine, lay, groups)
  b = _replay(ker_engine, lay, groups)
  b_ = batch_layouts([lay], PAD_TO)
  train = np.asarray(fwd(state, b_["tokens"], b_["positions"], b_["mask"]))[0, :lay.num_tokens]
  assert np.abs(b - a).max() < 1e-5, np.abs(b - a).max()
  assert np.abs(b - train).max() < 1e-5, np.abs(b - train).max()
  assert ker_engine.attention == "paged" and ref_engine.attention == "reference"


def test_paged_mask_encodes_the_step_mask():
  """Gathering the kernel metadata back into a dense mask gives ``step_mask`` exactly."""
  from kernels_pallas.segment_mask import pair_visible
  from selforch_jax.runtime.kv_pool import KVPool

  pool = KVPool(num_pages=4, page_size=4)
  s = pool.allocate(0, 6)
  pool.write(s, np.arange(6), [0, 0, 0, 1, 1, 1], np.arange(6))
  t = pool.allocate(1, 3)
  pool.write(t, [6, 7, 8], [2, 2, 2], [6, 7, 8])
  pool.evict(s[1:2])
  visible = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
  bidir = np.array([False, True, False])
  qseg, qord = np.array([1, 2]), np.array([5, 8])
  keep = np.ones(pool.num_slots, bool)
  keep[s[0]] = False
  want = step_mask(pool, qseg, qord, visible, bidir, keep)
  pm = build_paged_mask(pool, qseg, qord, visible, bidir, num_queries=4, key_keep=keep)
  assert isinstance(pm, PagedAttentionMask) and pm.shape == (1, 4, 16)
  got = pair_visible(pm.q_segment, pm.q_order, pm.slot_segment.reshape(1, -1),
                     pm.slot_order.reshape(1, -1), pm.slot_alive.reshape(1, -1), pm.visible,
                     pm.bidir)
  got = np.asarray(got)[0]
  np.testing.assert_array_equal(got[:2], want)
  assert not got[2:].any()                       # padding queries see nothing
  assert want[0, s[0]] == False and want[0, s[2]] and not want[0, s[1]]
  with pytest.raises(ValueError, match="segment ids"):
    build_paged_mask(pool, np.array([3]), np.array([0]), visible, bidir, num_queries=1)


def test_long_steps_on_a_paged_engine_run_the_dense_path(setup, monkeypatch):
  """A step of more than ``PAGED_MAX_QUERIES`` queries (a prefill chunk) on a "paged" engine
  takes the dense path (the kernel's one query block does not fit a GPU's shared memory for
  long steps) with the reference engine's logits; a short step still uses the kernel."""
  from selforch_jax.runtime import engine as engine_mod
  _, _, ref, ker = setup
  monkeypatch.setattr(engine_mod, "PAGED_MAX_QUERIES", 8)
  calls = []
  real = engine_mod.build_paged_mask
  monkeypatch.setattr(engine_mod, "build_paged_mask",
                      lambda *a, **k: calls.append(k["num_queries"]) or real(*a, **k))
  toks = np.asarray(TEXT[:13])
  one = (np.ones((1, 1), bool), np.zeros(1, bool))
  outs = []
  for eng in (ref, ker):
    a = np.asarray(eng.run_step(toks[:12], np.arange(12), np.zeros(12), 0, *one)[0])
    b = np.asarray(eng.run_step(toks[12:], [12], [0], 0, *one)[0])
    outs.append((a, b))
    eng.pool.free_owner(0)
  assert calls == [1], calls   # only the 1-query step built kernel metadata
  assert np.abs(outs[0][0] - outs[1][0]).max() < 1e-5
  assert np.abs(outs[0][1] - outs[1][1]).max() < 1e-5
