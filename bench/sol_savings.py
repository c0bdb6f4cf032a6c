r"""SOL / QUEST (issue 22, "Beyond upstream"): wall-clock per decode step of the QUEST page
selection with the compute actually saved (``sparsity="quest_gather(P)"``: each KV head gathers
its kept pages' K/V and attends over those only) against the plain dense step and the simulated
``quest(P)`` mask path, on the real SmolLM2-135M, batch 1, CPU.

One engine (reference attention, a pool of ``max(contexts)`` rounded to a power of two slots)
is prefilled with real text (the repository's own documentation, tokenized; chunks of
``--chunk`` tokens, plain steps) up to each context length in turn; at each length every variant
runs one decode step at position ``context`` (its slot is rolled back after the step, so every
step sees the same ``context + 1`` keys), the variants interleaved round by round so a change of
the machine's load hits them alike. Per variant: the median seconds per step over ``--reps``
rounds (after ``--warmup`` untimed rounds, which also compile), and per gather / mask variant the
median over rounds of its time / the dense time of the same round. ``os.getloadavg()`` is
recorded before and after each context (other processes share the cores).

Variants: ``dense`` (the plain step), ``gather_k<kappa>`` (``quest_gather(P)`` at keep fraction
kappa: the step's static page count is :func:`~selforch_jax.runtime.engine.quest_gather_pages`),
``mask_k<kappa>`` (``quest(P)``: the same selection as a mask over the whole key window; what SOL
ran before). The step reads the weights (~540 MB float32) plus the key window's K/V (30 layers x
3 KV heads x 64 x 4 B x 2 = 46 KB per slot: 377 MB at 8192 slots); the gather variant reads the
keys once for the page bounds (min / max per page, computed inside the step) and the kept pages'
K/V.

On a GPU (the GGUF does not travel to a lent machine): ``--weights=random`` runs a SmolLM2-135M-
shaped model with random weights (a step's time does not depend on the weights' values; the
QUEST selection does, but the gathered page count is fixed by kappa) and prefills random token
ids; ``--attention=auto`` makes the dense step use the Pallas paged kernel on a GPU (the
``quest_gather`` steps run the XLA gather path on either engine), ``reference`` the jnp path.

Run:
  python bench/sol_savings.py --contexts=1000,4000,8000 --kappas=0.25,0.5 --reps=15 \
      --out=bench/results --name=sol_savings_cpu
  python bench/sol_savings.py --weights=random --dtype=bfloat16 --attention=auto \
      --contexts=4000,16000,32000 --kappas=0.125,0.25,0.5 --name=sol_savings_h200   # on a GPU
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import loadavg, machine_info, write_result  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc_tokens(tok, n: int) -> np.ndarray:
  """``n`` token ids of the repository's markdown documentation (README, docs/, bench/),
  concatenated in sorted path order and repeated if short."""
  paths = sorted(glob.glob(os.path.join(ROOT, "*.md")) + glob.glob(os.path.join(ROOT, "docs",
                                                                                "*.md"))
                 + glob.glob(os.path.join(ROOT, "bench", "*.md")))
  ids: list[int] = []
  for p in paths:
    with open(p, encoding="utf-8") as f:
      ids += list(tok.encode(f.read()))
  if not ids:
    raise RuntimeError("no documentation text found to prefill with")
  while len(ids) < n:
    ids += ids
  return np.asarray(ids[:n], np.int32)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--contexts", default="1000,4000,8000", help="keys before the decode step")
  ap.add_argument("--kappas", default="0.25,0.5")
  ap.add_argument("--mask_kappas", default="0.25", help="kappas of the simulated quest(P) path")
  ap.add_argument("--page", type=int, default=8, help="QUEST page size (SOL's default 8)")
  ap.add_argument("--reps", type=int, default=15)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--chunk", type=int, default=1000, help="prefill tokens per step")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--weights", default="smollm2_gguf", choices=("smollm2_gguf", "random"),
                  help="random: SmolLM2-135M-shaped random weights, random prompt tokens")
  ap.add_argument("--attention", default="reference", choices=("reference", "auto", "paged"),
                  help="the engine's attention for plain (dense) steps")
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--name", default="sol_savings_cpu")
  a = ap.parse_args(argv)

  import jax

  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  from selforch_jax.runtime.engine import Engine, bucket_size, key_window, quest_gather_pages
  from selforch_jax.runtime.step import ForwardSpec

  t_start = time.perf_counter()
  contexts = sorted(int(x) for x in a.contexts.split(","))
  kappas = [float(x) for x in a.kappas.split(",") if x]
  mask_kappas = [float(x) for x in a.mask_kappas.split(",") if x]
  if a.weights == "random":
    cfg = get_preset("smollm2_135m").replace(dtype=a.dtype, param_dtype=a.dtype)
    model = init_model(cfg, seed=0)
    text = np.random.default_rng(1).integers(1, cfg.vocab_size, contexts[-1]).astype(np.int32)
  else:
    import ml_collections   # only the GGUF path (a lent GPU machine has neither ml_collections
    from selforch_jax import config_lib   # nor the GGUF)
    mc = config_lib.model_defaults()
    mc.preset, mc.weights, mc.dtype = "smollm2_135m", "smollm2_gguf", a.dtype
    cfg, model, tok = config_lib.load_model(ml_collections.ConfigDict(mc))
    text = doc_tokens(tok, contexts[-1])
  page = 16
  slots = bucket_size(contexts[-1] + 1)
  engine = Engine(model, num_pages=slots // page, page_size=page, attention=a.attention)
  one = (np.ones((1, 1), bool), np.zeros(1, bool))
  variants = [("dense", None)]
  variants += [(f"gather_k{k:g}", ForwardSpec(sparsity=f"quest_gather({a.page})",
                                              keep_frac=[k])) for k in kappas]
  variants += [(f"mask_k{k:g}", ForwardSpec(sparsity=f"quest({a.page})", keep_frac=[k]))
               for k in mask_kappas]
  rng = np.random.default_rng(0)
  rows, done = [], 0
  for ctx in contexts:
    t_fill = time.perf_counter()
    while done < ctx:   # plain prefill steps up to ctx keys
      n = min(a.chunk, ctx - done)
      engine.run_step(text[done:done + n], np.arange(done, done + n), np.zeros(n), 0, *one)
      done += n
    fill_s = time.perf_counter() - t_fill
    load_before = loadavg()
    times = {name: [] for name, _ in variants}
    for r in range(a.warmup + a.reps):
      for name, spec in variants:
        tokv = rng.integers(1, 1000, 1)
        t0 = time.perf_counter()
        out, _ = engine.run_step(tokv, [ctx], [0], 0, *one, spec=spec)
        (out if spec is None else out["logits"]).block_until_ready()
        dt = time.perf_counter() - t0
        engine.pool.rollback(0, 1)
        if r >= a.warmup:
          times[name].append(dt)
    mask = np.zeros((1, engine.num_slots), bool)
    mask[0, :ctx + 1] = True
    W = key_window(mask)
    d = np.asarray(times["dense"])
    row = dict(context=ctx, kv_len=ctx + 1, key_window=W, prefill_s=round(fill_s, 1),
               loadavg_before=load_before, loadavg_after=loadavg(), variants={})
    for name, spec in variants:
      t = np.asarray(times[name])
      v = dict(median_s=float(np.median(t)), min_s=float(t.min()), reps=len(t))
      if spec is not None:
        kf = float(spec.keep_frac[0])
        v["kappa"] = kf
        v["ratio_vs_dense_median"] = float(np.median(t / d))
        v["ratio_of_medians"] = float(np.median(t) / np.median(d))
        if spec.sparsity.startswith("quest_gather"):
          nb = quest_gather_pages(mask[:, :W], np.array([kf], np.float32), a.page)
          v["pages_gathered"] = nb
          v["keys_attended"] = None if nb is None else nb * a.page
      row["variants"][name] = v
    rows.append(row)
    print(ctx, {k: (round(v["median_s"] * 1e3, 1), round(v.get("ratio_vs_dense_median", 1), 3))
                for k, v in row["variants"].items()}, row["loadavg_after"], file=sys.stderr)
  result = dict(
      system="sol_quest_gather", model="smollm2_135m", weights=a.weights,
      attention=engine.attention, dtype=a.dtype, batch=1,
      quest_page=a.page, pool_page=page, pool_slots=engine.num_slots,
      prefill_text=("random token ids" if a.weights == "random" else
                    "repository markdown docs (README.md, docs/*.md, bench/*.md), tokenized"),
      note=("decode step = one query at position context over context + 1 keys; variants "
            "interleaved per round; ratio_vs_dense_median = median over rounds of t / t_dense of "
            "the same round"),
      rows=rows, wall_s=round(time.perf_counter() - t_start, 1), machine=machine_info(),
      loadavg=loadavg(), jax_backend=jax.default_backend(),
      command="python bench/sol_savings.py " + " ".join(sys.argv[1:] if argv is None else argv))
  write_result(result, a.out, a.name + ".json")


if __name__ == "__main__":
  main()
