"""Rollouts (trainers/rollouts.py) and the scheduler registry: greedy rollouts equal
``runtime.ar.generate``; the training forward's log-probs equal what the engine decoded with
(causal rows, and layout rows with TIP evictions: train = decode for the policy forward)."""

import jax
import numpy as np
import pytest
from flax import nnx

from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.lang import TagVocab, build_layout
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.annotated import random_annotated
from selforch_jax.runtime.schedulers.ar import generate
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.oracle import replay
from selforch_jax.runtime.schedulers import available, make_scheduler
from selforch_jax.trainers.logprobs import token_logprobs
from selforch_jax.trainers.rollouts import causal_row, sample, to_batch

BASE = 256
TV = TagVocab.appended(BASE, 4, eos_ids=[2], digit_ids=range(48, 58), space_ids=[32])
TEXT = np.array([i for i in range(3, BASE) if not 48 <= i < 58 and i != 32])
PROMPTS = [[5, 17, 99, 4], [7, 8], [200, 3, 3, 41, 90, 12]]


@pytest.fixture(scope="module")
def model():
  return init_model(get_preset("tiny_llama", vocab_size=BASE + 11), seed=1)


@pytest.fixture(scope="module")
def fwd(model):
  graphdef, state = nnx.split(model)
  return jax.jit(lambda b: token_logprobs(nnx.merge(graphdef, state), b))


def test_registry_has_ar_and_rejects_unknown(model):
  assert "ar" in available()
  with pytest.raises(KeyError, match="unknown scheduler .nope.; known"):
    make_scheduler("nope", Engine(model, 8, 4), PROMPTS)


def test_greedy_rollouts_equal_ar_generate(model):
  ro = sample(model, PROMPTS, max_new_tokens=7, stop_id=2, group_size=2, num_pages=32,
              page_size=4)
  ref = generate(Engine(model, 32, 4), PROMPTS, max_new_tokens=7, stop_ids=(2,))
  assert len(ro.responses) == 6 and ro.prompts[2] == ro.prompts[3] == PROMPTS[1]
  for i, r in enumerate(ref):
    want = list(r.token_ids) + ([2] if r.finish_reason == "stop" else [])
    assert ro.responses[2 * i] == ro.responses[2 * i + 1] == want
    np.testing.assert_allclose(ro.sampler_logprobs[2 * i], r.logprobs, atol=1e-6)


def test_sampled_group_members_differ(model):
  ro = sample(model, PROMPTS[:1], max_new_tokens=6, stop_id=None, group_size=4,
              sampling=SamplingParams(temperature=1.0, seed=3), num_pages=32, page_size=4)
  assert len({tuple(r) for r in ro.responses}) > 1
  assert all(len(r) == 6 for r in ro.responses) and set(ro.finish) == {"length"}


def test_training_logprobs_equal_sampler_logprobs(model, fwd):
  ro = sample(model, PROMPTS, max_new_tokens=6, stop_id=None, group_size=2,
              sampling=SamplingParams(temperature=1.0, seed=0), num_pages=32, page_size=4)
  b = to_batch(ro.prompts, ro.responses, 16)
  lp = np.asarray(fwd(b))
  for i, (p, r) in enumerate(zip(ro.prompts, ro.responses)):
    idx = np.flatnonzero(b["loss_mask"][i])
    assert idx.tolist() == list(range(len(p) - 1, len(p) + len(r) - 1))
    np.testing.assert_allclose(lp[i, idx], ro.sampler_logprobs[i], atol=2e-5)


def test_causal_row_cuts_and_pads():
  row = causal_row([1, 2, 3], [4, 5, 6, 7], 5, pad_id=0)
  assert row["tokens"].tolist() == [1, 2, 3, 4, 5]
  assert row["targets"].tolist() == [2, 3, 4, 5, 6]
  assert row["loss_mask"].tolist() == [0, 0, 1, 1, 1]
  short = causal_row([1, 2], [9], 4)
  assert short["loss_mask"].tolist() == [0, 1, 0, 0] and short["mask"][3].tolist() == [0, 0, 0, 1]
  with pytest.raises(ValueError):
    to_batch([[1]], [], 4)


