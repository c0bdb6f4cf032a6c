r"""Planned Diffusion vs AR-SFT, PASTA and a Dream-style full-diffusion baseline (issue 21), on the
synthetic cities task (exact match) or on AlpacaEval prompts (NLL under the base model), with
bootstrap 95% CIs and n, and the Pareto plot (speedup over AR vs quality).

Systems (each one engine, batch 1, greedy; after ``--warmup`` untimed answers of other examples;
the systems alternate per example, so all see the same machine load):

* ``pd``: the Planned Diffusion adapter (``--pd_adapter``) with the planned_diffusion runtime
  (``--steps_ratio``, ``--confidence``, or ``--threshold``: Fast-dLLM's confidence threshold;
  ``--pad_last``: ``[PAD]`` predictions are committed after every content prediction;
  ``--spread``: no two adjacent positions of a chunk are committed in one denoising step);
  its de-tagged logical text is scored;
* ``ar``: the AR-SFT adapter (``--ar_adapter``, trained on the same records with the tags
  stripped) with plain AR decoding (``""`` skips it; speedups need it);
* ``pasta``: a PASTA adapter (``--pasta_adapter``, e.g. ``configs/planned_diffusion.py:pasta``)
  with the pasta runtime (tag grammar on, as the PASTA eval:
  :func:`selforch_jax.eval.pasta.run_pasta`);
* ``dream``: ``--dream=L`` > 0: the PD adapter with ``full_diffusion=L`` (the whole answer one
  chunk of L masks, entropy-ordered unmasking, ``steps_ratio * L`` steps; no plan).

Tasks (``--task``):

* ``cities``: :func:`selforch_jax.data.synthetic_cities.generate_split` with ``--seed`` (default
  1000; training uses seed 0), k = 2..6; item accuracy (every city sentence verbatim in the
  answer) and answer accuracy (all of them);
* ``alpaca``: the first ``--n`` AlpacaEval instructions after ``--offset`` (the PASTA eval's
  prompts); quality = mean per-token NLL (nats) of the de-tagged answer under the base weights
  of the PD adapter's model (``selforch_jax.eval.pasta``'s measure; lower is better), and the
  answer length.

Per system: mean wall-clock per answer, mean critical path (sequential forwards after the
prefill: AR = generated tokens - 1; PD = plan / sync AR steps + denoising steps; PASTA = its
forwards - 1; Dream = its denoising steps), mean generated tokens, well-formed rate (PD / PASTA:
no parser rule or guard applied; AR and Dream: always); vs AR (paired over the same examples):
quality differences, speedup = mean AR wall / mean system wall and critical-path ratio = mean
system path / mean AR path (bootstrap of the ratio of means). Load averages before and after
are recorded (2 shared cores: other jobs slow every system).

``--resume`` continues the ``--out`` JSON of an interrupted or ``--max_minutes``-capped run
(the JSON is rewritten after every example, so a killed run loses at most the example it was
on): its records are kept and the examples after them are decoded (the same task, examples,
systems, adapters and decode options, checked before any model loads; ``--n`` may grow, not
shrink); ``segments`` lists each run's command, example range, load, time and AR adapter;
the top-level ``command`` and load are the latest run's, ``elapsed_s`` the sum. With nothing
left to decode it exits at once, the JSON unchanged. No ``--out`` file yet: a fresh run.

``--ar_from=JSON`` takes the AR-SFT system's records from an earlier run of this benchmark on the
same examples (same task, seed, offset and token budget; paired by example index) instead of
decoding them again (AR greedy is deterministic: its texts, scores and critical paths are those
of a rerun; its wall-clock was measured in that run, under that run's load, which the JSON
records as ``ar_from``).

Run:
  python bench/planned_diffusion.py --pd_adapter=adapters/pd_smollm2_135m \
      --ar_adapter=out/pd_ar/adapter --n=40 --out=bench/results/planned_diffusion_cities_cpu.json
  python bench/planned_diffusion.py --task=alpaca --n=100 --max_new_tokens=256 \
      --pd_adapter=adapters/pd_smollm2_135m --ar_adapter=adapters/pasta_baseline_smollm2_135m \
      --pasta_adapter=adapters/pasta_smollm2_135m --dream=128 \
      --out=bench/results/planned_diffusion_alpaca_cpu.json
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
TASKS = ("cities", "alpaca")
PASTA_CAP = 256       # the PASTA eval's thread budget floor (configs/eval_pasta.py)
LABELS = {"pd": "Planned Diffusion", "ar": "AR-SFT", "pasta": "PASTA", "dream": "Dream-style"}


def _ratio_ci(num: np.ndarray, den: np.ndarray, n_boot: int, seed: int) -> dict:
  """Paired percentile bootstrap of ``mean(num) / mean(den)``."""
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, num.size, (n_boot, num.size))
  r = num[idx].mean(1) / np.maximum(den[idx].mean(1), 1e-12)
  return dict(mean=float(num.mean() / max(den.mean(), 1e-12)), lo=float(np.quantile(r, 0.025)),
              hi=float(np.quantile(r, 0.975)), n=int(num.size))


class System:
  """One system's model, engine and options; :meth:`decode` answers one prompt.

  Args:
    name: "pd", "ar", "pasta" or "dream".
    loaded: ``(model, tokenizer)`` (:func:`selforch_jax.adapter.load_adapter`).
    prompt_len: the longest prompt (pool size).
    args: the parsed command line.
  """

  def __init__(self, name: str, loaded, prompt_len: int, args):
    from selforch_jax.eval.pasta import pasta_pool
    from selforch_jax.lang import TagVocab
    from selforch_jax.runtime.build import make_engine
    from selforch_jax.runtime.generation import eos_ids
    from selforch_jax.runtime.sampling import SamplingParams

    self.name = name
    self.model, self.tok = loaded
    self.tv = TagVocab.from_tokenizer(self.tok) if name != "ar" else None
    self.max_new = args.max_new_tokens if name != "dream" else args.dream + 2
    if name in ("pd", "dream"):
      pool = dict(threads=2, extra_tokens=self.max_new + 16)
    elif name == "pasta":
      self.options = dict(constrain_tags=True, max_threads=8, max_topic_tokens=12)
      pool = pasta_pool(prompt_len, self.max_new, self.options)
      del pool["prompt_lens"], pool["max_new_tokens"]
    else:
      pool = {}
    self.engine = make_engine(self.model, [prompt_len], self.max_new, **pool)
    self.kw = dict(max_new_tokens=self.max_new, sampling=SamplingParams(),
                   stop_ids=eos_ids(self.tok))
    if name in ("pd", "dream"):
      self.kw.update(tag_vocab=self.tv, steps_ratio=args.steps_ratio, confidence=args.confidence,
                     threshold=args.threshold or None, pad_last=args.pad_last,
                     spread=args.spread, window=args.window, pad_tail=args.pad_tail,
                     seed_topic=args.seed_topic)
    if name == "dream":
      self.kw["full_diffusion"] = args.dream

  def decode(self, prompt: list[int]) -> dict:
    """Decode one prompt: ``text`` (de-tagged), ``ids`` (its token ids), ``wall_s``,
    ``forwards``, ``critical_path``, ``tokens`` (generated, tags and stop included),
    ``finish_reason``, ``well_formed`` (+ ``raw`` and the PD figures where they exist)."""
    from selforch_jax.runtime.scheduler import run
    from selforch_jax.runtime.schedulers import make_scheduler

    if self.name == "pasta":
      from selforch_jax.eval.pasta import run_pasta
      r = run_pasta(self.engine, self.tok, self.tv, prompt, self.max_new, PASTA_CAP,
                    **self.options)
      return dict(text=r["text"], ids=list(r["ids"]), wall_s=r["wall_s"],
                  forwards=r["forwards"], critical_path=r["forwards"] - 1, tokens=r["tokens"],
                  finish_reason=r["finish_reason"], well_formed=bool(r["parsed_strict"]),
                  raw=r["raw"], threads=r["threads"], rounds=r["rounds"])
    runtime = "ar" if self.name == "ar" else "planned_diffusion"
    sched = make_scheduler(runtime, self.engine, [prompt], **self.kw)
    t0 = time.perf_counter()
    run(self.engine, sched)
    wall = time.perf_counter() - t0
    for o in sched.owners:
      self.engine.pool.free_owner(int(o))
    res = sched.results[0]
    stop = int(res.finish_reason == "stop" and self.name != "dream")
    out = dict(wall_s=wall, tokens=len(res.token_ids) + stop, finish_reason=res.finish_reason)
    if self.name == "ar":
      ids = list(res.token_ids)
      out.update(forwards=len(ids) + stop, well_formed=True)
    else:
      st = sched.stats[0]
      ids = sched.text_ids(0)
      out.update({k: st[k] for k in ("forwards", "rounds", "chunks", "ar_steps",
                                     "denoise_steps", "well_formed")})
      out["raw"] = self.tok.decode(list(res.token_ids))
    out.update(text=self.tok.decode(ids, skip_special_tokens=True) if self.name == "ar"
               else sched.text(0, self.tok), ids=ids, critical_path=out["forwards"] - 1)
    return out


def _examples(args) -> tuple[list[dict], list[dict]]:
  """``(evaluation examples, warm-up examples)``: dicts with ``messages`` (+ the cities)."""
  if args.task == "cities":
    from selforch_jax.data.synthetic_cities import generate_split
    conv = lambda exs: [dict(ex, messages=[{"role": "user", "content": ex["prompt"]}])  # noqa
                        for ex in exs]
    return conv(generate_split(args.n, args.seed)), conv(generate_split(args.warmup,
                                                                        args.seed + 1))
  from selforch_jax.data.sources import load_examples, prompt_and_reference
  rows = load_examples("alpaca_eval", split="test",
                       max_examples=args.offset + args.n + args.warmup)
  exs = [dict(messages=prompt_and_reference(r)[0]) for r in rows]
  return exs[args.offset:args.offset + args.n], exs[args.offset + args.n:][:args.warmup]


def summarize(recs: list[dict], task: str, n_boot: int, seed: int) -> dict:
  """One system's figures over its records (module docstring)."""
  from selforch_jax.eval.stats import bootstrap_ci
  ci = lambda v: bootstrap_ci([float(x) for x in v], n_boot, seed=seed)  # noqa: E731
  out = dict(n_answers=len(recs))
  if task == "cities":
    items = np.concatenate([[1.0] * r["items_correct"] + [0.0] * (r["items"] - r["items_correct"])
                            for r in recs])
    out.update(n_items=int(items.size), item_accuracy=ci(items),
               answer_accuracy=ci([r["answer_correct"] for r in recs]))
  else:
    nll = [r["nll"] for r in recs if r["nll"] is not None]
    out.update(nll=ci(nll) if nll else None, n_empty=len(recs) - len(nll),
               length=ci([r["n_ids"] for r in recs]))
  out.update(wall_s=ci([r["wall_s"] for r in recs]),
             critical_path=ci([r["critical_path"] for r in recs]),
             tokens=ci([r["tokens"] for r in recs]),
             well_formed=ci([r["well_formed"] for r in recs]),
             finish_reasons={f: sum(r["finish_reason"] == f for r in recs)
                             for f in sorted({r["finish_reason"] for r in recs})})
  return out


