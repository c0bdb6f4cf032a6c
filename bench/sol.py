r"""SOL (issue 22): quality vs achieved compute budget of the trained policy against SOL's two
baselines at the same budget and dense, plus wall-clock per decode step vs dense.

Held-back text: chat-formatted GSM8K *test* solutions and MATH-500 solutions (never in SOL
training), one window of ``context_len + T + 1`` tokens per example; every system runs the same
teacher-forced episodes on the engine (:class:`~selforch_jax.runtime.schedulers.sol.
SOLEpisodeScheduler`: dense prefill of the context, then T steps under the system's compute
schedule; its own steps' K/V feed later steps). Per target budget:

* ``policy``: the SOL adapter's policy, greedy, conditioned on the target (with
  ``--budget_guard=TOL``: under the decode-time budget guard, :class:`~selforch_jax.runtime.
  sol_control.BudgetController`; the baselines below then match the guarded actions);
* ``uniform``: one static action every step (upstream ``evaluate_fixed_matched_keep``): kappa and
  rho = the policy's mean nominal kappa / rho on this text, bits = its mean bits rounded;
* ``random``: the policy's own actions on this text shuffled across steps and windows (a random
  schedule with exactly the policy's nominal budget; upstream ``eval_random_alloc.py``);

and ``dense``. Quality: perplexity ``exp(mean NLL)`` of the T target tokens, with a percentile
bootstrap 95% CI over windows, and the paired bootstrap CI of the NLL difference policy -
uniform / policy - random. Budgets: achieved (applied usage) ``[kappa, rho, bits]`` and the
tracking error ``|achieved - target|`` (usage units) of the mean over all windows' steps, and
``tracking_error_rows``: the mean over windows of each window's own ``|achieved - target|``. Wall-clock: seconds per decode step of
one SOL action vs the plain dense step at the same kv length (masks and fake-quant are
simulated on the reference attention path: no saving is expected; the machine's load is
recorded).

Run:
  python bench/sol.py --adapter=adapters/sol_smollm2_135m --n=24 --out=bench/results
  python bench/sol.py --adapter=adapters/sol_smollm2_135m --n=40 --batch=16 --budget_guard=0.02 \
      --timing_reps=0 --name=sol_guard_cpu        # policy + budget guard; no step timing
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import loadavg, machine_info, write_result  # noqa: E402


def episodes(engine, seqs, actor, grid, sparsity, Lc, batch):
  """NLL ``[n, T]`` and applied usage ``[n, T, 3]`` of ``seqs`` under ``actor`` (rows in order)."""
  from selforch_jax.runtime.scheduler import run_job
  from selforch_jax.runtime.schedulers.sol import SOLEpisodeScheduler
  nll, use = [], []
  for s in range(0, len(seqs), batch):
    part = seqs[s:s + batch]
    ep = SOLEpisodeScheduler(part, Lc, actor.rows(s, s + len(part)), grid, sparsity,
                             rollouts=1, reference=False)
    run_job(engine, ep)
    nll.append(-ep.logp[:, 0])
    use.append(ep.usage[:, 0])
  return np.concatenate(nll), np.concatenate(use)


class Rows:
  """Make a fresh actor for rows ``[a, b)`` of the evaluation set."""

  def __init__(self, make):
    self.make = make
    self.actors = []

  def rows(self, a, b):
    act = self.make(a, b)
    self.actors.append(act)
    return act


def step_timing(engine, model, grid, sparsity, action, kv_len, rows, reps):
  """Median seconds of one decode step of ``rows`` queries at ``kv_len`` keys each: the plain
  step and the step under ``action`` (every row), measured alternately."""
  from selforch_jax.runtime.step import ForwardSpec
  engine.reset()
  vis = np.eye(rows, dtype=bool)
  bidir = np.zeros(rows, bool)
  rng = np.random.default_rng(0)
  for r in range(rows):
    engine.run_step(rng.integers(1, 1000, kv_len), np.arange(kv_len), np.full(kv_len, r), r,
                    vis, bidir, spec=ForwardSpec(outputs=("hidden",)))
  spec = grid.spec(np.full(rows, action), sparsity)
  times = {"dense": [], "sol": []}
  for i in range(reps + 2):
    for name, sp in (("dense", None), ("sol", spec)):
      toks = rng.integers(1, 1000, rows)
      t0 = time.perf_counter()
      out, slots = engine.run_step(toks, np.full(rows, kv_len), np.arange(rows), np.arange(rows),
                                   vis, bidir, spec=sp)
      (out if sp is None else out["logits"]).block_until_ready()
      dt = time.perf_counter() - t0
      for r in range(rows):
        engine.pool.rollback(r, 1)
      if i >= 2:
        times[name].append(dt)
  return {k: float(np.median(v)) for k, v in times.items()}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--adapter", default="adapters/sol_smollm2_135m")
  ap.add_argument("--n", type=int, default=24, help="windows per source (GSM8K test, MATH-500)")
  ap.add_argument("--targets", default="0.5,0.8,8;0.75,0.9,12;0.6,0.7,6;1.0,1.0,10")
  ap.add_argument("--batch", type=int, default=12)
  ap.add_argument("--timing_reps", type=int, default=10, help="0: no step timing")
  ap.add_argument("--budget_guard", type=float, default=None,
                  help="the policy under the decode-time budget guard at this tolerance (usage "
                       "units, >= 0); default: no guard")
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--name", default="sol_cpu")
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  from selforch_jax.runtime.sol_control import budget_guard_option
  try:   # the decode CLI's check (>= 0, finite); the bench passes the tolerance itself on
    budget_guard_option(a.budget_guard)
  except ValueError as e:
    ap.error(f"--budget_guard: {e}")
  if a.timing_reps < 0:
    ap.error(f"--timing_reps must be >= 0, got {a.timing_reps}")

  import jax
  import ml_collections

  from selforch_jax import config_lib
  from selforch_jax.eval.stats import bootstrap_ci, paired_bootstrap_diff
  from selforch_jax.runtime.engine import Engine
  from selforch_jax.runtime.sol_actions import ActionGrid, budget_triple, parse_budget
  from selforch_jax.runtime.sol_control import BudgetController, ScheduleActor
  from selforch_jax.sol_adapter import load_sol_policy
  from selforch_jax.trainers.sol_run import windows

  t_start = time.perf_counter()
  policy, grid, sparsity, meta = load_sol_policy(a.adapter)
  tr = meta["training"]["sol"]
  Lc, T = int(tr["context_len"]), int(tr["rollout_len"])
  _, model, tok = config_lib.load_model(ml_collections.ConfigDict(meta["model"]))
  L = Lc + T + 1
  seqs = np.concatenate([windows(tok, [("gsm8k", a.n)], L, seed=a.seed, split="test"),
                         _math500_windows(tok, a.n, L, a.seed)])
  n = len(seqs)
  page = 16
  engine = Engine(model, num_pages=a.batch * (-(-L // page) + 1) + 8, page_size=page,
                  attention="reference")
  embed = model.embed[...]
  dense_idx = grid.dense_idx

  def fixed(actions_all):
    return Rows(lambda s, e: ScheduleActor(grid, actions_all[s:e]))

  res = {"dense": None, "budgets": []}
  nll_d, use_d = episodes(engine, seqs, fixed(np.full((n, T), dense_idx)), grid, sparsity, Lc,
                          a.batch)
  res["dense"] = dict(ppl=float(np.exp(nll_d.mean())),
                      nll_ci=bootstrap_ci(nll_d.mean(1), n_boot=2000),
                      achieved_budget=budget_triple(use_d.reshape(-1, 3).mean(0)))
  rng = np.random.default_rng(a.seed)
  for tstr in a.targets.split(";"):
    tg = parse_budget(tstr)
    pol = Rows(lambda s, e: BudgetController(policy, grid, np.tile(tg, (e - s, 1)), T, embed,
                                             greedy=True, budget_guard=a.budget_guard,
                                             sparsity=sparsity))
    nll_p, use_p = episodes(engine, seqs, pol, grid, sparsity, Lc, a.batch)
    # the policy's actions, [n, T] (rows of each batch's controller, in order)
    acts = np.concatenate([np.stack(act.history, 1) for act in pol.actors])
    vals = grid.values(acts.reshape(-1))
    k_u, r_u = float(vals[:, 0].mean()), float(vals[:, 1].mean())
    b_u = int(np.clip(np.round(vals[:, 2].mean()), 2, 16))
    ugrid = ActionGrid(tuple(sorted({round(k_u, 4), 1.0})), tuple(sorted({round(r_u, 4), 1.0})),
                       tuple(sorted({b_u, 16})))
    u_idx = int(np.flatnonzero((ugrid.table[:, 0] == round(k_u, 4))
                               & (ugrid.table[:, 1] == round(r_u, 4))
                               & (ugrid.table[:, 2] == b_u))[0])
    nll_u, use_u = episodes(engine, seqs, Rows(lambda s, e: ScheduleActor(
        ugrid, np.full((e - s, T), u_idx))), ugrid, sparsity, Lc, a.batch)
    shuffled = rng.permutation(acts.reshape(-1)).reshape(acts.shape)
    nll_r, use_r = episodes(engine, seqs, fixed(shuffled), grid, sparsity, Lc, a.batch)
    row = dict(target_budget=budget_triple(tg))
    for name, nll, use in (("policy", nll_p, use_p), ("uniform", nll_u, use_u),
                           ("random", nll_r, use_r)):
      ach = use.reshape(-1, 3).mean(0)
      ci = bootstrap_ci(nll.mean(1), n_boot=2000)
      row_err = np.abs(use.mean(1) - tg).mean(0)
      row[name] = dict(ppl=float(np.exp(nll.mean())),
                       ppl_ci=[float(np.exp(ci["lo"])), float(np.exp(ci["hi"]))],
                       achieved_budget=budget_triple(ach),
                       tracking_error=[round(float(x), 4) for x in np.abs(ach - tg)],
                       tracking_error_rows=[round(float(x), 4) for x in row_err])
    row["uniform"]["action"] = [k_u, r_u, b_u]
    row["policy"]["nominal_budget"] = [round(k_u, 4), round(r_u, 4),
                                       round(float(vals[:, 2].mean()), 4)]
    if a.budget_guard is not None:   # the guard's predicted usage of the actions it allowed
      pred = sum(act.predicted_sum.sum(0) for act in pol.actors)
      steps = sum(int(act.eff_steps.sum()) for act in pol.actors)
      row["policy"]["guard_predicted_budget"] = budget_triple(pred / max(steps, 1))
    row["policy_minus_uniform_nll"] = paired_bootstrap_diff(nll_p.mean(1), nll_u.mean(1),
                                                            n_boot=2000)
    row["policy_minus_random_nll"] = paired_bootstrap_diff(nll_p.mean(1), nll_r.mean(1),
                                                           n_boot=2000)
    row["policy_action_hist"] = np.bincount(acts.reshape(-1), minlength=grid.num_actions).tolist()
    res["budgets"].append(row)
    print(tstr, {k: (row[k]["ppl"], row[k]["achieved_budget"]) for k in
                 ("policy", "uniform", "random")}, file=sys.stderr)
  timing = []
  for action_tag in ("k050-s080-q8", "k025-s060-q6"):
    if action_tag in grid.tags() and a.timing_reps > 0:
      idx = grid.tags().index(action_tag)
      for rows in (1, 8):
        t = step_timing(engine, model, grid, sparsity, idx, Lc + T, rows, a.timing_reps)
        timing.append(dict(action=action_tag, rows=rows, kv_len=Lc + T, **t,
                           sol_over_dense=t["sol"] / t["dense"], loadavg=loadavg()))
  result = dict(
      system="sol", adapter=a.adapter, model=meta["model"].get("preset"),
      adapter_metrics=meta.get("metrics", {}).get("summary"),
      grid={"kappas": list(grid.kappas), "rhos": list(grid.rhos), "bits": list(grid.bits)},
      sparsity=sparsity, context_len=Lc, rollout_len=T, budget_guard=a.budget_guard,
      data=dict(gsm8k_test=a.n, math500=len(seqs) - a.n, windows=n,
                note="chat-formatted question + reference solution, one window per example"),
      dense=res["dense"], budgets=res["budgets"], step_timing=timing,
      wall_s=round(time.perf_counter() - t_start, 1), machine=machine_info(), loadavg=loadavg(),
      jax_backend=jax.default_backend(),
      command="python bench/sol.py " + " ".join(sys.argv[1:] if argv is None else argv))
  os.makedirs(a.out, exist_ok=True)
  write_result(result, a.out, a.name + ".json")
  plot(result, os.path.join(a.out, a.name + ".png"))


def _math500_windows(tok, n, L, seed):
  """Windows of MATH-500 problems + solutions (the dataset's test file)."""
  from selforch_jax.data.sources import load_examples
  rng = np.random.default_rng(seed)
  out = []
  for ex in load_examples("math500", split="test", max_examples=4 * n):
    ids = tok.encode_chat(ex["messages"], add_generation_prompt=False)
    if len(ids) >= L:
      end = int(rng.integers(L, len(ids) + 1))
      out.append(ids[end - L:end])
    if len(out) == n:
      break
  return np.asarray(out, np.int32)


def plot(result, path):
  """Perplexity vs achieved budget, one panel per axis (kappa, rho, bits)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
  marks = {"policy": ("o", "C0"), "uniform": ("s", "C1"), "random": ("^", "C2")}
  for i, (ax, name) in enumerate(zip(axes, ("kappa (attention keep)", "rho (MLP channel keep)",
                                            "bits (MLP output)"))):
    for sys_name, (m, c) in marks.items():
      xs = [b[sys_name]["achieved_budget"][i] for b in result["budgets"]]
      ys = [b[sys_name]["ppl"] for b in result["budgets"]]
      lo = [b[sys_name]["ppl"] - b[sys_name]["ppl_ci"][0] for b in result["budgets"]]
      hi = [b[sys_name]["ppl_ci"][1] - b[sys_name]["ppl"] for b in result["budgets"]]
      ax.errorbar(xs, ys, yerr=[lo, hi], fmt=m, color=c, label=sys_name if i == 0 else None,
                  capsize=3)
    d = result["dense"]
    ax.scatter([d["achieved_budget"][i]], [d["ppl"]], marker="*", s=150, color="k",
               label="dense" if i == 0 else None)
    ax.set_xlabel(f"achieved {name}")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel(f"perplexity (n={result['data']['windows']} windows x "
                     f"{result['rollout_len']} tokens)")
  axes[0].legend()
  guard = result.get("budget_guard")
  fig.suptitle(f"SOL on {result['model']}: held-back GSM8K test + MATH-500 text, CPU"
               + ("" if guard is None else f"; policy under the budget guard (tol {guard})"))
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  main()
