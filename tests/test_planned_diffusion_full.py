"""The Dream-style full-diffusion baseline of the Planned Diffusion scheduler (issue 21,
``full_diffusion=L``: the whole answer one masked chunk, entropy-ordered unmasking, no plan).

* Train = decode oracle: at every engine step (the prefill and every denoising step) the logits
  of each query equal a whole-sequence forward with the baseline's mask (prompt causal; the
  chunk ``<async>`` + masks + ``</async>`` sees the prompt and itself bidirectionally) on the
  sequence state of that step, float32 1e-5; batch 2 decodes as each request alone.
* On scripted logits: the number of positions committed per step is Dream's
  ``max(1, int(masked * (1 - s / t)))`` in confidence order, all at the last step; ``[PAD]`` is
  stripped from the text and ends the answer as ``"stop"``; bad options raise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from selforch_jax.lang import TagVocab
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.diffusion_unmask import unmask_count
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import execute, run
from selforch_jax.runtime.schedulers import planned_diffusion as pd
from selforch_jax.runtime.step import StepResult

BASE = 256
V = BASE + 11
EOS = 2
TV = TagVocab.appended(BASE, 4, eos_ids=[EOS], digit_ids=range(48, 58), space_ids=[32])
PROMPTS = [[70, 71, 72], [90, 91, 92, 93, 94, 95]]
L = 7


@pytest.fixture(scope="module")
def tiny():
  model = init_model(get_preset("tiny_llama", vocab_size=V), seed=5)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  return model, state, fwd


def _reference(fwd, state, seq, prompt_len):
  n = len(seq)
  mask = np.tril(np.ones((n, n), bool))
  mask[prompt_len:, prompt_len:] = True      # the chunk: bidirectional, sees the prompt
  return np.asarray(fwd(state, jnp.asarray([seq], jnp.int32),
                        jnp.arange(n, dtype=jnp.int32)[None], jnp.asarray(mask[None])))[0]


def test_train_equals_decode_every_step(tiny):
  model, state, fwd = tiny
  engine = Engine(model, num_pages=96, page_size=4)
  s = pd.PlannedDiffusionScheduler(PROMPTS, TV, 40, stop_ids=[EOS], vocab_size=V,
                                   full_diffusion=L, steps_ratio=0.5)
  kinds = []
  while (plan := s.next_step()) is not None:
    seqs = [s.sequence(i) for i in range(len(PROMPTS))]
    result = execute(engine, plan)
    got = np.asarray(result.logits)
    kind, _, queries = plan.tag
    kinds.append(kind)
    for i, p in enumerate(PROMPTS):
      rows = [t for t, (ri, _) in enumerate(queries) if ri == i]
      ref = _reference(fwd, state, seqs[i], len(p))
      np.testing.assert_allclose(got[rows], ref[[queries[t][1] for t in rows]], atol=1e-5,
                                 rtol=1e-5)
    s.on_step(plan, result)
  steps = int(0.5 * L)
  assert kinds == ["prefill"] + ["denoise"] * steps
  for i, p in enumerate(PROMPTS):
    st, res = s.stats[i], s.results[i]
    assert (st["ar_steps"], st["denoise_steps"], st["critical_path"]) == (0, steps, steps)
    assert res.token_ids[0] == TV.async_open and res.token_ids[-1] == TV.async_close
    assert len(res.token_ids) == L + 2 and TV.mask not in res.token_ids
    assert s.text_ids(i) == [t for t in res.token_ids if not TV.is_tag(t)]
    assert st["well_formed"] and st["chunks"] == 1
  one = pd.PlannedDiffusionScheduler([PROMPTS[1]], TV, 40, stop_ids=[EOS], vocab_size=V,
                                     full_diffusion=L, steps_ratio=0.5)
  run(Engine(model, num_pages=96, page_size=4), one)
  assert one.results[0].token_ids == s.results[1].token_ids


def _drive(n, steps_ratio, pad_at=None, max_new=40):
  """No model: chunk row j puts its top mass on token 110 + j (confidence falls with j, so
  the unmask order is left to right); ``pad_at``: rows from there on predict [PAD]."""
  s = pd.PlannedDiffusionScheduler([[70, 71]], TV, max_new, stop_ids=[EOS], vocab_size=V,
                                   full_diffusion=n, steps_ratio=steps_ratio)
  committed = []
  while (plan := s.next_step()) is not None:
    T = len(plan.tokens)
    lg = np.zeros((T, V), np.float32)
    if plan.tag[0] == "denoise":
      before = int(s.reqs[0].chunks[0].masked.sum())
      for t, (_, i) in enumerate(plan.tag[2]):
        j = i - s.reqs[0].chunks[0].start     # row j predicts content slot j
        tok = TV.pad if pad_at is not None and j >= pad_at else 110 + j
        lg[t, tok % V] = 20.0 - 0.5 * j
    s.on_step(plan, StepResult(logits=jnp.asarray(lg), slots=np.arange(T), released_pages=[]))
    if plan.tag[0] == "denoise":
      left = int(s.reqs[0].chunks[0].masked.sum()) if s.reqs[0].chunks else 0
      committed.append(before - left)
  return s, committed


def test_unmask_schedule_and_pad():
  s, committed = _drive(12, 0.5)
  steps = 6
  ts = np.linspace(1.0, 1e-3, steps + 1)
  want, m = [], 12
  for i in range(steps):
    k = m if i == steps - 1 else unmask_count(m, float(ts[i + 1]), float(ts[i]))
    want.append(k)
    m -= k
  assert committed == want and sum(committed) == 12
  assert s.text_ids(0) == [110 + j for j in range(12)]
  assert s.results[0].finish_reason == "length" and s.stats[0]["critical_path"] == steps
  s, _ = _drive(10, 1.0, pad_at=4)
  assert s.text_ids(0) == [110, 111, 112, 113] and s.results[0].finish_reason == "stop"
  assert s.results[0].token_ids.count(TV.pad) == 6
  s, _ = _drive(50, 1.0, max_new=9)          # the chunk is shrunk to the budget
  assert len(s.results[0].token_ids) == 9 and len(s.text_ids(0)) == 7


def test_bad_options():
  with pytest.raises(ValueError, match="full_diffusion"):
    pd.PlannedDiffusionScheduler([[1]], TV, 8, full_diffusion=0)
  with pytest.raises(ValueError, match="max_new_tokens"):
    pd.PlannedDiffusionScheduler([[1]], TV, 2, full_diffusion=4)


def test_api_and_decode_options(tiny):
  from selforch_jax import api
  from selforch_jax.decoding import run as decode_run
  from tests.trace_fixtures import ByteTagTokenizer
  tok = ByteTagTokenizer()
  (a,) = api.decode_ids(tiny[0], tok, [tok.encode_chat([{"role": "user", "content": "hi"}])],
                        runtime="planned_diffusion", max_new_tokens=24, tag_vocab=TV,
                        options={"full_diffusion": 16, "steps_ratio": 0.25})
  assert a.figures["denoise_steps"] == 4 and a.figures["critical_path"] == 4
  assert a.figures["ar_steps"] == 0 and len(a.token_ids) == 18 and a.forwards == 5
  c = decode_run.defaults()
  c.runtime = "planned_diffusion"
  assert decode_run.options(c)["full_diffusion"] is None
  c.planned_diffusion.full_diffusion = 64
  assert decode_run.options(c)["full_diffusion"] == 64
  assert "planned_diffusion.full_diffusion" in decode_run.help_text()
