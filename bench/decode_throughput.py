r"""Greedy decode throughput of our JAX decoder vs transformers, llama.cpp and the memory roofline.

Run (from the repository root)::

  python bench/decode_throughput.py --out=out/bench                      # everything, ~5 min on 2 cores
  python bench/decode_throughput.py --out=out/bench --skip_torch --skip_llamacpp
  python bench/decode_throughput.py --out=/tmp/b --model=tiny_llama --new_tokens=4 \
      --skip_torch --skip_llamacpp --bandwidth_mb=16                   # smoke test (random tiny model)

Everything is measured in one run, on the same model and the same chat prompts (the first
``--prompts`` AlpacaEval instructions of ``data/alpaca_eval/example_outputs.json``, encoded
with the GGUF's ChatML template), at batch 1, greedy, with exactly ``--new_tokens`` tokens
generated per prompt (stop tokens are not honoured, so every system does the same work):

* ``ours``: :class:`selforch_jax.decoding.generate.Generator` per compute dtype (float32, and
  bfloat16 with bfloat16 parameters), compile excluded (one warm-up call per prompt first).
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name,
  torch_dtype=float32)`` (the same GGUF dequantised to float32), ``torch.set_num_threads`` =
  ``--threads``; (a) ``generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`` and
  (b) a hand-written KV-cached greedy loop under ``torch.inference_mode``.
* ``llamacpp``: ``llama_cpp.Llama`` on the same GGUF (its own Q4_1 kernels), ``n_threads`` =
  ``--threads``, greedy (argmax of the last logits) in a hand-written eval loop.
* ``roofline``: the copy bandwidth measured here divided by the bytes of all parameters (a
  decode step at batch 1 reads every weight once, the tied embedding included as the LM head).
* ``forward_cost``: one jitted forward of T = 1, 2, 4, ... query tokens against a KV cache of
  fixed length, relative to T = 1 (what parallel decoding pays for several tokens per step).

Writes ``<out>/decode_throughput.json`` and prints it. All times are medians over repeats.
See ``bench/README.md`` for the meaning of every field.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from typing import Any, Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a plain script from anywhere
  sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

ALPACA_EVAL = os.path.join(REPO_ROOT, "data", "alpaca_eval", "example_outputs.json")
TARGET_VS_TORCH_LOOP = 1.0   # ours >= 1.0x the transformers cached loop (float32)
TARGET_VS_ROOFLINE = 0.70    # ours >= 70% of the memory roofline (float32)


# --------------------------------------------------------------------------------------------
# helpers
def _median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs)) if xs else float("nan")


def _r(x: float | None, nd: int = 3):
  return None if x is None else round(float(x), nd)


def _first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
  """Index of the first position where ``a`` and ``b`` differ (None when equal)."""
  for i, (x, y) in enumerate(zip(a, b)):
    if int(x) != int(y):
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def _until_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
  out = []
  for t in ids:
    if int(t) in stop_ids:
      break
    out.append(int(t))
  return out


def machine_info() -> dict[str, Any]:
  info = {
      "cpu_count": os.cpu_count(),
      "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "cpu_model": None,
      "platform": platform.platform(),
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jax_backend": jax.default_backend(),
      "jax_devices": [str(d) for d in jax.devices()],
      "numpy": np.__version__,
  }
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          info["cpu_model"] = line.split(":", 1)[1].strip()
          break
  except OSError:
    pass
  try:
    import flax
    info["flax"] = flax.__version__
  except Exception:  # pragma: no cover
    pass
  return info


# --------------------------------------------------------------------------------------------
# memory bandwidth
def measure_copy_bandwidth(mb: int, repeats: int = 5, threads: int = 2) -> dict[str, Any]:
  """Copy bandwidth in GB/s (bytes read + bytes written per second), best of ``repeats``.

  Measured single-threaded (``np.copyto`` of one ``mb`` MB float32 array) and with
  ``threads`` threads each copying its own slice (numpy releases the GIL while copying).
  """
  n = mb * (1 << 20) // 4
  src = np.ones(n, np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # first touch
  best1 = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    np.copyto(dst, src)
    best1 = min(best1, time.perf_counter() - t0)
  chunks = np.array_split(np.arange(n), threads)
  bounds = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]

  def work(lo, hi):
    np.copyto(dst[lo:hi], src[lo:hi])

  bestn = float("inf")
  for _ in range(repeats):
    ts = [threading.Thread(target=work, args=b) for b in bounds]
    t0 = time.perf_counter()
    for t in ts:
      t.start()
    for t in ts:
      t.join()
    bestn = min(bestn, time.perf_counter() - t0)
  nbytes = 2 * src.nbytes
  del src, dst
  gbs1, gbsn = nbytes / best1 / 1e9, nbytes / bestn / 1e9
  return {"array_mb": mb, "repeats": repeats, "copy_gb_per_s_1thread": _r(gbs1),
          f"copy_gb_per_s_{threads}threads": _r(gbsn), "copy_gb_per_s": _r(max(gbs1, gbsn))}


# --------------------------------------------------------------------------------------------
# model + prompts
def load_prompts(n: int) -> list[str]:
  with open(ALPACA_EVAL, encoding="utf-8") as f:
    rows = json.load(f)
  return [r["instruction"] for r in rows[:n]]


def load_ours(model_name: str, dtype: str, seed: int = 0):
  """Returns ``(cfg, model, gguf_path or None)`` with param_dtype = compute dtype = ``dtype``."""
  if model_name == "smollm2":
    from selforch_jax.checkpoints.assets import smollm2_gguf_path
    from selforch_jax.checkpoints.gguf_import import load_gguf
    path = smollm2_gguf_path()
    cfg, model, _ = load_gguf(path, param_dtype=dtype, dtype=dtype)
    return cfg, model, path
  if model_name.endswith(".gguf"):
    from selforch_jax.checkpoints.gguf_import import load_gguf
    cfg, model, _ = load_gguf(model_name, param_dtype=dtype, dtype=dtype)
    return cfg, model, model_name
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  cfg = get_preset(model_name, param_dtype=dtype, dtype=dtype)
  return cfg, init_model(cfg, seed=seed), None


def encode_prompts(instructions: list[str], gguf_path: str | None, vocab: int):
  """Chat-template token ids per instruction, and the stop ids (empty for a random model)."""
  if gguf_path is not None:
    from selforch_jax.tokenizers import Tokenizer
    tok = Tokenizer.from_gguf(gguf_path)
    ids = [list(tok.encode_chat([{"role": "user", "content": s}])) for s in instructions]
    return ids, sorted(int(s) for s in tok.stop_ids)
  # random tiny model: bytes of the instruction modulo the vocabulary, at most 48 tokens
  return [[b % vocab for b in s.encode("utf-8")][:48] for s in instructions], []


def param_bytes(model) -> int:
  state = nnx.state(model, nnx.Param)
  return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(state)))


# --------------------------------------------------------------------------------------------
# ours
def bench_ours(model, prompt_ids, new_tokens: int, repeats: int) -> dict[str, Any]:
  from selforch_jax.decoding.generate import Generator
  gen = Generator(model)
  compile_s, tps, prefill, e2e, tokens = 0.0, [], [], [], []
  for ids in prompt_ids:
    res, st = gen.generate([ids], max_new_tokens=new_tokens, stop_ids=())  # warm-up / compile
    compile_s += st.compile_s
    tokens.append([int(t) for t in res[0].token_ids])
    for _ in range(repeats):
      res, st = gen.generate([ids], max_new_tokens=new_tokens, stop_ids=())
      assert st.compile_s == 0.0
      tps.append(st.decode_tokens_per_s)
      prefill.append(st.prefill_ms)
      e2e.append(new_tokens / (st.prefill_ms / 1000 + st.decode_s))
  return {"decode_tokens_per_s": _r(_median(tps), 2),
          "decode_tokens_per_s_runs": [_r(x, 2) for x in tps],
          "prefill_ms": _r(_median(prefill), 2),
          "end_to_end_tokens_per_s": _r(_median(e2e), 2),
          "compile_s_total": _r(compile_s, 2),
          "prompt_tokens": [len(p) for p in prompt_ids],
          "_tokens": tokens}


def bench_forward_cost(model, Ts: Sequence[int], cache_len: int, repeats: int) -> dict[str, Any]:
  """Median wall time of one jitted forward of T query tokens against a KV cache.

  The cache has ``cache_len`` slots; the T tokens are written at slot ``cache_len // 2`` and
  every query sees the slots before it (causal), so all T cost the same cache length.
  """
  from selforch_jax.models.transformer import KVCache
  graphdef, state = nnx.split(model)
  cfg = model.cfg

  def fwd(state, tokens, positions, mask, cache, cache_index):
    m = nnx.merge(graphdef, state)
    logits, cache = m(tokens, positions, mask, cache, cache_index)
    return logits, cache

  jfwd = jax.jit(fwd, donate_argnums=(4,))
  start = cache_len // 2
  out = {"cache_len": cache_len, "cache_index": start, "repeats": repeats, "ms": {}}
  for T in Ts:
    if start + T > cache_len:
      continue
    tokens = jnp.ones((1, T), jnp.int32)
    positions = (start + jnp.arange(T, dtype=jnp.int32))[None]
    mask = (jnp.arange(cache_len)[None, :] <= (start + jnp.arange(T))[:, None])[None]
    cache = KVCache.zeros(cfg, 1, cache_len)
    ci = jnp.int32(start)
    logits, cache = jfwd(state, tokens, positions, mask, cache, ci)  # compile + warm-up
    jax.block_until_ready(logits)
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      logits, cache = jfwd(state, tokens, positions, mask, cache, ci)
      jax.block_until_ready((logits, cache))
      times.append(time.perf_counter() - t0)
    out["ms"][str(T)] = _r(1000 * _median(times), 3)
    del cache
  base = out["ms"].get("1")
  out["relative_to_T1"] = {k: _r(v / base, 3) for k, v in out["ms"].items()} if base else {}
  out["tokens_per_s_at_T"] = {k: _r(int(k) / (v / 1000), 1) for k, v in out["ms"].items()}
  return out


# --------------------------------------------------------------------------------------------
# transformers
def bench_transformers(gguf_path: str, prompt_ids, new_tokens: int, threads: int,
                       repeats: int) -> dict[str, Any]:
  import torch
  import transformers
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(threads)
  t0 = time.perf_counter()
  model = AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), torch_dtype=torch.float32)
  model.eval()
  load_s = time.perf_counter() - t0
  nparam_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
  eos = model.generation_config.eos_token_id
  pad = model.generation_config.pad_token_id
  pad = pad if pad is not None else (eos if isinstance(eos, int) else (eos or [0])[0])

  def cached_loop(ids, n):
    with torch.inference_mode():
      x = torch.tensor([ids], dtype=torch.long)
      t0 = time.perf_counter()
      out = model(input_ids=x, use_cache=True)
      past = out.past_key_values
      tok = int(out.logits[0, -1].argmax())
      t1 = time.perf_counter()
      toks = [tok]
      for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[tok]], dtype=torch.long), past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
        tok = int(out.logits[0, -1].argmax())
        toks.append(tok)
      t2 = time.perf_counter()
    return toks, t1 - t0, t2 - t1

  def gen(ids, n):
    with torch.inference_mode():
      x = torch.tensor([ids], dtype=torch.long)
      t0 = time.perf_counter()
      out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)
      t = time.perf_counter() - t0
    return out[0, x.shape[1]:].tolist(), t

  # warm-up (first calls allocate and pick kernels)
  cached_loop(prompt_ids[0], min(4, new_tokens))
  gen(prompt_ids[0], min(4, new_tokens))

  loop_tps, loop_prefill, loop_tokens, gen_e2e, gen_dec, gen_tokens = [], [], [], [], [], []
  for ids in prompt_ids:
    for r in range(repeats):
      toks, pre_s, dec_s = cached_loop(ids, new_tokens)
      loop_tps.append((new_tokens - 1) / dec_s)
      loop_prefill.append(1000 * pre_s)
      if r == 0:
        loop_tokens.append(toks)
      toks_g, t = gen(ids, new_tokens)
      gen_e2e.append(new_tokens / t)
      # decode part: subtract the prefill measured by the cached loop on the same prompt
      gen_dec.append((new_tokens - 1) / max(t - pre_s, 1e-9))
      if r == 0:
        gen_tokens.append([int(v) for v in toks_g])
  return {"transformers": transformers.__version__, "torch": torch.__version__,
          "threads": threads, "load_s": _r(load_s, 2), "param_bytes": int(nparam_bytes),
          "cached_loop": {"decode_tokens_per_s": _r(_median(loop_tps), 2),
                          "decode_tokens_per_s_runs": [_r(x, 2) for x in loop_tps],
                          "prefill_ms": _r(_median(loop_prefill), 2)},
          "generate": {"decode_tokens_per_s": _r(_median(gen_dec), 2),
                       "end_to_end_tokens_per_s": _r(_median(gen_e2e), 2),
                       "end_to_end_tokens_per_s_runs": [_r(x, 2) for x in gen_e2e]},
          "_loop_tokens": loop_tokens, "_gen_tokens": gen_tokens}


# --------------------------------------------------------------------------------------------
# llama.cpp
def bench_llamacpp(gguf_path: str, prompt_ids, new_tokens: int, threads: int,
                   repeats: int) -> dict[str, Any]:
  try:
    import llama_cpp
  except Exception as e:  # ImportError, or a broken shared library
    return {"status": f"not installed ({type(e).__name__}: {e})"}
  n_ctx = max(len(p) for p in prompt_ids) + new_tokens + 8
  llm = llama_cpp.Llama(model_path=gguf_path, n_threads=threads, n_threads_batch=threads,
                        n_ctx=max(n_ctx, 256), n_batch=512, verbose=False)

  def run(ids, n):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t1 = time.perf_counter()
    toks = [tok]
    for _ in range(n - 1):
      llm.eval([tok])
      tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
      toks.append(tok)
    t2 = time.perf_counter()
    return toks, t1 - t0, t2 - t1

  run(prompt_ids[0], min(4, new_tokens))  # warm-up
  tps, prefill, tokens = [], [], []
  for ids in prompt_ids:
    for r in range(repeats):
      toks, pre_s, dec_s = run(ids, new_tokens)
      tps.append((new_tokens - 1) / dec_s)
      prefill.append(1000 * pre_s)
      if r == 0:
        tokens.append(toks)
  del llm
  return {"status": "ok", "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
          "threads": threads, "weights": "GGUF as stored (Q4_1 kernels)",
          "decode_tokens_per_s": _r(_median(tps), 2),
          "decode_tokens_per_s_runs": [_r(x, 2) for x in tps],
          "prefill_ms": _r(_median(prefill), 2), "_tokens": tokens}


# --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="output directory (decode_throughput.json)")
  p.add_argument("--model", default="smollm2",
                 help="'smollm2' (the bundled GGUF), a .gguf path, or a preset name for a "
                      "random model (e.g. tiny_llama)")
  p.add_argument("--new_tokens", type=int, default=64, help="tokens generated per prompt")
  p.add_argument("--prompts", type=int, default=3, help="first N AlpacaEval instructions")
  p.add_argument("--repeats", type=int, default=2, help="timed runs per prompt (after warm-up)")
  p.add_argument("--dtypes", default="float32,bfloat16", help="our compute/param dtypes")
  p.add_argument("--threads", type=int, default=2, help="threads for torch and llama.cpp")
  p.add_argument("--skip_torch", action="store_true")
  p.add_argument("--skip_llamacpp", action="store_true")
  p.add_argument("--bandwidth_mb", type=int, default=512, help="size of the copied array")
  p.add_argument("--forward_T", default="1,2,4,8,16", help="query lengths for forward_cost")
  p.add_argument("--forward_cache_len", type=int, default=256)
  p.add_argument("--forward_repeats", type=int, default=7)
  args = p.parse_args(argv)
  if args.new_tokens < 2:
    p.error("--new_tokens must be >= 2")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Run the benchmark; write and print ``<out>/decode_throughput.json``; return the dict."""
  args = parse_args(argv)
  t_start = time.perf_counter()
  dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  result: dict[str, Any] = {
      "config": {"model": args.model, "new_tokens": args.new_tokens, "prompts": args.prompts,
                 "repeats": args.repeats, "batch": 1, "dtypes": dtypes, "threads": args.threads,
                 "greedy": True, "stop_tokens_honoured": False},
      "machine": machine_info(),
  }
  bw_start = measure_copy_bandwidth(args.bandwidth_mb, threads=args.threads)

  instructions = load_prompts(args.prompts)
  result["prompts"] = [s[:80] for s in instructions]
  ours: dict[str, Any] = {}
  tokens_by_dtype: dict[str, list[list[int]]] = {}
  gguf_path, stop_ids, prompt_ids, forward_cost = None, [], None, {}
  for dtype in dtypes:
    t0 = time.perf_counter()
    cfg, model, gguf_path = load_ours(args.model, dtype)
    load_s = time.perf_counter() - t0
    if prompt_ids is None:
      prompt_ids, stop_ids = encode_prompts(instructions, gguf_path, cfg.vocab_size)
    r = bench_ours(model, prompt_ids, args.new_tokens, args.repeats)
    tokens_by_dtype[dtype] = r.pop("_tokens")
    r["load_s"] = _r(load_s, 2)
    r["param_bytes"] = param_bytes(model)
    r["num_params"] = int(cfg.num_params())
    ours[dtype] = r
    if dtype == dtypes[0]:
      Ts = [int(t) for t in args.forward_T.split(",") if t.strip()]
      forward_cost = bench_forward_cost(model, Ts, args.forward_cache_len, args.forward_repeats)
      forward_cost["dtype"] = dtype
      # the decode loop's per-token time vs one jitted forward of one token (loop overhead)
      fwd1 = forward_cost["ms"].get("1")
      if fwd1:
        forward_cost["decode_loop_ms_per_token"] = _r(1000 / r["decode_tokens_per_s"], 3)
        forward_cost["single_forward_T1_tokens_per_s"] = _r(1000 / fwd1, 2)
    del model
  result["ours"] = ours
  result["forward_cost"] = forward_cost
  result["prompt_tokens"] = [len(p) for p in prompt_ids]
  result["stop_ids"] = stop_ids

  agreement: dict[str, Any] = {}
  if len(dtypes) > 1:
    a, b = tokens_by_dtype[dtypes[0]], tokens_by_dtype[dtypes[1]]
    agreement[f"ours_{dtypes[1]}_vs_ours_{dtypes[0]}_first_mismatch"] = [
        _first_mismatch(x, y) for x, y in zip(a, b)]

  ref_dtype = "float32" if "float32" in ours else dtypes[0]
  if args.skip_torch:
    result["transformers"] = {"status": "skipped (--skip_torch)"}
  elif gguf_path is None:
    result["transformers"] = {"status": "skipped (random model: no GGUF to load)"}
  else:
    try:
      tr = bench_transformers(gguf_path, prompt_ids, args.new_tokens, args.threads, args.repeats)
      loop_tokens, gen_tokens = tr.pop("_loop_tokens"), tr.pop("_gen_tokens")
      tr["status"] = "ok"
      result["transformers"] = tr
      ours_tok = tokens_by_dtype[ref_dtype]
      mm = [_first_mismatch(x, y) for x, y in zip(ours_tok, loop_tokens)]
      # generate(min_new_tokens=N) forbids EOS before N tokens: compare up to our first stop
      mg = [_first_mismatch(_until_stop(x, stop_ids), y[:len(_until_stop(x, stop_ids))])
            for x, y in zip(ours_tok, gen_tokens)]
      agreement[f"ours_{ref_dtype}_vs_transformers_loop_first_mismatch"] = mm
      agreement[f"ours_{ref_dtype}_vs_transformers_loop_identical"] = [m is None for m in mm]
      agreement[f"ours_{ref_dtype}_vs_transformers_generate_until_stop_identical"] = [
          m is None for m in mg]
      agreement["transformers_loop_vs_generate_until_stop_identical"] = [
          _first_mismatch(_until_stop(x, stop_ids), y[:len(_until_stop(x, stop_ids))]) is None
          for x, y in zip(loop_tokens, gen_tokens)]
      agreement["all_prompts_identical_ours_vs_transformers"] = all(m is None for m in mm)
    except Exception as e:  # record, do not crash the rest of the benchmark
      result["transformers"] = {"status": f"failed ({type(e).__name__}: {e})"}

  if args.skip_llamacpp:
    result["llamacpp"] = {"status": "skipped (--skip_llamacpp)"}
  elif gguf_path is None:
    result["llamacpp"] = {"status": "skipped (random model: no GGUF)"}
  else:
    try:
      lc = bench_llamacpp(gguf_path, prompt_ids, args.new_tokens, args.threads, args.repeats)
    except Exception as e:
      lc = {"status": f"failed ({type(e).__name__}: {e})"}
    if "_tokens" in lc:
      lt = lc.pop("_tokens")
      agreement[f"ours_{ref_dtype}_vs_llamacpp_first_mismatch (Q4_1 kernels, info only)"] = [
          _first_mismatch(x, y) for x, y in zip(tokens_by_dtype[ref_dtype], lt)]
    result["llamacpp"] = lc
  result["agreement"] = agreement

  bw_end = measure_copy_bandwidth(args.bandwidth_mb, threads=args.threads)
  bw = max(bw_start["copy_gb_per_s"], bw_end["copy_gb_per_s"])
  roof: dict[str, Any] = {"bandwidth_start": bw_start, "bandwidth_end": bw_end,
                          "copy_gb_per_s_used": bw,
                          "bytes_per_token_definition": "sum of all parameter bytes in the "
                          "dtype used (tied embedding counted once: it is the LM head)"}
  for dtype, r in ours.items():
    bpt = r["param_bytes"]
    tps = bw * 1e9 / bpt
    roof[dtype] = {"weight_bytes_per_token": bpt, "roofline_tokens_per_s": _r(tps, 2),
                   "ours_fraction_of_roofline": _r(r["decode_tokens_per_s"] / tps, 3),
                   "ours_effective_gb_per_s": _r(r["decode_tokens_per_s"] * bpt / 1e9, 2)}
  result["roofline"] = roof

  ratios: dict[str, Any] = {}
  tr = result.get("transformers", {})
  lc = result.get("llamacpp", {})
  for dtype, r in ours.items():
    x = r["decode_tokens_per_s"]
    d: dict[str, Any] = {"ours_over_roofline": roof[dtype]["ours_fraction_of_roofline"]}
    if tr.get("status") == "ok":
      d["ours_over_transformers_cached_loop"] = _r(x / tr["cached_loop"]["decode_tokens_per_s"])
      d["ours_over_transformers_generate"] = _r(x / tr["generate"]["decode_tokens_per_s"])
      d["ours_over_transformers_generate_end_to_end"] = _r(
          r["end_to_end_tokens_per_s"] / tr["generate"]["end_to_end_tokens_per_s"])
    if lc.get("status") == "ok":
      d["ours_over_llamacpp"] = _r(x / lc["decode_tokens_per_s"])
    ratios[dtype] = d
  result["ratios"] = ratios

  tgt_dtype = "float32" if "float32" in ratios else None
  targets: dict[str, Any] = {}
  if tgt_dtype:
    rr = ratios[tgt_dtype]
    targets["float32_ours_ge_1.0x_transformers_cached_loop"] = (
        None if "ours_over_transformers_cached_loop" not in rr
        else bool(rr["ours_over_transformers_cached_loop"] >= TARGET_VS_TORCH_LOOP))
    targets["float32_ours_ge_70pct_roofline"] = bool(rr["ours_over_roofline"] >= TARGET_VS_ROOFLINE)
  result["targets"] = targets
  result["wall_s"] = _r(time.perf_counter() - t_start, 1)

  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "decode_throughput.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))
  print(f"wrote {path}", file=sys.stderr)
  return result


if __name__ == "__main__":
  main()