def versus_ar(recs: list[dict], ar: list[dict], task: str, n_boot: int) -> dict:
  """Paired comparisons of one system with AR on the same examples."""
  from selforch_jax.eval.stats import paired_bootstrap_diff
  out = dict(speedup=_ratio_ci(np.array([r["wall_s"] for r in ar]),
                               np.array([r["wall_s"] for r in recs]), n_boot, 0),
             critical_path_ratio=_ratio_ci(np.array([r["critical_path"] for r in recs], float),
                                           np.array([r["critical_path"] for r in ar], float),
                                           n_boot, 0))
  if task == "cities":
    frac = lambda rs: [r["items_correct"] / r["items"] for r in rs]  # noqa: E731
    out.update(answer_accuracy_diff=paired_bootstrap_diff(
                   [float(r["answer_correct"]) for r in recs],
                   [float(r["answer_correct"]) for r in ar], n_boot),
               item_fraction_diff=paired_bootstrap_diff(frac(recs), frac(ar), n_boot))
  else:
    pairs = [(r["nll"], a["nll"]) for r, a in zip(recs, ar)
             if r["nll"] is not None and a["nll"] is not None]
    out["nll_diff"] = (paired_bootstrap_diff([p[0] for p in pairs], [p[1] for p in pairs], n_boot)
                       if pairs else None)
  return out


