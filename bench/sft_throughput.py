r"""SFT train-step throughput of our JAX trainer vs a hand-written PyTorch/transformers loop.

Run (from the repository root)::

  python bench/sft_throughput.py --out=out/bench                    # LoRA r=8, ~2 min on 2 idle cores
  python bench/sft_throughput.py --out=out/bench --lora_rank=0      # full fine-tuning
  python bench/sft_throughput.py --out=/tmp/b --model=tiny_smollm2 --skip_torch --steps=1 \
      --seq_len=64 --batch_size=2                                   # smoke test (random tiny model)
  python bench/sft_throughput.py --out=/tmp/b --breakdown           # + where our step time goes

Both frameworks are measured in the same run, on the same model (SmolLM2-135M-Instruct from the
bundled GGUF, dequantised to float32, float32 compute), the same GSM8K batches and the same
optimiser (clip-by-global-norm 1.0 then AdamW, constant learning rate, no weight decay):

* batches: ``selforch_jax.data.pipeline.make_dataset`` with ``packing=False`` (one example per
  row, right-padded to ``--seq_len``; the fair and simple choice, so that the torch model needs
  no block-diagonal mask). The first ``warmup + steps`` batches are drawn once and fed to both.
* ``ours``: :class:`selforch_jax.trainers.sft.SFTTrainer` (one jitted, donated train step on a
  1-device mesh), ``.train_step(numpy_batch)``; the first ``--warmup`` steps (compile) are not
  timed. A step's time includes the host->device copy of the batch and the host read of the
  metrics (the call is synchronous).
* ``torch``: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, torch_dtype=float32)``
  (for a random preset: our weights exported with ``export_hf``), ``torch.set_num_threads``
  (``--threads``), a hand-written loop: forward (``input_ids``, ``position_ids``; rows are
  right-padded, so the causal mask alone is exact for every loss token), our masked CE (sum over
  ``loss_mask`` / count, computed in float32 over the full vocabulary), ``backward``,
  ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW``. LoRA: ``peft`` (r, alpha, the same seven
  target projections, dropout 0) when importable, else a hand-written LoRA wrapper; either way
  the adapters' A matrices are copied from ours (B starts at zero in both), so the two runs
  train the same function from the same point. ``torch_other_threads``: the same loop again
  (fresh model) with each of ``--torch_extra_threads`` (default 1 thread): on a shared 2-core
  machine two OpenMP threads stall whenever the other core is busy, one thread does not.
* tokens: **non-padding tokens** of a batch (``segment_ids > 0``), the same count for both;
  ``tokens_per_s`` is the median over the timed steps of tokens / step time. ``all_tokens`` (B*T)
  and ``loss_tokens`` are reported too.
* ``agreement``: the first-step losses of both (same weights, same batch) and the largest
  per-step loss difference over all steps.
* ``breakdown_ours`` (``--breakdown``): median times of pieces of our step (forward loss only,
  forward+backward, the LM head + CE over the vocabulary alone, forward+backward with remat on);
  torch's forward / backward / clip+optimiser medians are always in ``torch``.

``--seq_len`` must be >= ~64: GSM8K chats need ~49+ tokens (SmolLM2's system prompt and the
question) before the first answer token, and rows without a loss token are skipped.

Writes ``<out>/sft_throughput.json`` and prints it. See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:  # run as a plain script from anywhere
  sys.path.insert(0, REPO_ROOT)
from bench.common import loadavg, machine_info, write_result  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

TARGET_RATIO = 1.0  # ours >= 1.0x torch tokens/s (reported, not asserted)
LOSS_TOL = 1e-3     # first-step losses should agree within this (nats)


# --------------------------------------------------------------------------------------------
# helpers
def _median(xs: Sequence[float]) -> float:
  return float(statistics.median(xs)) if xs else float("nan")


def _r(x: float | None, nd: int = 4):
  return None if x is None else round(float(x), nd)


def batch_token_counts(b: dict[str, np.ndarray]) -> dict[str, int]:
  return {"tokens": int((b["segment_ids"] > 0).sum()), "loss_tokens": int(b["loss_mask"].sum()),
          "all_tokens": int(b["tokens"].size)}


def summarize(times: list[float], counts: list[dict[str, int]]) -> dict[str, Any]:
  """Medians over the timed steps (times in seconds, counts per step)."""
  tps = [c["tokens"] / t for c, t in zip(counts, times)]
  all_tps = [c["all_tokens"] / t for c, t in zip(counts, times)]
  return {
      "tokens_per_s": _r(_median(tps), 2),
      "all_tokens_per_s": _r(_median(all_tps), 2),
      "step_s_median": _r(_median(times), 4),
      "step_s": [_r(t, 4) for t in times],
      "tokens_per_s_mean_of_total": _r(sum(c["tokens"] for c in counts) / sum(times), 2)
      if times else None,
  }


def sgemm_probe(m: int, k: int, n: int, threads: int, with_torch: bool,
                repeats: int = 10) -> dict[str, Any]:
  """float32 ``[m,k] @ [k,n]`` GFLOP/s of jax (jit) and torch (``threads`` and 1 thread), best
  of ``repeats``: how fast each framework's matmul is on this machine *right now* (the machine
  is shared; torch's OpenMP/MKL threads suffer more than XLA's pool when cores are contended)."""
  rng = np.random.default_rng(0)
  a = rng.standard_normal((m, k), np.float32)
  b = rng.standard_normal((k, n), np.float32)
  flop = 2.0 * m * k * n

  def best(fn):
    fn()
    ts = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      fn()
      ts.append(time.perf_counter() - t0)
    return _r(flop / min(ts) / 1e9, 1)

  ja, jb = jnp.asarray(a), jnp.asarray(b)
  f = jax.jit(jnp.matmul)
  out: dict[str, Any] = {"shape": [m, k, n],
                         "jax_gflops": best(lambda: f(ja, jb).block_until_ready())}
  if with_torch:
    import torch
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    out[f"torch_{threads}_threads_gflops"] = best(lambda: ta @ tb)
    torch.set_num_threads(1)
    out["torch_1_thread_gflops"] = best(lambda: ta @ tb)
    torch.set_num_threads(prev)
  return out


# --------------------------------------------------------------------------------------------
# model, tokenizer, data
def load_ours(model_name: str, seed: int = 0):
  """``(cfg, model, tokenizer, gguf_path_or_None)`` in float32."""
  from selforch_jax.checkpoints.assets import smollm2_gguf_path
  from selforch_jax.tokenizers import Tokenizer

  gguf = smollm2_gguf_path()
  tok = Tokenizer.from_gguf(gguf)
  if model_name == "smollm2_135m":
    from selforch_jax.checkpoints.gguf_import import load_gguf
    cfg, model, _ = load_gguf(gguf, param_dtype="float32", dtype="float32")
    return cfg, model, tok, gguf
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  cfg = get_preset(model_name, param_dtype="float32", dtype="float32")
  if cfg.vocab_size < tok.vocab_size:
    raise ValueError(f"preset {model_name!r} has vocab {cfg.vocab_size} < the SmolLM2 "
                     f"tokenizer's {tok.vocab_size}; use smollm2_135m or tiny_smollm2")
  return cfg, init_model(cfg, seed), tok, None


def data_config(args) -> dict[str, Any]:
  return dict(name="gsm8k", seq_len=args.seq_len, batch_size=args.batch_size, packing=False,
              shuffle=True, shuffle_seed=args.seed, num_epochs=1, num_threads=2,
              prefetch_buffer_size=16)


def draw_batches(args, tok, n: int) -> list[dict[str, np.ndarray]]:
  from selforch_jax.data.pipeline import make_dataset
  it = iter(make_dataset(data_config(args), tok, "train", args.seed))
  out = []
  for _ in range(n):
    try:
      out.append({k: np.array(v) for k, v in next(it).items()})
    except StopIteration:
      # examples whose assistant tokens are all cut by truncation are skipped; GSM8K's
      # shortest prompt (system + question) is ~49 tokens, so --seq_len < 50 yields nothing
      raise ValueError(
          f"GSM8K train gave only {len(out)} batches of {args.batch_size} rows at seq_len="
          f"{args.seq_len} (need {n}): rows must fit the prompt and >= 1 answer token; "
          "use --seq_len >= 64") from None
  return out


def optim_config(args):
  from selforch_jax.trainers.optim import optim_defaults
  oc = optim_defaults()
  oc.lr = args.lr
  oc.warmup_steps = 0
  oc.schedule = "constant"
  oc.weight_decay = 0.0
  oc.clip_norm = 1.0
  oc.grad_accum = 1
  return oc


# --------------------------------------------------------------------------------------------
# ours
def bench_ours(model, args, batches) -> tuple[dict[str, Any], Any]:
  from selforch_jax import sharding as shd
  from selforch_jax.trainers.sft import SFTTrainer

  mesh = shd.make_mesh(1, 1, 1) if jax.device_count() == 1 else shd.make_mesh()
  t0 = time.perf_counter()
  trainer = SFTTrainer(model, mesh, optim_config(args), len(batches), lora=args.lora_rank > 0)
  init_s = time.perf_counter() - t0
  times, losses, metrics = [], [], []
  for i, b in enumerate(batches):
    t0 = time.perf_counter()
    m = trainer.train_step(b)
    dt = time.perf_counter() - t0
    times.append(dt)
    losses.append(m["loss"])
    metrics.append(m)
  w = args.warmup
  counts = [batch_token_counts(b) for b in batches]
  res = summarize(times[w:], counts[w:])
  res.update({
      "first_step_s_incl_compile": _r(times[0], 3),
      "warmup_s": [_r(t, 3) for t in times[:w]],
      "trainer_init_s": _r(init_s, 3),
      "losses": [_r(x, 6) for x in losses],
      "grad_norms": [_r(m["grad_norm"], 5) for m in metrics],
      "trainable_params": int(sum(x.size for x in jax.tree.leaves(trainer.params))),
  })
  return res, trainer


def lora_a_matrices(model) -> dict[str, np.ndarray]:
  """The model's initial A adapters as ``{name: [L, in, r]}`` float32 numpy (multi-dim inputs
  flattened); read before training (the trainer donates and updates them)."""
  out = {}
  for k, v in model.layers.stacked().items():
    if k.endswith("_lora_a"):
      a = np.array(jax.device_get(v), np.float32)
      out[k[:-len("_lora_a")]] = a.reshape(a.shape[0], -1, a.shape[-1])
  return out


def breakdown_ours(model_cfg, trainer, batch, repeats: int) -> dict[str, Any]:
  """Median seconds of pieces of our train step, on a copy of the trainer's state."""
  from selforch_jax.data.masks import segment_mask
  from selforch_jax.trainers.loss import masked_loss_sum

  params, frozen = trainer.params, trainer.frozen
  b = trainer.put_batch(batch)

  def timeit(fn, *a):
    jax.block_until_ready(fn(*a))  # compile
    ts = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*a))
      ts.append(time.perf_counter() - t0)
    return _r(_median(ts), 4)

  def loss_with(graphdef):
    def f(p, fr, bt):
      s, n = masked_loss_sum(*_logits_targets(graphdef, p, fr, bt))
      return s / jnp.maximum(n, 1.0)
    return f

  def _logits_targets(graphdef, p, fr, bt):
    m = nnx.merge(graphdef, p, fr)
    logits, _ = m(bt["tokens"], bt["positions"], segment_mask(bt["segment_ids"]))
    return logits, bt["targets"], bt["loss_mask"]

  out: dict[str, Any] = {}
  g = trainer.graphdef
  out["forward_loss_s"] = timeit(jax.jit(loss_with(g)), params, frozen, b)
  out["forward_backward_s"] = timeit(jax.jit(jax.grad(loss_with(g))), params, frozen, b)

  # the LM head + CE alone, on the final hidden states (fwd, and fwd+bwd w.r.t. hidden)
  m = nnx.merge(g, params, frozen)
  hidden, _ = jax.jit(lambda mm, bt: mm(bt["tokens"], bt["positions"],
                                        segment_mask(bt["segment_ids"]), return_hidden=True))(m, b)
  emb = m.embed[...]

  def head_ce(h, e, bt):
    logits = jnp.einsum("btd,dv->btv", h, e.T, preferred_element_type=jnp.float32)
    s, n = masked_loss_sum(logits, bt["targets"], bt["loss_mask"])
    return s / jnp.maximum(n, 1.0)

  out["head_ce_forward_s"] = timeit(jax.jit(head_ce), hidden, emb, b)
  argnums = (0,) if model_cfg.lora_rank else (0, 1)
  out["head_ce_forward_backward_s"] = timeit(jax.jit(jax.grad(head_ce, argnums=argnums)),
                                             hidden, emb, b)

  # remat on: same params, graph of a model whose config has remat=True
  m_remat = nnx.merge(g, params, frozen)
  m_remat.cfg = m_remat.cfg.replace(remat=True)
  g_remat, p_r, f_r = nnx.split(m_remat, _trainable_filter(model_cfg), ...)
  out["forward_backward_remat_s"] = timeit(jax.jit(jax.grad(loss_with(g_remat))), p_r, f_r, b)
  return out


