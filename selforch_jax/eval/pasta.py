"""PASTA evaluation (issue 5): PASTA vs AR, Skeleton-of-Thought and APAR on AlpacaEval prompts.

``python -m selforch_jax.eval --config=configs/eval_pasta.py [--config.n=10] --workdir=DIR``

In one run, batch 1, greedy, on the first ``n`` AlpacaEval instructions
(``data/alpaca_eval``, after ``offset``):

* **AR**: the baseline model (``config.baseline``, a Baseline-SFT workdir; default the base
  model) decoded autoregressively through the engine (:mod:`selforch_jax.runtime.schedulers.ar`);
* **PASTA**: the PASTA model (``config.pasta``; default the base model with tag rows) with
  :class:`~selforch_jax.runtime.schedulers.pasta.PASTAScheduler`;
* **SoT** (:mod:`selforch_jax.runtime.schedulers.sot`) and **APAR** (:mod:`selforch_jax.runtime.schedulers.apar`) on
  the baseline model (both are methods for an untrained-for-PASTA model);
* every run in ``config.pareto`` (``label=workdir,...``: PASTA runs per λ / round; labels
  ``NAME/ROUND`` draw one line per NAME in the plot) decoded with
  PASTA, for the Pareto plot, prompt by prompt beside the main systems (every wall ratio compares
  timings taken under the same machine load; every pareto model is in memory at once).

Each of these paths may be a training workdir, an adapter directory (:mod:`selforch_jax.adapter`)
or a Hugging Face directory.

Figures per system, each with n and a bootstrap 95% CI (:mod:`selforch_jax.eval.stats`):

* ``wall_speedup``: geometric mean over prompts of ``AR wall-clock / system wall-clock`` (the
  CI is the bootstrap CI of the mean log ratio, exponentiated); compiles are excluded (every
  step size the runs use is compiled before timing);
* ``theoretical_speedup``: per prompt, tokens of the sequential (de-tagged) response over the
  forwards on its critical path (PASTA's definition; :class:`~selforch_jax.runtime.schedulers.pasta.
  PastaStats`; SoT/APAR: tokens generated over engine steps); AR is 1;
* ``tokens_per_forward``: every token the engine ran for the response (tags included) per step;
* ``parse_rate``: PASTA: no degradation rule applied, except the ones that close a plan or chunk
  still open when the answer reached ``max_new_tokens`` (an AR answer is cut there too);
  ``parse_rate_strict`` counts those as failures. With ``constrain_tags`` (the default) the
  runtime samples under the tag grammar (:func:`selforch_jax.runtime.schedulers.pasta.tag_grammar`), so the
  rules left are the budget ones (those, and a thread at its cap); an answer forks at most
  ``max_threads`` threads (default 32; PASTA's pool has room for as many partial pages), and a
  promise topic of ``max_topic_tokens`` tokens (default 12; 0 = no limit) must go on with its
  length; SoT:
  the skeleton had numbered points; APAR: at least one fork;
* ``throughput_speedup``: geometric mean over prompts of the system's response tokens (de-tagged)
  per wall-clock second over AR's on the same prompt: the speedup a reader of the answer sees
  when both answers are cut at ``max_new_tokens`` (PASTA's budget counts its tags and plans too;
  prompts where either answer is empty are left out, as their ratio is undefined);
* judge-free quality: ``nll`` — mean per-token negative log-likelihood (nats) of the de-tagged
  response under the baseline model given the chat prompt (one full forward), and its paired
  difference to AR's (``nll_minus_ar``; lower is better). AR's greedy answer is the baseline
  model's own mode, so this measure favours AR over any other model's answer; ``nll_ref`` /
  ``nll_ref_minus_ar`` are the same under ``config.nll_ref`` (default ``"base"``: the base
  weights of ``config.model``, which wrote none of the answers when ``config.baseline`` is a
  tuned run — without one, AR is the base weights and ``nll_ref`` equals ``nll``; a model
  directory with the baseline's tokenizer also works; ``""`` turns it off); ``length`` —
  response tokens;
* ``win_rate`` vs the AR output when ``config.judge.backend`` is set
  (:mod:`selforch_jax.eval.judges`).

``config.forced.n > 0`` adds the forced-plan measurement: a PLAN of ``forced.promises``
promises of length ``forced.length`` is teacher-forced after each of the first ``forced.n``
prompts (prompt + PLAN + ``<async>``), the threads run to their ``</async>`` or cap, the job ends
at the join (``max_rounds=1``), and AR decodes the same number of tokens from the same prompt: tokens per forward and wall-clock ratio of the engine's
parallel threads on these weights.

Outputs: ``DIR/pasta_eval.json`` (every figure + config), ``DIR/pasta_eval_records.jsonl``
(per prompt and system), ``DIR/pasta_pareto.png``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from selforch_jax import config_lib

SYSTEMS = ("ar", "pasta", "sot", "apar")


def defaults() -> ml_collections.ConfigDict:
  """Keys of a PASTA eval config (see the module docstring)."""
  return ml_collections.ConfigDict(dict(
      kind="pasta",
      model=config_lib.model_defaults(),
      pasta="", baseline="", pareto="",
      n=100, offset=0, max_new_tokens=256, systems="ar,pasta,sot,apar",
      page_size=16, cap=256, constrain_tags=True, max_threads=32, max_topic_tokens=12,
      sot=dict(skeleton_tokens=64, point_tokens=64, max_points=6),
      apar=dict(child_tokens=64, max_forks=8),
      judge=dict(backend="", url="", model="", api_key_env="OPENAI_API_KEY"),
      forced=dict(n=0, promises=6, length=3, cap=1),
      nll_ref="base", n_boot=10000, seed=0, warmup=True,
  ))


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ``config_lib.ConfigError`` naming the bad key, before any work."""
  from selforch_jax.eval.run import MODEL_DIRS, is_model_dir
  config_lib.validate(config, defaults())
  config_lib.validate_model(config.model)
  systems = [s for s in config.systems.split(",") if s]
  bad = sorted(set(systems) - set(SYSTEMS))
  if bad or "ar" not in systems:
    raise config_lib.ConfigError(f"systems={config.systems!r}: known {SYSTEMS}, 'ar' required "
                                 "(it is the reference of every speedup)")
  if config.n < 1 or config.max_new_tokens < 1 or config.offset < 0:
    raise config_lib.ConfigError("n and max_new_tokens must be >= 1, offset >= 0")
  if config.max_threads < 1 or config.max_topic_tokens < 0:
    raise config_lib.ConfigError(
        f"max_threads={config.max_threads} must be >= 1 (the most threads a PASTA answer may "
        f"fork; its pool has room for them), max_topic_tokens={config.max_topic_tokens} >= 0")
  if config.forced.n < 0 or config.forced.promises < 1 or config.forced.length < 1:
    raise config_lib.ConfigError("forced.n >= 0, forced.promises >= 1, forced.length >= 1")
  from selforch_jax.eval.judges import config_error
  bad_judge = config_error(config.judge)
  if bad_judge:
    raise config_lib.ConfigError(bad_judge)
  nll_ref = [] if config.nll_ref in ("", "base") else [("nll_ref", config.nll_ref)]
  for key, path in [("pasta", config.pasta), ("baseline", config.baseline), *nll_ref,
                    *[(f"pareto[{lab}]", p) for lab, p in _pareto_runs(config.pareto)]]:
    if path and not is_model_dir(path):
      raise config_lib.ConfigError(f"{key}={path!r} is {MODEL_DIRS}")


