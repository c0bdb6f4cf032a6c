r"""The engine with the Pallas paged kernel compiled on a GPU: train = decode, and step time vs the
dense reference path.

Run (from the repository root)::

  python bench/engine_gpu.py --out=out/bench                 # on a GPU machine (~2-3 min)
  python bench/engine_gpu.py --cpu_smoke --out=/tmp/egpu     # CPU, kernel in interpret mode

Two parts, one JSON (``<out>/engine_gpu.json``):

* ``oracle``: a random tiny Llama (float32, matmuls at HIGHEST precision) replays random annotated
  sequences of every kind (PASTA forks/joins, diffusion chunks, TIP evictions, registers inside
  threads) through two engines, ``attention="reference"`` (dense mask) and ``attention="paged"``
  (the kernel), and through the training forward with the mask builder's mask; reports the max
  |logit| differences (the issue's bound: 1e-5).
* ``step``: a SmolLM2-135M-shaped model (random weights, ``--dtype``) over a pool of
  ``--num_pages x 16`` slots holding ``--context`` tokens of which ``--evict_frac`` are evicted
  (dead pages, as TIP leaves them); one step of T queries (T in ``--T``) that see the live
  context, timed with the reference path and the kernel path (median of ``--repeats`` after a
  warm-up; host bookkeeping included, i.e. :meth:`Engine.run_step`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
  sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from bench.common import machine_info, write_result  # noqa: E402
from selforch_jax.lang import TagVocab, batch_layouts  # noqa: E402
from selforch_jax.models.config import get_preset  # noqa: E402
from selforch_jax.models.transformer import init_model  # noqa: E402
from selforch_jax.runtime.annotated import KINDS, random_layout  # noqa: E402
from selforch_jax.runtime.engine import Engine  # noqa: E402
from selforch_jax.runtime.oracle import plan_groups, replay  # noqa: E402

BASE_VOCAB = 256
TV = TagVocab.appended(BASE_VOCAB, 4, eos_ids=[2], digit_ids=range(48, 58), space_ids=[32])
TEXT = np.array([i for i in range(3, BASE_VOCAB) if not 48 <= i < 58 and i != 32])


def _free_all(engine):
  for o in engine.pool.owners():
    engine.pool.free_owner(o)


def oracle(interpret: bool, num_sequences: int, pad_to: int) -> dict:
  model = init_model(get_preset("tiny_llama", vocab_size=BASE_VOCAB + 11), seed=7)
  graphdef, state = nnx.split(model)
  fwd = jax.jit(lambda st, t, p, m: nnx.merge(graphdef, st)(t, p, m)[0])
  ref = Engine(model, num_pages=32, page_size=16, attention="reference")
  ker = Engine(model, num_pages=32, page_size=16, attention="paged", interpret=interpret)
  rng = np.random.default_rng(0)
  out = {}
  for kind in KINDS:
    errs = {"kernel_vs_reference": 0.0, "kernel_vs_training": 0.0,
            "reference_vs_training": 0.0}
    for _ in range(num_sequences):
      lay = random_layout(kind, rng, TV, TEXT, max_tokens=pad_to)
      groups = plan_groups(lay.segment_ids, lay.visible, lay.bidir, lay.kill_at, rng=rng,
                           max_group=24 if kind == "diffusion" else 8, order="threads")
      args = (lay.token_ids, lay.positions, lay.segment_ids, lay.visible, lay.bidir, lay.kill_at)
      a = replay(ref, *args, groups=groups)
      _free_all(ref)
      b = replay(ker, *args, groups=groups)
      _free_all(ker)
      bl = batch_layouts([lay], pad_to)
      t = np.asarray(fwd(state, bl["tokens"], bl["positions"], bl["mask"]))[0, :lay.num_tokens]
      for k, (x, y) in {"kernel_vs_reference": (b, a), "kernel_vs_training": (b, t),
                        "reference_vs_training": (a, t)}.items():
        errs[k] = max(errs[k], float(np.abs(x - y).max()))
    out[kind] = errs
  out["max"] = max(v["kernel_vs_training"] for v in out.values() if isinstance(v, dict))
  out["ok"] = out["max"] < 1e-5
  return out


def step_times(preset: str, dtype: str, num_pages: int, context: int, evict_frac: float,
               Ts, repeats: int, interpret: bool) -> dict:
  cfg = get_preset(preset).replace(dtype=dtype, param_dtype=dtype)
  model = init_model(cfg, seed=0)
  res = {"preset": preset, "dtype": dtype, "num_slots": num_pages * 16, "context": context,
         "evict_frac": evict_frac, "T": list(Ts), "reference_ms": {}, "paged_ms": {}}
  one = (np.ones((1, 1), bool), np.zeros(1, bool))
  rng = np.random.default_rng(0)
  for impl in ("reference", "paged"):
    eng = Engine(model, num_pages=num_pages, page_size=16, attention=impl, interpret=interpret)
    for s in range(0, context, 256):  # prefill the context, 256 tokens per step
      n = min(256, context - s)
      eng.run_step(rng.integers(0, cfg.vocab_size, n), s + np.arange(n), np.zeros(n), 0, *one)
    slots = np.flatnonzero(eng.pool.owner == 0)
    pages = np.unique(slots // 16)
    dead = rng.choice(pages[:-1], int(evict_frac * (len(pages) - 1)), replace=False)
    eng.pool.evict(np.concatenate([np.arange(p * 16, p * 16 + 16) for p in dead]) if len(dead)
                   else np.zeros(0, np.int64))
    res["live_tokens"] = eng.pool.live_tokens
    for T in Ts:
      times = []
      for r in range(repeats + 1):
        t0 = time.perf_counter()
        logits, _ = eng.run_step(rng.integers(0, cfg.vocab_size, T), context + np.arange(T),
                                 np.zeros(T), 1, *one)
        jax.block_until_ready(logits)
        dt = time.perf_counter() - t0
        eng.pool.rollback(1, T)
        if r:
          times.append(dt * 1e3)
      res[f"{impl}_ms"][str(T)] = round(statistics.median(times), 3)
  res["speedup"] = {T: round(res["reference_ms"][T] / res["paged_ms"][T], 3)
                    for T in res["reference_ms"]}
  return res


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--cpu_smoke", action="store_true")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--num_pages", type=int, default=512)
  p.add_argument("--context", type=int, default=4096)
  p.add_argument("--evict_frac", type=float, default=0.5)
  p.add_argument("--T", default="1,8,32")
  p.add_argument("--repeats", type=int, default=10)
  a = p.parse_args(argv)
  t0 = time.perf_counter()
  jax.config.update("jax_default_matmul_precision", "highest")
  smoke = a.cpu_smoke
  result = {"config": vars(a), "machine": machine_info(), "mode": "interpret" if smoke else "compiled"}
  result["oracle"] = oracle(interpret=smoke, num_sequences=1 if smoke else 2, pad_to=64 if smoke else 128)
  print("oracle:", result["oracle"], flush=True)
  write_result(result, a.out, "engine_gpu.json")  # kept if the timing part runs out of time
  jax.config.update("jax_default_matmul_precision", "default")
  Ts = [int(t) for t in a.T.split(",")]
  if smoke:
    result["step"] = step_times("tiny_llama", "float32", 16, 128, a.evict_frac, Ts[:2], 1, True)
  else:
    result["step"] = step_times("smollm2_135m", a.dtype, a.num_pages, a.context, a.evict_frac,
                                Ts, a.repeats, False)
  print("step:", result["step"], flush=True)
  result["wall_s"] = round(time.perf_counter() - t0, 1)
  write_result(result, a.out, "engine_gpu.json")
  return 0 if result["oracle"]["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
