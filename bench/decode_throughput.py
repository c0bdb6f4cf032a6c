r"""Greedy decode throughput of our JAX decoder vs transformers, llama.cpp and the memory roofline.

Run (from the repository root)::

  python bench/decode_throughput.py --out=out/bench                      # everything, ~5-7 min on 2 cores
  python bench/decode_throughput.py --out=out/bench --skip_torch --skip_llamacpp
  python bench/decode_throughput.py --out=/tmp/b --model=tiny_llama --new_tokens=4 \
      --skip_torch --skip_llamacpp --bandwidth_mb=16                   # smoke test (random tiny model)

Everything is measured in one run, on the same model and the same chat prompts (the first
``--prompts`` AlpacaEval instructions of ``data/alpaca_eval/example_outputs.json``, encoded
with the GGUF's ChatML template), at batch 1, greedy, with exactly ``--new_tokens`` tokens
generated per prompt (stop tokens are not honoured, so every system does the same work):

* ``ours``: the engine (:class:`selforch_jax.runtime.engine.Engine` + the AR scheduler, the path
  every runtime decodes through) per compute dtype (float32, and bfloat16 with bfloat16
  parameters), compile excluded (``Engine.warm_up`` and one warm-up run per prompt first).
* ``host_overhead``: per batch-1 decode step, the scheduler-driven step minus the same jitted
  step called directly (allocation, metadata, mask, dispatch and sampling on the host).
* ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name,
  torch_dtype=float32)`` (the same GGUF dequantised to float32), ``torch.set_num_threads`` =
  ``--threads``; (a) ``generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`` and
  (b) a hand-written KV-cached greedy loop under ``torch.inference_mode``.
* ``llamacpp``: ``llama_cpp.Llama`` on the same GGUF (its own Q4_1 kernels), ``n_threads`` =
  ``--threads``, greedy (``Llama.generate(top_k=1, temp=0, repeat_penalty=1)``).
* ``roofline``: the copy bandwidth measured here divided by the bytes of all parameters (a
  decode step at batch 1 reads every weight once, the tied embedding included as the LM head).
* ``forward_cost``: one jitted forward of T = 1, 2, 4, ... query tokens against a KV cache of
  fixed length, relative to T = 1 (what parallel decoding pays for several tokens per step).

Every system is loaded and warmed up first; then ``--repeats`` timed rounds each run every prompt
on every system in turn (transformers after the first round only within ``--torch_budget_s``),
so that load from other processes on a shared machine hits all systems alike. Reported speeds
are medians over the runs (``*_best`` is the fastest run). Writes ``<out>/decode_throughput.json``
and prints it. See ``bench/README.md`` for the meaning of every field.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a plain script from anywhere
  sys.path.insert(0, REPO_ROOT)
from bench.common import loadavg, machine_info, write_result  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from selforch_jax.models.transformer import Transformer  # noqa: E402
from selforch_jax.runtime.engine import Engine  # noqa: E402
from selforch_jax.runtime.sampling import SamplingParams  # noqa: E402
from selforch_jax.runtime.scheduler import run  # noqa: E402
from selforch_jax.runtime.schedulers.ar import ARScheduler  # noqa: E402

ALPACA_EVAL = os.path.join(REPO_ROOT, "data", "alpaca_eval", "example_outputs.json")
TARGET_VS_TORCH_LOOP = 1.0   # ours >= 1.0x the transformers cached loop (float32)
TARGET_VS_ROOFLINE = 0.75    # ours >= 75% of the memory roofline (float32)


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


def with_layer_loop(model, loop: str):
  """A copy of ``model`` (same weights) whose config runs the layers with ``loop``."""
  new = Transformer(model.cfg.replace(layer_loop=loop), rngs=nnx.Rngs(params=0))
  nnx.update(new, nnx.state(model))
  return new


def param_bytes(model) -> int:
  state = nnx.state(model, nnx.Param)
  return int(sum(x.nbytes for x in jax.tree_util.tree_leaves(state)))


# --------------------------------------------------------------------------------------------
# the systems; each one is loaded and warmed up first, then timed in interleaved rounds
def _summary(tps: list[float], prefill_ms: list[float]) -> dict[str, Any]:
  return {"decode_tokens_per_s": _r(_median(tps), 2),
          "decode_tokens_per_s_best": _r(max(tps), 2) if tps else None,
          "decode_tokens_per_s_runs": [_r(x, 2) for x in tps],
          "prefill_ms": _r(_median(prefill_ms), 2)}


class _TimedAR(ARScheduler):
  """The AR scheduler, recording the wall time after every step's sampling (host sync)."""

  def on_step(self, plan, result):
    super().on_step(plan, result)
    self.stamps.append(time.perf_counter())


