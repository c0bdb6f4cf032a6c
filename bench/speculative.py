r"""Lossless speculative decoding on the engine: PTD vs PLD vs Lookahead vs AR (issue 19).

On MT-Bench first turns (``data/mt_bench``), GSM8K test (the first ``--n``, default 100) and the
AlpacaEval prompts the PASTA eval uses (``data/alpaca_eval``, from offset 0), with the real
SmolLM2-135M-Instruct in float32, greedy, one request at a time, every system on the same
engine: tokens per forward, accepted guess tokens per step, wall-clock per answer and the
speedup vs AR (ratio of mean wall-clock per prompt), with bootstrap 95% CIs
(``scipy.stats.bootstrap``, paired for the speedup) and n; every greedy answer is checked equal
to AR's (``equal_to_ar``). Tree sizes: with ``--calibrate_n > 0``, PTD first runs on that many
GSM8K *train* prompts recording the counterfactual acceptance of every guess budget, and
:func:`~selforch_jax.runtime.schedulers.ptd.choose_sizes` picks ``max_tree`` / ``max_guess`` from
that curve and the measured step cost (``bench/results/engine_step_cpu.json``); the chosen
sizes are in the JSON.

Every finished prompt is appended to ``--records`` (default ``<out>_records.jsonl``); a rerun
with the same ``--out`` resumes after the last finished prompt with the options and tree sizes
the run started with, so a larger ``--n`` extends a finished run.

Run (smoke; the full run drops --n / --new_tokens):
  python bench/speculative.py --n=3 --new_tokens=32 --out=out/speculative_smoke.json
  python bench/speculative.py --out=bench/results/speculative_cpu.json    # n = 100 / 80 / 100
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import loadavg, machine_info  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
  spec = importlib.util.spec_from_file_location("ptd_config", os.path.join(ROOT, "configs/ptd.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def load_prompts(name: str, n: int) -> list[str]:
  """User turns of the first ``n`` rows of set ``name`` (gsm8k | math500 | mt_bench |
  alpaca_eval | gsm8k_train)."""
  from selforch_jax.data.sources import load_examples
  if name == "mt_bench":
    with open(os.path.join(ROOT, "data/mt_bench/question.jsonl")) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    return [r["turns"][0] for r in rows[:n]]
  ds, split = {"gsm8k": ("gsm8k", "test"), "gsm8k_train": ("gsm8k", "train"),
               "math500": ("math500", "test"), "alpaca_eval": ("alpaca_eval", "test")}[name]
  rows = load_examples(ds, split=split, max_examples=n)
  return [next(m["content"] for m in r["messages"] if m["role"] == "user") for r in rows]


def decode_one(engine, system, ids, new_tokens, stop_ids, opts):
  from selforch_jax.runtime.scheduler import run
  from selforch_jax.runtime.schedulers import make_scheduler
  t0 = time.perf_counter()
  s = make_scheduler(runtime_of(system), engine, [ids], max_new_tokens=new_tokens,
                     stop_ids=stop_ids, **opts)
  steps = run(engine, s)
  wall = time.perf_counter() - t0
  for o in s.owners:
    engine.pool.free_owner(int(o))
  r = s.results[0]
  st = s.stats[0] if getattr(s, "stats", None) else dict(
      forwards=steps, tokens_per_forward=(len(r.token_ids) + (r.finish_reason == "stop"))
      / max(steps, 1), mean_accepted=0.0)
  rec = dict(forwards=int(st["forwards"]), tokens_per_forward=float(st["tokens_per_forward"]),
             mean_accepted=float(st.get("mean_accepted", 0.0)), wall_s=wall,
             new_tokens=len(r.token_ids), finish_reason=r.finish_reason,
             counterfactual=st.get("counterfactual"))
  rec.update({k: st[k] for k in ORTHRUS_FIGURES if k in st})
  return r, rec


ORTHRUS_FIGURES = ("diffusion_forwards", "verify_forwards", "fused_drafts",
                   "mean_acceptance_length")


def runtime_of(system: str) -> str:
  """The registered runtime of a bench system: ``orthrus_fused`` (``fused=True``, the fused
  draft anchored at the last draft) and ``orthrus_fused_at<j>`` (``fuse_at=j``) are
  ``orthrus``."""
  return "orthrus" if system.startswith("orthrus") else system


def orthrus_variant(system: str) -> dict:
  """The Orthrus options of a bench system name (:func:`runtime_of`)."""
  if system == "orthrus":
    return {}
  if system == "orthrus_fused":
    return dict(fused=True)
  if system.startswith("orthrus_fused_at") and system[16:].isdigit():
    return dict(fused=True, fuse_at=int(system[16:]))
  raise ValueError(f"unknown Orthrus system {system!r} (orthrus, orthrus_fused, "
                   "orthrus_fused_at<j>)")


def read_records(path):
  """The header and finished prompts of a ``--records`` JSONL.

  Returns ``(header, done)``: ``header`` is the first row (systems, options, sizing) or None
  when the file is absent or empty; ``done`` maps ``(set_name, prompt_index)`` to
  ``{system: record}``. A truncated last line (a killed run) is ignored.
  """
  if not path or not os.path.exists(path):
    return None, {}
  header, done = None, {}
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if row.get("header"):
        header = row
      else:
        done[(row["set"], int(row["k"]))] = row["records"]
  return header, done


def write_record(path, row, mode="a"):
  """Append one JSON row to ``path`` and flush it to disk (``mode='w'`` starts the file)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, mode) as f:
    f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())


