r"""TIP evaluation: accuracy vs live KV for TIP and KV-budget baselines, in one run (issue 6).

``python -m selforch_jax.eval --config=configs/eval_tip.py --workdir=DIR`` runs, per dataset
(GSM8K test, the synthetic chained-arithmetic task, MATH-500, AIME: any name of
``data.sources.DATASETS`` with a test file), on the same fixed subset ``rows[offset:offset+n]``:

* ``tip``: the TIP model through :class:`~selforch_jax.runtime.schedulers.tip.TIPScheduler` (register tags
  evict dead steps);
* ``dense``: the dense model with the full KV cache;
* ``streaming_llm``, ``h2o``, ``paged_h2o``: the dense model under a live-KV budget
  (:mod:`selforch_jax.runtime.schedulers.kv_policies`).

**Matched budget** (``eval.budget``): per problem, ``"tip_mean"`` = ceil of TIP's mean live KV on
that problem (tokens, prompt included), ``"tip_peak"`` = TIP's peak, or a fixed integer (a string
of digits) for every problem. Budgets are at least ``n_sink + 2`` tokens.

Reported per system (``DIR/tip_eval.json``): exact-match accuracy (``eval/answers.py`` answer
extraction on the tag-stripped output, :func:`~selforch_jax.lang.assemble.assemble` order) with a
bootstrap 95% CI and n; live KV per problem (mean and peak, tokens and bytes; averaged over
problems, and the largest peak); decode wall-clock (``decode_s``: every scheduler run of the
system, prefill included, compiles excluded: each engine program is compiled by a warm-up first)
and generated tokens; the budget used. Per dataset also the paired differences TIP - each system (bootstrap CI) and the live-KV
reduction of TIP vs dense, and (``eval.teacher_forced``) the live KV of the *reference*
solutions with register tags teacher-forced through TIP (the synthetic task's own annotation,
the ``tip_gsm8k`` annotator for GSM8K): what eviction saves when the model writes the annotated
solution, measurable before any training. Per-problem records go to ``DIR/tip_<dataset>_<system>.jsonl`` and
the plot of accuracy vs mean live KV to ``DIR/tip_accuracy_vs_live_kv.png``.

Models: ``tip`` / ``dense`` are training workdirs (latest checkpoint, LoRA merged), adapter or
HF directories; empty = the base model of ``model`` (with tag rows when ``model.tags``), so the
command runs before any training. ``tip_for.<dataset>`` / ``dense_for.<dataset>`` override them
for one dataset (e.g. models trained on GSM8K and on the synthetic task, in one run); each
directory is loaded once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import ml_collections
import numpy as np

from selforch_jax import config_lib

SYSTEMS = ("tip", "dense", "streaming_llm", "h2o", "paged_h2o")


def defaults() -> ml_collections.ConfigDict:
  """Keys of a TIP eval config (``kind="tip"`` selects this module in ``python -m
  selforch_jax.eval``).

  model: the base model (``config_lib.model_defaults``; ``tags`` on so TIP has register rows);
  tip / dense: model directories (``""`` = the base model); tip_for / dense_for: per-dataset
  overrides (``tip_for.synthetic_chain=DIR``; ``""`` = use ``tip`` / ``dense``); eval: ``datasets``
  (comma-separated), ``n`` / ``offset`` (fixed subset), ``max_new_tokens``, ``batch_size``
  (requests decoded together), ``systems`` (comma-separated subset of
  ``tip,dense,streaming_llm,h2o,paged_h2o``), ``budget`` (``tip_mean``, ``tip_peak`` or an
  integer string), ``n_sink`` (StreamingLLM sinks), ``recent_ratio`` (H2O window share),
  ``page_size`` (KV page tokens), ``temperature`` / ``seed`` (0 = greedy), ``n_boot``,
  ``system_prompt``, ``prompt_suffix``, ``teacher_forced`` (also teacher-force the reference
  solutions with register tags through TIP: :func:`teacher_forced_live_kv`).
  """
  from selforch_jax.data.sources import DATASETS
  mc = config_lib.model_defaults()
  mc.tags = True
  per_dataset = {d: "" for d, v in DATASETS.items() if "test" in v[1]}
  return ml_collections.ConfigDict(dict(
      kind="tip", model=mc, tip="", dense="", tip_for=dict(per_dataset),
      dense_for=dict(per_dataset),
      eval=dict(datasets="gsm8k,synthetic_chain", n=300, offset=0, max_new_tokens=256,
                batch_size=8, systems=",".join(SYSTEMS), budget="tip_mean", n_sink=4,
                recent_ratio=0.5, page_size=16, temperature=0.0, seed=0, n_boot=10000,
                system_prompt="", prompt_suffix="", teacher_forced=True),
  ))


def _list(s: str) -> list[str]:
  return [x.strip() for x in s.split(",") if x.strip()]


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ``config_lib.ConfigError`` naming the bad key, before any work."""
  from selforch_jax.data.sources import DATASETS
  config_lib.validate(config, defaults())
  config_lib.validate_model(config.model)
  ec = config.eval
  for d in _list(ec.datasets):
    if d not in DATASETS or "test" not in DATASETS[d][1]:
      known = sorted(k for k, v in DATASETS.items() if "test" in v[1])
      raise config_lib.ConfigError(f"eval.datasets: {d!r} has no test file; known: {known}")
  if not _list(ec.datasets):
    raise config_lib.ConfigError("eval.datasets is empty")
  systems = _list(ec.systems)
  bad = [s for s in systems if s not in SYSTEMS]
  if bad or not systems:
    raise config_lib.ConfigError(f"eval.systems: unknown {bad}; known: {list(SYSTEMS)}")
  if ec.budget in ("tip_mean", "tip_peak"):
    if "tip" not in systems and any(s in systems for s in SYSTEMS[2:]):
      raise config_lib.ConfigError(f"eval.budget={ec.budget!r} needs 'tip' in eval.systems")
  elif not (ec.budget.isdigit() and int(ec.budget) >= ec.n_sink + 2):
    raise config_lib.ConfigError(
        f"eval.budget={ec.budget!r} must be 'tip_mean', 'tip_peak' or an integer >= n_sink + 2")
  if min(ec.n, ec.batch_size, ec.max_new_tokens, ec.page_size) < 1 or ec.n_sink < 0:
    raise config_lib.ConfigError("eval.n, batch_size, max_new_tokens, page_size must be >= 1")
  if ec.offset < 0:
    raise config_lib.ConfigError(f"eval.offset={ec.offset} must be >= 0")
  if not 0.0 <= ec.recent_ratio < 1.0 or ec.temperature < 0:
    raise config_lib.ConfigError("eval.recent_ratio must be in [0, 1), temperature >= 0")
  from selforch_jax.eval.run import MODEL_DIRS, is_model_dir
  bad = []  # every model path that is no model directory, named in one error
  for key in ("tip", "dense"):
    paths = [(key, config[key])] + [(f"{key}_for.{d}", p) for d, p in config[key + "_for"].items()]
    bad += [f"{k}={p!r}" for k, p in paths if p and not is_model_dir(p)]
  if bad:
    raise config_lib.ConfigError(f"{', '.join(bad)}: each is {MODEL_DIRS}")