# --------------------------------------------------------------------------------------------
# experiment: LoRA term with a hand-written VJP (--ours_lora_vjp; patches this process only)
@jax.custom_vjp
def lora_delta(x2, a, b):
  """``(x2 @ a) @ b`` for ``x2 [N, in]``, ``a [in, r]``, ``b [r, out]``."""
  return (x2 @ a) @ b


def _lora_delta_fwd(x2, a, b):
  xa = x2 @ a
  return xa @ b, (x2, xa, a, b)


def _lora_delta_bwd(res, dy):
  # Autodiff's dB = xa^T dy makes XLA:CPU write the big [N, out] activation gradient (fused
  # with the SwiGLU / attention backward) in transposed layout for the dot. Transposing the
  # thin [N, r] operands ourselves, behind a barrier so the transposes are not folded back
  # into the dots, keeps every big operand in its natural layout.
  x2, xa, a, b = res
  dxa = dy @ b.T
  xa_t, dxa_t = jax.lax.optimization_barrier((xa.T, dxa.T))
  return dxa @ a.T, (dxa_t @ x2).T, xa_t @ dy


lora_delta.defvjp(_lora_delta_fwd, _lora_delta_bwd)


def proj_lora_vjp(x, p, name, eq, dtype, lora_scale):
  """Drop-in for ``models.transformer.proj`` whose LoRA term uses :func:`lora_delta`."""
  y = jnp.einsum(eq, x, p[name].astype(dtype))
  if f"{name}_lora_a" in p:
    a = p[f"{name}_lora_a"].astype(dtype)
    b = p[f"{name}_lora_b"].astype(dtype)
    d = lora_delta(x.reshape(x.shape[0] * x.shape[1], -1), a.reshape(-1, a.shape[-1]),
                   b.reshape(b.shape[0], -1))
    y = y + lora_scale * d.reshape(y.shape)
  return y