def ci(x, stat=np.mean):
  from scipy.stats import bootstrap
  x = np.asarray(x, float)
  if x.size < 2 or np.ptp(x) == 0:
    return [float(stat(x)), float(stat(x))]
  r = bootstrap((x,), stat, n_resamples=2000, method="percentile", random_state=0)
  return [float(r.confidence_interval.low), float(r.confidence_interval.high)]


def ratio_ci(a, b):
  from scipy.stats import bootstrap
  a, b = np.asarray(a, float), np.asarray(b, float)
  if a.size < 2:
    return [float(a.mean() / b.mean())] * 2
  r = bootstrap((a, b), lambda x, y: np.mean(x) / np.mean(y), paired=True, vectorized=False,
                n_resamples=2000, method="percentile", random_state=0)
  return [float(r.confidence_interval.low), float(r.confidence_interval.high)]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--n", type=int, default=100, help="prompts per set (MT-Bench has 80)")
  ap.add_argument("--new_tokens", type=int, default=256)
  ap.add_argument("--sets", default="gsm8k,mt_bench,alpaca_eval")
  ap.add_argument("--systems", default="ar,ptd,pld,lookahead")
  ap.add_argument("--scale", default="cpu", help="configs/ptd.py scale: cpu | upstream")
  ap.add_argument("--calibrate_n", type=int, default=0,
                  help="GSM8K train prompts for choose_sizes (0: configs/ptd.py sizes)")
  ap.add_argument("--page_size", type=int, default=16)
  ap.add_argument("--orthrus_adapter", default="",
                  help="an Orthrus adapter: its model (base + diffusion view) runs every system, "
                       "and 'orthrus', 'orthrus_fused' (the verify pass fused with the next "
                       "block's draft, anchored at the last draft) and 'orthrus_fused_at<j>' "
                       "(anchored at draft j) in --systems decode with it")
  ap.add_argument("--orthrus_block", type=int, default=0, help="orthrus block size (0: the "
                  "adapter's)")
  ap.add_argument("--out", default="out/speculative.json")
  ap.add_argument("--plot", default="", help="PNG path (default: --out with .png)")
  ap.add_argument("--records", default="", help="per-prompt JSONL appended as the run goes and "
                  "read back on a rerun, which resumes after the last finished prompt (default: "
                  "--out with _records.jsonl; 'none' keeps nothing)")
  a = ap.parse_args(argv)
  rec_path = "" if a.records == "none" else (
      a.records or os.path.splitext(a.out)[0] + "_records.jsonl")
  header, done = read_records(rec_path)

  from selforch_jax.checkpoints.assets import smollm2_gguf_path
  from selforch_jax.checkpoints.gguf_import import load_gguf
  from selforch_jax.runtime.engine import Engine
  from selforch_jax.runtime.schedulers.ptd import choose_sizes
  from selforch_jax.tokenizers import HFTokenizer

  cfg = _config()
  path = smollm2_gguf_path()
  _, model, _ = load_gguf(path)
  tok = HFTokenizer.from_gguf(path)
  stop_ids = list(tok.stop_ids)
  systems = a.systems.split(",")
  specs = ()
  if a.orthrus_adapter:   # AR and the others decode with the same model (base view)
    from selforch_jax.adapter import load_adapter
    from selforch_jax.models.orthrus import VIEW, mask_token_id
    from selforch_jax.runtime.step import ForwardSpec
    model, tok = load_adapter(a.orthrus_adapter)
    with open(os.path.join(a.orthrus_adapter, "adapter_config.json")) as f:
      block = a.orthrus_block or int(json.load(f)["block_size"])
    orthrus_opts = dict(block_size=block, mask_id=mask_token_id(model, tok))
    specs = (ForwardSpec(view=VIEW), ForwardSpec(view=VIEW, query_view=np.zeros(1, bool)))
  elif any(runtime_of(s) == "orthrus" for s in systems):
    ap.error("--systems with orthrus needs --orthrus_adapter=DIR")
  opts = {s: (dict(orthrus_opts, **orthrus_variant(s)) if runtime_of(s) == "orthrus"
              else cfg.options(s, a.scale)) for s in systems}
  enc = lambda text: tok.encode_chat([{"role": "user", "content": text}])  # noqa: E731
  sets = {s: [enc(t) for t in load_prompts(s, a.n)] for s in a.sets.split(",")}
  max_prompt = max(len(p) for ps in sets.values() for p in ps)
  # relabel moves a whole page per accepting step into the sequence: room for one per token
  pages = (max_prompt + a.new_tokens) // a.page_size + a.new_tokens + 16
  engine = Engine(model, num_pages=pages, page_size=a.page_size)
  # every step bucket (trees, prefills) at every key window: no compile inside a timed run
  # (relabel's page moves widen the key window as an answer grows)
  engine.warm_up(sorted({1, 2, 4, 8, 16, 32, 64} | {len(p) for ps in sets.values() for p in ps}))
  if specs:   # the diffusion view's block step and the fused verify + draft step
    engine.warm_up(range(1, 2 * orthrus_opts["block_size"] + 1), attn_mass=(), specs=specs)
  out = dict(config=dict(vars(a), model="SmolLM2-135M-Instruct (GGUF, float32)", greedy=True,
                         num_pages=pages, options=opts, stop_ids=stop_ids),
             machine=machine_info(), loadavg_start=loadavg(), sets={})
  if header is not None:      # a resumed run keeps the sizes and options it started with
    if header["systems"] != systems:
      ap.error(f"--records={rec_path} was written for systems {header['systems']}, not {systems}")
    opts = header["options"]
    if header.get("sizing"):
      out["sizing"] = header["sizing"]
    out["config"]["options"] = opts
  elif a.calibrate_n and "ptd" in systems:
    budgets = (0, 1, 2, 4, 6, 8, 12, 16, 24, 32)
    cal = dict(opts["ptd"], max_tree=63, max_guess=32, record_budgets=budgets)
    curves = []
    for text in load_prompts("gsm8k_train", a.calibrate_n):
      _, rec = decode_one(engine, "ptd", enc(text), a.new_tokens, stop_ids, cal)
      curves.append(rec["counterfactual"])
    acc = {b: float(np.mean([c[b] for c in curves if b in c])) for b in budgets}
    with open(os.path.join(ROOT, "bench/results/engine_step_cpu.json")) as f:
      step_ms = json.load(f)["ms"]
    sizes = choose_sizes(step_ms, acc)
    opts["ptd"].update(max_tree=sizes["max_tree"], max_guess=sizes["max_guess"])
    out["sizing"] = dict(accept_curve=acc, step_ms=step_ms, chosen=sizes)
  if header is None and rec_path:
    write_record(rec_path, dict(header=True, systems=systems, options=opts,
                                sizing=out.get("sizing")), mode="w")
  out["resumed_prompts"] = len(done)
  for s in systems:                           # compile outside the timed runs
    decode_one(engine, s, next(iter(sets.values()))[0], min(16, a.new_tokens), stop_ids, opts[s])
  for set_name, prompts in sets.items():
    recs = {s: [] for s in systems}
    for k, ids in enumerate(prompts):
      if (set_name, k) in done:
        for s in systems:
          recs[s].append(done[(set_name, k)][s])
        continue
      ref = None
      for s in systems:
        r, rec = decode_one(engine, s, ids, a.new_tokens, stop_ids, opts[s])
        if s == "ar":
          ref = r.token_ids
        rec["equal_to_ar"] = None if ref is None else r.token_ids == ref
        rec.pop("counterfactual", None)
        recs[s].append(rec)
      if rec_path:
        write_record(rec_path, dict(set=set_name, k=k, records={s: recs[s][-1] for s in systems},
                                    loadavg=loadavg()))
      print(f"{set_name} {k + 1}/{len(prompts)} " + " ".join(
          f"{s}:{recs[s][-1]['tokens_per_forward']:.2f}" for s in systems), file=sys.stderr)
    summ = {}
    for s in systems:
      tpf = [r["tokens_per_forward"] for r in recs[s]]
      acc = [r["mean_accepted"] for r in recs[s]]
      wall = [r["wall_s"] for r in recs[s]]
      d = dict(n=len(tpf), tokens_per_forward=float(np.mean(tpf)), tokens_per_forward_ci=ci(tpf),
               **{f: float(np.mean([r[f] for r in recs[s]])) for f in ORTHRUS_FIGURES
                  if all(f in r for r in recs[s])},
               accepted_per_step=float(np.mean(acc)), accepted_per_step_ci=ci(acc),
               wall_s=float(np.mean(wall)),
               tokens_per_s=float(sum(r["new_tokens"] for r in recs[s]) / sum(wall)),
               all_equal_to_ar=all(r["equal_to_ar"] is not False for r in recs[s]))
      if "ar" in recs:
        ar_wall = [r["wall_s"] for r in recs["ar"]]
        d["speedup_vs_ar"] = float(np.mean(ar_wall) / np.mean(wall))
        d["speedup_vs_ar_ci"] = ratio_ci(ar_wall, wall)
      summ[s] = d
    out["sets"][set_name] = dict(summary=summ, records=recs)
  out["loadavg_end"] = loadavg()
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
  plot(out, a.plot or os.path.splitext(a.out)[0] + ".png")
  for set_name, v in out["sets"].items():
    for s, d in v["summary"].items():
      print(f"{set_name:12s} {s:10s} n={d['n']} tok/fwd {d['tokens_per_forward']:.2f} "
            f"{d['tokens_per_forward_ci']} speedup {d.get('speedup_vs_ar', float('nan')):.2f} "
            f"{d.get('speedup_vs_ar_ci')} equal {d['all_equal_to_ar']}")
  return out


def plot(out, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sets = list(out["sets"])
  systems = list(next(iter(out["sets"].values()))["summary"])
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  for ax, key in zip(axes, ("tokens_per_forward", "speedup_vs_ar")):
    w = 0.8 / len(systems)
    for j, s in enumerate(systems):
      vals = [out["sets"][t]["summary"][s].get(key, np.nan) for t in sets]
      cis = [out["sets"][t]["summary"][s].get(key + "_ci", [v, v]) for t, v in zip(sets, vals)]
      err = np.abs(np.array(cis).T - np.array(vals))
      ax.bar(np.arange(len(sets)) + j * w, vals, w, yerr=err, label=s, capsize=3)
    ax.set_xticks(np.arange(len(sets)) + 0.4 - w / 2)
    ax.set_xticklabels(sets)
    ax.set_title(key.replace("_", " ") + " (95% CI)")
    ax.axhline(1.0, color="k", lw=0.5)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)


if __name__ == "__main__":
  main()