def model_paths(config: ml_collections.ConfigDict, dataset: str) -> dict[str, str]:
  """The ``tip`` and ``dense`` model directories for ``dataset`` (``""`` = the base model):
  ``tip_for.<dataset>`` / ``dense_for.<dataset>`` when set, else ``tip`` / ``dense``; an unset
  dense model is the TIP model (the untrained-base comparison)."""
  tip = config.tip_for.get(dataset) or config.tip
  dense = config.dense_for.get(dataset) or config.dense or tip
  return {"tip": tip, "dense": dense}


def _load_models(config, paths: dict[str, str], cache: dict) -> dict:
  """``{"tip": (model, tok, tv), "dense": ...}`` for ``paths`` (see :func:`model_paths`), each
  directory loaded once into ``cache``.

  Raises:
    config_lib.ConfigError: a model without a tokenizer, or a TIP model without register tags.
  """
  from selforch_jax.eval.run import load_finetuned
  from selforch_jax.lang.tags import TagVocab
  models = {}
  for key in ("tip", "dense"):
    path = os.path.normpath(paths[key]) if paths[key] else ""
    if path not in cache:
      model, tok = load_finetuned(path) if path else config_lib.load_model(config.model)[1:]
      if tok is None:
        raise config_lib.ConfigError(f"the {key} model ({path or 'base'}) has no tokenizer")
      try:
        tv = TagVocab.from_tokenizer(tok)
      except KeyError:
        tv = None
      cache[path] = (model, tok, tv)
    if key == "tip" and cache[path][2] is None:
      raise config_lib.ConfigError(
          f"the TIP model ({path or 'base'}) has no register tags: set model.tags=True "
          "or pass a TIP training workdir")
    models[key] = cache[path]
  return models