def _trainable_filter(cfg):
  from selforch_jax.trainers.sft import trainable_filter
  return trainable_filter(cfg.lora_rank > 0, False)


# --------------------------------------------------------------------------------------------
# torch
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _torch_lora_manual(model, rank: int, alpha: float, targets):
  """Freeze ``model`` and wrap each target ``nn.Linear`` with ``base(x) + s * B(A(x))``."""
  import torch

  class LoRALinear(torch.nn.Module):
    def __init__(self, base: torch.nn.Linear):
      super().__init__()
      self.base = base
      self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False)
      self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False)
      torch.nn.init.zeros_(self.lora_B.weight)
      self.scale = alpha / rank

    def forward(self, x):
      return self.base(x) + self.scale * self.lora_B(self.lora_A(x))

  for p in model.parameters():
    p.requires_grad_(False)
  for layer in model.model.layers:
    for parent in (layer.self_attn, layer.mlp):
      for name in targets:
        if hasattr(parent, name):
          setattr(parent, name, LoRALinear(getattr(parent, name)))
  return model


def _lora_A_modules(model, name: str) -> list:
  """The A ``nn.Linear`` of target ``name`` in every layer (peft or manual wrapper)."""
  out = []
  base = model.get_base_model() if hasattr(model, "get_base_model") else model
  for layer in base.model.layers:
    parent = layer.self_attn if hasattr(layer.self_attn, name) else layer.mlp
    mod = getattr(parent, name)
    a = mod.lora_A
    out.append(a["default"] if hasattr(a, "keys") else a)
  return out