def _pareto_runs(spec: str) -> list[tuple[str, str]]:
  out = []
  for item in [s for s in spec.split(",") if s]:
    if "=" not in item:
      raise config_lib.ConfigError(f"pareto entry {item!r} must be label=workdir")
    lab, path = item.split("=", 1)
    if lab in [o[0] for o in out]:
      raise config_lib.ConfigError(f"pareto label {lab!r} is given twice")
    out.append((lab, path))
  return out


def _load(config, path: str):
  """``(model, tokenizer, TagVocab)``: a training workdir / adapter / HF dir, or the base model
  with tags."""
  from selforch_jax.eval.run import load_finetuned
  from selforch_jax.lang import TagVocab, add_tags
  if path:
    model, tok = load_finetuned(path)
  else:
    model, tok = config_lib.load_model(config.model)[1:]
  if tok.token_to_id("<promise>") is None:
    add_tags(tok, model)
  return model, tok, TagVocab.from_tokenizer(tok)


def warm_up(engine, max_T: int, constraint_ids=None) -> None:
  """Compile every step size up to ``max_T`` (powers of two) at every key window, and PASTA's
  greedy sampling of as many rows (also constrained to the tag grammar over ``constraint_ids`` when given:
  :func:`pasta_constraint_ids`), so timed runs exclude compiles; resets the engine's step
  counters."""
  from selforch_jax.runtime.sampling import SamplingParams
  from selforch_jax.runtime.engine import bucket_size
  from selforch_jax.runtime.sampling import sample_rows
  S = engine.num_slots
  sizes = []
  T = 1
  while T <= min(bucket_size(max_T), S):
    sizes.append(T)
    T *= 2
  engine.warm_up(sizes)  # every step size at every key window
  for T in sizes:
    logits = jnp.zeros((T, engine.cfg.vocab_size), jnp.float32)
    sample_rows(logits, np.arange(T), jax.random.PRNGKey(0), 0, SamplingParams())
    if constraint_ids is not None:
      G = len(constraint_ids)
      sample_rows(logits, np.arange(T), jax.random.PRNGKey(0), 0, SamplingParams(),
                  (constraint_ids, np.zeros((T, G), bool), np.zeros(T, bool)))
  engine.num_steps = engine.num_query_tokens = 0