def question_texts(rows, prompt_suffix: str) -> list[str]:
  """The last user turn of each converted test row, ``prompt_suffix`` added: the ``question``
  of the per-problem records."""
  from selforch_jax.data.sources import prompt_and_reference
  return [prompt_and_reference(r)[0][-1]["content"] + prompt_suffix for r in rows]


def _prompts(rows, tok, ec) -> tuple[list[list[int]], list[str], list[str]]:
  """Chat prompts (generation prompt added), reference answers and question texts."""
  from selforch_jax.data.sources import prompt_and_reference
  prompts, refs, questions = [], [], []
  for r, q in zip(rows, question_texts(rows, ec.prompt_suffix)):
    msgs, ref = prompt_and_reference(r)
    msgs[-1] = dict(msgs[-1], content=q)
    if ec.system_prompt:
      msgs.insert(0, {"role": "system", "content": ec.system_prompt})
    prompts.append(tok.encode_chat(msgs, add_generation_prompt=True))
    refs.append(str(r.get("answer", ref)))
    questions.append(q)
  return prompts, refs, questions


def pages_per_request(prompt_len: int, max_new: int, page_size: int, num_registers: int) -> int:
  """KV pages one request may hold: its tokens, plus one partly filled page per live register
  step (TIP starts each step on a fresh page) and a margin of 4 (prompt, current step, joins)."""
  from selforch_jax.runtime.build import pool_pages
  return pool_pages([prompt_len], max_new, page_size, threads=num_registers + 6)


def _warm_up(engine, prompt_lens, batch: int, attn_mass: bool = True) -> None:
  """Compile every program the runs will use (without and, with ``attn_mass``, with the
  attention mass H2O reads; the prefill buckets of these prompts and decode buckets 1..batch,
  at every key window: :meth:`Engine.warm_up`), so the timed runs exclude compiles."""
  engine.warm_up(list(prompt_lens) + list(range(1, batch + 1)),
                 (False, True) if attn_mass else (False,))


def run_system(system: str, engine, prompts, tv, ec, stop_ids, budgets=None) -> dict:
  """Decode ``prompts`` with one system in batches of ``ec.batch_size``.

  Returns:
    ``{"results": [GenerationResult], "kv": [per-request kv dict], "decode_s": float}``.
  """
  from selforch_jax.runtime.sampling import SamplingParams
  from selforch_jax.runtime.schedulers.kv_policies import PolicyScheduler, make_policy
  from selforch_jax.runtime.scheduler import run
  from selforch_jax.runtime.schedulers.tip import TIPScheduler

  sampling = SamplingParams(temperature=float(ec.temperature), seed=int(ec.seed))
  results, kv, secs = [], [], 0.0
  from selforch_jax.progress import progress
  for s in progress(range(0, len(prompts), ec.batch_size), f"tip eval {system}", unit="batch"):
    batch = prompts[s:s + ec.batch_size]
    if system == "tip":
      sched = TIPScheduler(engine, batch, tv, ec.max_new_tokens, sampling, stop_ids)
    else:
      pols = []
      for j in range(len(batch)):
        if system == "dense":
          pols.append(make_policy("dense"))
          continue
        extra = ({"n_sink": ec.n_sink} if system == "streaming_llm"
                 else {"recent_ratio": ec.recent_ratio})
        pols.append(make_policy(system, budgets[s + j], **extra))
      sched = PolicyScheduler(engine, batch, pols, ec.max_new_tokens, sampling, stop_ids)
    t0 = time.perf_counter()
    run(engine, sched)
    secs += time.perf_counter() - t0
    for o in sched.owners:
      engine.pool.free_owner(int(o))
    results += sched.results
    kv += sched.kv_stats
    print(f"    {system}: {len(results)}/{len(prompts)}", file=sys.stderr)
  return {"results": results, "kv": kv, "decode_s": secs}


