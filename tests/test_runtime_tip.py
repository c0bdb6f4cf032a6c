"""The TIP runtime on a tiny random model: train = decode on register-annotated sequences (teacher
forced and the model's own samples), evicted steps have no effect on later logits, their pages
are reused, live KV equals a brute-force count, malformed register use loses no text."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.lang import TagVocab, assemble, batch_layouts, build_layout
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import KVCache, init_model
from selforch_jax.runtime.schedulers import ar
from selforch_jax.runtime.annotated import random_annotated
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.kv_pool import ALIVE, FREE
from selforch_jax.runtime.schedulers import make_scheduler
from selforch_jax.runtime.scheduler import execute, run
from selforch_jax.runtime.schedulers.tip import TIPScheduler

BASE = 256
TV = TagVocab.appended(BASE, 4, eos_ids=[2], digit_ids=range(48, 58), space_ids=[32])
TV0 = dataclasses.replace(TV, eos_ids=())     # the runtime's (and SFT data's) layout: no EOS split
TEXT = np.array([i for i in range(3, BASE) if not 48 <= i < 58 and i != 32])
R = TV.registers
PAD_TO = 128


@pytest.fixture(scope="module")
def setup():
  model = init_model(get_preset("tiny_llama", vocab_size=BASE + 11), seed=3)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  return model, state, fwd


def reference_logits(setup, ids):
  """The training forward: ``build_layout`` (no EOS split) mask, all tokens at once."""
  _, state, fwd = setup
  lay = build_layout(ids, TV0)
  b = batch_layouts([lay], PAD_TO)
  return np.asarray(fwd(state, b["tokens"], b["positions"], b["mask"]))[0, :len(ids)], lay


def brute_live(lay, lo, hi):
  """Live KV after running token j (j in [lo, hi)): tokens i <= j with j < kill_at[i]."""
  return [int(lay.alive(j).sum()) for j in range(lo, hi)]


def test_teacher_forced_tip_equals_training_forward_batched(setup):
  """Three register-annotated sequences decoded together (prompts with register tags too):
  every step's logits equal the full forward with build_layout's mask, live KV equals the
  brute-force count, and evictions happened."""
  model = setup[0]
  rng = np.random.default_rng(0)
  seqs, cuts = [], []
  for _ in range(3):
    ids, _ = random_annotated("tip", rng, TV, TEXT)
    ids = ids + [R[int(rng.integers(0, 3))], *rng.choice(TEXT, 3).tolist()] + ids[-6:]
    seqs.append(ids[:PAD_TO])
    cuts.append(int(rng.integers(2, 8)))
  engine = Engine(model, num_pages=96, page_size=4)
  sched = TIPScheduler(engine, [s[:c] for s, c in zip(seqs, cuts)], TV,
                       forced=[s[c:] for s, c in zip(seqs, cuts)], keep_logits=True)
  run(engine, sched)
  killed = 0
  for i, (ids, c) in enumerate(zip(seqs, cuts)):
    ref, lay = reference_logits(setup, ids)
    got = np.stack(sched.step_logits[i])
    assert got.shape[0] == len(ids) - c
    assert np.abs(got - ref[c - 1:len(ids) - 1]).max() < 1e-5
    assert sched.results[i].token_ids == ids[c:]
    assert sched.live_trace[i] == brute_live(lay, c - 1, len(ids) - 1)
    st = sched.kv_stats[i]
    assert st["peak_live_tokens"] == max(sched.live_trace[i])
    assert st["mean_live_bytes"] == pytest.approx(
        np.mean(sched.live_trace[i]) * engine.pool.bytes_per_token)
    killed += int((lay.kill_at < len(ids)).sum())
    np.testing.assert_array_equal(sched.layout(i).kill_at[:c], lay.kill_at[:c].clip(
        max=len(ids) - 1))
  assert killed > 10
  for o in sched.owners:
    engine.pool.free_owner(int(o))
  assert engine.pool.live_tokens == 0 and engine.pool.num_free_pages == 96


def test_sampled_tip_with_evictions_equals_training_forward():
  """Sampling (the AR scheduler's sampler) on a model with a 20-token text vocabulary and 2
  registers, so that it emits register tags itself; the runtime's logits on its own output
  equal the training forward of that output (kills included)."""
  tv = TagVocab.appended(20, 2)          # no digits: promises never get chunks (AR structure)
  model = init_model(get_preset("tiny_llama", vocab_size=29), seed=5)
  graphdef, state = nnx.split(model)
  engine = Engine(model, num_pages=96, page_size=4)
  r = tv.registers
  prompts = [[5, r[0], 7, 8], [9, 10, 11], [12, r[1], 13, r[0], 14]]
  sampling = SamplingParams(temperature=2.0, seed=4)
  sched = TIPScheduler(engine, prompts, tv, max_new_tokens=40, sampling=sampling,
                       keep_logits=True)
  run(engine, sched)
  kills = 0
  for i, p in enumerate(prompts):
    ids = p + sched.results[i].token_ids
    lay = build_layout(ids, tv)
    b = batch_layouts([lay], 64)
    ref = np.asarray(nnx.merge(graphdef, state)(b["tokens"], b["positions"], b["mask"])[0])[0]
    got = np.stack(sched.step_logits[i])
    assert np.abs(got - ref[len(p) - 1:len(ids) - 1]).max() < 1e-5
    kills += int((lay.kill_at[:len(ids) - 1] < len(ids) - 1).sum())
    assert sched.live_trace[i] == brute_live(lay, len(p) - 1, len(ids) - 1)
  assert kills > 5
  # the same sampler as AR: up to request 1's first kill, TIP and AR draw the same tokens
  ref_ar = ar.generate(Engine(model, num_pages=96, page_size=4), prompts, max_new_tokens=40,
                       sampling=sampling)
  lay1 = build_layout(prompts[1] + sched.results[1].token_ids, tv)
  first_kill = int(lay1.kill_at.min()) - len(prompts[1])
  assert first_kill > 0
  assert sched.results[1].token_ids[:first_kill + 1] == ref_ar[1].token_ids[:first_kill + 1]


def test_greedy_without_tags_equals_ar(setup):
  model = setup[0]
  prompts = [[5, 6, 7, 8, 9], [10, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
  a = ar.generate(Engine(model, num_pages=32, page_size=8), prompts, max_new_tokens=12,
                  stop_ids=[3])
  engine = Engine(model, num_pages=32, page_size=8)
  sched = make_scheduler("tip", engine, prompts, tag_vocab=TV, max_new_tokens=12, stop_ids=[3])
  run(engine, sched)
  for x, y in zip(a, sched.results):
    assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
  for o in sched.owners:
    engine.pool.free_owner(int(o))
  assert engine.pool.num_free_pages == 32


SEQ = ([20, 21, 22]                      # prompt
       + [R[0], 30, 31, 32, 33, 34]      # step A in reg_0 (6 tokens: 2 pages of 4)
       + [R[1], 40, 41]                  # step B in reg_1
       + [R[0], 50, 51, 52]              # reuses reg_0: kills step A
       + [R[2], 60, 61, 62, 63, 64, 65, 66, 67, 68]
       + [R[1], 70, 71, 72, 73])         # kills step B


def _run_forced(model, perturb_slots_after_kill: str | None, num_pages=8):
  """Teacher-force SEQ; after the step that runs the killing ``<reg_0>`` (index 12), optionally
  overwrite the K/V of step A (``"dead"``) or of step B (``"live"``) in the device cache."""
  engine = Engine(model, num_pages=num_pages, page_size=4)
  sched = TIPScheduler(engine, [SEQ[:3]], TV, forced=[SEQ[3:]], keep_logits=True)
  pol = sched.policies[0]
  pages_of, released_at_kill = {}, None
  while (plan := sched.next_step()) is not None:
    before = {o: engine.pool.page_table(o).tolist() for o in pol.owners()}
    for o, pages in before.items():
      pages_of.setdefault(o, set()).update(pages)
    res = execute(engine, plan)
    sched.on_step(plan, res)
    fed = len(pol.slot_of)
    if fed == 13:                                   # the killing <reg_0> just ran
      dead_owner = pol.regs._owner_of[3]
      released_at_kill = set(before[dead_owner])
      # released: no longer step A's (the pool hands out the lowest free page first, so the
      # killing step's own fresh page may already be one of them)
      assert all(engine.pool.page_owner[p] != dead_owner for p in released_at_kill)
      assert not engine.pool.page_table(dead_owner).size
      if perturb_slots_after_kill:
        idx = range(3, 9) if perturb_slots_after_kill == "dead" else range(9, 12)
        slots = np.asarray([pol.slot_of[j] for j in idx])
        if perturb_slots_after_kill == "dead":
          # the lowest freed page is already the killing step's fresh page (its slots hold the
          # new step now); perturb the dead slots that are still free (two of them are never
          # overwritten before the end: they test that dead K/V stays unseen until reuse)
          slots = slots[engine.pool.state[slots] == FREE]
          assert slots.size >= 2
        L, K, Dh = model.cfg.num_layers, model.cfg.num_kv_heads, model.cfg.head_dim
        big = jnp.full((L, slots.size, K, Dh), 1e3, jnp.float32)
        engine.cache = KVCache(k=engine.cache.k.at[:, 0, slots].set(big),
                               v=engine.cache.v.at[:, 0, slots].set(-big))
  for o in pol.owners():
    pages_of.setdefault(o, set()).update(engine.pool.page_table(o).tolist())
  return np.stack(sched.step_logits[0]), sched, engine, pages_of, released_at_kill


def test_evicted_step_has_no_effect_and_its_pages_are_reused(setup):
  model = setup[0]
  clean, sched, engine, pages_of, released = _run_forced(model, None)
  dead, _, _, _, _ = _run_forced(model, "dead")
  live, _, _, _, _ = _run_forced(model, "live")
  np.testing.assert_array_equal(dead, clean)            # bit-identical after the kill
  later = slice(13 - 3, None)                           # logits of queries after index 12
  assert np.abs(live[later] - clean[later]).max() > 1e-2  # control: a live step matters
  # step A held 6 tokens on two whole pages; both went back to the free list at the kill ...
  assert len(released) == 2
  # ... and a later step's page table reuses them (8 pages in the pool: reuse is forced)
  later_owners = [o for o in sched.policies[0].owners() if o > sched.policies[0].regs._owner_of[13]]
  assert released & set().union(*(pages_of[o] for o in later_owners))
  # every register step started on a fresh page: no page holds two owners' tokens
  pol = sched.policies[0]
  starts = [j for j, t in enumerate(SEQ[:-1]) if t in R]
  assert all(pol.slot_of[j] % 4 == 0 for j in starts)
  # brute-force live KV
  _, lay = reference_logits(setup, SEQ)
  assert sched.live_trace[0] == brute_live(lay, 2, len(SEQ) - 1)
  np.testing.assert_allclose(clean, reference_logits(setup, SEQ)[0][2:-1], atol=1e-5)


def test_malformed_register_use_degrades_and_loses_no_text(setup):
  model = setup[0]
  bad = [20, TV.promise_open, 5, R[0], 6, TV.async_close, R[3], R[3], 7, TV.sync, R[0], 8, 9]
  engine = Engine(model, num_pages=32, page_size=4)
  sched = TIPScheduler(engine, [[1, 2]], TV, forced=[bad], keep_logits=True)
  run(engine, sched)
  out = sched.results[0].token_ids
  assert out == bad
  text = assemble([1, 2] + out, TV0)
  for t in [1, 2, 20, 5, 6, 7, 8, 9]:
    assert t in text
  ref, _ = reference_logits(setup, [1, 2] + bad)
  assert np.abs(np.stack(sched.step_logits[0]) - ref[1:-1]).max() < 1e-5
  assert sched.layout(0).notes      # the parser's degradation rules applied


def test_teacher_forced_gsm8k_solution_on_smollm2():
  """Real SmolLM2-135M (tag rows added): a GSM8K solution annotated with registers by the
  ``tip_gsm8k`` annotator, teacher-forced through the TIP scheduler. The incremental logits equal
  the training forward with build_layout's mask (within 1e-5 of the logit scale, as the SmolLM2
  oracle test: float32 noise of this 30-layer model is ~1e-4 absolute), and the live KV is below
  dense (prompt + tokens so far) wherever a step has died."""
  from selforch_jax.checkpoints.assets import smollm2_gguf_path
  from selforch_jax.checkpoints.gguf_import import load_gguf
  from selforch_jax.data.sources import load_examples
  from selforch_jax.lang import add_tags
  from selforch_jax.lang.annotators import get_annotator
  from selforch_jax.tokenizers import HFTokenizer

  path = smollm2_gguf_path()
  _, model, _ = load_gguf(path)
  tok = HFTokenizer.from_gguf(path)
  tv = add_tags(tok, model, 8)
  ex = load_examples("gsm8k", split="test", max_examples=1)[0]
  q, sol = ex["messages"][0]["content"], ex["messages"][1]["content"]
  ann = get_annotator("tip_gsm8k", num_registers=8).annotate(q, sol)
  assert ann.info["evicted"]                           # this solution has dead steps
  prompt = tok.encode_chat([{"role": "user", "content": q}], add_generation_prompt=True)
  forced = tok.encode(ann.text) + [tok.stop_ids[-1]]
  engine = Engine(model, num_pages=32, page_size=16)
  sched = TIPScheduler(engine, [prompt], tv, forced=[forced], keep_logits=True,
                       stop_ids=tok.stop_ids)
  run(engine, sched)
  ids = prompt + forced
  lay = build_layout(ids, dataclasses.replace(tv, eos_ids=()))
  graphdef, state = nnx.split(model)
  b = batch_layouts([lay], -(-len(ids) // 64) * 64)
  ref = np.asarray(jax.jit(lambda s, t, p, m: nnx.merge(graphdef, s)(t, p, m)[0])(
      state, b["tokens"], b["positions"], b["mask"]))[0, len(prompt) - 1:len(ids) - 1]
  got = np.stack(sched.step_logits[0])
  assert np.abs(got - ref).max() < 1e-5 * np.abs(ref).max()
  assert (got.argmax(-1) == ref.argmax(-1)).all()
  live = np.asarray(sched.live_trace[0])
  dense = len(prompt) + np.arange(live.size)           # dense: every token stays
  assert live.tolist() == brute_live(lay, len(prompt) - 1, len(ids) - 1)
  assert (live <= dense).all() and live[-1] < dense[-1]
  print(f"\nSmolLM2 teacher-forced GSM8K test[0]: prompt {len(prompt)}, response {len(forced)} "
        f"tokens; live KV mean {live.mean():.1f} / peak {live.max()} vs dense mean "
        f"{dense.mean():.1f} / peak {dense.max()}; response-only mean {live.mean() - len(prompt):.1f}"
        f" vs {dense.mean() - len(prompt):.1f}; max |err| {np.abs(got - ref).max():.2e}")


def test_register_kv_inside_threads_on_the_engine(setup):
  """Composition: registers inside PASTA threads. ``RegisterKV`` fed the builder's events of a
  ``threads_tip`` sequence (a PASTA round whose chunks reuse registers) gives each thread's steps
  their own owners (fresh pages); with its evictions, one token per engine step under the
  layout's segments, the logits equal the training forward."""
  from selforch_jax.lang import LayoutBuilder
  from selforch_jax.runtime.schedulers.tip import RegisterKV
  model = setup[0]
  rng = np.random.default_rng(7)
  freed = thread_kills = 0
  for _ in range(2):
    ids, _ = random_annotated("threads_tip", rng, TV, TEXT)
    ref, lay = reference_logits(setup, ids)
    engine = Engine(model, num_pages=64, page_size=4)
    counter = iter(range(1, 10 ** 6))
    regs = RegisterKV(0, lambda: next(counter))
    b = LayoutBuilder(TV0)
    out = []
    for i, t in enumerate(ids):
      ev = b.feed(t)
      r = regs.route(ev, b.document_offset)
      evict, free = regs.resolve(r.kill) if r.kill else ([], [])
      for o in free:
        engine.pool.free_owner(o)
      freed += len(free)
      if evict:
        engine.pool.evict(evict)
      thread_kills += sum(lay.streams[j] >= 0 for j in r.kill)
      lg, slots = engine.run_step([t], [lay.positions[i]], [lay.segment_ids[i]], r.owner,
                                  lay.visible, lay.bidir, orders=[i])
      regs.written([i], slots)
      out.append(np.asarray(lg[0]))
    # every register step (main thread or thread) got its own owner, so its own pages
    assert len(regs.owners) >= 1 + sum(t in R for t in ids)
    assert np.abs(np.stack(out) - ref).max() < 1e-5
    engine.pool.check_invariants()
  assert thread_kills > 0 and freed > 0