def pareto(out: dict, path: str) -> str | None:
  """The speedup-vs-quality plot (:func:`selforch_jax.eval.plots.pareto_plot`); None without
  an AR system (no speedup to draw)."""
  from selforch_jax.eval.plots import pareto_plot
  systems, vs = out["systems"], out.get("vs_ar", {})
  if "ar" not in systems:
    return None
  key, ylabel = (("item_accuracy", "item exact-match accuracy") if out["task"] == "cities" else
                 ("nll", "NLL of the de-tagged answer under the base model (nats, lower better)"))
  one = dict(mean=1.0, lo=1.0, hi=1.0)
  pts = [dict(label=LABELS["ar"], x=one, y=systems["ar"][key], kind="reference")]
  for s in systems:
    if s != "ar" and systems[s].get(key):
      pts.append(dict(label=LABELS[s], x=vs[s]["speedup"], y=systems[s][key],
                      kind="pasta" if s == "pd" else "baseline"))
  return pareto_plot(pts, path, ylabel=ylabel, series={},
                     title=f"{out['task']}: n={systems['ar']['n_answers']}, batch 1, greedy")


def _read_json(path: str, flag: str) -> dict:
  """An earlier run's JSON; ValueError naming ``flag`` and ``path`` when it is not one."""
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{flag} {path}: not a readable JSON file ({e})") from None


