r"""Pallas kernels compiled on a GPU vs their XLA references: correctness, time, skip ratios.

Run (from the repository root)::

  python bench/kernels_gpu.py --out=out/bench                 # on a GPU machine (~1-3 min)
  python bench/kernels_gpu.py --cpu_smoke --out=/tmp/kbench   # CPU, interpret mode, tiny sizes

What it measures, in one run:

* ``skip``: the block-sparse skip ratio of :func:`kernels_pallas.segment_attention.tile_skip_ratio`
  for a PASTA-shaped mask with 8 threads (``pasta_mask_metadata``: prefix 128, a plan of 8
  promises x 16, 8 chunks, tail 128 at S = 2048; AR threads and diffusion chunks), at block
  sizes 128 and 64, plus the page skip ratio of the decode pool. Cheap ``jnp``; always at full
  size, also with ``--cpu_smoke``.
* ``prefill``: :func:`segment_attention` (Pallas, compiled; ``interpret=True`` with
  ``--cpu_smoke``) vs ``segment_attention_reference`` (dense XLA, float32, HIGHEST precision: the
  correctness oracle) and vs ``xla_dense`` (dense XLA in the input dtype with a float32 softmax,
  the model's attention: the speed baseline). Shapes: B in {1, 4}, H = 9, K = 3 (SmolLM2), D = 64,
  T = S = 2048, the PASTA mask, bfloat16 and float32.
* ``train``: forward + backward (grads of q, k, v; the Pallas dQ and dK/dV kernels) vs the
  reference's and the dense XLA attention's grads, first block size only; ``max_rel_err`` is the
  largest ``max|grad - ref| / max|ref|`` over q, k, v.
* ``decode``: :func:`paged_attention` vs ``paged_attention_reference`` / ``xla_dense`` (gather the
  pages, dense mask): 16 query tokens (8 threads x 2) over 64 pages of 16 slots per sequence,
  a 30 % evicted pool, with and without flash-decoding splits.

Every time is the median over ``--repeats`` calls after a warm-up (compile excluded), in ms.
``ok`` is ``max_abs_err <= tol`` (tol: bf16 2e-2, f32 1e-4 on GPU; the tests use 1e-5 on CPU).
Writes ``<out>/kernels_gpu.json``; exits 1 when a case fails or raises (the JSON keeps going).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a plain script from anywhere
  sys.path.insert(0, REPO_ROOT)
from bench.common import machine_info  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels_pallas import paged_attention as pa  # noqa: E402
from kernels_pallas import segment_attention as sa  # noqa: E402
from kernels_pallas import segment_mask as sm  # noqa: E402

GPU_TOL = {"float32": 1e-4, "bfloat16": 2e-2}   # max abs error (prefill, decode); relative (train)
CPU_TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
  jax.block_until_ready(fn())   # warm-up / compile
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(statistics.median(ts))


# --------------------------------------------------------------------------------------------
# inputs

def pasta_prefill_inputs(B, H, K, S, D, dtype, threads=8, seed=0, bidir_chunks=False):
  meta = sm.pasta_mask_metadata(S, threads, batch=B, prefix_len=max(1, S // 16),
                                promise_len=max(1, S // 128), tail_len=max(1, S // 16),
                                bidir_chunks=bidir_chunks)
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, H, S, D)), dtype)
  k = jnp.asarray(rng.normal(size=(B, K, S, D)), dtype)
  v = jnp.asarray(rng.normal(size=(B, K, S, D)), dtype)
  seg, order = jnp.asarray(meta["segment"]), jnp.asarray(meta["order"])
  return (q, k, v, seg, seg, order, order, jnp.asarray(meta["alive"]),
          jnp.asarray(meta["visible"]), jnp.asarray(meta["bidir"]))


def pasta_decode_inputs(B, H, K, D, dtype, *, pages_per_seq=64, page_size=16, threads=8,
                        tokens_per_thread=2, evicted_pages=0.25, dead_slots=0.1, seed=0):
  """A decode step of PASTA threads over a paged pool (TIP-style evictions)."""
  rng = np.random.default_rng(seed)
  n = pages_per_seq * page_size
  G = 2 * threads + 2
  prefix, plan = n // 8, n // 8
  seg = np.empty(n, np.int32)
  seg[:prefix] = 0
  seg[prefix:prefix + plan] = 1 + np.sort(rng.integers(0, threads, plan))
  seg[prefix + plan:] = 1 + threads + rng.integers(0, threads, n - prefix - plan)
  vis = np.zeros((G, G), bool)
  vis[0, 0] = True
  for t in range(threads):
    vis[1 + t, 0] = vis[1 + threads + t, 0] = True
    vis[1 + t, 1:2 + t] = True
    vis[1 + threads + t, 1:2 + t] = True
    vis[1 + threads + t, 1 + threads + t] = True
  vis[G - 1] = True
  P = B * pages_per_seq
  slot_seg = np.tile(seg, B).reshape(P, page_size)
  slot_ord = np.tile(np.arange(n, dtype=np.int32), B).reshape(P, page_size)
  alive = rng.random((P, page_size)) >= dead_slots
  alive[rng.random(P) < evicted_pages] = False
  page_table = np.arange(P, dtype=np.int32).reshape(B, pages_per_seq)
  Tq = threads * tokens_per_thread
  q_seg = np.tile(np.repeat(1 + threads + np.arange(threads), tokens_per_thread), (B, 1))
  q_ord = np.tile(n + np.arange(Tq, dtype=np.int32), (B, 1))
  q = jnp.asarray(rng.normal(size=(B, H, Tq, D)), dtype)
  kp = jnp.asarray(rng.normal(size=(K, P, page_size, D)), dtype)
  vp = jnp.asarray(rng.normal(size=(K, P, page_size, D)), dtype)
  return (q, kp, vp, jnp.asarray(page_table), jnp.asarray(alive), jnp.asarray(slot_seg),
          jnp.asarray(slot_ord), jnp.asarray(q_seg, jnp.int32), jnp.asarray(q_ord),
          jnp.asarray(np.broadcast_to(vis, (B, G, G)).copy()), jnp.zeros((B, G), bool))


# --------------------------------------------------------------------------------------------
# XLA speed baselines (the model's dense attention: input-dtype matmuls, float32 softmax)

def _xla_dense_from_mask(q, k, v, mask, scale):
  B, H, T, D = q.shape
  K = k.shape[1]
  qg = q.reshape(B, K, H // K, T, D)
  s = jnp.einsum("bkgtd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  s = jnp.where(mask[:, None, None], s, sm.MASK_VALUE)
  p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
  return jnp.einsum("bkgts,bksd->bkgtd", p, v).reshape(B, H, T, D)


@jax.jit
def xla_dense_prefill(q, k, v, qs, ks, qo, ko, ka, vis, bd):
  mask = sm.pair_visible(qs, qo, ks, ko, ka, vis, bd)
  return _xla_dense_from_mask(q, k, v, mask, q.shape[-1] ** -0.5)


@jax.jit
def xla_dense_decode(q, kp, vp, pt, alive, seg, order, qs, qo, vis, bd):
  B = q.shape[0]
  K, P, ps, D = kp.shape
  ptc, a, s, o = pa._gather_slots(pt, alive, seg, order)
  mp = ptc.shape[1]
  kg = jnp.transpose(kp[:, ptc], (1, 0, 2, 3, 4)).reshape(B, K, mp * ps, D)
  vg = jnp.transpose(vp[:, ptc], (1, 0, 2, 3, 4)).reshape(B, K, mp * ps, D)
  mask = sm.pair_visible(qs, qo, s, o, a, vis, bd)
  return _xla_dense_from_mask(q, kg, vg, mask, D ** -0.5)


# --------------------------------------------------------------------------------------------
# cases

def _compare(out, ref, dtype_name, tol_table):
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  finite = bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
  tol = tol_table[dtype_name]
  return {"max_abs_err": err, "tol": tol, "finite": finite, "ok": finite and err <= tol}


def run_prefill_case(B, H, K, S, D, dtype_name, block, *, interpret, repeats, tol_table):
  dtype = jnp.dtype(dtype_name)
  args = pasta_prefill_inputs(B, H, K, S, D, dtype)
  bs = sa.BlockSizes(block_q=block, block_k=block)
  kern = jax.jit(functools.partial(sa.segment_attention, block_sizes=bs, interpret=interpret))
  ref = jax.jit(sa.segment_attention_reference)
  out = kern(*args)
  res = {"B": B, "H": H, "K": K, "T": S, "S": S, "D": D, "dtype": dtype_name, "block": block,
         "tile_skip_ratio": sa.tile_skip_ratio(*args[3:], block_q=block, block_k=block)}
  res.update(_compare(out, ref(*args), dtype_name, tol_table))
  res["kernel_ms"] = _median_ms(lambda: kern(*args), repeats)
  res["reference_ms"] = _median_ms(lambda: ref(*args), repeats)
  res["xla_dense_ms"] = _median_ms(lambda: xla_dense_prefill(*args), repeats)
  res["speedup_vs_xla_dense"] = res["xla_dense_ms"] / res["kernel_ms"]
  return res


def run_train_case(B, H, K, S, D, dtype_name, block, *, interpret, repeats, tol_table):
  """Forward + backward (grads of q, k, v) of the kernel vs the reference / XLA dense."""
  dtype = jnp.dtype(dtype_name)
  args = pasta_prefill_inputs(B, H, K, S, D, dtype, seed=1)
  meta = args[3:]
  w = jnp.asarray(np.random.default_rng(2).normal(size=args[0].shape), jnp.float32)
  bs = sa.BlockSizes(block_q=block, block_k=block)

  def loss(attn):
    return lambda q, k, v: jnp.sum(w * attn(q, k, v, *meta).astype(jnp.float32))

  kern = jax.jit(jax.grad(loss(functools.partial(sa.segment_attention, block_sizes=bs,
                                                 interpret=interpret)), (0, 1, 2)))
  ref = jax.jit(jax.grad(loss(sa.segment_attention_reference), (0, 1, 2)))
  xla = jax.jit(jax.grad(loss(xla_dense_prefill), (0, 1, 2)))
  qkv = args[:3]
  got = kern(*qkv)
  want = ref(*(x.astype(jnp.float32) for x in qkv))
  rel = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / (jnp.max(jnp.abs(r)) + 1e-30))
            for g, r in zip(got, want))
  finite = all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in got)
  tol = tol_table[dtype_name]
  res = {"B": B, "H": H, "K": K, "T": S, "S": S, "D": D, "dtype": dtype_name, "block": block,
         "what": "grad of sum(w * out) w.r.t. q, k, v",
         "max_rel_err": rel, "tol": tol, "finite": finite, "ok": finite and rel <= tol}
  res["kernel_ms"] = _median_ms(lambda: kern(*qkv), repeats)
  res["reference_ms"] = _median_ms(lambda: ref(*qkv), repeats)
  res["xla_dense_ms"] = _median_ms(lambda: xla(*qkv), repeats)
  res["speedup_vs_xla_dense"] = res["xla_dense_ms"] / res["kernel_ms"]
  return res


def run_decode_case(B, H, K, D, dtype_name, pages_per_seq, page_size, splits, *, interpret,
                    repeats, tol_table):
  dtype = jnp.dtype(dtype_name)
  args = pasta_decode_inputs(B, H, K, D, dtype, pages_per_seq=pages_per_seq,
                             page_size=page_size)
  bs = pa.PagedBlockSizes(num_splits=splits)
  kern = jax.jit(functools.partial(pa.paged_attention, block_sizes=bs, interpret=interpret))
  ref = jax.jit(pa.paged_attention_reference)
  out = kern(*args)
  res = {"B": B, "H": H, "K": K, "Tq": int(args[0].shape[2]), "D": D, "dtype": dtype_name,
         "pages_per_seq": pages_per_seq, "page_size": page_size, "num_splits": splits,
         "page_skip_ratio": pa.page_skip_ratio(*args[3:])}
  res.update(_compare(out, ref(*args), dtype_name, tol_table))
  res["kernel_ms"] = _median_ms(lambda: kern(*args), repeats)
  res["reference_ms"] = _median_ms(lambda: ref(*args), repeats)
  res["xla_dense_ms"] = _median_ms(lambda: xla_dense_decode(*args), repeats)
  res["speedup_vs_xla_dense"] = res["xla_dense_ms"] / res["kernel_ms"]
  return res


def skip_ratios(S=2048, threads=8) -> dict[str, Any]:
  out: dict[str, Any] = {"seq_len": S, "threads": threads}
  for bidir in (False, True):
    meta = sm.pasta_mask_metadata(S, threads, bidir_chunks=bidir)
    seg, order = jnp.asarray(meta["segment"]), jnp.asarray(meta["order"])
    m = (seg, seg, order, order, jnp.asarray(meta["alive"]), jnp.asarray(meta["visible"]),
         jnp.asarray(meta["bidir"]))
    name = "pasta_diffusion_chunks" if bidir else "pasta_ar_threads"
    dense = sm.pair_visible(m[0], m[2], m[1], m[3], m[4], m[5], m[6])
    out[name] = {
        "layout": meta["lengths"],
        "pair_density": float(jnp.mean(dense)),
        **{f"tile_skip_ratio_block{b}": sa.tile_skip_ratio(*m, block_q=b, block_k=b)
           for b in (128, 64, 32)},
    }
  d = pasta_decode_inputs(1, 3, 1, 16, jnp.float32)
  out["decode_pool_page_skip_ratio"] = pa.page_skip_ratio(*d[3:])
  return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default="out/bench")
  p.add_argument("--cpu_smoke", action="store_true",
                 help="interpret mode at tiny sizes (proves the script runs; no GPU needed)")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--batches", default="1,4")
  p.add_argument("--dtypes", default="bfloat16,float32")
  args = p.parse_args(argv)
  t_start = time.perf_counter()
  on_gpu = jax.default_backend() == "gpu"
  smoke = args.cpu_smoke
  if not smoke and not on_gpu:
    raise SystemExit("no GPU backend: run with --cpu_smoke (interpret mode, tiny sizes)")
  interpret = smoke
  tol = CPU_TOL if smoke else GPU_TOL
  repeats = 2 if smoke else args.repeats
  batches = [1] if smoke else [int(b) for b in args.batches.split(",")]
  dtypes = args.dtypes.split(",")
  if smoke:
    H, K, D, S, blocks = 3, 1, 16, 40, (16,)
    decode = dict(pages_per_seq=4, page_size=8, splits=(2,))
  else:
    H, K, D, S, blocks = 9, 3, 64, 2048, (128, 64)
    decode = dict(pages_per_seq=64, page_size=16, splits=(1, 8))

  result: dict[str, Any] = {"config": vars(args), "machine": machine_info(), "mode":
                            "interpret (cpu_smoke)" if smoke else "compiled",
                            "skip": skip_ratios(), "prefill": [], "train": [], "decode": [],
                            "errors": []}
  for B in batches:
    for dt in dtypes:
      for blk in blocks:
        try:
          result["prefill"].append(run_prefill_case(B, H, K, S, D, dt, blk, interpret=interpret,
                                                    repeats=repeats, tol_table=tol))
        except Exception as e:  # keep going; the JSON says what broke
          result["errors"].append({"case": f"prefill B={B} {dt} block={blk}",
                                   "error": repr(e), "trace": traceback.format_exc()[-3000:]})
      # float32 dK/dV tiles of 128 need 259 KiB of shared memory (H200 has 227 KiB): use the smallest.
      train_block = blocks[-1] if dt == "float32" else blocks[0]
      try:
        result["train"].append(run_train_case(B, H, K, S, D, dt, train_block, interpret=interpret,
                                              repeats=repeats, tol_table=tol))
      except Exception as e:
        result["errors"].append({"case": f"train B={B} {dt} block={train_block}",
                                 "error": repr(e), "trace": traceback.format_exc()[-3000:]})
      for splits in decode["splits"]:
        try:
          result["decode"].append(run_decode_case(
              B, H, K, D, dt, decode["pages_per_seq"], decode["page_size"], splits,
              interpret=interpret, repeats=repeats, tol_table=tol))
        except Exception as e:
          result["errors"].append({"case": f"decode B={B} {dt} splits={splits}",
                                   "error": repr(e), "trace": traceback.format_exc()[-3000:]})
  result["all_ok"] = (not result["errors"]
                      and all(c["ok"] for c in result["prefill"] + result["train"]
                              + result["decode"]))
  result["wall_s"] = time.perf_counter() - t_start
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "kernels_gpu.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=str)
  print(json.dumps({k: result[k] for k in ("mode", "skip", "all_ok", "wall_s")}, indent=1,
                   default=str))
  for c in result["prefill"] + result["train"] + result["decode"]:
    print({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in c.items()})
  for e in result["errors"]:
    print("ERROR", e["case"], e["error"])
  return result


if __name__ == "__main__":
  sys.exit(0 if main()["all_ok"] else 1)
