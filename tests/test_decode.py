"""Decode invariants of the engine's AR path on tiny random models (Llama and Qwen3 layouts):
every answer of a batch equals the answer alone, cached decoding equals the full forward, seeds
reproduce, stop ids / stop strings / max_new_tokens end rows independently, context check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax.runtime.build import make_engine, pool_pages
from selforch_jax.runtime.generation import ContextLengthError
from selforch_jax.runtime.sampling import SamplingParams, sample_token
from selforch_jax.runtime.schedulers import ar
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import (KVCache, causal_mask, init_model,
                                             positions_from_valid)

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [200]]


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3"])
def model(request):
  return init_model(get_preset(request.param), seed=1)


def gen(model, prompts, max_new_tokens, **kw):
  """AR decoding of ``prompts`` on a fresh engine sized by the one builder."""
  engine = make_engine(model, [len(p) for p in prompts], max_new_tokens)
  return ar.generate(engine, prompts, max_new_tokens=max_new_tokens, **kw), engine


def full_logprobs(model, seq):
  t = jnp.asarray([seq])
  v = jnp.ones_like(t, bool)
  logits, _ = model(t, positions_from_valid(v), causal_mask(v))
  return np.asarray(jax.nn.log_softmax(logits[0], -1)), np.asarray(logits[0])


def test_cached_decode_equals_full_forward_every_step(model):
  res, _ = gen(model, PROMPTS[:1], 24)
  p = PROMPTS[0]
  seq = p + res[0].token_ids
  lp, logits = full_logprobs(model, seq)
  n = len(res[0].token_ids)
  assert n == 24 and res[0].finish_reason == "length"
  ref = np.array([lp[len(p) - 1 + i, seq[len(p) + i]] for i in range(n)])
  np.testing.assert_allclose(np.array(res[0].logprobs), ref, atol=1e-5)
  # greedy: each produced token is the argmax of the full forward at that step
  assert [int(np.argmax(logits[len(p) - 1 + i])) for i in range(n)] == res[0].token_ids

  # and the cache itself: logits of one cached step equal the full forward's last row
  cfg = model.cfg
  T = len(seq)
  cache = KVCache.zeros(cfg, 1, T + 3)
  toks = jnp.asarray([seq])
  mask = jnp.arange(T + 3)[None, :] <= jnp.arange(T)[:, None]
  lg_c, cache = model(toks[:, :-1], jnp.arange(T - 1)[None], mask[None, :-1], cache, 0)
  lg_last, _ = model(toks[:, -1:], jnp.asarray([[T - 1]]), mask[None, -1:], cache, T - 1)
  np.testing.assert_allclose(np.asarray(lg_c[0]), logits[:-1], atol=1e-5)
  np.testing.assert_allclose(np.asarray(lg_last[0, 0]), logits[-1], atol=1e-5)


def test_batch_of_different_lengths_equals_each_alone(model):
  """Several owners in one pool, one engine step per token: each request gets exactly the
  tokens it gets alone (greedy, float32)."""
  batch, engine = gen(model, PROMPTS, 16)
  # one prefill step per prompt, then one step per token while any row is live
  assert engine.num_steps == len(PROMPTS) + 16 - 1
  assert max(engine.buckets_used) >= 4   # decode steps ran several rows together
  for i, p in enumerate(PROMPTS):
    solo, _ = gen(model, [p], 16)
    assert batch[i].token_ids == solo[0].token_ids, i
    np.testing.assert_allclose(batch[i].logprobs, solo[0].logprobs, atol=1e-5)
  assert len({tuple(r.token_ids) for r in batch}) > 1   # the rows differ: no row copied another


def test_shorter_max_new_tokens_is_prefix(model):
  for sp in (SamplingParams(), SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)):
    long, _ = gen(model, PROMPTS, 20, sampling=sp)
    short, _ = gen(model, PROMPTS, 7, sampling=sp)
    for a, b in zip(long, short):
      assert a.token_ids[:7] == b.token_ids
      assert b.finish_reason == "length"


def test_same_seed_same_sample_different_seed_differs(model):
  sp = SamplingParams(temperature=1.0, seed=3)
  a, _ = gen(model, PROMPTS, 16, sampling=sp)
  b, _ = gen(model, PROMPTS, 16, sampling=sp)
  c, _ = gen(model, PROMPTS, 16, sampling=SamplingParams(temperature=1.0, seed=4))
  assert [r.token_ids for r in a] == [r.token_ids for r in b]
  np.testing.assert_array_equal(np.concatenate([r.logprobs for r in a]),
                                np.concatenate([r.logprobs for r in b]))
  assert [r.token_ids for r in a] != [r.token_ids for r in c]
  greedy, _ = gen(model, PROMPTS, 16)
  assert [r.token_ids for r in a] != [r.token_ids for r in greedy]


def test_stop_tokens_end_rows_independently(model):
  free, _ = gen(model, PROMPTS, 12)
  stop = free[0].token_ids[3]  # a token row 0 produces at step 3
  first = free[0].token_ids.index(stop)
  res, _ = gen(model, PROMPTS, 12, stop_ids=[stop])
  assert res[0].finish_reason == "stop"
  assert res[0].token_ids == free[0].token_ids[:first]
  for r, f in zip(res, free):  # other rows: cut at their own first stop token, or unchanged
    cut = f.token_ids.index(stop) if stop in f.token_ids else len(f.token_ids)
    assert r.token_ids == f.token_ids[:cut]
    assert r.finish_reason == ("stop" if stop in f.token_ids else "length")


def test_stop_strings_end_a_row_keeping_the_completing_token(model):
  free, _ = gen(model, PROMPTS, 12)
  decode = lambda ids: "".join(f"<{t}>" for t in ids)  # noqa: E731 - one "word" per token
  target = free[1].token_ids[4]
  stop = f"<{target}>"
  streamed = []
  res, _ = gen(model, PROMPTS, 12, stop_strings=[stop], decode=decode,
               on_token=lambda r, t: streamed.append((r, t)))
  k = free[1].token_ids.index(target)
  assert res[1].token_ids == free[1].token_ids[:k + 1] and res[1].finish_reason == "stop"
  for r, f in zip(res, free):
    cut = f.token_ids.index(target) + 1 if target in f.token_ids else len(f.token_ids)
    assert r.token_ids == f.token_ids[:cut]
  # the streaming callback saw every kept token of every row, in order
  for i, r in enumerate(res):
    assert [t for row, t in streamed if row == i] == r.token_ids
  with pytest.raises(ValueError, match="decode"):
    ar.ARScheduler(PROMPTS, 4, stop_strings=["x"])


def test_sampling_filters():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  keys = jax.random.split(jax.random.PRNGKey(0), 2000)
  draw = lambda sp: np.asarray(jax.vmap(lambda k: sample_token(logits, k, sp))(keys))[:, 0]
  assert set(draw(SamplingParams(temperature=1.0, top_k=2))) == {0, 1}
  assert set(draw(SamplingParams(temperature=1.0, top_p=0.7))) == {0, 1}  # 0.5 < 0.7 <= 0.8
  assert set(draw(SamplingParams(temperature=1.0, top_p=0.85))) == {0, 1, 2}
  freq = np.bincount(draw(SamplingParams(temperature=1.0)), minlength=4) / 2000
  np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.04)
  assert int(sample_token(logits, keys[0], SamplingParams())[0]) == 0
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)


def test_context_length_and_bad_inputs(model):
  assert model.cfg.max_position_embeddings == 512
  with pytest.raises(ContextLengthError, match=r"520 tokens; with max_new_tokens=4 .* 512"):
    gen(model, [[1] * 520], 4)
  engine = make_engine(model, [8], 4)
  with pytest.raises(ContextLengthError, match="524 > the model's context of 512"):
    ar.generate(engine, [[1] * 520], max_new_tokens=4)   # the engine path checks too
  with pytest.raises(ValueError, match="empty"):
    ar.generate(engine, [[]], max_new_tokens=8)
  with pytest.raises(ValueError, match="token ids"):
    ar.generate(engine, [[model.cfg.vocab_size]], max_new_tokens=2)


def test_pool_pages_rule():
  assert pool_pages([16, 17], 16, 16) == 2 + 3           # ceil(32/16) + ceil(33/16)
  assert pool_pages(10, 6, 16, threads=4, extra_tokens=64) == 5 + 4   # ceil(80/16) + 4
  with pytest.raises(ValueError, match="at least one"):
    pool_pages([], 4)


def test_bfloat16_compute_close_to_float32():
  cfg = get_preset("tiny_llama")
  m32 = init_model(cfg, seed=2)
  m16 = init_model(cfg.replace(param_dtype="bfloat16", dtype="bfloat16"), seed=2)
  assert m16.embed[...].dtype == jnp.bfloat16
  t = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
  v = jnp.ones_like(t, bool)
  a, _ = m32(t, positions_from_valid(v), causal_mask(v))
  b, _ = m16(t, positions_from_valid(v), causal_mask(v))
  assert b.dtype == jnp.float32  # logits are always float32
  err = float(jnp.abs(a - b).max() / jnp.abs(a).max())
  assert 0 < err < 0.05, err  # bf16 rounding is visible but small
  cache = KVCache.zeros(m16.cfg, 1, 16)
  assert cache.k.dtype == jnp.bfloat16


def test_decode_config_validation():
  from selforch_jax import config_lib
  from selforch_jax.decoding.run import defaults, validate
  c = defaults()
  validate(c)
  with c.unlocked():
    c.sampling.temprature = 0.5
  with pytest.raises(config_lib.ConfigError, match="sampling.temprature"):
    validate(c)
  c = defaults()
  assert "padding" not in c   # batching is exact on the engine: no padding to choose
  c.runtime = "beam"
  with pytest.raises(config_lib.ConfigError, match="valid: ar, pasta"):
    validate(c)
  c = defaults()
  c.model.weights = "/nonexistent/model.gguf"
  with pytest.raises(config_lib.ConfigError, match="model.weights"):
    validate(c)


def test_scatter_writes_equal_contiguous_writes():
  """A cache filled through arbitrary slots (a paged pool) gives the same logits."""
  m = init_model(get_preset("tiny_qwen3"), seed=5)
  T, S = 6, 16
  toks = jnp.asarray([[7, 8, 9, 10, 11, 12]])
  pos = jnp.arange(T)[None]
  v = jnp.ones_like(toks, bool)
  ref, _ = m(toks, pos, causal_mask(v))
  slots = jnp.asarray([[9, 2, 14, 0, 5, 11]])  # scattered slots
  # query t sees the slots of tokens 0..t
  vis = jnp.zeros((1, T, S), bool)
  for t in range(T):
    vis = vis.at[0, t, slots[0, :t + 1]].set(True)
  out, cache = m(toks, pos, vis, KVCache.zeros(m.cfg, 1, S), write_slots=slots)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
  assert float(jnp.abs(cache.k[:, 0, 1]).max()) == 0.0  # untouched slot
  with pytest.raises(ValueError, match="exactly one"):
    m(toks, pos, vis, KVCache.zeros(m.cfg, 1, S), 0, write_slots=slots)


def test_decode_run_checks_prompts_first_and_keeps_previous_output(tmp_path):
  import json

  from selforch_jax import config_lib
  from selforch_jax.decoding.run import defaults, run
  c = defaults()
  c.model.preset, c.model.weights, c.model.tokenizer = "tiny_smollm2", "random", "smollm2_gguf"
  c.max_new_tokens = 4
  wd = str(tmp_path)
  s = run(c, wd, prompt="Name three colors.")
  assert s["prompts"] == 1 and s["config"]["sampling"]["temperature"] == 0.0
  good = open(tmp_path / "answers.jsonl").read()
  row = json.loads(good)
  assert row["prompt"] == "Name three colors." and len(row["token_ids"]) == 4
  assert row["finish_reason"] == "length" and row["forwards"] == 4
  assert row["tokens_per_forward"] == 1.0 and row["wall_s"] > 0
  from selforch_jax.runtime.generation import ContextLengthError
  with pytest.raises(ContextLengthError, match="context of 2048"):
    run(c, wd, prompt="word " * 3000)
  assert open(tmp_path / "answers.jsonl").read() == good  # the earlier run survives
  c.sampling.top_p = 1.5
  with pytest.raises(config_lib.ConfigError, match="sampling: top_p"):
    run(c, wd, prompt="hi")
  (tmp_path / "empty.jsonl").write_text("")
  from selforch_jax.decoding.prompts import load_prompts
  with pytest.raises(ValueError, match="empty.jsonl has no rows"):
    load_prompts(prompts_file=str(tmp_path / "empty.jsonl"))