def annotated_references(rows, dataset: str, num_registers: int) -> list[str] | None:
  """The reference solutions with register tags: the row's own annotation (synthetic chain),
  else the ``tip_gsm8k`` annotator on a GSM8K solution (a solution it cannot annotate stays
  plain); None for a dataset with neither (MATH-500 / AIME references have no steps to tag)."""
  from selforch_jax.lang.annotators import get_annotator
  out = []
  ann = get_annotator("tip_gsm8k", num_registers=num_registers) if dataset == "gsm8k" else None
  from selforch_jax.progress import progress
  for r in progress(rows, f"tip prompts {dataset}", unit="problem"):
    msgs = r["messages"]
    if msgs[-1]["role"] != "assistant":
      return None
    q, sol = msgs[-2]["content"], msgs[-1]["content"]
    if "<reg_" not in sol:
      if ann is None:
        return None
      sol = ann.annotate(q, sol).text or sol
    out.append(sol)
  return out


def teacher_forced_live_kv(engine, prompts, solutions, tok, tv, ec) -> dict:
  """Teacher-force ``solutions`` (+ end of turn) through :class:`TIPScheduler`: the live KV that
  TIP's eviction gives on the reference register annotations, against dense (which keeps every
  token: ``P + k`` live tokens after step k), and the mean log-probability of the solution
  tokens under eviction.

  Returns:
    ``n``, ``tip_live_kv_mean_tokens`` / ``..._peak_tokens``, ``dense_live_kv_mean_tokens`` /
    ``..._peak_tokens`` (averages over problems), ``reduction_mean`` / ``reduction_peak``
    (1 - TIP / dense), ``response_reduction_mean`` (the same over the response tokens only,
    prompt excluded; from ``tip_`` / ``dense_response_live_kv_mean_tokens``), ``mean_logprob``,
    ``killed_share`` (share of response tokens evicted by the end), ``decode_s``.
  """
  from selforch_jax.runtime.scheduler import run
  from selforch_jax.runtime.schedulers.tip import TIPScheduler
  forced = [tok.encode(s) + [tok.stop_ids[-1]] for s in solutions]
  tip_m, tip_p, den_m, den_p, resp_t, resp_d, lps, killed = [], [], [], [], [], [], [], []
  secs = 0.0
  from selforch_jax.progress import progress
  for s in progress(range(0, len(prompts), ec.batch_size), "tip forced", unit="batch"):
    bp, bf = prompts[s:s + ec.batch_size], forced[s:s + ec.batch_size]
    sched = TIPScheduler(engine, bp, tv, forced=bf, stop_ids=())
    t0 = time.perf_counter()
    run(engine, sched)
    secs += time.perf_counter() - t0
    for i, (p, f) in enumerate(zip(bp, bf)):
      live = np.asarray(sched.live_trace[i], np.float64)
      dense = len(p) + np.arange(live.size, dtype=np.float64)
      tip_m.append(live.mean())
      tip_p.append(live.max())
      den_m.append(dense.mean())
      den_p.append(dense.max())
      resp_t.append((live - len(p)).clip(min=0).mean())
      resp_d.append((dense - len(p)).mean())
      lps.append(float(np.mean(sched.results[i].logprobs)))
      lay = sched.layout(i)
      killed.append(float((lay.kill_at[len(p):] < lay.num_tokens).mean()))
    for o in sched.owners:
      engine.pool.free_owner(int(o))
  return teacher_forced_figures(
      {"n": len(prompts), "tip_live_kv_mean_tokens": float(np.mean(tip_m)),
       "tip_live_kv_peak_tokens": float(np.mean(tip_p)),
       "dense_live_kv_mean_tokens": float(np.mean(den_m)),
       "dense_live_kv_peak_tokens": float(np.mean(den_p)),
       "tip_response_live_kv_mean_tokens": float(np.mean(resp_t)),
       "dense_response_live_kv_mean_tokens": float(np.mean(resp_d)),
       "mean_logprob": float(np.mean(lps)), "killed_share": float(np.mean(killed)),
       "decode_s": round(secs, 2)})