def earlier_ar(path: str, args) -> dict:
  """The AR-SFT records of an earlier run's JSON (``--ar_from``), checked to be of the same
  examples and budget: ``{"records", "path", "command", "load_before", "load_after"}``.

  Raises:
    ValueError: the JSON has no AR records, other examples / budget, or alpaca records
      without ``n_ids`` (an older run).
  """
  prev = _read_json(path, "--ar_from")
  recs = prev.get("records", {}).get("ar")
  if not recs:
    raise ValueError(f"--ar_from={path}: no AR records in it")
  for k in ("task", "seed", "offset", "max_new_tokens", "prompt_tokens"):
    have, want = prev["args"].get(k), getattr(args, k)
    if k == "task":
      have = prev.get("task")
    if have is not None and have != want:
      raise ValueError(f"--ar_from={path}: {k}={have!r} there, {want!r} here (other examples "
                       "or budget)")
  if args.task == "alpaca" and any("n_ids" not in r for r in recs):
    raise ValueError(f"--ar_from={path}: its alpaca records have no n_ids (an older run: "
                     "decode AR again)")
  return dict(records=recs, path=path, command=prev.get("command"),
              load_before=prev.get("load_before"), load_after=prev.get("load_after"),
              ar_adapter=prev["args"].get("ar_adapter"))


# The arguments that decide what a record is: a resumed run must decode with the same ones.
RESUME_KEYS = ("task", "seed", "offset", "max_new_tokens", "prompt_tokens", "steps_ratio",
               "confidence", "threshold", "pad_last", "spread", "window", "pad_tail",
               "seed_topic", "dream", "pd_adapter", "pasta_adapter")


def run_systems(args) -> set[str]:
  """The systems a command line runs: ``pd``, ``ar`` (decoded or ``--ar_from``), ``pasta``,
  ``dream``."""
  given = dict(pd=args.pd_adapter, ar=args.ar_adapter or args.ar_from,
               pasta=args.pasta_adapter, dream=args.dream)
  return {s for s, v in given.items() if v}


def effective_ar_adapter(args) -> str:
  """The AR-SFT adapter behind a run's AR records: ``--ar_adapter``, or the ``--ar_from``
  JSON's (``""`` when neither)."""
  if args.ar_adapter or not args.ar_from:
    return args.ar_adapter
  with open(args.ar_from, encoding="utf-8") as f:
    return json.load(f)["args"].get("ar_adapter", "")


