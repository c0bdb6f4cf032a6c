"""AR decoding through the engine on the real SmolLM2-135M-Instruct equals the full causal
forward of the model token for token (greedy, one chat prompt, 16 new tokens: each token is the
argmax of the uncached forward over prompt + answer, log-probs equal), and eviction on the real
model: an evicted slot has no effect on later logits."""

import jax.numpy as jnp
import numpy as np
import pytest

from selforch_jax.checkpoints.assets import smollm2_gguf_path
from selforch_jax.checkpoints.gguf_import import load_gguf
from selforch_jax.models.transformer import KVCache, causal_mask, positions_from_valid
from selforch_jax.runtime.schedulers import ar
from selforch_jax.runtime.engine import Engine
from selforch_jax.tokenizers import HFTokenizer

ONE = (np.ones((1, 1), bool), np.zeros(1, bool))


@pytest.fixture(scope="module")
def smollm2():
  path = smollm2_gguf_path()
  _, model, _ = load_gguf(path)
  return model, HFTokenizer.from_gguf(path)


def test_ar_engine_equals_full_forward_on_smollm2(smollm2):
  import jax
  model, tok = smollm2
  prompt = tok.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}])
  engine = Engine(model, num_pages=8, page_size=16)
  out = ar.generate(engine, [prompt], max_new_tokens=16, stop_ids=tok.stop_ids)
  ids = out[0].token_ids
  assert len(ids) >= 8 and tok.decode(ids).strip()
  seq = jnp.asarray([prompt + ids])
  v = jnp.ones_like(seq, bool)
  logits, _ = model(seq, positions_from_valid(v), causal_mask(v))
  rows = np.asarray(logits[0, len(prompt) - 1:len(prompt) - 1 + len(ids)])
  assert [int(i) for i in rows.argmax(-1)] == ids     # greedy = argmax of the uncached forward
  lp = np.asarray(jax.nn.log_softmax(rows, -1))[np.arange(len(ids)), ids]
  np.testing.assert_allclose(out[0].logprobs, lp, atol=1e-4)   # float32 noise only
  # one prefill step (T = prompt length), then one step per further sampled token
  assert engine.num_steps == len(ids) + (out[0].finish_reason == "stop")
  assert engine.buckets_used == {1, 1 << (len(prompt) - 1).bit_length()}


def test_evicted_slot_has_no_effect_on_smollm2(smollm2):
  model, tok = smollm2
  prompt = tok.encode("The capital of France is Paris. The capital of Italy is Rome.")
  n = len(prompt)
  dead = np.arange(4, 8)  # one whole page of 4 slots

  def run(perturb):
    engine = Engine(model, num_pages=8, page_size=4)
    _, slots = engine.run_step(prompt, np.arange(n), np.zeros(n), 0, *ONE)
    assert engine.pool.evict(slots[dead]) == [1]
    if perturb:
      L, K, Dh = model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim
      big = jnp.full((L, dead.size, K, Dh), 1e4, jnp.float32)
      engine.cache = KVCache(k=engine.cache.k.at[:, 0, slots[dead]].set(big),
                             v=engine.cache.v.at[:, 0, slots[dead]].set(big))
    lg, _ = engine.run_step(tok.encode(" The"), [n], [0], 0, *ONE)
    return np.asarray(lg), engine

  clean, engine = run(False)
  perturbed, _ = run(True)
  np.testing.assert_array_equal(perturbed, clean)
  assert engine.pool.live_tokens == n + 1 - dead.size
  assert engine.pool.live_bytes == engine.pool.live_tokens * 2 * 30 * 3 * 64 * 4