def torch_model_loader(gguf_path: str | None, ours_model, ours_cfg) -> tuple[Callable, str]:
  """``(load, source)``: ``load()`` returns a fresh float32 transformers model of the same
  weights: the GGUF itself, or (random presets) our model exported once with ``export_hf``."""
  import torch
  from transformers import AutoModelForCausalLM

  if gguf_path is not None:
    return (lambda: AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        torch_dtype=torch.float32)), "gguf"
  from selforch_jax.checkpoints.safetensors_io import export_hf
  d = tempfile.mkdtemp(prefix="sft_bench_hf_")
  export_hf(ours_model, ours_cfg, d, dtype="float32")
  return (lambda: AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)), \
      "export_hf(ours)"


def bench_torch(args, torch_model, lora_a: dict[str, np.ndarray] | None,
                batches, threads: int) -> dict[str, Any]:
  import torch
  import torch.nn.functional as F

  torch.set_num_threads(threads)
  torch.manual_seed(args.seed)
  model = torch_model
  model.config.use_cache = False
  lora_impl = None
  if args.lora_rank > 0:
    alpha = args.lora_alpha
    use_peft = args.torch_lora in ("auto", "peft")
    if use_peft:
      try:
        import peft
      except ImportError:
        if args.torch_lora == "peft":
          raise
        use_peft = False
    if use_peft:
      lcfg = peft.LoraConfig(r=args.lora_rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                             target_modules=list(LORA_TARGETS))
      model = peft.get_peft_model(model, lcfg)
      lora_impl = f"peft {peft.__version__}"
    else:
      model = _torch_lora_manual(model, args.lora_rank, alpha, LORA_TARGETS)
      lora_impl = "manual (frozen base + A/B nn.Linear wrapper)"
    with torch.no_grad():  # A from ours: [L, in, r] -> torch Linear(in, r).weight [r, in]
      for name in LORA_TARGETS:
        for l, a_mod in enumerate(_lora_A_modules(model, name)):
          a_mod.weight.copy_(torch.from_numpy(lora_a[name][l].T.copy()))
  model.train()
  params = [p for p in model.parameters() if p.requires_grad]
  opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

  def to_t(b):
    return {k: torch.from_numpy(np.asarray(v, np.int64)) for k, v in b.items()}

  times, losses, gnorms, parts = [], [], [], []
  for b in batches:
    t0 = time.perf_counter()
    tb = to_t(b)
    logits = model(input_ids=tb["tokens"], position_ids=tb["positions"], use_cache=False).logits
    mask = tb["loss_mask"].to(torch.float32)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tb["targets"].reshape(-1),
                         reduction="none")
    n = mask.sum().clamp_min(1.0)
    loss = (ce * mask.reshape(-1)).sum() / n
    t1 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t2 = time.perf_counter()
    gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    lv = float(loss.detach())
    t3 = time.perf_counter()
    times.append(t3 - t0)
    parts.append((t1 - t0, t2 - t1, t3 - t2))
    losses.append(lv)
    gnorms.append(float(gn))
    del logits, ce, loss
  w = args.warmup
  counts = [batch_token_counts(b) for b in batches]
  res = summarize(times[w:], counts[w:])
  res.update({
      "first_step_s": _r(times[0], 3),
      "losses": [_r(x, 6) for x in losses],
      "grad_norms": [_r(x, 5) for x in gnorms],
      "trainable_params": int(sum(p.numel() for p in params)),
      "threads": threads,
      "lora_impl": lora_impl,
      "attention": "causal only (rows are right-padded single examples: exact for loss tokens); "
                   f"attn_implementation={getattr(model.config, '_attn_implementation', None)}",
      "forward_s_median": _r(_median([p[0] for p in parts[w:]]), 4),
      "backward_s_median": _r(_median([p[1] for p in parts[w:]]), 4),
      "clip_optimizer_s_median": _r(_median([p[2] for p in parts[w:]]), 4),
  })
  return res