def earlier_run(path: str, args, defaults: dict) -> dict | None:
  """The JSON of the run ``--resume`` continues, checked to decode the same examples with the
  same systems, adapters and options (:data:`RESUME_KEYS`; a key an older JSON lacks counts
  as its default; the AR records' adapter may come from ``--ar_adapter`` or ``--ar_from`` in
  either run, it must be the same path); None when ``path`` does not exist yet (a fresh run).
  Its records are cut to its ``n_done`` and ``segments`` is filled in for an older JSON.

  Raises:
    ValueError: the JSON is of other examples, systems, adapters or options, holds more
      examples than ``--n``, or its records cannot be summarized again (alpaca records
      without ``n_ids``).
  """
  if not os.path.exists(path):
    return None
  prev = _read_json(path, "--resume")
  here = run_systems(args)
  if set(prev["records"]) != here:
    raise ValueError(f"--resume {path}: systems {sorted(prev['records'])} there, "
                     f"{sorted(here)} here")
  for k in RESUME_KEYS:
    have = prev["task"] if k == "task" else prev["args"].get(k, defaults[k])
    if have != getattr(args, k):
      raise ValueError(f"--resume {path}: {k}={have!r} there, {getattr(args, k)!r} here")
  if "ar" in here:
    last = (prev.get("segments") or [{}])[-1]
    have = last.get("ar_adapter_used")
    if have is None:                                     # an older JSON: from its arguments
      old = argparse.Namespace(ar_adapter=prev["args"].get("ar_adapter", ""),
                               ar_from=prev["args"].get("ar_from", ""))
      have = (effective_ar_adapter(old) if old.ar_adapter or os.path.exists(old.ar_from)
              else f"unknown (--ar_from={old.ar_from})")
    if have != effective_ar_adapter(args):
      raise ValueError(f"--resume {path}: its AR records are of the adapter {have!r}, here "
                       f"{effective_ar_adapter(args)!r}")
  n = int(prev["n_done"])
  if n > args.n:
    raise ValueError(f"--resume {path}: it holds {n} examples > --n={args.n}")
  recs = prev["records"]
  if args.task == "alpaca" and any("n_ids" not in r for rs in recs.values() for r in rs):
    raise ValueError(f"--resume {path}: its alpaca records have no n_ids (an older run)")
  prev["records"] = {s: [dict(r) for r in rs[:n]] for s, rs in recs.items()}
  prev.setdefault("segments", [dict(
      command=prev.get("command"), examples=[0, n], load_before=prev.get("load_before"),
      load_after=prev.get("load_after"), elapsed_s=prev.get("elapsed_s"),
      ar_from=(prev.get("ar_from") or {}).get("path"), ar_adapter=prev["args"].get("ar_adapter"))])
  return prev


