r"""Planned Diffusion vs AR on the synthetic cities task (issue 21): exact-match accuracy per item
and per answer, critical path and wall-clock, with bootstrap 95% CIs and n.

Evaluation examples: :func:`selforch_jax.data.synthetic_cities.generate_split` with ``--seed``
(default 1000; the training records use seed 0), k = 2..6 cities. Every system decodes the same
chat prompts one at a time (batch 1), greedy, on one engine per system (one pool size, so compiled
steps are reused), after ``--warmup`` untimed answers of other examples; the systems alternate per
example, so both see the same machine load:

* ``pd``: the Planned Diffusion adapter (``--pd_adapter``) with the planned_diffusion runtime
  (``--steps_ratio``, ``--confidence``); its de-tagged logical text is scored;
* ``ar``: the AR-SFT adapter (``--ar_adapter``, trained on the same records with the tags
  stripped) with plain AR decoding; ``--ar_adapter=""`` skips it.

Per system: item accuracy (every city sentence verbatim in the answer), answer accuracy (all of
them), mean wall-clock per answer, mean critical path (sequential forwards after the prefill: AR
= generated tokens - 1; PD = plan / sync AR steps + denoising steps), mean generated tokens; vs AR
(paired over the same examples): accuracy differences, speedup = mean AR wall / mean PD wall,
critical-path ratio = mean PD path / mean AR path (bootstrap of the ratio of means). The machine's
load averages before and after are recorded (2 shared cores: other jobs slow every system).

Run:
  python bench/planned_diffusion.py --pd_adapter=adapters/pd_smollm2_135m \
      --ar_adapter=out/pd_ar/adapter --n=40 --out=bench/results/planned_diffusion_cities_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import loadavg, machine_info  # noqa: E402

PROMPT_TOKENS = 320   # longest cities prompt (k = 6) in chat form, with room to spare


def _ratio_ci(num: np.ndarray, den: np.ndarray, n_boot: int, seed: int) -> dict:
  """Paired percentile bootstrap of ``mean(num) / mean(den)``."""
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, num.size, (n_boot, num.size))
  r = num[idx].mean(1) / np.maximum(den[idx].mean(1), 1e-12)
  return dict(mean=float(num.mean() / max(den.mean(), 1e-12)), lo=float(np.quantile(r, 0.025)),
              hi=float(np.quantile(r, 0.975)), n=int(num.size))


class System:
  """One system's model, engine and scheduler options; :meth:`decode` answers one example."""

  def __init__(self, name: str, adapter: str, prompt_len: int, args):
    from selforch_jax.adapter import load_adapter
    from selforch_jax.lang import TagVocab
    from selforch_jax.runtime.build import make_engine
    from selforch_jax.runtime.generation import eos_ids
    from selforch_jax.runtime.sampling import SamplingParams

    self.name = name
    self.model, self.tok = load_adapter(adapter)
    self.runtime = "planned_diffusion" if name == "pd" else "ar"
    extra = dict(threads=2, extra_tokens=args.max_new_tokens + 16) if name == "pd" else {}
    self.engine = make_engine(self.model, [prompt_len], args.max_new_tokens, **extra)
    self.kw = dict(max_new_tokens=args.max_new_tokens, sampling=SamplingParams(),
                   stop_ids=eos_ids(self.tok))
    if name == "pd":
      self.kw.update(tag_vocab=TagVocab.from_tokenizer(self.tok), steps_ratio=args.steps_ratio,
                     confidence=args.confidence)

  def prompt(self, ex) -> list[int]:
    return self.tok.encode_chat([{"role": "user", "content": ex["prompt"]}],
                                add_generation_prompt=True)

  def decode(self, ex) -> dict:
    """Decode one example; returns its record (score, wall, forwards, path, tokens, text)."""
    from selforch_jax.data.synthetic_cities import score_answer
    from selforch_jax.runtime.scheduler import run
    from selforch_jax.runtime.schedulers import make_scheduler

    sched = make_scheduler(self.runtime, self.engine, [self.prompt(ex)], **self.kw)
    t0 = time.perf_counter()
    run(self.engine, sched)
    wall = time.perf_counter() - t0
    for o in sched.owners:
      self.engine.pool.free_owner(int(o))
    res = sched.results[0]
    stop = int(res.finish_reason == "stop")
    extra = {}
    if self.runtime == "ar":
      text = self.tok.decode(list(res.token_ids), skip_special_tokens=True)
      forwards = len(res.token_ids) + stop
    else:
      text = sched.text(0, self.tok)
      st = sched.stats[0]
      forwards = st["forwards"]
      extra = {k: st[k] for k in ("rounds", "chunks", "ar_steps", "denoise_steps",
                                  "well_formed")}
      extra["raw"] = self.tok.decode(list(res.token_ids))
    sc = score_answer(ex, text)
    return dict(k=len(ex["cities"]), **sc, wall_s=wall, forwards=forwards,
                critical_path=forwards - 1, tokens=len(res.token_ids) + stop,
                finish_reason=res.finish_reason, text=text, **extra)


