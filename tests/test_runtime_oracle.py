"""The train = decode oracle (DESIGN.md §2.2) on a tiny random model, with the lang mask builder.

For random annotated sequences of every kind (PASTA rounds with forks and joins, diffusion chunks
run whole in one bidirectional step, TIP registers with evictions, registers inside threads,
packed documents, malformed noise), the logits of the training forward
``model(tokens[None], layout.positions[None], layout.token_mask()[None])`` equal the engine's
incremental logits within 1e-5 in float32, for several step groupings: sequence order and
interleaved threads, 1-8 tokens per step, tokens evicted as soon as no later query sees them.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from selforch_jax.lang import TagVocab, batch_layouts, build_layout
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.annotated import KINDS, random_layout
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.kv_pool import ALIVE
from selforch_jax.runtime.mask import sequence_mask
from selforch_jax.runtime.oracle import plan_groups, replay

BASE_VOCAB = 256
TV = TagVocab.appended(BASE_VOCAB, 4, eos_ids=[2], digit_ids=range(48, 58), space_ids=[32])
TEXT = np.array([i for i in range(3, BASE_VOCAB) if not 48 <= i < 58 and i != 32])
PAD_TO = 128


@pytest.fixture(scope="module")
def setup():
  model = init_model(get_preset("tiny_llama", vocab_size=BASE_VOCAB + 11), seed=3)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  engine = Engine(model, num_pages=64, page_size=4)
  return model, state, fwd, engine


def training_logits(setup, layout):
  """The trainer's forward: ``batch_layouts`` (``Layout.token_mask()``) padded to PAD_TO."""
  _, state, fwd, _ = setup
  b = batch_layouts([layout], PAD_TO)
  return np.asarray(fwd(state, b["tokens"], b["positions"], b["mask"]))[0, :layout.num_tokens]


@pytest.mark.parametrize("kind", KINDS)
def test_train_equals_decode_tiny(setup, kind):
  _, _, _, engine = setup
  rng = np.random.default_rng(KINDS.index(kind))
  evicted = released = multi = bidir_steps = parallel = 0
  for _ in range(4):
    lay = random_layout(kind, rng, TV, TEXT, max_tokens=PAD_TO)
    n = lay.num_tokens
    # the engine's rule (runtime.mask) and the builder's token mask agree
    np.testing.assert_array_equal(
        sequence_mask(lay.segment_ids, lay.visible, lay.bidir, lay.kill_at), lay.token_mask())
    ref = training_logits(setup, lay)
    for order in ("index", "threads"):
      # diffusion: up to all chunks of a round in one step, as Planned Diffusion runs them
      groups = plan_groups(lay.segment_ids, lay.visible, lay.bidir, lay.kill_at, rng=rng,
                           max_group=24 if kind == "diffusion" else 8, order=order)
      trace = []
      out = replay(engine, lay.token_ids, lay.positions, lay.segment_ids, lay.visible, lay.bidir,
                   lay.kill_at, groups=groups, live_trace=trace)
      err = np.abs(out - ref).max()
      assert err < 1e-5, (kind, order, err, lay.notes)
      # bookkeeping: live KV never negative, equals the ALIVE slots, never above N
      assert all(0 <= live <= n for _, live, _ in trace)
      assert engine.pool.live_tokens == int(np.count_nonzero(engine.pool.state == ALIVE))
      # every token killed by a register is gone from the pool at the end
      dead = np.flatnonzero(lay.kill_at < n)
      evicted += dead.size
      assert engine.pool.live_tokens <= n - dead.size
      released += sum(len(r) for _, _, r in trace)
      multi += sum(len(g) > 1 for g in groups)
      bidir_steps += sum(lay.bidir[lay.segment_ids[g]].any() for g in groups)
      chunk_segs = [set(lay.segment_ids[g][lay.streams[g] >= 0].tolist()) for g in groups]
      parallel += sum(len(c) > 1 for c in chunk_segs)   # steps that run 2+ threads at once
      for o in engine.pool.owners():
        engine.pool.free_owner(o)
      engine.pool.check_invariants()
  assert multi > 0
  if kind in ("tip", "threads_tip", "packed"):
    assert evicted > 0 and released > 0   # evictions happened and freed whole pages
  if kind == "diffusion":
    assert bidir_steps > 0
  if kind in ("pasta", "diffusion", "threads_tip"):
    assert parallel > 0


def test_diffusion_chunk_is_one_step_and_sees_itself_whole(setup):
  """A bidirectional chunk's first token depends on its last one (in one step), and a causal
  replay of the same chunk would give different logits."""
  _, _, _, engine = setup
  rng = np.random.default_rng(11)
  lay = random_layout("diffusion", rng, TV, TEXT, max_tokens=PAD_TO)
  groups = plan_groups(lay.segment_ids, lay.visible, lay.bidir, lay.kill_at, max_group=4)
  for s in np.flatnonzero(lay.bidir):
    idx = np.flatnonzero(lay.segment_ids == s)
    assert any(np.array_equal(g[np.isin(g, idx)], idx) for g in groups)
  ref = training_logits(setup, lay)
  out = replay(engine, lay.token_ids, lay.positions, lay.segment_ids, lay.visible, lay.bidir,
               lay.kill_at, groups=groups)
  for o in engine.pool.owners():
    engine.pool.free_owner(o)
  assert np.abs(out - ref).max() < 1e-5
  causal = replay(engine, lay.token_ids, lay.positions, lay.segment_ids, lay.visible,
                  np.zeros_like(lay.bidir), lay.kill_at, groups=groups)
  for o in engine.pool.owners():
    engine.pool.free_owner(o)
  first = np.flatnonzero(lay.segment_ids == np.flatnonzero(lay.bidir)[0])[0]
  assert np.abs(causal[first] - ref[first]).max() > 1e-3


def test_fuzz_random_token_streams_through_parser_and_engine(setup):
  """Random streams of text and tags (stray, unclosed, nested, EOS anywhere) through the mask
  builder and the engine: never raise, live KV never negative, and still train = decode."""
  _, _, _, engine = setup
  rng = np.random.default_rng(99)
  tags = [TV.promise_open, TV.promise_close, TV.async_open, TV.async_close, TV.sync, TV.mask,
          TV.pad, *TV.registers, *TV.digit_ids, *TV.eos_ids, *TV.space_ids]
  for i in range(25):
    n = int(rng.integers(1, 60))
    p_tag = float(rng.uniform(0.1, 0.6))
    ids = [int(rng.choice(tags)) if rng.random() < p_tag else int(rng.choice(TEXT))
           for _ in range(n)]
    lay = build_layout(ids, TV, chunk_bidirectional=[False, True, "auto"][i % 3],
                       async_sees_full_plan=bool(i % 2))
    assert lay.num_tokens == n
    groups = plan_groups(lay.segment_ids, lay.visible, lay.bidir, lay.kill_at, rng=rng,
                         max_group=int(rng.integers(1, 9)), order=("index", "threads")[i % 2])
    trace = []
    out = replay(engine, lay.token_ids, lay.positions, lay.segment_ids, lay.visible, lay.bidir,
                 lay.kill_at, groups=groups, live_trace=trace)
    assert min(live for _, live, _ in trace) >= 0
    engine.pool.check_invariants()
    for o in engine.pool.owners():
      engine.pool.free_owner(o)
    assert np.abs(out - training_logits(setup, lay)).max() < 1e-5, (ids, lay.notes)