def pasta_options(c) -> dict:
  """:class:`~selforch_jax.runtime.schedulers.pasta.PASTAScheduler` options from a config (the eval's, or
  ``make demo``'s ``pasta`` section): ``constrain_tags``, ``max_threads`` and
  ``max_topic_tokens`` (config 0 = no limit), the last two only under the tag grammar."""
  if not c.constrain_tags:
    return {"constrain_tags": False}
  return {"constrain_tags": True, "max_threads": int(c.max_threads),
          "max_topic_tokens": int(c.max_topic_tokens) or None}


UNCONSTRAINED_THREADS = 32   # pool room for threads when the tag grammar does not cap them


def pasta_pool(prompt_len: int, max_new: int, options: dict) -> dict:
  """:func:`selforch_jax.runtime.build.make_engine` pool arguments for one PASTA answer: prompt
  + answer + the runtime-fed tags, plus the partial last page of each thread (``max_threads``
  of ``options`` under the tag grammar, which caps them; else :data:`UNCONSTRAINED_THREADS`)."""
  from selforch_jax.runtime.schedulers.pasta import POOL_TAG_TOKENS
  return dict(prompt_lens=[int(prompt_len)], max_new_tokens=int(max_new),
              threads=int(options.get("max_threads") or UNCONSTRAINED_THREADS),
              extra_tokens=POOL_TAG_TOKENS)


def pasta_constraint_ids(tv, tok, options: dict) -> tuple[int, ...] | None:
  """The ids the PASTA scheduler constrains under ``options`` (:func:`pasta_options`; None
  without ``constrain_tags``), for :func:`warm_up`."""
  from selforch_jax.runtime.schedulers.pasta import constraint_ids
  if not options.get("constrain_tags"):
    return None
  return constraint_ids(tv, tok.stop_ids, digits=options.get("max_topic_tokens") is not None)