class EngineRunner:
  """Our engine + AR scheduler at batch 1 (stop tokens ignored: exactly N tokens per prompt).

  One :class:`~selforch_jax.runtime.engine.Engine` with room for the longest prompt plus N new
  tokens; every step size and key window is compiled first (``Engine.warm_up``); each timed run
  resets the pool and decodes one prompt. Prefill ms = the first step (prompt forward + first
  token); decode tokens/s = (N - 1) / the time of the remaining steps.
  """

  def __init__(self, model, prompt_ids, new_tokens: int, page_size: int = 16):
    self.prompt_ids, self.n = prompt_ids, new_tokens
    longest = max(len(p) for p in prompt_ids) + new_tokens
    t0 = time.perf_counter()
    self.engine = Engine(model, num_pages=-(-longest // page_size) + 1, page_size=page_size,
                         attention="reference")
    self.engine.warm_up([1] + [len(p) for p in prompt_ids])
    self.compile_s = time.perf_counter() - t0
    self.tps, self.prefill, self.e2e, self.tokens = [], [], [], []
    self.step_ms: list[float] = []
    for ids in prompt_ids:  # warm-up run per prompt (sampler programs, first-call costs)
      self.tokens.append(self._decode(ids)[0])

  def _decode(self, ids):
    self.engine.reset()
    sched = _TimedAR([ids], self.n, SamplingParams(), stop_ids=())
    sched.stamps = []
    t0 = time.perf_counter()
    run(self.engine, sched)
    return [int(t) for t in sched.results[0].token_ids], t0, sched.stamps

  def run(self, i: int) -> None:
    toks, t0, stamps = self._decode(self.prompt_ids[i])
    assert len(toks) == self.n and len(stamps) == self.n, (len(toks), len(stamps))
    pre_s, dec_s = stamps[0] - t0, stamps[-1] - stamps[0]
    self.tps.append((self.n - 1) / dec_s)
    self.prefill.append(1000 * pre_s)
    self.e2e.append(self.n / (stamps[-1] - t0))
    self.step_ms.extend(1000 * (b - a) for a, b in zip(stamps[1:-1], stamps[2:]))

  def summary(self) -> dict[str, Any]:
    out = _summary(self.tps, self.prefill)
    out["end_to_end_tokens_per_s"] = _r(_median(self.e2e), 2)
    out["compile_s_total"] = _r(self.compile_s, 2)
    out["decode_step_ms_median"] = _r(_median(self.step_ms), 3)
    return out


def host_overhead(engine_runner: EngineRunner, repeats: int = 30) -> dict[str, Any]:
  """Host work per batch-1 decode step: the scheduler-driven step's wall time minus the same
  jitted step program called directly with prebuilt device inputs (mask, slots, tokens).

  Both run the same program over the same key window at the same pool state; the difference is
  allocation, metadata recording, mask building, dispatch and sampling on the host.
  """
  eng = engine_runner.engine
  ids = engine_runner.prompt_ids[0]
  eng.reset()
  sched = _TimedAR([ids], engine_runner.n, SamplingParams(), stop_ids=())
  sched.stamps = []
  run(eng, sched)
  sched_ms = [1000 * (b - a) for a, b in zip(sched.stamps[1:-1], sched.stamps[2:])]
  # the same decode step (1 query at the end of the sequence) through Engine.step directly
  n = len(ids) + engine_runner.n - 1
  mask = np.zeros((1, eng.num_slots), bool)
  mask[0, :n] = True
  args = (np.zeros(1, np.int32), np.full(1, n - 1, np.int32), np.full(1, n - 1, np.int32), mask)
  jax.block_until_ready(eng.step(*args))
  direct = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(eng.step(*args))
    direct.append(1000 * (time.perf_counter() - t0))
  s, d = _median(sched_ms), _median(direct)
  return {"scheduler_step_ms": _r(s, 3), "direct_step_ms": _r(d, 3),
          "host_overhead_ms": _r(s - d, 3), "host_overhead_fraction": _r((s - d) / s, 3),
          "target_fraction_le": 0.10, "definition": host_overhead.__doc__.split("\n\n")[0]}


class TorchRunner:
  """transformers on the GGUF dequantised to float32: generate() and a hand-written loop."""

  def __init__(self, gguf_path: str, prompt_ids, new_tokens: int, threads: int):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    self.torch, self.prompt_ids, self.n = torch, prompt_ids, new_tokens
    t0 = time.perf_counter()
    self.model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        torch_dtype=torch.float32)
    self.model.eval()
    self.info = {"transformers": transformers.__version__, "torch": torch.__version__,
                 "threads": threads, "load_s": _r(time.perf_counter() - t0, 2),
                 "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
                 "param_bytes": int(sum(p.numel() * p.element_size()
                                        for p in self.model.parameters()))}
    eos = self.model.generation_config.eos_token_id
    pad = self.model.generation_config.pad_token_id
    self.pad = pad if pad is not None else (eos if isinstance(eos, int) else (eos or [0])[0])
    self.loop_tps, self.loop_prefill, self.gen_e2e, self.gen_dec = [], [], [], []
    self.loop1_tps, self.loop1_prefill = [], []
    self.seconds = 0.0  # time spent in timed runs (the --torch_budget_s check)
    self.loop_tokens: dict[int, list[int]] = {}
    self.gen_tokens: dict[int, list[int]] = {}
    self._loop(prompt_ids[0], min(4, new_tokens))  # warm-up
    self._generate(prompt_ids[0], min(4, new_tokens))

  def _loop(self, ids, n):
    torch = self.torch
    with torch.inference_mode():
      x = torch.tensor([ids], dtype=torch.long)
      t0 = time.perf_counter()
      out = self.model(input_ids=x, use_cache=True)
      past = out.past_key_values
      tok = int(out.logits[0, -1].argmax())
      t1 = time.perf_counter()
      toks = [tok]
      for _ in range(n - 1):
        out = self.model(input_ids=torch.tensor([[tok]], dtype=torch.long), past_key_values=past,
                         use_cache=True)
        past = out.past_key_values
        tok = int(out.logits[0, -1].argmax())
        toks.append(tok)
      t2 = time.perf_counter()
    return toks, t1 - t0, t2 - t1

  def _generate(self, ids, n):
    torch = self.torch
    with torch.inference_mode():
      x = torch.tensor([ids], dtype=torch.long)
      t0 = time.perf_counter()
      out = self.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                max_new_tokens=n, min_new_tokens=n, pad_token_id=self.pad)
      t = time.perf_counter() - t0
    return [int(v) for v in out[0, x.shape[1]:].tolist()], t

  def run(self, i: int) -> None:
    t0 = time.perf_counter()
    toks, pre_s, dec_s = self._loop(self.prompt_ids[i], self.n)
    self.loop_tps.append((self.n - 1) / dec_s)
    self.loop_prefill.append(1000 * pre_s)
    self.loop_tokens.setdefault(i, toks)
    # generate(): N tokens, and 1 token (prefill + first token) right before, so the decode
    # rate (N - 1) / (t_N - t_1) excludes the prefill under the same machine conditions
    _, t1 = self._generate(self.prompt_ids[i], 1)
    toks, t = self._generate(self.prompt_ids[i], self.n)
    self.gen_e2e.append(self.n / t)
    self.gen_dec.append((self.n - 1) / max(t - t1, 1e-9))
    self.gen_tokens.setdefault(i, toks)
    self.seconds += time.perf_counter() - t0

  def run_loop_1thread(self, i: int) -> None:
    """The cached loop with one torch thread (shows how much thread contention costs)."""
    t0 = time.perf_counter()
    self.torch.set_num_threads(1)
    try:
      _, pre_s, dec_s = self._loop(self.prompt_ids[i], self.n)
    finally:
      self.torch.set_num_threads(self.info["threads"])
      self.seconds += time.perf_counter() - t0
    self.loop1_tps.append((self.n - 1) / dec_s)
    self.loop1_prefill.append(1000 * pre_s)

  def summary(self) -> dict[str, Any]:
    gen = {"decode_tokens_per_s": _r(_median(self.gen_dec), 2),
           "decode_tokens_per_s_best": _r(max(self.gen_dec), 2),
           "decode_tokens_per_s_runs": [_r(x, 2) for x in self.gen_dec],
           "end_to_end_tokens_per_s": _r(_median(self.gen_e2e), 2),
           "end_to_end_tokens_per_s_runs": [_r(x, 2) for x in self.gen_e2e]}
    out = {**self.info, "status": "ok", "cached_loop": _summary(self.loop_tps, self.loop_prefill),
           "generate": gen}
    if self.loop1_tps:
      out["cached_loop_1thread"] = _summary(self.loop1_tps, self.loop1_prefill)
    return out