def write_run(args, argv, records: dict, prev: dict | None, start: int, load_before,
              t0: float, ar_prev: dict | None) -> dict:
  """Summarize the records so far and write the run's JSON to ``args.out`` (atomically: after
  every example, so an interrupted run keeps what it decoded and ``--resume`` continues it).

  Returns:
    The JSON's dict (module docstring): ``systems``, ``vs_ar``, ``segments``, ``records``.
  """
  elapsed = time.time() - t0
  command = "python bench/planned_diffusion.py " + " ".join(argv or sys.argv[1:])
  n_done = min(len(r) for r in records.values())
  segments = (prev["segments"] if prev is not None else []) + [dict(
      command=command, examples=[start, n_done], load_before=load_before, load_after=loadavg(),
      elapsed_s=elapsed, ar_from=args.ar_from or None, ar_adapter=args.ar_adapter,
      ar_adapter_used=ar_prev["ar_adapter"] if ar_prev else args.ar_adapter)]
  out = dict(
      task=args.task,
      task_note=("synthetic_cities (selforch_jax.data.synthetic_cities), k = 2..6"
                 if args.task == "cities" else "AlpacaEval instructions (data/alpaca_eval)")
      + ", greedy, batch 1",
      command=command, args=vars(args), machine=machine_info(), load_before=load_before,
      load_after=segments[-1]["load_after"], elapsed_s=sum(g["elapsed_s"] or 0 for g in segments),
      n_done=n_done, segments=segments,
      systems={s: summarize(r, args.task, args.n_boot, 0) for s, r in records.items()})
  if ar_prev is not None:
    out["ar_from"] = {k: ar_prev[k] for k in ("path", "command", "load_before", "load_after")}
  if "ar" in records:
    out["vs_ar"] = {s: versus_ar(r, records["ar"], args.task, args.n_boot)
                    for s, r in records.items() if s != "ar"}
  out["records"] = {s: [{k: v for k, v in r.items() if k != "ids"} for r in rs]
                    for s, rs in records.items()}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  tmp = args.out + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(out, f, indent=1)
  os.replace(tmp, args.out)         # an interrupted write leaves the last JSON
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--task", default="cities", choices=TASKS)
  ap.add_argument("--pd_adapter", default="adapters/pd_smollm2_135m",
                  help="the Planned Diffusion adapter ('' skips the PD system)")
  ap.add_argument("--ar_adapter", default="")
  ap.add_argument("--ar_from", default="",
                  help="the AR-SFT records of an earlier run (its JSON) instead of --ar_adapter")
  ap.add_argument("--pasta_adapter", default="")
  ap.add_argument("--dream", type=int, default=0,
                  help="Dream-style baseline with this many masks (0 = off)")
  ap.add_argument("--n", type=int, default=40)
  ap.add_argument("--seed", type=int, default=1000, help="cities: evaluation split seed")
  ap.add_argument("--offset", type=int, default=0, help="alpaca: first instruction")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--max_new_tokens", type=int, default=400)
  ap.add_argument("--steps_ratio", type=float, default=0.5)
  ap.add_argument("--confidence", default="entropy")
  ap.add_argument("--pad_last", action="store_true",
                  help="PD / Dream: commit [PAD] predictions after every content prediction")
  ap.add_argument("--spread", action="store_true",
                  help="PD / Dream: never commit two adjacent positions of a chunk in one "
                       "denoising step (the last step commits everything left)")
  ap.add_argument("--window", type=int, default=0,
                  help="PD / Dream: semi-autoregressive unmasking, only a chunk's first W "
                       "masked positions are candidates (0 = off)")
  ap.add_argument("--pad_tail", action="store_true",
                  help="PD / Dream: a committed [PAD] fills the rest of its chunk with [PAD]")
  ap.add_argument("--seed_topic", action="store_true",
                  help="PD: each chunk starts with its promise's topic tokens, committed at "
                       "the scaffold")
  ap.add_argument("--threshold", type=float, default=0.0,
                  help="PD / Dream: Fast-dLLM unmasking, every masked position whose top "
                       "probability is >= this per step (0 = off: steps_ratio's schedule)")
  ap.add_argument("--n_boot", type=int, default=10000)
  ap.add_argument("--max_minutes", type=float, default=0.0,
                  help="stop starting new examples after this many minutes (0 = no limit)")
  ap.add_argument("--prompt_tokens", type=int, default=PROMPT_TOKENS,
                  help="pool room per prompt (longer prompts are an error)")
  ap.add_argument("--resume", action="store_true",
                  help="continue --out: keep its records, decode the examples after them")
  ap.add_argument("--out", default="bench/results/planned_diffusion_cities_cpu.json")
  ap.add_argument("--plot", default=None, help="Pareto PNG (default: --out with .png)")
  args = ap.parse_args(argv)
  if args.n < 1 or args.warmup < 0 or args.dream < 0:
    ap.error("--n must be >= 1, --warmup and --dream >= 0")
  if args.window < 0:
    ap.error("--window must be >= 0 (0 = off)")
  if not 0.0 <= args.threshold <= 1.0:
    ap.error("--threshold must be in [0, 1] (0 = off)")
  if args.dream and not args.pd_adapter:
    ap.error("--dream decodes with the PD adapter: it needs --pd_adapter")
  if not (args.pd_adapter or args.pasta_adapter or args.ar_adapter):
    ap.error("nothing to run: give --pd_adapter, --pasta_adapter or --ar_adapter")
  if args.ar_from and args.ar_adapter:
    ap.error("--ar_from and --ar_adapter exclude each other")
  try:                                  # one-line errors (exit 2) before any model loads
    ar_prev = earlier_ar(args.ar_from, args) if args.ar_from else None
    prev = earlier_run(args.out, args, vars(ap.parse_args([]))) if args.resume else None
  except (ValueError, OSError) as e:
    ap.error(str(e))
  if prev is not None and prev["n_done"] >= args.n:
    print(f"--resume: {args.out} already holds {prev['n_done']} examples: nothing to do",
          file=sys.stderr)
    return prev
  from selforch_jax.adapter import load_adapter

  examples, warm = _examples(args)
  load_before = loadavg()
  t0 = time.time()
  adapters = {"pd": args.pd_adapter, "ar": args.ar_adapter, "pasta": args.pasta_adapter}
  loaded = {s: load_adapter(a) for s, a in adapters.items() if a}
  if args.dream:
    loaded["dream"] = loaded["pd"]
  systems = {s: System(s, m, args.prompt_tokens, args) for s, m in loaded.items()}
  nll = None
  if args.task == "alpaca":
    import ml_collections

    from selforch_jax import config_lib
    from selforch_jax.eval.pasta import _NLL
    first = next(a for a in (args.pd_adapter, args.pasta_adapter, args.ar_adapter) if a)
    with open(os.path.join(first, "adapter_config.json")) as f:
      mc = ml_collections.ConfigDict(json.load(f)["model"])
    nll = _NLL(config_lib.load_model(mc)[1])     # the base weights (no LoRA)
  prompts = {s: [sy.tok.encode_chat(ex["messages"], add_generation_prompt=True)
                 for ex in examples + warm] for s, sy in systems.items()}
  longest = max(len(p) for ps in prompts.values() for p in ps)
  if longest > args.prompt_tokens:
    ap.error(f"a prompt has {longest} tokens > --prompt_tokens={args.prompt_tokens}")
  for i in range(len(warm)):            # compile the step sizes, untimed
    for s, sy in systems.items():
      sy.decode(prompts[s][len(examples) + i])
  records = {s: [] for s in systems}
  if ar_prev is not None:
    records["ar"] = []
  start = 0
  if prev is not None:
    records = prev["records"]
    start = len(records["ar" if "ar" in records else next(iter(records))])
    print(f"--resume: {start} examples done in {args.out}", file=sys.stderr)
  for i, ex in enumerate(examples):     # systems alternate per example: same machine load
    if i < start:
      continue
    if i > start and args.max_minutes and time.time() - t0 > 60 * args.max_minutes:
      print(f"time budget reached after {i} examples", file=sys.stderr)
      break
    if ar_prev is not None and i >= len(ar_prev["records"]):
      print(f"--ar_from holds {i} examples: stopping there", file=sys.stderr)
      break
    for s, sy in systems.items():
      r = sy.decode(prompts[s][i])
      if args.task == "cities":
        from selforch_jax.data.synthetic_cities import score_answer
        r.update(k=len(ex["cities"]), **score_answer(ex, r["text"]))
        msg = f"items {r['items_correct']}/{r['items']}"
      else:
        base_prompt = next(iter(prompts.values()))[i]
        r["nll"] = nll(base_prompt, r["ids"]) if r["ids"] else None
        msg = f"nll {r['nll']}"
      r["n_ids"] = len(r["ids"])
      records[s].append(r)
      print(f"{s} {i + 1}/{len(examples)} {msg} wall {r['wall_s']:.1f}s "
            f"path {r['critical_path']}", file=sys.stderr, flush=True)
    if ar_prev is not None:
      records["ar"].append(dict(ar_prev["records"][i]))
    write_run(args, argv, records, prev, start, load_before, t0, ar_prev)
  out = write_run(args, argv, records, prev, start, load_before, t0, ar_prev)
  plot = pareto(out, args.plot or os.path.splitext(args.out)[0] + ".png")
  print(json.dumps({k: v for k, v in out.items() if k != "records"}, indent=1))
  print(f"wrote {args.out}" + (f" and {plot}" if plot else ""), file=sys.stderr)
  return out


if __name__ == "__main__":
  main()