class _NLL:
  """Mean per-token NLL (nats) of a response given its prompt under one model (full causal
  forward, padded to a multiple of 128 tokens so few shapes compile)."""

  def __init__(self, model):
    graphdef, self.state = nnx.split(model)

    def nll(state, t, p, m, tgt, w):
      logits = nnx.merge(graphdef, state)(t, p, m)[0]
      lp = jax.nn.log_softmax(logits.astype(jax.numpy.float32), -1)
      tok_lp = jax.numpy.take_along_axis(lp, tgt[..., None], -1)[..., 0]
      return -(tok_lp * w).sum() / w.sum()

    self.fn = jax.jit(nll)

  def __call__(self, prompt: list[int], response: list[int]) -> float | None:
    if not response:
      return None
    ids = list(prompt) + list(response)
    n = len(ids)
    N = -(-n // 128) * 128
    t = np.zeros((1, N), np.int32)
    t[0, :n] = ids
    m = np.tril(np.ones((N, N), bool))[None]
    tgt = np.zeros((1, N), np.int32)
    tgt[0, :n - 1] = ids[1:]
    w = np.zeros((1, N), np.float32)
    w[0, len(prompt) - 1:n - 1] = 1.0
    return float(self.fn(self.state, t, np.arange(N, dtype=np.int32)[None], m, tgt, w))


def _ci(values, ec) -> dict | None:
  from selforch_jax.eval.stats import bootstrap_ci
  vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
  return bootstrap_ci(vals, n_boot=ec.n_boot, seed=ec.seed) if vals else None


def _geo_ci(ratios, ec) -> dict | None:
  d = _ci([math.log(r) for r in ratios if r and r > 0], ec)
  if d is None:
    return None
  return {k: (math.exp(v) if k != "n" else v) for k, v in d.items()}


def _paired(a, b, ec) -> dict | None:
  from selforch_jax.eval.stats import paired_bootstrap_diff
  pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
  if not pairs:
    return None
  x, y = zip(*pairs)
  return paired_bootstrap_diff(list(x), list(y), n_boot=ec.n_boot, seed=ec.seed)


def _decode(tok, ids) -> str:
  return tok.decode(ids, skip_special_tokens=True)


def run_ar(engine, tok, prompt, max_new) -> dict:
  """AR baseline on one prompt (batch 1): text, token ids, wall seconds, tokens, forwards."""
  from selforch_jax.runtime.schedulers import ar
  steps0 = engine.num_steps
  t0 = time.perf_counter()
  (r,) = ar.generate(engine, [prompt], max_new_tokens=max_new, stop_ids=tok.stop_ids)
  wall = time.perf_counter() - t0
  tokens = len(r.token_ids) + (r.finish_reason == "stop")
  fw = engine.num_steps - steps0
  return dict(text=_decode(tok, r.token_ids), ids=r.token_ids, wall_s=wall, tokens=tokens,
              forwards=fw, theoretical_speedup=tokens / fw, tokens_per_forward=tokens / fw,
              parsed=True)


def run_pasta(engine, tok, tv, prompt, max_new, cap, **options) -> dict:
  """PASTA on one prompt (batch 1, greedy; ``options``: :class:`~selforch_jax.runtime.schedulers.pasta.
  PASTAScheduler` options, e.g. ``constrain_tags`` for the tag grammar,
  :func:`selforch_jax.runtime.schedulers.pasta.tag_grammar`): ``text`` (final, logical order, tags
  dropped, decoded whole), ``display_text`` (the same with each chunk joined by the separator its
  layout implies: :meth:`~selforch_jax.runtime.schedulers.pasta.PASTAScheduler.text`), ``raw``
  (the canonical tagged output, tags written), ids, wall seconds, stats."""
  from selforch_jax.runtime.schedulers import pasta
  t0 = time.perf_counter()
  s = pasta.generate(engine, [prompt], tv, max_new_tokens=max_new, stop_ids=tok.stop_ids, cap=cap,
                     **options)
  wall = time.perf_counter() - t0
  st = s.stats[0]
  ids = s.text_ids(0)
  finish = s.results[0].finish_reason
  # truncated at max_new_tokens is not malformed (AR's answers are cut there too): the budget
  # rules, applied at the end ("end: ..."), of a job that ran out of tokens
  budget_only = finish == "length" and all(d.startswith("end:") for d in st.degraded)
  return dict(text=_decode(tok, ids), display_text=s.text(0, tok), ids=ids, wall_s=wall,
              tokens=st.tokens,
              forwards=st.forwards, theoretical_speedup=st.theoretical_speedup,
              tokens_per_forward=st.tokens_per_forward,
              parsed=st.well_formed or budget_only, parsed_strict=st.well_formed,
              finish_reason=finish,
              threads=st.threads, rounds=st.rounds, degraded=list(st.degraded),
              raw=tok.decode(s.results[0].token_ids))


def run_sot(engine, tok, question, sc) -> dict:
  """Skeleton-of-Thought on one question."""
  from selforch_jax.runtime.schedulers import sot
  r = sot.skeleton_of_thought(engine, tok, question, skeleton_tokens=sc.skeleton_tokens,
                              point_tokens=sc.point_tokens, max_points=sc.max_points)
  ids = tok.encode(r.text)
  return dict(text=r.text, ids=ids, wall_s=r.wall_s, tokens=r.tokens, forwards=r.forwards,
              theoretical_speedup=r.tokens / r.forwards, tokens_per_forward=r.tokens / r.forwards,
              parsed=r.parsed, points=len(r.points))


def run_apar(engine, tok, prompt, max_new, apc) -> dict:
  """APAR-style decoding on one prompt."""
  from selforch_jax.runtime.schedulers import apar
  r = apar.apar_generate(engine, prompt, tok, max_new_tokens=max_new,
                         child_tokens=apc.child_tokens, max_forks=apc.max_forks,
                         stop_ids=tok.stop_ids)
  return dict(text=_decode(tok, r.token_ids), ids=r.token_ids, wall_s=r.wall_s, tokens=r.tokens,
              forwards=r.forwards, theoretical_speedup=r.tokens / r.forwards,
              tokens_per_forward=r.tokens / r.forwards, parsed=r.forks > 0, forks=r.forks)


def summarize(recs: list[dict], ar_recs: list[dict], ec, judge_scores=None) -> dict:
  """Every figure of one system over the prompts (see the module docstring)."""
  out = {
      "n": len(recs),
      "wall_speedup": _geo_ci([a["wall_s"] / r["wall_s"] for r, a in zip(recs, ar_recs)], ec),
      "throughput_speedup": _geo_ci([(r["length"] / r["wall_s"]) / (a["length"] / a["wall_s"])
                                     for r, a in zip(recs, ar_recs) if a["length"]], ec),
      "theoretical_speedup": _ci([r["theoretical_speedup"] for r in recs], ec),
      "tokens_per_forward": _ci([r["tokens_per_forward"] for r in recs], ec),
      "parse_rate": _ci([float(r["parsed"]) for r in recs], ec),
      "parse_rate_strict": _ci([float(r.get("parsed_strict", r["parsed"])) for r in recs], ec),
      "nll": _ci([r["nll"] for r in recs], ec),
      "nll_minus_ar": _paired([r["nll"] for r in recs], [a["nll"] for a in ar_recs], ec),
      "length": _ci([r["length"] for r in recs], ec),
      "wall_s": _ci([r["wall_s"] for r in recs], ec),
  }
  if any("nll_ref" in r for r in recs):   # runs before nll_ref existed have none
    out["nll_ref"] = _ci([r.get("nll_ref") for r in recs], ec)
    out["nll_ref_minus_ar"] = _paired([r.get("nll_ref") for r in recs],
                                      [a.get("nll_ref") for a in ar_recs], ec)
  if judge_scores is not None:
    out["win_rate_vs_ar"] = judge_scores["ci"]
    out["judge_unparsed"] = judge_scores["unparsed"]
  return out


def _thread_lengths(layout) -> list[int]:
  return [int((layout.segment_ids == g).sum()) for g in np.flatnonzero(layout.segment_streams >= 0)]


def forced_plan(engine, tok, tv, prompts, fc, ec) -> dict:
  """The forced-plan measurement (module docstring): PASTA threads vs AR, same token count."""
  from selforch_jax.lang import Promise, Round, serialize
  from selforch_jax.runtime.schedulers import ar, pasta
  from selforch_jax.progress import progress
  recs = []
  for p in progress(prompts, "pasta forced plan", unit="prompt"):
    plan = []
    for k in range(fc.promises):
      plan.append(Promise(tuple(tok.encode(f" part {k + 1}")), int(fc.length)))
    forced = p + serialize([Round(plan=tuple(plan), sync=False)], tv) + [tv.async_open]
    t0 = time.perf_counter()
    s = pasta.generate(engine, [forced], tv, max_new_tokens=fc.promises * (20 * fc.length + 2) + 1,
                       stop_ids=(), cap=fc.cap, max_rounds=1)
    wp = time.perf_counter() - t0
    st = s.stats[0]
    n_tok = st.tokens
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    ar.generate(engine, [forced[:-1]], max_new_tokens=n_tok)
    wa = time.perf_counter() - t0
    recs.append(dict(tokens=n_tok, pasta_forwards=st.forwards, degraded=list(st.degraded),
                     thread_lengths=_thread_lengths(s.layout(0)), ar_forwards=engine.num_steps - steps0,
                     pasta_wall_s=wp, ar_wall_s=wa, threads=st.threads,
                     tokens_per_forward=st.tokens_per_forward, wall_speedup=wa / wp))
  return {"records": recs,
          "tokens_per_forward": _ci([r["tokens_per_forward"] for r in recs], ec),
          "wall_speedup": _geo_ci([r["wall_speedup"] for r in recs], ec),
          "promises": fc.promises, "length": fc.length, "cap": fc.cap}


def pareto_figure(out: dict, judged: bool, workdir: str) -> None:
  """Draw ``workdir/pasta_pareto.png`` from ``out["systems"]`` (wall speedup vs quality: the
  judge win rate when ``judged`` (:func:`run` judges the pareto runs too), else AR NLL - system
  NLL; AR the reference star) and set
  ``out["pareto_png"]``; nothing when no system besides AR has both figures. Pareto runs
  labelled ``NAME/ROUND`` (``--config.pareto=lam1/r3=DIR,lam1/r6=DIR,...``) are joined by one
  line per NAME, from the ``pasta`` (SFT) point through its rounds in config order."""
  from selforch_jax.eval.plots import pareto_plot
  points = []
  for name, summ in out["systems"].items():
    if name == "ar" or summ["wall_speedup"] is None or summ["nll_minus_ar"] is None:
      continue
    y = summ.get("win_rate_vs_ar") or {k: (-v if k != "n" else v) for k, v in
                                       summ["nll_minus_ar"].items()}
    if "win_rate_vs_ar" not in summ:
      y = dict(y, lo=y["hi"], hi=y["lo"])
    points.append(dict(label=name, x=summ["wall_speedup"], y=y,
                       kind="pasta" if name.startswith("pasta") else "baseline"))
  if not points:
    return
  n = out["n"]
  ylabel = ("judge win rate vs AR" if judged else
            "quality: AR NLL - system NLL (nats/token, higher is better)")
  ref = 0.5 if judged else 0.0
  points.append(dict(label="AR", x={"mean": 1.0, "lo": 1.0, "hi": 1.0, "n": n},
                     y={"mean": ref, "lo": ref, "hi": ref, "n": n}, kind="reference"))
  series = {}   # pareto labels "NAME/ROUND" (e.g. lam1/r3): one line per NAME from the SFT point
  for p in points:
    lab = p["label"]
    if lab.startswith("pasta[") and "/" in lab:
      series.setdefault(lab[len("pasta["):].split("/")[0],
                        ["pasta"] if any(q["label"] == "pasta" for q in points) else []
                        ).append(lab)
  out["pareto_png"] = pareto_plot(points, os.path.join(workdir, "pasta_pareto.png"),
                                  ylabel=ylabel, title=f"AlpacaEval n={n}",
                                  series=series or None)


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """The whole evaluation (module docstring); writes the JSON, JSONL and PNG into ``workdir``."""
  from selforch_jax.data.sources import load_examples, prompt_and_reference
  from selforch_jax.eval import judges

  validate(config)
  ec = config
  systems = [s for s in config.systems.split(",") if s]
  rows = load_examples("alpaca_eval", split="test", max_examples=ec.offset + ec.n)[ec.offset:]
  os.makedirs(workdir, exist_ok=True)
  t_start = time.perf_counter()
  base_model, base_tok, base_tv = _load(config, config.baseline)
  same = not config.pasta and not config.baseline
  p_model, p_tok, p_tv = (base_model, base_tok, base_tv) if same else _load(config, config.pasta)
  arch = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
  a = {k: getattr(base_model.cfg, k) for k in arch}
  b = {k: getattr(p_model.cfg, k) for k in arch}
  if a != b:  # a wall-clock speedup between different networks measures the networks
    raise config_lib.ConfigError(
        f"the PASTA model ({config.pasta or 'base'}: {b}) and the AR reference "
        f"({config.baseline or 'base'}: {a}) differ in architecture; pass --config.baseline with "
        "a run of the same model")
  questions = [prompt_and_reference(r)[0][-1]["content"] for r in rows]
  prompts = [base_tok.encode_chat(prompt_and_reference(r)[0], add_generation_prompt=True)
             for r in rows]
  p_prompts = prompts if same else [p_tok.encode_chat(prompt_and_reference(r)[0],
                                                      add_generation_prompt=True) for r in rows]
  P = max(len(p) for p in prompts + p_prompts)
  sc, apc, fc = config.sot, config.apar, config.forced
  # each system runs on a pool sized to its own need (the CPU engine attends over every slot,
  # so a pool sized for SoT's parallel prompts would slow AR and PASTA alike): AR and PASTA get
  # the same size (PASTA's spare pages: each thread ends in a partial page)
  ps = config.page_size
  opts = pasta_options(ec)
  seq = pasta_pool(P, ec.max_new_tokens, opts)
  sizes = {"ar": seq, "pasta": seq,
           "apar": dict(seq, max_new_tokens=ec.max_new_tokens + apc.max_forks * apc.child_tokens,
                        threads=seq["threads"] + apc.max_forks),
           "sot": dict(prompt_lens=[P + 256 + sc.skeleton_tokens + 32] * sc.max_points,
                       max_new_tokens=sc.point_tokens, threads=1),
           "forced": dict(prompt_lens=[P], max_new_tokens=fc.promises * (20 * fc.length + 10) * 2
                          + 64, threads=4)}
  engines = {}
  warm_T = max(P, 256 + P, 2 * sc.max_points + 8)   # the largest step any system here runs

  def engine_for(system):
    from selforch_jax.runtime.build import make_engine, pool_pages
    model = p_model if system in ("pasta", "forced") else base_model
    key = (id(model), pool_pages(page_size=ps, **sizes[system]))
    if key not in engines:
      engines[key] = make_engine(model, page_size=ps, check=False, **sizes[system])
      if config.warmup:
        warm_up(engines[key], warm_T, pasta_constraint_ids(p_tv, p_tok, opts))
    return engines[key]

  for s in systems:
    engine_for(s)
  nll = _NLL(base_model)
  if config.nll_ref == "base":   # the weights every model here was tuned from
    nll_ref = (nll if not config.baseline else
               _NLL(p_model if not config.pasta else _load(config, "")[0]))
  elif config.nll_ref:
    ref_model, ref_tok, _ = _load(config, config.nll_ref)
    probe = "Name three primary colors: red, blue and yellow. 12,345 + 6.7 = ?"
    if ref_tok.encode(probe) != base_tok.encode(probe):   # its NLL reads base_tok's ids
      raise config_lib.ConfigError(f"nll_ref={config.nll_ref!r} has another tokenizer than the "
                                   f"AR model ({config.baseline or 'base'}); pick a model of the "
                                   "same family")
    nll_ref = _NLL(ref_model)
  else:
    nll_ref = None

  def quality(r, prompt):   # judge-free quality of one answer (module docstring), in place
    resp = base_tok.encode(r["text"])
    r.update(nll=nll(prompt, resp), length=len(resp))
    if nll_ref is not None:
      r["nll_ref"] = nll_ref(prompt, resp)

  # pareto runs are decoded prompt by prompt beside the main systems, so that every wall ratio
  # compares timings taken under the same machine load
  pareto = []   # (system name, engine, tokenizer, TagVocab, chat prompts)
  for lab, path in _pareto_runs(config.pareto):
    m, t, tv = _load(config, path)
    from selforch_jax.runtime.build import make_engine
    e = make_engine(m, page_size=ps, check=False, **sizes["pasta"])
    if config.warmup:
      warm_up(e, warm_T, pasta_constraint_ids(tv, t, opts))
    pareto.append((f"pasta[{lab}]", e, t, tv,
                   [t.encode_chat(prompt_and_reference(r)[0], add_generation_prompt=True)
                    for r in rows]))
  recs = {s: [] for s in systems + [p[0] for p in pareto]}
  from selforch_jax.progress import progress
  for i, (q, pr, pp) in progress(enumerate(zip(questions, prompts, p_prompts)), "pasta eval",
                                 total=len(prompts), unit="problem"):
    for s in systems:
      if s == "ar":
        r = run_ar(engine_for("ar"), base_tok, pr, ec.max_new_tokens)
      elif s == "pasta":
        r = run_pasta(engine_for("pasta"), p_tok, p_tv, pp, ec.max_new_tokens, ec.cap,
                      **opts)
      elif s == "sot":
        r = run_sot(engine_for("sot"), base_tok, q, sc)
      else:
        r = run_apar(engine_for("apar"), base_tok, pr, ec.max_new_tokens, apc)
      quality(r, pr)
      r.update(prompt_index=ec.offset + i, system=s)
      recs[s].append(r)
    for name, e, t, tv, pps in pareto:
      r = run_pasta(e, t, tv, pps[i], ec.max_new_tokens, ec.cap, **opts)
      quality(r, pr)
      r.update(prompt_index=ec.offset + i, system=name)
      recs[name].append(r)
    print(f"  {i + 1}/{len(rows)}: " + " ".join(
        f"{s} {rs[-1]['wall_s']:.2f}s" for s, rs in recs.items()), file=sys.stderr)
  judge = judges.make_judge(  # a local judge reads two answers: the largest pool
      config.judge, engine_for("sot") if config.judge.backend == "local" else None, base_tok)
  out = {"n": len(rows), "subset": [ec.offset, ec.offset + len(rows)],
         "file": "data/alpaca_eval/gpt4_1106_preview_model_outputs.json",
         "config": config.to_dict(), "machine": {"backend": jax.default_backend(),
                                                 "devices": len(jax.devices())},
         "models": {"baseline": config.baseline or config.model.weights,
                    "nll_ref": (config.model.weights if config.nll_ref == "base" else
                                config.nll_ref),
                    "pasta": config.pasta or f"{config.model.weights} + untrained tag rows"},
         "systems": {}}
  def judged(rs):   # the judge's win rate vs AR (None without a judge)
    if judge is None:
      return None
    return judges.win_rate(judge, questions, [r["text"] for r in rs],
                           [r["text"] for r in recs["ar"]], n_boot=ec.n_boot, seed=ec.seed)

  for s, rs in recs.items():   # the pareto runs are judged too: one quality scale in the plot
    out["systems"][s] = summarize(rs, recs["ar"], ec, judged(rs) if s != "ar" else None)
  if fc.n > 0:
    out["forced_plan"] = forced_plan(engine_for("forced"), p_tok, p_tv, p_prompts[:fc.n], fc, ec)
  out["total_wall_s"] = time.perf_counter() - t_start
  with open(os.path.join(workdir, "pasta_eval_records.jsonl"), "w", encoding="utf-8") as f:
    for s, rs in recs.items():
      for r in rs:
        f.write(json.dumps({k: v for k, v in r.items() if k != "ids"}, ensure_ascii=False) + "\n")
  pareto_figure(out, judge is not None, workdir)
  with open(os.path.join(workdir, "pasta_eval.json"), "w") as f:
    json.dump(out, f, indent=2)
  return out


def summary(out: dict) -> str:
  """Human-readable lines: one per system with every figure's mean [lo, hi] (n)."""
  from selforch_jax.eval.stats import format_ci
  lines = [f"AlpacaEval prompts [{out['subset'][0]}, {out['subset'][1]}) (n={out['n']}), "
           f"total {out['total_wall_s']:.0f} s"]
  keys = ("wall_speedup", "throughput_speedup", "theoretical_speedup", "tokens_per_forward",
          "parse_rate", "parse_rate_strict", "nll", "nll_minus_ar", "nll_ref", "nll_ref_minus_ar",
          "length", "win_rate_vs_ar")
  for name, s in out["systems"].items():
    lines.append(f"{name}:")
    for k in keys:
      if s.get(k) is not None:
        lines.append(f"  {k:20s} {format_ci(s[k])}")
  if "forced_plan" in out:
    fp = out["forced_plan"]
    lines.append(f"forced plan ({fp['promises']} promises x length {fp['length']}):")
    for k in ("tokens_per_forward", "wall_speedup"):
      if fp[k] is not None:
        lines.append(f"  {k:20s} {format_ci(fp[k])}")
  return "\n".join(lines)
