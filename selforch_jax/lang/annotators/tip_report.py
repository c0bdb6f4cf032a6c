"""TIP annotation report on GSM8K: how much of a solution the register tags let the runtime evict.

Run (the whole train split, K = 8)::

  python -m selforch_jax.lang.annotators.tip_report --split=train --num_registers=8
  # the synthetic chain task (gold dependence graphs):
  python -m selforch_jax.lang.annotators.tip_report --data=synthetic_chain --split=train

Prints (and with ``--out`` writes) JSON: fraction annotated, steps per solution, graph register
pressure, resident (not yet killed) steps, evicted steps, the share of solution tokens dead by the
end, and mean live KV vs dense over the decode steps, on the SmolLM2 tokenization.
"""

from __future__ import annotations

from selforch_jax.lang.annotators.tip_gsm8k import (
  TipGSM8KAnnotator, annotate_with_graph, split_steps,
)
from selforch_jax.lang.tags import DEFAULT_NUM_REGISTERS


def main(argv=None) -> None:
  """Annotation report on a GSM8K (or synthetic_chain, with its gold graphs) split: fraction annotated, steps per solution, live steps
  (mean / peak vs total) and the share of solution tokens dead (evicted) by the end and in the
  mean over decode steps, measured on the SmolLM2 token layout (:func:`build_layout`)."""
  import argparse
  import json

  import numpy as np

  from selforch_jax import config_lib
  from selforch_jax.data.sources import read_jsonl
  from selforch_jax.lang.mask import build_layout
  from selforch_jax.lang.tags import add_tags

  ap = argparse.ArgumentParser(description=main.__doc__)
  ap.add_argument("--data", default="gsm8k", choices=("gsm8k", "synthetic_chain"))
  ap.add_argument("--split", default="train")
  ap.add_argument("--num_registers", type=int, default=DEFAULT_NUM_REGISTERS)
  ap.add_argument("--spill", default="merge")
  ap.add_argument("--max_examples", type=int, default=None)
  ap.add_argument("--out", default=None, help="write the report JSON here")
  a = ap.parse_args(argv)
  rows = read_jsonl(f"{a.data}/{a.split}.jsonl")[:a.max_examples]
  tok = config_lib.load_tokenizer("smollm2_gguf")
  tv = add_tags(tok, None, a.num_registers)
  ann = TipGSM8KAnnotator(a.num_registers, a.spill)
  n_ok, steps, mlive, pres, mres, frac_steps_evicted = 0, [], [], [], [], []
  dead_end, live_mean, live_mean_prompt, merged = [], [], [], 0
  from selforch_jax.progress import progress
  for row in progress(rows, "tip annotate", unit="example"):
    if a.data == "gsm8k":
      out = ann.annotate(row["question"], row["answer"])
    else:
      steps_ = split_steps(row["solution"])
      out = annotate_with_graph(steps_, [set(u) for u in row["uses"]], len(steps_) - 1,
                                a.num_registers, a.spill)
    if out.text is None:
      continue
    n_ok += 1
    i = out.info
    steps.append(i["steps"])
    mlive.append(i["max_live"])
    pres.append(i["peak_resident"])
    mres.append(i["mean_resident"])
    frac_steps_evicted.append(len(i["evicted"]) / i["steps"])
    merged += len(i["merged"])
    ids = np.asarray(tok.encode(out.text), np.int64)
    sol = ~np.isin(ids, tv.registers)  # solution tokens (tags are not counted as text)
    lay = build_layout(ids, tv, eos_ids=())
    n = len(ids)
    dead_end.append(float(np.sum(sol & (lay.kill_at < n)) / max(sol.sum(), 1)))
    # live KV at decode step t (query t): earlier tokens not killed for query t
    t = np.arange(n)
    alive = (t[None, :] < t[:, None]) & (lay.kill_at[None, :] > t[:, None])
    live, dense = alive.sum(1), t
    live_mean.append(float(live.sum() / max(dense.sum(), 1)))
    q = len(tok.encode(row["question"]))  # with a never-evicted prompt in front
    live_mean_prompt.append(float((live + q).sum() / (dense + q).sum()))
  rep = {
    "data": a.data, "split": a.split, "num_registers": a.num_registers, "spill": a.spill, "rows": len(rows),
    "annotated": n_ok, "fraction_annotated": n_ok / max(len(rows), 1),
    "steps_per_solution_mean": float(np.mean(steps)), "steps_per_solution_max": int(np.max(steps)),
    "graph_max_live_mean": float(np.mean(mlive)), "graph_max_live_peak": int(np.max(mlive)),
    "resident_steps_mean": float(np.mean(mres)), "resident_steps_peak_mean": float(np.mean(pres)),
    "resident_steps_peak_max": int(np.max(pres)),
    "fraction_steps_evicted_mean": float(np.mean(frac_steps_evicted)),
    "merged_steps_total": merged,
    "fraction_solution_tokens_dead_at_end_mean": float(np.mean(dead_end)),
    "live_kv_vs_dense_solution_only_mean": float(np.mean(live_mean)),
    "live_kv_vs_dense_with_prompt_mean": float(np.mean(live_mean_prompt)),
  }
  print(json.dumps(rep, indent=1))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(rep, f, indent=1)


if __name__ == "__main__":
  main()