TEACHER_FORCED_MEANS = ("tip_live_kv_mean_tokens", "tip_live_kv_peak_tokens",
                        "dense_live_kv_mean_tokens", "dense_live_kv_peak_tokens",
                        "tip_response_live_kv_mean_tokens", "dense_response_live_kv_mean_tokens",
                        "mean_logprob", "killed_share")


def teacher_forced_figures(means: dict) -> dict:
  """``means`` (``n``, ``decode_s`` and the :data:`TEACHER_FORCED_MEANS`: averages over
  problems) plus the reductions of TIP vs dense computed from them: ``reduction_mean``,
  ``reduction_peak`` and ``response_reduction_mean`` (``1 - TIP / dense``)."""
  m = dict(means)
  m["reduction_mean"] = 1.0 - m["tip_live_kv_mean_tokens"] / m["dense_live_kv_mean_tokens"]
  m["reduction_peak"] = 1.0 - m["tip_live_kv_peak_tokens"] / m["dense_live_kv_peak_tokens"]
  m["response_reduction_mean"] = 1.0 - (m["tip_response_live_kv_mean_tokens"]
                                        / max(m["dense_response_live_kv_mean_tokens"], 1e-9))
  return m


def _budgets(ec, tip_kv: list[dict] | None, n: int) -> list[int]:
  lo = ec.n_sink + 2
  if ec.budget == "tip_mean":
    return [max(lo, math.ceil(k["mean_live_tokens"])) for k in tip_kv]
  if ec.budget == "tip_peak":
    return [max(lo, int(k["peak_live_tokens"])) for k in tip_kv]
  return [int(ec.budget)] * n