@pytest.mark.parametrize("kind", ["tip", "pasta"])
def test_layout_logprobs_equal_engine_decoding(model, fwd, kind):
  """Rows built with the tag vocab use build_layout's positions and mask: their log-probs equal
  the engine's logits when the sequence is decoded with the runtime's evictions."""
  rng = np.random.default_rng(7)
  killed = 0
  for _ in range(2):
    ids, kw = random_annotated(kind, rng, TV, TEXT)
    assert kw == {}
    ids = ids[:120]
    n_prompt = 3
    b = to_batch([ids[:n_prompt]], [ids[n_prompt:]], 128, tag_vocab=TV)
    lp = np.asarray(fwd(b))[0]
    lay = build_layout(np.asarray(ids), TV, eos_ids=())
    killed += int((lay.kill_at < lay.num_tokens).sum())
    engine = Engine(model, num_pages=64, page_size=4)
    logits = replay(engine, lay.token_ids, lay.positions, lay.segment_ids, lay.visible, lay.bidir,
                    lay.kill_at)
    dec = jax.nn.log_softmax(logits, -1)
    n = len(ids)
    want = np.asarray(dec[np.arange(n - 1), np.asarray(ids[1:])])
    m = b["loss_mask"][0, :n - 1].astype(bool)
    assert m.sum() >= n - n_prompt - 1 - np.sum(np.asarray(ids[:-1]) == TV.async_close)
    np.testing.assert_allclose(lp[:n - 1][m], want[m], atol=2e-5)
  if kind != "pasta":
    assert killed > 0  # evictions happened


def test_tip_rollouts_train_equals_decode(model, fwd):
  """TIP rollouts (register reuse evicts KV pages at decode time): the training rows' mask is
  the layout of what ran, and the forward's log-probs equal the sampler's. The prompts reuse
  registers, so steps are evicted before the response is decoded."""
  r0, r1 = TV.registers[:2]
  prompts = [[5, r0, 17, 18, r1, 99, r0, 4], [7, r1, 8, 9, r1, 30]]
  ro = sample(model, prompts, max_new_tokens=40, stop_id=None, group_size=3, scheduler="tip",
              sampling=SamplingParams(temperature=1.0, seed=0), num_pages=128, page_size=4,
              tag_vocab=TV)
  b = to_batch(ro.prompts, ro.responses, 64, tag_vocab=TV)
  lp = np.asarray(fwd(b))
  killed = 0
  for i, (p, r) in enumerate(zip(ro.prompts, ro.responses)):
    ids = np.asarray(p + r)
    lay = build_layout(ids, TV, eos_ids=())
    killed += int((lay.kill_at < lay.num_tokens).sum())
    n = len(ids)
    np.testing.assert_array_equal(b["mask"][i, :n - 1, :n - 1], lay.token_mask()[:-1, :-1])
    got = lp[i, len(p) - 1:n - 1]
    np.testing.assert_allclose(got, ro.sampler_logprobs[i], atol=2e-5)
  assert killed > 0, "no register reuse: the test would not exercise eviction"


def test_pasta_rollouts_train_equals_decode(model, fwd):
  """PASTA rollouts (threads forked from a teacher-forced plan, decoded in parallel): the rows'
  build_layout log-probs equal the sampler's at every sampled (not runtime-fed) token."""
  from selforch_jax.lang import Promise, Round, serialize
  plan = [75, Promise((80, 81), 1), 76, Promise((82,), 2), 77]
  prompt = serialize([60, 61, 62, Round(plan=tuple(plan), sync=False)], TV) + [TV.async_open]
  ro = sample(model, [prompt], max_new_tokens=40, stop_id=2, group_size=2, scheduler="pasta",
              sampling=SamplingParams(temperature=1.0, seed=4), num_pages=128, page_size=4,
              tag_vocab=TV, scheduler_kwargs={"length_unit": 2, "cap": 4})
  assert "pasta" in available()
  b = to_batch(ro.prompts, ro.responses, 96, tag_vocab=TV, length_unit=2, cap=4)
  lp = np.asarray(fwd(b))
  compared = 0
  for i, (p, r) in enumerate(zip(ro.prompts, ro.responses)):
    assert p == prompt[:-1] and r.count(TV.async_open) >= 2   # both threads ran
    got = lp[i, len(p) - 1:len(p) + len(ro.sampler_logprobs[i]) - 1]
    want = np.asarray(ro.sampler_logprobs[i])
    sampled = want != 0.0                 # runtime-fed tags carry log-prob 0
    np.testing.assert_allclose(got[sampled], want[sampled], atol=2e-4)
    compared += int(sampled.sum())
  assert compared > 20