def summarize(recs: list[dict], n_boot: int, seed: int) -> dict:
  from selforch_jax.eval.stats import bootstrap_ci
  items = np.concatenate([[1.0] * r["items_correct"] + [0.0] * (r["items"] - r["items_correct"])
                          for r in recs])
  return dict(
      n_answers=len(recs), n_items=int(items.size),
      item_accuracy=bootstrap_ci(items, n_boot, seed=seed),
      answer_accuracy=bootstrap_ci([float(r["answer_correct"]) for r in recs], n_boot, seed=seed),
      wall_s=bootstrap_ci([r["wall_s"] for r in recs], n_boot, seed=seed),
      critical_path=bootstrap_ci([float(r["critical_path"]) for r in recs], n_boot, seed=seed),
      tokens=bootstrap_ci([float(r["tokens"]) for r in recs], n_boot, seed=seed),
      finish_reasons={f: sum(r["finish_reason"] == f for r in recs)
                      for f in sorted({r["finish_reason"] for r in recs})})


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--pd_adapter", default="adapters/pd_smollm2_135m")
  ap.add_argument("--ar_adapter", default="")
  ap.add_argument("--n", type=int, default=40)
  ap.add_argument("--seed", type=int, default=1000)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--max_new_tokens", type=int, default=400)
  ap.add_argument("--steps_ratio", type=float, default=0.5)
  ap.add_argument("--confidence", default="entropy")
  ap.add_argument("--n_boot", type=int, default=10000)
  ap.add_argument("--max_minutes", type=float, default=0.0,
                  help="stop starting new examples after this many minutes (0 = no limit)")
  ap.add_argument("--out", default="bench/results/planned_diffusion_cities_cpu.json")
  args = ap.parse_args(argv)
  from selforch_jax.data.synthetic_cities import generate_split
  from selforch_jax.eval.stats import paired_bootstrap_diff

  examples = generate_split(args.n, args.seed)
  warm = generate_split(args.warmup, args.seed + 1)
  load_before = loadavg()
  t0 = time.time()
  adapters = {"pd": args.pd_adapter} | ({"ar": args.ar_adapter} if args.ar_adapter else {})
  systems = {s: System(s, a, PROMPT_TOKENS, args) for s, a in adapters.items()}
  for ex in warm:                       # compile the step sizes, untimed
    for sy in systems.values():
      sy.decode(ex)
  records = {s: [] for s in systems}
  for i, ex in enumerate(examples):     # systems alternate per example: same machine load
    if i and args.max_minutes and time.time() - t0 > 60 * args.max_minutes:
      print(f"time budget reached after {i} examples", file=sys.stderr)
      break
    for s, sy in systems.items():
      r = sy.decode(ex)
      records[s].append(r)
      print(f"{s} {i + 1}/{len(examples)} k={r['k']} items {r['items_correct']}/{r['items']} "
            f"wall {r['wall_s']:.1f}s path {r['critical_path']}", file=sys.stderr, flush=True)
  out = dict(
      task="synthetic_cities (selforch_jax.data.synthetic_cities), k = 2..6, greedy, batch 1",
      command="python bench/planned_diffusion.py " + " ".join(argv or sys.argv[1:]),
      args=vars(args), machine=machine_info(), load_before=load_before, load_after=loadavg(),
      elapsed_s=time.time() - t0, n_done=len(records["pd"]),
      systems={s: summarize(r, args.n_boot, 0) for s, r in records.items()})
  if "ar" in records:
    pd_r, ar_r = records["pd"], records["ar"]
    frac = lambda rs: [r["items_correct"] / r["items"] for r in rs]  # noqa: E731
    out["pd_vs_ar"] = dict(
        answer_accuracy_diff=paired_bootstrap_diff(
            [float(r["answer_correct"]) for r in pd_r],
            [float(r["answer_correct"]) for r in ar_r], args.n_boot),
        item_fraction_diff=paired_bootstrap_diff(frac(pd_r), frac(ar_r), args.n_boot),
        speedup=_ratio_ci(np.array([r["wall_s"] for r in ar_r]),
                          np.array([r["wall_s"] for r in pd_r]), args.n_boot, 0),
        critical_path_ratio=_ratio_ci(np.array([r["critical_path"] for r in pd_r], float),
                                      np.array([r["critical_path"] for r in ar_r], float),
                                      args.n_boot, 0))
  out["records"] = records
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  print(json.dumps({k: v for k, v in out.items() if k != "records"}, indent=1))
  print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
  main()
