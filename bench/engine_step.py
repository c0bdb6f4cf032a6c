r"""Cost of one engine step as a function of the number of query tokens T (DESIGN.md §5, §7).

Run (from the repository root)::

  python bench/engine_step.py --out=out/bench                  # real SmolLM2 on CPU, ~1-2 min
  python bench/engine_step.py --out=/tmp/b --smoke             # tiny random model (the test)

What is measured: an :class:`selforch_jax.runtime.engine.Engine` over a paged pool of
``--num_pages x --page_size`` slots holds ``--context`` live tokens (one prefilled sequence).
For each T in ``--T`` (default 1, 4, 16, 64, 256), T query tokens that see the whole context and
each other causally run in one engine step (:meth:`Engine.step`: host arrays in, K/V written to T
own slots, logits ``[T, V]`` back and ready), ``--repeats`` times, every T against the same
context (the dense reference attention reads the step's key window: the used slots rounded up to
a power of two, at least 256). The first step
per T is excluded (compile); the repeats go round-robin over the T values in a shuffled order, so
load from other processes affects every T alike.
Reported per T: median and min wall ms of the step, ms including the host bookkeeping
(:meth:`Engine.run_step`: slot allocation + the host mask build), the cost relative to T = 1, and
query tokens per second. A step of this model reads every weight once, so on a CPU several tokens
per step cost little more than one: ``relative_to_T1[T] / T`` is what parallel decoding pays
per token.

Then the key-window curve (``--window_T`` queries, default 8): the same step when the queries see
the slots ``[0, end)`` for each key window ``end`` of the pool, up to the whole pool; the engine
attends over that window only, so the cost follows the used slots, not the pool size
(``key_window.relative_to_whole_pool``; e.g. ``--num_pages=304`` is the walk eval's pool).

Then (``plain_spec_vs_plain``) the ForwardSpec path with everything off against today's plain
step on a T = 1 step: whether the lowered HLO text is the same, and both step times; and
(``layer_loop``) each ``ModelConfig.layer_loop`` of ``--layer_loops`` (``lax.scan`` over the
stacked layers vs an unrolled Python loop) on a fresh engine over the same weights: compile
seconds (the first step) and median ms of steps of ``--layer_loop_T`` queries after the context.
``uptime_loadavg_1_5_15`` records the machine's load (other processes share the cores).

Writes ``<out>/engine_step.json`` and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a plain script from anywhere
  sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402

from selforch_jax.runtime.engine import Engine, key_window, key_windows  # noqa: E402
from selforch_jax.runtime.mask import step_mask  # noqa: E402

ONE_SEGMENT = (np.ones((1, 1), bool), np.zeros(1, bool))


def _load(smoke: bool, seed: int):
  if smoke:
    from selforch_jax.models.config import get_preset
    from selforch_jax.models.transformer import init_model
    return init_model(get_preset("tiny_llama"), seed=seed), "tiny_llama (random)"
  from selforch_jax.checkpoints.assets import smollm2_gguf_path
  from selforch_jax.checkpoints.gguf_import import load_gguf
  _, model, _ = load_gguf(smollm2_gguf_path())
  return model, "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32)"


def prepare(engine: Engine, T: int, owner: int, rng: np.random.Generator) -> dict:
  """Inputs of a step of T queries that see the context (owner 0) and each other causally.

  The T slots are reserved for ``owner`` and stay allocated while the curve is measured (each
  T writes its own slots; every step's mask shows only the context and its own queries)."""
  pool = engine.pool
  ctx = int(np.count_nonzero(pool.alive & (pool.owner == 0)))
  positions = ctx + np.arange(T)
  orders = engine.next_order + np.arange(T)
  slots = pool.allocate(owner, T)
  pool.write(slots, positions, np.full(T, owner), orders)
  visible = np.zeros((owner + 1, owner + 1), bool)
  visible[owner, [0, owner]] = True
  mask = step_mask(pool, np.full(T, owner), orders, visible, np.zeros(owner + 1, bool))
  assert mask.sum() == ctx * T + T * (T + 1) // 2
  return dict(tokens=rng.integers(0, engine.cfg.vocab_size, T), positions=positions,
              slots=slots, mask=mask)


def timed_step(engine: Engine, x: dict) -> float:
  """Seconds of one blocked engine step (host arrays in, logits ready)."""
  t0 = time.perf_counter()
  jax.block_until_ready(engine.step(x["tokens"], x["positions"], x["slots"], x["mask"]))
  return time.perf_counter() - t0


def run_step_ms(engine: Engine, T: int, repeats: int, rng: np.random.Generator) -> float:
  """Median ms of the scheduler-facing call (allocate + host mask + step), slots released."""
  ctx = int(engine.pool.live_tokens)
  tokens = rng.integers(0, engine.cfg.vocab_size, T)
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    lg, _ = engine.run_step(tokens, ctx + np.arange(T), np.zeros(T), 1, *ONE_SEGMENT)
    jax.block_until_ready(lg)
    out.append(time.perf_counter() - t0)
    engine.pool.rollback(1, T)
  return 1e3 * statistics.median(out)


def pasta_skip_ratios(seq_len: int = 2048) -> dict:
  """Fraction of (q tile, kv tile) pairs the block-sparse segment attention skips for a
  PASTA-shaped training mask with 8 threads (``kernels_pallas.segment_mask``), per block size,
  for AR threads (causal chunks) and diffusion chunks (bidirectional)."""
  from kernels_pallas.segment_attention import tile_skip_ratio
  from kernels_pallas.segment_mask import pasta_mask_metadata
  out = {"seq_len": seq_len}
  for kind, bidir in (("ar_threads", False), ("diffusion_chunks", True)):
    m = pasta_mask_metadata(seq_len, 8, bidir_chunks=bidir)
    for blk in (128, 64):
      out[f"{kind}_block{blk}"] = float(tile_skip_ratio(
          m["segment"], m["segment"], m["order"], m["order"], m["alive"], m["visible"], m["bidir"],
          block_q=blk, block_k=blk))
  return out


def key_window_curve(engine: Engine, T: int, repeats: int, rng: np.random.Generator) -> dict:
  """Median ms of a step of T queries that see the slots ``[0, end)``, for ``end`` = each key
  window of the pool (:func:`selforch_jax.runtime.engine.key_windows`; the last is the whole
  pool), measured round-robin in a shuffled order. The step's cost follows the end of the
  visible slots, not the pool's size: what a pool whose used pages are packed at the front
  (lowest free page first) pays. The queries write the slots ``[end - T, end)`` and see them
  causally after the context ``[0, end - T)``. Reports the key window each step ran with."""
  S = engine.num_slots
  ends = key_windows(S)
  tokens = rng.integers(0, engine.cfg.vocab_size, T)
  x = {}
  for end in ends:
    m = np.zeros((T, S), bool)
    m[:, :end - T] = True
    m[:, end - T:end] = np.tril(np.ones((T, T), bool))
    x[end] = dict(tokens=tokens, positions=np.arange(end - T, end),
                  slots=np.arange(end - T, end), mask=m)
  for end in ends:       # compile
    timed_step(engine, x[end])
  times = {end: [] for end in ends}
  for _ in range(repeats):
    for end in rng.permutation(ends):
      times[int(end)].append(timed_step(engine, x[int(end)]))
  ms = {str(e): 1e3 * statistics.median(v) for e, v in times.items()}
  return dict(T=T, slots=S, visible_slots=ends, ms=ms,
              key_window={str(e): key_window(x[e]["mask"]) for e in ends},
              relative_to_whole_pool={k: v / ms[str(S)] for k, v in ms.items()})


def _hlo(fn, *args) -> str:
  return fn.lower(*args).as_text().replace("jit__jitted_spec_step", "M").replace(
      "jit__jitted_step", "M")


def plain_spec_vs_plain(engine: Engine, x: dict, repeats: int) -> dict:
  """The ForwardSpec path with everything off (``_jitted_spec_step`` at ``PLAIN_KEY``, no
  arrays) against today's plain step (``_jitted_step``) on the same step ``x``: whether the
  lowered HLO text is the same (module name aside), and the median ms of each, round-robin."""
  from selforch_jax.runtime import engine as em
  T = len(x["tokens"])
  tokens = np.asarray(x["tokens"], np.int32)
  positions = np.asarray(x["positions"], np.int32)
  slots = np.asarray(x["slots"], np.int32)
  W = key_window(x["mask"])
  mask = np.asarray(x["mask"][:, :W])
  gd, st = engine.graphdef, engine.state

  def plain():
    lg, engine.cache = em._jitted_step(gd, st, engine.cache, tokens, positions, slots, mask)
    return lg

  def spec():
    lg, engine.cache = em._jitted_spec_step(gd, em.PLAIN_KEY, st, engine.cache, tokens,
                                            positions, slots, mask, {})
    return lg

  same = (_hlo(em._jitted_step, gd, st, engine.cache, tokens, positions, slots, mask)
          == _hlo(em._jitted_spec_step, gd, em.PLAIN_KEY, st, engine.cache, tokens, positions,
                  slots, mask, {}))
  fns = {"plain": plain, "spec_all_off": spec}
  for f in fns.values():
    jax.block_until_ready(f())
  times = {k: [] for k in fns}
  for i in range(repeats):
    for k in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
      t0 = time.perf_counter()
      jax.block_until_ready(fns[k]())
      times[k].append(time.perf_counter() - t0)
  ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
  return dict(T=T, hlo_text_equal=bool(same), ms=ms,
              spec_over_plain=ms["spec_all_off"] / ms["plain"])


def layer_loop_compare(model, loops: Sequence[str], context: int, num_pages: int, page_size: int,
                       Ts: Sequence[int], repeats: int, rng: np.random.Generator) -> dict:
  """Per layer loop (``ModelConfig.layer_loop``): a fresh engine over the same weights, the
  context prefilled, then for each T in ``Ts`` a step of T queries after it: compile s (the
  first step, minus nothing: it includes the run) and median ms of ``repeats`` steps."""
  from flax import nnx
  from selforch_jax.models.transformer import Transformer
  out = {}
  state = nnx.state(model)
  ctx = rng.integers(0, model.cfg.vocab_size, context)
  for loop in loops:
    cfg = model.cfg.replace(layer_loop=loop)
    m = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
    nnx.update(m, state)
    eng = Engine(m, num_pages=num_pages, page_size=page_size, attention="reference")
    t0 = time.perf_counter()
    lg, _ = eng.run_step(ctx, np.arange(context), np.zeros(context), 0, *ONE_SEGMENT)
    jax.block_until_ready(lg)
    res = dict(prefill_s_incl_compile=time.perf_counter() - t0, compile_s={}, ms={})
    for i, T in enumerate(Ts):
      x = prepare(eng, T, owner=2 + i, rng=rng)
      res["compile_s"][str(T)] = timed_step(eng, x)
      res["ms"][str(T)] = 1e3 * statistics.median(timed_step(eng, x) for _ in range(repeats))
    out[loop] = res
  if len(loops) == 2:
    a, b = loops
    out[f"{b}_over_{a}_ms"] = {k: out[b]["ms"][k] / out[a]["ms"][k] for k in out[a]["ms"]}
  return out


def main(argv: Sequence[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="directory for engine_step.json")
  p.add_argument("--smoke", action="store_true", help="tiny random model (fast; for tests)")
  p.add_argument("--T", default="1,4,16,64,256", help="query tokens per step, comma-separated")
  p.add_argument("--context", type=int, default=None,
                 help="live tokens in the pool (default 256; smoke 32)")
  p.add_argument("--num_pages", type=int, default=None, help="default 48 (smoke 12)")
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--repeats", type=int, default=None, help="default 20 (smoke 3)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--window_T", type=int, default=8,
                 help="query tokens of the key-window curve (0 = skip it)")
  p.add_argument("--layer_loops", default="scan,unroll",
                 help="ModelConfig.layer_loop values to compare (empty = skip)")
  p.add_argument("--layer_loop_T", default="1,16", help="query tokens of the layer-loop steps")
  a = p.parse_args(argv)
  context = a.context if a.context is not None else (32 if a.smoke else 256)
  num_pages = a.num_pages if a.num_pages is not None else (12 if a.smoke else 48)
  repeats = a.repeats if a.repeats is not None else (3 if a.smoke else 20)
  Ts = [int(t) for t in a.T.split(",") if t]
  if not Ts or min(Ts) < 1:
    p.error("--T needs positive integers")
  pages = -(-context // a.page_size) + sum(-(-T // a.page_size) for T in Ts)
  if pages > num_pages:
    p.error(f"the context ({context}) and one slot range per T need {pages} pages of "
            f"{a.page_size}; --num_pages is {num_pages}")

  t_start = time.perf_counter()
  model, model_name = _load(a.smoke, a.seed)
  load_s = time.perf_counter() - t_start
  engine = Engine(model, num_pages=num_pages, page_size=a.page_size)
  rng = np.random.default_rng(a.seed)
  ctx_tokens = rng.integers(0, engine.cfg.vocab_size, context)
  t0 = time.perf_counter()
  lg, _ = engine.run_step(ctx_tokens, np.arange(context), np.zeros(context), 0, *ONE_SEGMENT)
  jax.block_until_ready(lg)
  prefill_s = time.perf_counter() - t0

  # 1) the curve: all T prepared and compiled first, then measured round-robin in a shuffled
  #    order per repeat, so that load from other processes hits every T alike
  inputs = {T: prepare(engine, T, owner=2 + i, rng=rng) for i, T in enumerate(Ts)}
  compile_s = {T: timed_step(engine, inputs[T]) for T in Ts}
  times = {T: [] for T in Ts}
  for _ in range(repeats):
    for T in rng.permutation(Ts):
      times[int(T)].append(timed_step(engine, inputs[int(T)]))
  for i, T in enumerate(Ts):
    engine.pool.free_owner(2 + i)
  # 2) the same steps through run_step (bookkeeping included), the pool back to the context
  full = {T: run_step_ms(engine, T, max(3, repeats // 4), rng) for T in Ts}
  per_T = {str(T): dict(median_ms=1e3 * statistics.median(times[T]), min_ms=1e3 * min(times[T]),
                        run_step_median_ms=full[T], compile_s=compile_s[T]) for T in Ts}
  base = per_T[str(Ts[0])]["median_ms"]
  rel = {k: v["median_ms"] / base for k, v in per_T.items()}
  out = {
      "config": dict(model=model_name, dtype=engine.cfg.dtype, num_pages=num_pages,
                     page_size=a.page_size, slots=engine.num_slots, context_tokens=context,
                     T=Ts, repeats=repeats, seed=a.seed, smoke=a.smoke),
      "machine": dict(platform=platform.platform(), cpu_count=os.cpu_count(),
                      jax=jax.__version__, backend=jax.default_backend(),
                      device=str(jax.devices()[0])),
      "ms": {k: v["median_ms"] for k, v in per_T.items()},
      "min_ms": {k: v["min_ms"] for k, v in per_T.items()},
      "run_step_ms": {k: v["run_step_median_ms"] for k, v in per_T.items()},
      "relative_to_T1": rel,
      "relative_per_token": {k: rel[k] / int(k) for k in rel},
      "query_tokens_per_s": {k: int(k) / (v["median_ms"] / 1e3) for k, v in per_T.items()},
      "compile_s": {k: v["compile_s"] for k, v in per_T.items()},
      "load_s": load_s,
      "context_prefill_s_incl_compile": prefill_s,
      "live_kv": engine.pool.stats(),
      "wall_s": time.perf_counter() - t_start,
  }
  if a.window_T > 0:
    engine.pool.free_owner(0)   # the curve's masks decide what is seen; the pool is empty
    out["key_window"] = key_window_curve(engine, a.window_T, repeats, rng)
    out["wall_s"] = time.perf_counter() - t_start
  out["pasta_8_threads_tile_skip_ratio"] = pasta_skip_ratios()
  # 3) the ForwardSpec path with everything off vs today's plain step (same HLO, same time)
  engine.reset()
  x1 = prepare(engine, 1, owner=1, rng=rng)
  out["plain_spec_vs_plain"] = plain_spec_vs_plain(engine, x1, repeats)
  engine.pool.free_owner(1)
  # 4) the layer loop: lax.scan over stacked layers vs a Python loop (compile s, step ms)
  loops = [x for x in a.layer_loops.split(",") if x]
  if loops:
    lT = [int(t) for t in a.layer_loop_T.split(",") if t]
    out["layer_loop"] = dict(
        default=engine.cfg.resolved_layer_loop(decode=True), context_tokens=context, T=lT,
        repeats=max(3, repeats // 2),
        **layer_loop_compare(model, loops, context, num_pages, a.page_size, lT,
                             max(3, repeats // 2), rng))
  from bench.common import loadavg
  out["uptime_loadavg_1_5_15"] = loadavg()
  out["wall_s"] = time.perf_counter() - t_start
  if Ts[0] != 1:
    out["note"] = f"relative_to_T1 is relative to the smallest T measured ({Ts[0]})"
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "engine_step.json"), "w") as f:
    json.dump(out, f, indent=2)
  print(json.dumps(out, indent=2))
  return out


if __name__ == "__main__":
  main()