_LLAMACPP_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=1, n_ctx=64, verbose=False)
llm.eval([1, 2, 3])
"""


def probe_llamacpp(gguf_path: str) -> str | None:
  """Load the GGUF in llama.cpp and decode 3 tokens in a child process (a llama.cpp build that
  crashes in native code would take this whole benchmark down); None if it works, else why."""
  try:
    r = subprocess.run([sys.executable, "-c", _LLAMACPP_PROBE, gguf_path], capture_output=True,
                       text=True, timeout=120)
  except subprocess.TimeoutExpired:
    return "llama.cpp probe timed out"
  if r.returncode == 0:
    return None
  if "ModuleNotFoundError" in r.stderr:
    raise ImportError("llama_cpp")
  return f"llama.cpp crashed in a probe decode (exit {r.returncode}): {r.stderr.strip()[-200:]}"


class LlamaCppRunner:
  """llama.cpp (llama-cpp-python) on the GGUF as stored, greedy through ``Llama.generate``."""

  def __init__(self, gguf_path: str, prompt_ids, new_tokens: int, threads: int):
    import llama_cpp  # ImportError when llama-cpp-python is not installed
    self.prompt_ids, self.n = prompt_ids, new_tokens
    n_ctx = max(256, max(len(p) for p in prompt_ids) + new_tokens + 8)
    self.llm = llama_cpp.Llama(model_path=gguf_path, n_threads=threads, n_threads_batch=threads,
                               n_ctx=n_ctx, n_batch=512, verbose=False)
    self.info = {"llama_cpp_python": getattr(llama_cpp, "__version__", "?"), "threads": threads,
                 "weights": "the GGUF as stored (llama.cpp's Q4_1 kernels)"}
    self.tps, self.prefill = [], []
    self.tokens: dict[int, list[int]] = {}
    self._run(prompt_ids[0], min(4, new_tokens))  # warm-up

  def _run(self, ids, n):
    # Llama.generate with top_k=1 is greedy (argmax); repeat_penalty=1 disables the penalty
    gen = self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                            reset=True)
    t0 = time.perf_counter()
    toks = [int(next(gen))]  # prefill + the first token
    t1 = time.perf_counter()
    for _ in range(n - 1):
      toks.append(int(next(gen)))
    t2 = time.perf_counter()
    gen.close()
    return toks, t1 - t0, t2 - t1

  def run(self, i: int) -> None:
    toks, pre_s, dec_s = self._run(self.prompt_ids[i], self.n)
    self.tps.append((self.n - 1) / dec_s)
    self.prefill.append(1000 * pre_s)
    self.tokens.setdefault(i, toks)

  def summary(self) -> dict[str, Any]:
    return {**self.info, "status": "ok", **_summary(self.tps, self.prefill)}


def bench_forward_cost(model, Ts: Sequence[int], cache_len: int, repeats: int) -> dict[str, Any]:
  """Median wall time of one jitted forward of T query tokens against a KV cache.

  The cache has ``cache_len`` slots; the T tokens are written at slot ``cache_len // 2`` and
  each query sees the slots up to its own (causal), so every T runs against the same cache.
  All T are compiled first, then timed in interleaved rounds (fair under a noisy machine).
  """
  from selforch_jax.models.transformer import KVCache
  graphdef, state = nnx.split(model)
  cfg = model.cfg

  def fwd(state, tokens, positions, mask, cache, cache_index):
    return nnx.merge(graphdef, state)(tokens, positions, mask, cache, cache_index)

  jfwd = jax.jit(fwd, donate_argnums=(4,))
  start = cache_len // 2
  ci = jnp.int32(start)
  inputs, times = {}, {}
  for T in Ts:
    if start + T > cache_len:
      continue
    tokens = jnp.ones((1, T), jnp.int32)
    positions = (start + jnp.arange(T, dtype=jnp.int32))[None]
    mask = (jnp.arange(cache_len)[None, :] <= (start + jnp.arange(T))[:, None])[None]
    logits, cache = jfwd(state, tokens, positions, mask, KVCache.zeros(cfg, 1, cache_len), ci)
    jax.block_until_ready(logits)  # compile + warm-up
    inputs[T], times[T] = [tokens, positions, mask, cache], []
  for _ in range(repeats):
    for T, a in inputs.items():
      t0 = time.perf_counter()
      logits, a[3] = jfwd(state, a[0], a[1], a[2], a[3], ci)
      jax.block_until_ready((logits, a[3]))
      times[T].append(time.perf_counter() - t0)
  ms = {str(T): _r(1000 * _median(v), 3) for T, v in times.items()}
  base = ms.get("1")
  return {"dtype": cfg.dtype, "cache_len": cache_len, "cache_index": start, "repeats": repeats,
          "ms": ms, "relative_to_T1": {k: _r(v / base, 3) for k, v in ms.items()} if base else {},
          "tokens_per_s_at_T": {k: _r(int(k) / (v / 1000), 1) for k, v in ms.items()}}


# --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="output directory (decode_throughput.json)")
  p.add_argument("--model", default="smollm2",
                 help="'smollm2' (the bundled GGUF), a .gguf path, or a model preset name for a "
                      "random model (e.g. tiny_llama; no tokenizer, torch or llama.cpp then)")
  p.add_argument("--new_tokens", type=int, default=64, help="tokens generated per prompt")
  p.add_argument("--prompts", type=int, default=3, help="first N AlpacaEval instructions")
  p.add_argument("--repeats", type=int, default=2,
                 help="timed rounds (every prompt, every system) after the warm-up")
  p.add_argument("--torch_budget_s", type=float, default=120.0,
                 help="transformers runs in the first round, and in later rounds only while its "
                      "timed runs so far took less than this (it is slow on a loaded machine)")
  p.add_argument("--dtypes", default="float32,bfloat16", help="our compute (= param) dtypes")
  p.add_argument("--threads", type=int, default=2, help="threads for torch and llama.cpp")
  p.add_argument("--no_1thread", action="store_true",
                 help="skip the extra single-thread runs of transformers' loop and llama.cpp")
  p.add_argument("--layer_loops", default="scan,unroll",
                 help="layer loops timed for the first dtype (ModelConfig.layer_loop), side by side")
  p.add_argument("--skip_torch", action="store_true")
  p.add_argument("--skip_llamacpp", action="store_true")
  p.add_argument("--bandwidth_mb", type=int, default=512, help="size of the copied array")
  p.add_argument("--forward_T", default="1,2,4,8,16", help="query lengths for forward_cost")
  p.add_argument("--forward_cache_len", type=int, default=256)
  p.add_argument("--forward_repeats", type=int, default=5)
  args = p.parse_args(argv)
  if args.new_tokens < 2:
    p.error("--new_tokens must be >= 2 (tokens/s is measured over the tokens after the first)")
  if args.prompts < 1 or args.repeats < 1:
    p.error("--prompts and --repeats must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Run the benchmark; write and print ``<out>/decode_throughput.json``; return the dict."""
  args = parse_args(argv)
  t_start = time.perf_counter()
  dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  result: dict[str, Any] = {
      "config": {"model": args.model, "new_tokens": args.new_tokens, "prompts": args.prompts,
                 "repeats": args.repeats, "torch_budget_s": args.torch_budget_s, "batch": 1,
                 "dtypes": dtypes, "threads": args.threads, "greedy": True,
                 "stop_tokens_honoured": False},
      "machine": machine_info(("flax",)),
  }
  bw_start = measure_copy_bandwidth(args.bandwidth_mb, threads=args.threads)
  result["machine"]["loadavg_start"] = loadavg()

  instructions = load_prompts(args.prompts)
  result["prompts"] = [s[:80] for s in instructions]

  # ---- load + warm up every system ------------------------------------------------------
  ours: dict[str, EngineRunner] = {}
  other_loops: dict[str, EngineRunner] = {}
  ours_info: dict[str, dict[str, Any]] = {}
  gguf_path, stop_ids, prompt_ids, forward_cost = None, [], None, {}
  for dtype in dtypes:
    t0 = time.perf_counter()
    cfg, model, gguf_path = load_ours(args.model, dtype)
    load_s = time.perf_counter() - t0
    if prompt_ids is None:
      prompt_ids, stop_ids = encode_prompts(instructions, gguf_path, cfg.vocab_size)
    ours[dtype] = EngineRunner(model, prompt_ids, args.new_tokens)
    if dtype == dtypes[0]:
      for loop in [l.strip() for l in args.layer_loops.split(",") if l.strip()]:
        if loop != cfg.resolved_layer_loop(decode=True):
          other_loops[loop] = EngineRunner(with_layer_loop(model, loop), prompt_ids,
                                           args.new_tokens)
    ours_info[dtype] = {"load_s": _r(load_s, 2), "param_bytes": param_bytes(model),
                        "layer_loop": cfg.resolved_layer_loop(decode=True),
                        "num_params": int(cfg.num_params())}
    if dtype == dtypes[0]:
      Ts = [int(t) for t in args.forward_T.split(",") if t.strip()]
      forward_cost = bench_forward_cost(model, Ts, args.forward_cache_len, args.forward_repeats)
    del model
  result["prompt_tokens"] = [len(p) for p in prompt_ids]
  result["stop_ids"] = stop_ids

  torch_runner = llama_runner = llama_runner1 = None
  if args.skip_torch:
    result["transformers"] = {"status": "skipped (--skip_torch)"}
  elif gguf_path is None:
    result["transformers"] = {"status": "skipped (random model: no GGUF to load)"}
  else:
    try:
      torch_runner = TorchRunner(gguf_path, prompt_ids, args.new_tokens, args.threads)
    except Exception as e:  # record, do not crash the rest of the benchmark
      result["transformers"] = {"status": f"failed ({type(e).__name__}: {e})"}
  if args.skip_llamacpp:
    result["llamacpp"] = {"status": "skipped (--skip_llamacpp)"}
  elif gguf_path is None:
    result["llamacpp"] = {"status": "skipped (random model: no GGUF)"}
  else:
    probe = probe_llamacpp(gguf_path)
    try:
      if probe is not None:
        raise RuntimeError(probe)
      llama_runner = LlamaCppRunner(gguf_path, prompt_ids, args.new_tokens, args.threads)
      if not args.no_1thread and args.threads != 1:
        llama_runner1 = LlamaCppRunner(gguf_path, prompt_ids, args.new_tokens, 1)
    except ImportError as e:
      result["llamacpp"] = {"status": f"not installed ({e}); pip install llama-cpp-python"}
    except Exception as e:
      result["llamacpp"] = {"status": f"failed ({type(e).__name__}: {e})"}

  # ---- timed rounds: every prompt, every system, interleaved -------------------------------
  for r in range(args.repeats):
    for i in range(len(prompt_ids)):
      for runner in ours.values():
        runner.run(i)
      for runner in other_loops.values():
        runner.run(i)
      if torch_runner is not None and (r == 0 or torch_runner.seconds < args.torch_budget_s):
        torch_runner.run(i)
        if not args.no_1thread and args.threads != 1:
          torch_runner.run_loop_1thread(i)
      if llama_runner is not None:
        llama_runner.run(i)
      if llama_runner1 is not None:
        llama_runner1.run(i)

  result["ours"] = {d: {**ours[d].summary(), **ours_info[d]} for d in dtypes}
  result["host_overhead"] = host_overhead(ours[dtypes[0]])
  d0 = dtypes[0]
  loops = {ours_info[d0]["layer_loop"]: result["ours"][d0]["decode_tokens_per_s"]}
  result["layer_loop"] = {"default": ours_info[d0]["layer_loop"],
                          "runs": {ours_info[d0]["layer_loop"]: {
                              "decode_tokens_per_s": loops[ours_info[d0]["layer_loop"]],
                              "compile_s_total": result["ours"][d0]["compile_s_total"]}}}
  for loop, runner in other_loops.items():
    sm = runner.summary()
    sm["tokens_identical_to_default"] = [a == b for a, b in zip(runner.tokens, ours[d0].tokens)]
    sm["over_default"] = _r(sm["decode_tokens_per_s"] / loops[ours_info[d0]["layer_loop"]])
    result["layer_loop"]["runs"][loop] = sm
  if forward_cost:
    fwd1 = forward_cost["ms"].get("1")
    x = result["ours"][dtypes[0]]["decode_tokens_per_s"]
    if fwd1 and x:
      # the decode loop's time per token vs one jitted single-token forward (loop overhead)
      forward_cost["decode_loop_ms_per_token"] = _r(1000 / x, 3)
      forward_cost["decode_loop_over_single_forward"] = _r(1000 / x / fwd1, 3)
  result["forward_cost"] = forward_cost
  if torch_runner is not None:
    result["transformers"] = torch_runner.summary()
  if llama_runner is not None:
    result["llamacpp"] = llama_runner.summary()
    if llama_runner1 is not None:
      result["llamacpp"]["1thread"] = llama_runner1.summary()

  # ---- agreement of greedy tokens ---------------------------------------------------------
  agreement: dict[str, Any] = {}
  ref = "float32" if "float32" in ours else dtypes[0]
  ref_tokens = ours[ref].tokens
  for d in dtypes:
    if d != ref:
      agreement[f"ours_{d}_vs_ours_{ref}_first_mismatch"] = [
          _first_mismatch(x, y) for x, y in zip(ours[d].tokens, ref_tokens)]
  if torch_runner is not None:
    loop = [torch_runner.loop_tokens[i] for i in range(len(prompt_ids))]
    gen = [torch_runner.gen_tokens[i] for i in range(len(prompt_ids))]
    mm = [_first_mismatch(x, y) for x, y in zip(ref_tokens, loop)]

    def until_stop_same(a, b):  # generate(min_new_tokens=N) bans EOS: compare up to a's stop
      a = _until_stop(a, stop_ids)
      return _first_mismatch(a, b[:len(a)]) is None

    agreement[f"ours_{ref}_vs_transformers_loop_first_mismatch"] = mm
    agreement[f"ours_{ref}_vs_transformers_loop_identical"] = [m is None for m in mm]
    agreement[f"ours_{ref}_vs_transformers_generate_identical_until_stop"] = [
        until_stop_same(x, y) for x, y in zip(ref_tokens, gen)]
    agreement["transformers_loop_vs_generate_identical_until_stop"] = [
        until_stop_same(x, y) for x, y in zip(loop, gen)]
    agreement["all_prompts_identical_ours_vs_transformers"] = all(m is None for m in mm)
  if llama_runner is not None:
    lt = [llama_runner.tokens[i] for i in range(len(prompt_ids))]
    agreement[f"ours_{ref}_vs_llamacpp_first_mismatch"] = [
        _first_mismatch(x, y) for x, y in zip(ref_tokens, lt)]
    agreement["llamacpp_note"] = ("llama.cpp multiplies Q4_1 weights with 8-bit-quantised "
                                  "activations, so its greedy tokens may differ (info only)")
  result["agreement"] = agreement

  # ---- roofline ---------------------------------------------------------------------------
  bw_end = measure_copy_bandwidth(args.bandwidth_mb, threads=args.threads)
  result["machine"]["loadavg_end"] = loadavg()
  bw = max(bw_start["copy_gb_per_s"], bw_end["copy_gb_per_s"])
  roof: dict[str, Any] = {
      "bandwidth_start": bw_start, "bandwidth_end": bw_end, "copy_gb_per_s_used": bw,
      "bytes_per_token_definition": "sum of all parameter bytes in the dtype used (the tied "
                                    "embedding counted once: the LM head reads all of it)"}
  for d in dtypes:
    o = result["ours"][d]
    bpt = o["param_bytes"]
    tps = bw * 1e9 / bpt
    roof[d] = {"weight_bytes_per_token": bpt, "roofline_tokens_per_s": _r(tps, 2),
               "ours_fraction_of_roofline": _r(o["decode_tokens_per_s"] / tps, 3),
               "ours_best_fraction_of_roofline": _r(o["decode_tokens_per_s_best"] / tps, 3),
               "ours_effective_gb_per_s": _r(o["decode_tokens_per_s"] * bpt / 1e9, 2)}
  result["roofline"] = roof

  # ---- ratios (of medians) and targets ----------------------------------------------------
  tr, lc = result["transformers"], result["llamacpp"]
  ratios: dict[str, Any] = {}
  for d in dtypes:
    o = result["ours"][d]
    x = o["decode_tokens_per_s"]
    rr: dict[str, Any] = {"ours_over_roofline": roof[d]["ours_fraction_of_roofline"]}
    if tr.get("status") == "ok":
      rr["ours_over_transformers_cached_loop"] = _r(x / tr["cached_loop"]["decode_tokens_per_s"])
      rr["ours_best_over_transformers_cached_loop_best"] = _r(
          o["decode_tokens_per_s_best"] / tr["cached_loop"]["decode_tokens_per_s_best"])
      rr["ours_over_transformers_generate"] = _r(x / tr["generate"]["decode_tokens_per_s"])
      rr["ours_over_transformers_generate_end_to_end"] = _r(
          o["end_to_end_tokens_per_s"] / tr["generate"]["end_to_end_tokens_per_s"])
    if tr.get("cached_loop_1thread"):
      rr["ours_over_transformers_cached_loop_1thread"] = _r(
          x / tr["cached_loop_1thread"]["decode_tokens_per_s"])
    if lc.get("status") == "ok":
      rr["ours_over_llamacpp"] = _r(x / lc["decode_tokens_per_s"])
      if lc.get("1thread"):
        rr["ours_over_llamacpp_1thread"] = _r(x / lc["1thread"]["decode_tokens_per_s"])
      rr["ours_best_over_llamacpp_best"] = _r(
          o["decode_tokens_per_s_best"] / lc["decode_tokens_per_s_best"])
    ratios[d] = rr
  result["ratios"] = ratios
  targets: dict[str, Any] = {}
  if "float32" in ratios:
    rr = ratios["float32"]
    loop = rr.get("ours_over_transformers_cached_loop")
    targets["float32_ours_ge_1.0x_transformers_cached_loop"] = (
        None if loop is None else bool(loop >= TARGET_VS_TORCH_LOOP))
    targets["float32_ours_ge_75pct_roofline"] = bool(rr["ours_over_roofline"] >= TARGET_VS_ROOFLINE)
    targets["host_overhead_le_10pct_of_step"] = bool(
        result["host_overhead"]["host_overhead_fraction"] <= 0.10)
  result["targets"] = targets
  result["wall_s"] = _r(time.perf_counter() - t_start, 1)

  write_result(result, args.out, "decode_throughput.json")
  return result


if __name__ == "__main__":
  main()