# --------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, help="output directory (sft_throughput.json)")
  p.add_argument("--steps", type=int, default=4, help="timed train steps per framework")
  p.add_argument("--warmup", type=int, default=1, help="untimed first steps (compile)")
  p.add_argument("--batch_size", type=int, default=4)
  p.add_argument("--seq_len", type=int, default=256)
  p.add_argument("--lora_rank", type=int, default=8, help="0 = full fine-tuning")
  p.add_argument("--lora_alpha", type=float, default=None,
                 help="LoRA alpha (default 2 * rank, as configs/sft.py)")
  p.add_argument("--lr", type=float, default=None,
                 help="constant learning rate (default 2e-4 LoRA, 5e-5 full, as configs/sft.py)")
  p.add_argument("--model", default="smollm2_135m",
                 help="smollm2_135m (real GGUF weights) or a preset (e.g. tiny_smollm2, random)")
  p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
  p.add_argument("--torch_extra_threads", default="1",
                 help="comma list of further torch thread counts to time (fresh model, same "
                      "batches) next to --threads; '' = none")
  p.add_argument("--torch_lora", default="auto", choices=("auto", "peft", "manual"))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--skip_torch", action="store_true")
  p.add_argument("--breakdown", action="store_true",
                 help="also time pieces of our step (forward, backward, LM head + CE, remat)")
  p.add_argument("--breakdown_repeats", type=int, default=3)
  p.add_argument("--ours_lora_vjp", action="store_true",
                 help="experiment: run ours with proj_lora_vjp patched over "
                      "models.transformer.proj in this process (no file is changed)")
  a = p.parse_args(argv)
  if a.steps < 1 or a.warmup < 1:
    p.error("--steps and --warmup must be >= 1")
  if a.lora_alpha is None:
    a.lora_alpha = 2.0 * a.lora_rank if a.lora_rank else 16.0
  if a.lr is None:
    a.lr = 2e-4 if a.lora_rank else 5e-5
  return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Run the benchmark; write and print ``<out>/sft_throughput.json``; return the dict."""
  args = parse_args(argv)
  t_start = time.perf_counter()
  os.makedirs(args.out, exist_ok=True)
  n = args.warmup + args.steps
  result: dict[str, Any] = {
      "config": {
          "model": args.model, "dtype": "float32", "batch_size": args.batch_size,
          "seq_len": args.seq_len, "steps_timed": args.steps, "warmup_steps": args.warmup,
          "lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha if args.lora_rank else None,
          "lora_targets": list(LORA_TARGETS) if args.lora_rank else None,
          "optimizer": {"name": "clip_by_global_norm(1.0) + AdamW", "lr": args.lr,
                        "schedule": "constant", "betas": [0.9, 0.999], "eps": 1e-8,
                        "weight_decay": 0.0},
          "data": data_config(args),
          "tokens_definition": "non-padding tokens (segment_ids > 0) per batch, same for both",
          "timing": "median over the timed steps of tokens / wall time of one full train step "
                    "(batch to device, forward, backward, clip, AdamW, loss to host); "
                    "warmup (compile) steps excluded",
          "threads": args.threads,
          "ours_lora_vjp": bool(args.ours_lora_vjp),
      },
      "machine": machine_info(("flax", "optax", "torch", "transformers", "peft")) | {"torch_threads": args.threads},
  }

  t0 = time.perf_counter()
  cfg, model, tok, gguf_path = load_ours(args.model, args.seed)
  load_s = time.perf_counter() - t0
  probe_shape = (args.batch_size * args.seq_len, cfg.hidden_size, cfg.intermediate_size)
  result["machine"]["sgemm_probe_start"] = sgemm_probe(*probe_shape, args.threads,
                                                       not args.skip_torch)
  batches = draw_batches(args, tok, n)
  counts = [batch_token_counts(b) for b in batches]
  result["batches"] = {"tokens": [c["tokens"] for c in counts],
                       "loss_tokens": [c["loss_tokens"] for c in counts],
                       "all_tokens": counts[0]["all_tokens"]}

  torch_load, torch_source = None, None
  if not args.skip_torch:
    # export (random presets) before ours takes ownership of the model arrays
    torch_load, torch_source = torch_model_loader(gguf_path, model, cfg)

  if args.lora_rank > 0:
    from selforch_jax.models.transformer import add_lora
    model = add_lora(model, args.lora_rank, args.lora_alpha, seed=args.seed)
  model_cfg = model.cfg
  if args.ours_lora_vjp:
    from selforch_jax.models import transformer as T
    T.proj = proj_lora_vjp
  lora_a = lora_a_matrices(model) if args.lora_rank > 0 and not args.skip_torch else None
  ours, trainer = bench_ours(model, args, batches)
  ours["load_s"] = _r(load_s, 2)
  result["ours"] = ours
  if args.breakdown:
    result["breakdown_ours"] = breakdown_ours(model_cfg, trainer, batches[0],
                                              args.breakdown_repeats)
  del trainer, model

  if args.skip_torch:
    result["torch"] = {"status": "skipped (--skip_torch)"}
  else:
    def run_torch(threads):
      import torch
      torch.set_num_threads(threads)
      t0 = time.perf_counter()
      tm = torch_load()
      load_s = time.perf_counter() - t0
      tr = bench_torch(args, tm, lora_a, batches, threads)
      tr.update({"status": "ok", "source": torch_source, "load_s": _r(load_s, 2)})
      return tr

    result["torch"] = run_torch(args.threads)
    extra = {}
    for th in [int(x) for x in args.torch_extra_threads.split(",") if x.strip()]:
      tr = run_torch(th)
      extra[f"threads_{th}"] = {
          "tokens_per_s": tr["tokens_per_s"], "step_s_median": tr["step_s_median"],
          "step_s": tr["step_s"], "forward_s_median": tr["forward_s_median"],
          "backward_s_median": tr["backward_s_median"],
          "clip_optimizer_s_median": tr["clip_optimizer_s_median"],
          "first_step_loss": tr["losses"][0],
          "ratio_ours_over_this": _r(result["ours"]["tokens_per_s"] / tr["tokens_per_s"], 3),
          "max_abs_loss_diff_vs_ours": _r(max(abs(a - b) for a, b in
                                              zip(result["ours"]["losses"], tr["losses"])), 7)}
    result["torch_other_threads"] = extra

  o, t = result["ours"], result["torch"]
  ratio = None
  agreement: dict[str, Any] = {"ours_first_step_loss": o["losses"][0]}
  if t.get("status") == "ok":
    ratio = o["tokens_per_s"] / t["tokens_per_s"]
    diffs = [abs(a - b) for a, b in zip(o["losses"], t["losses"])]
    agreement.update({
        "torch_first_step_loss": t["losses"][0],
        "first_step_abs_diff": _r(diffs[0], 7),
        "first_step_within_tol": bool(diffs[0] <= LOSS_TOL),
        "tol": LOSS_TOL,
        "max_abs_diff_all_steps": _r(max(diffs), 7),
    })
  result["agreement"] = agreement
  result["tokens_per_s"] = {"ours": o["tokens_per_s"],
                            "torch": t.get("tokens_per_s"),
                            "ratio_ours_over_torch": _r(ratio, 3)}
  result["step_s_median"] = {"ours": o["step_s_median"], "torch": t.get("step_s_median")}
  result["target"] = {"ratio_ge": TARGET_RATIO,
                      "met": None if ratio is None else bool(ratio >= TARGET_RATIO)}
  result["machine"]["sgemm_probe_end"] = sgemm_probe(*probe_shape, args.threads,
                                                     not args.skip_torch)
  result["machine"]["loadavg_at_end"] = loadavg()
  result["wall_s"] = _r(time.perf_counter() - t_start, 1)

  write_result(result, args.out, "sft_throughput.json")
  return result


if __name__ == "__main__":
  main()