def evaluate_dataset(dataset: str, models: dict, ec, workdir: str) -> dict:
  """All systems on one dataset (see the module docstring); writes the per-problem JSONL."""
  from selforch_jax.data.sources import load_examples
  from selforch_jax.eval.answers import extract_answer, is_correct
  from selforch_jax.lang.assemble import assemble
  from selforch_jax.runtime.engine import Engine

  rows = load_examples(dataset, split="test", max_examples=ec.offset + ec.n)[ec.offset:]
  systems = _list(ec.systems)
  out = {"n": len(rows), "subset": [ec.offset, ec.offset + len(rows)], "systems": {}}
  correct, tip_kv = {}, None
  engines = {}
  solutions = None
  if ec.teacher_forced and models["tip"][2] is not None:
    solutions = annotated_references(rows, dataset, models["tip"][2].num_registers)
  order = (["teacher_forced"] if solutions is not None else []) + systems
  for system in order:
    model, tok, tv = models["dense" if system in SYSTEMS[1:] else "tip"]
    prompts, refs, questions = _prompts(rows, tok, ec)
    B = min(ec.batch_size, len(prompts))
    key = id(model)
    if key not in engines:
      K = tv.num_registers if tv is not None else 0
      longest = ec.max_new_tokens
      if solutions is not None and model is models["tip"][0]:
        longest = max(longest, max(len(tok.encode(x)) + 1 for x in solutions))
      per = pages_per_request(max(map(len, prompts)), longest, ec.page_size, K)
      h2o = any(x in systems for x in ("h2o", "paged_h2o"))
      # H2O reads attention mass from the dense-mask path; otherwise the engine's default
      # ("auto": the Pallas paged kernel on a GPU, whose compiles are then not warmed up)
      engines[key] = Engine(model, num_pages=B * per, page_size=ec.page_size,
                            attention="reference" if h2o else "auto")
      t0 = time.perf_counter()
      if engines[key].attention == "reference":
        _warm_up(engines[key], [len(p) for p in prompts], B, attn_mass=h2o)
      print(f"  compiled {dataset} programs in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    engine = engines[key]
    if system == "teacher_forced":
      print(f"  {dataset}: reference solutions teacher-forced through TIP", file=sys.stderr)
      out["teacher_forced"] = teacher_forced_live_kv(engine, prompts, solutions, tok, tv, ec)
      continue
    budgets = None
    if system not in ("tip", "dense"):
      budgets = _budgets(ec, tip_kv, len(prompts))
    print(f"  {dataset}: {system} on {len(prompts)} problems", file=sys.stderr)
    res = run_system(system, engine, prompts, tv, ec, tok.stop_ids, budgets)
    recs = []
    for j, (r, k) in enumerate(zip(res["results"], res["kv"])):
      ids = assemble(r.token_ids, tv) if tv is not None else r.token_ids
      text = tok.decode(ids, skip_special_tokens=True)
      recs.append({"question": questions[j], "reference": refs[j], "output": text,
                   "raw": tok.decode(r.token_ids),  # register tags written
                   "extracted": extract_answer(text), "correct": bool(is_correct(text, refs[j])),
                   "finish_reason": r.finish_reason, "new_tokens": len(r.token_ids),
                   "prompt_tokens": len(prompts[j]),
                   "budget": None if budgets is None else budgets[j], **k})
    with open(os.path.join(workdir, f"tip_{dataset}_{system}.jsonl"), "w", encoding="utf-8") as f:
      for x in recs:
        f.write(json.dumps(x, ensure_ascii=False) + "\n")
    if system == "tip":
      tip_kv = res["kv"]
    correct[system] = np.array([x["correct"] for x in recs], np.float64)
    out["systems"][system] = system_summary(recs, res["decode_s"], ec.n_boot, ec.seed)
  compare_systems(out, correct, ec.n_boot, ec.seed)
  return out


def system_summary(recs: list[dict], decode_s: float, n_boot: int, seed: int) -> dict:
  """One system's figures from its per-problem records (the ``tip_<dataset>_<system>.jsonl``
  rows): accuracy with a bootstrap 95% CI and n, live KV (tokens and bytes; means over problems
  and the largest peak), prompt length, budget, decode seconds and tokens per second.

  Raises:
    ValueError: no records.
  """
  from selforch_jax.eval.stats import bootstrap_ci, format_ci
  if not recs:
    raise ValueError("system_summary: no records")
  acc = bootstrap_ci(np.array([x["correct"] for x in recs], np.float64), n_boot=n_boot, seed=seed)
  mean = lambda key: float(np.mean([x[key] for x in recs]))  # noqa: E731
  budgets = [x["budget"] for x in recs if x["budget"] is not None]
  new = sum(x["new_tokens"] for x in recs)
  return {
      "accuracy": acc, "accuracy_str": format_ci(acc),
      "live_kv_mean_tokens": mean("mean_live_tokens"),
      "live_kv_peak_tokens": mean("peak_live_tokens"),
      "live_kv_max_peak_tokens": int(max(x["peak_live_tokens"] for x in recs)),
      "live_kv_mean_bytes": mean("mean_live_bytes"), "live_kv_peak_bytes": mean("peak_live_bytes"),
      "resident_kv_mean_tokens": mean("mean_resident_tokens"),
      "prompt_mean_tokens": mean("prompt_tokens"),
      "budget_mean_tokens": float(np.mean(budgets)) if budgets else None,
      "decode_s": round(decode_s, 2), "new_tokens": new,
      "tokens_per_s": round(new / decode_s, 2) if decode_s else 0.0,
  }


def compare_systems(out: dict, correct: dict, n_boot: int, seed: int) -> None:
  """Adds to one dataset's ``out`` (in place) the paired accuracy differences TIP - each other
  system (``tip_minus``, bootstrap CI over the same problems) and TIP's live-KV reduction vs
  dense (``live_kv_reduction_vs_dense``: mean, peak, and over the response tokens only).
  ``correct``: system -> 0/1 array per problem, in the same problem order. No-op without TIP."""
  from selforch_jax.eval.stats import format_ci, paired_bootstrap_diff
  if "tip" not in correct:
    return
  out["tip_minus"] = {}
  for s in correct:
    if s != "tip":
      d = paired_bootstrap_diff(correct["tip"], correct[s], n_boot=n_boot, seed=seed)
      out["tip_minus"][s] = d | {"str": format_ci(d)}
  if "dense" in correct:
    t, d = out["systems"]["tip"], out["systems"]["dense"]
    # over the response only: both keep the whole prompt, so subtract its length
    out["live_kv_reduction_vs_dense"] = {
        "mean": 1.0 - t["live_kv_mean_tokens"] / d["live_kv_mean_tokens"],
        "peak": 1.0 - t["live_kv_peak_tokens"] / d["live_kv_peak_tokens"],
        "response_mean": 1.0 - (t["live_kv_mean_tokens"] - t["prompt_mean_tokens"])
                         / max(d["live_kv_mean_tokens"] - d["prompt_mean_tokens"], 1e-9)}


def plot(out: dict, path: str) -> None:
  """Accuracy (95% CI error bars) vs mean live KV tokens, one panel per dataset."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ds = list(out["datasets"])
  fig, axes = plt.subplots(1, len(ds), figsize=(5 * len(ds), 4), squeeze=False)
  for ax, d in zip(axes[0], ds):
    for name, m in out["datasets"][d]["systems"].items():
      a = m["accuracy"]
      ax.errorbar([m["live_kv_mean_tokens"]], [a["mean"]],
                  yerr=[[a["mean"] - a["lo"]], [a["hi"] - a["mean"]]], fmt="o", capsize=4,
                  label=name)
    ax.set_xlabel("mean live KV per problem (tokens)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_title(f"{d} (n={out['datasets'][d]['n']})")
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Evaluate every system on every dataset; writes ``tip_eval.json``, JSONL and the plot."""
  validate(config)
  ec = config.eval
  os.makedirs(workdir, exist_ok=True)
  t_all = time.perf_counter()
  cache: dict = {}
  out = {"config": config.to_dict(), "tip_source": config.tip or config.model.weights,
         "dense_source": config.dense or config.tip or config.model.weights, "datasets": {}}
  from selforch_jax.data.sources import load_examples
  for d in _list(ec.datasets):  # a shard's offset past a test file's end fails before any work
    have = len(load_examples(d, split="test", max_examples=ec.offset + 1))
    if have <= ec.offset:
      raise config_lib.ConfigError(
          f"eval.offset={ec.offset}: {d}'s test file has only {have} problems")
  # every model loaded (and checked) before any dataset runs
  runs = []
  for d in _list(ec.datasets):
    paths = model_paths(config, d)
    runs.append((d, paths, _load_models(config, paths, cache)))
  out["model_config"] = dataclasses.asdict(runs[0][2]["tip"][0].cfg)
  for d, paths, models in runs:
    out["datasets"][d] = evaluate_dataset(d, models, ec, workdir)
    out["datasets"][d]["models"] = {k: v or config.model.weights for k, v in paths.items()}
  out["seconds"] = round(time.perf_counter() - t_all, 1)
  plot(out, os.path.join(workdir, "tip_accuracy_vs_live_kv.png"))
  with open(os.path.join(workdir, "tip_eval.json"), "w") as f:
    json.dump(out, f, indent=2)
  return out


def summary(out: dict) -> str:
  """Human-readable lines: per dataset and system, accuracy, live KV, decode time."""
  lines = []
  for d, r in out["datasets"].items():
    lines.append(f"{d} (n={r['n']}):")
    for s, m in r["systems"].items():
      b = "" if m["budget_mean_tokens"] is None else f" budget {m['budget_mean_tokens']:.1f}"
      lines.append(f"  {s:14s} acc {m['accuracy_str']}  live KV mean {m['live_kv_mean_tokens']:.1f}"
                   f" peak {m['live_kv_peak_tokens']:.1f} tokens{b}  decode {m['decode_s']:.1f}s")
    if "teacher_forced" in r:
      t = r["teacher_forced"]
      lines.append(f"  reference solutions teacher-forced through TIP: live KV mean "
                   f"{t['tip_live_kv_mean_tokens']:.1f} vs dense {t['dense_live_kv_mean_tokens']:.1f}"
                   f" (-{100 * t['reduction_mean']:.1f}%; response only "
                   f"-{100 * t['response_reduction_mean']:.1f}%), peak "
                   f"{t['tip_live_kv_peak_tokens']:.1f} vs {t['dense_live_kv_peak_tokens']:.1f}")
    if "live_kv_reduction_vs_dense" in r:
      red = r["live_kv_reduction_vs_dense"]
      lines.append(f"  TIP live KV vs dense: mean -{100 * red['mean']:.1f}%, "
                   f"peak -{100 * red['peak']:.1f}%, response only "
                   f"-{100 * red['response_mean']:.1f}%")
  return "\n".join(lines)
