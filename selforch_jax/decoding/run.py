"""The decode run behind ``python -m selforch_jax.decode``: config schema, validation, decoding
prompts with any runtime through :func:`selforch_jax.api.decode_ids` (the engine), writing JSONL.

``config.runtime`` picks the system (:data:`selforch_jax.api.RUNTIMES`: ``ar``, ``pasta``,
``tip``, ``sot``, ``apar``, ``streaming_llm``, ``h2o``); ``config.adapter`` loads an adapter
directory (:mod:`selforch_jax.adapter`; ``pasta`` defaults to ``adapters/pasta_smollm2_135m``
when present, ``tip`` needs one). Every row of ``answers.jsonl`` has ``text``, ``token_ids``,
``finish_reason``, ``forwards``, ``tokens_per_forward``, ``wall_s`` and the runtime's own figures.

With ``pasta.adapter`` set (a PASTA adapter directory), the run then decodes ``pasta.alpaca_eval``
AlpacaEval prompts (from index ``pasta.offset``; AlpacaEval never enters PASTA training,
``data/pasta/PROVENANCE.md``) with the adapter's model, batch 1, greedy, twice on one engine:
PASTA (:mod:`selforch_jax.runtime.schedulers.pasta`) and plain AR, both timed after every step
size is compiled. It writes ``pasta.jsonl`` (one row per prompt, :func:`run_pasta_part`) and a
``pasta`` block in ``summary.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ml_collections

from selforch_jax import config_lib
from selforch_jax.runtime.schedulers.orthrus import check_options as check_orthrus_options
from selforch_jax.runtime.schedulers.planned_diffusion import check_options as check_pd_options
from selforch_jax.runtime.sol_control import DEFAULT_BUDGET_GUARD, budget_guard_option

# one line per config key (``--help`` lists them with their defaults)
HELP = {
    "runtime": "decoding system: ar, pasta, tip, sot, apar, streaming_llm, h2o, ptd, pld, "
               "lookahead, orthrus",
    "adapter": "adapter directory to load (pasta: default adapters/pasta_smollm2_135m; tip needs one)",
    "inputs": "dataset prompts, e.g. 'alpaca_eval:20,gsm8k:10' (first N test rows of each)",
    "system_prompt": "optional system turn before every prompt",
    "chat": "apply the model's chat template",
    "max_new_tokens": "tokens per answer (0 = the runtime's default: 512 for pasta / tip, tags "
                      "included; 128 otherwise)",
    "batch_size": "prompts decoded together in one engine job",
    "page_size": "KV pool page size (tokens)",
    "stop": "stop strings separated by '|' (the text is cut before the first one)",
    "budget": "streaming_llm / h2o: live KV tokens per request",
    "trace": "draw every engine step as a timeline: a .html / .png / .json path ('' = off)",
    "sampling.temperature": "0 = greedy",
    "sampling.top_k": "keep the k most likely tokens (0 = off)",
    "sampling.top_p": "nucleus mass (1 = off)",
    "sampling.min_p": "keep tokens with p >= min_p * p_max (0 = off)",
    "sampling.seed": "PRNG seed (same seed, same sample)",
    "sot.skeleton_tokens": "SoT: skeleton budget",
    "sot.point_tokens": "SoT: budget per point expansion",
    "sot.max_points": "SoT: most points expanded",
    "apar.child_tokens": "APAR: budget of one forked item",
    "apar.max_forks": "APAR: most forks per answer",
    "orthrus.block_size": "orthrus: diffusion block B (1 verified root + B-1 drafts per verify)",
    "orthrus.fused": "orthrus: fuse each verify pass with the next block's diffusion draft",
    "orthrus.fuse_at": "orthrus: with fused, anchor the fused draft at verified draft j (0 = the "
                       "last one, used only when a block is accepted whole; 1 = usable whenever "
                       "a draft is accepted)",
    "orthrus.denoise_steps": "orthrus: diffusion passes per block, each fixing the most "
                             "confident drafts (1 = one pass; > 1 needs fused=False and pays "
                             "off only with a denoise=multi adapter)",
    "sol.budget": "sol: target budget 'kappa,rho,bits' (attention keep, MLP channel keep, MLP "
                  "output bits)",
    "sol.budget_guard": "sol: budget guard tolerance (usage units): each step's action is the "
                        "policy's best among those keeping every axis' running mean usage "
                        "within it of the target or moving toward it (0 = off)",
    "planned_diffusion.steps_ratio": "planned_diffusion: denoising steps per token of the "
                                     "longest chunk",
    "planned_diffusion.confidence": "planned_diffusion: unmask order: entropy, margin or prob",
    "planned_diffusion.threshold": "planned_diffusion: Fast-dLLM probability threshold (0 = off)",
    "planned_diffusion.max_promises": "planned_diffusion: most promises per round",
    "planned_diffusion.pad_last": "planned_diffusion: commit [PAD] predictions after every "
                                  "content one (the committed adapter's eval; upstream: off)",
    "planned_diffusion.spread": "planned_diffusion: never commit two adjacent chunk positions in "
                                "one denoising step (the last step commits all left)",
    "planned_diffusion.window": "planned_diffusion: semi-autoregressive unmasking, only a "
                                "chunk's first this-many masked positions are candidates "
                                "(1: left to right, the committed adapter's best; 0 = off, "
                                "upstream's order)",
    "planned_diffusion.pad_tail": "planned_diffusion: a committed [PAD] fills the rest of its "
                                  "chunk with [PAD] (a finished chunk stops costing steps; "
                                  "upstream: off)",
    "planned_diffusion.seed_topic": "planned_diffusion: each chunk starts with its promise's "
                                    "topic tokens, committed at the scaffold (for chunks "
                                    "trained to begin with their topic, as the committed "
                                    "cities adapter's; False for other data; upstream: off)",
    "planned_diffusion.max_rounds": "planned_diffusion: most rounds (then plain AR)",
    "planned_diffusion.plan_cap": "planned_diffusion: most tokens of one plan",
    "planned_diffusion.full_diffusion": "planned_diffusion: Dream-style baseline, the whole "
                                        "answer one chunk of this many masks (0 = off; "
                                        "Dream's entropy order needs window=0)",
    "pasta.adapter": "demo part: PASTA adapter decoding AlpacaEval prompts after the main run ('' = off)",
    "pasta.alpaca_eval": "demo part: AlpacaEval prompts",
    "pasta.offset": "demo part: first AlpacaEval row",
    "pasta.max_new_tokens": "demo part: tokens per answer",
    "pasta.cap": "pasta: floor of a thread's token budget",
    "pasta.constrain_tags": "pasta: sample under the tag grammar",
    "pasta.max_threads": "pasta: most threads one answer may fork (with constrain_tags)",
    "pasta.max_topic_tokens": "pasta: promise topic tokens before its length is forced (0 = off)",
}


def defaults() -> ml_collections.ConfigDict:
  """All keys of a decode config, with their default values and types (:data:`HELP`)."""
  from selforch_jax.runtime.schedulers.pasta import DEFAULT_MAX_THREADS, DEFAULT_MAX_TOPIC_TOKENS
  return ml_collections.ConfigDict(dict(
      model=config_lib.model_defaults(),
      runtime="ar",
      adapter="",
      inputs="",             # e.g. "alpaca_eval:20,gsm8k:10"
      system_prompt="",      # optional system turn
      chat=True,             # apply the model's chat template
      max_new_tokens=0,      # 0: api.default_max_new_tokens(runtime)
      batch_size=8,
      page_size=16,
      stop="",
      budget=256,
      trace="",              # e.g. out/trace.html (selforch_jax.trace_render)
      sampling=dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0),
      sot=dict(skeleton_tokens=96, point_tokens=64, max_points=10),
      apar=dict(child_tokens=64, max_forks=8),
      orthrus=dict(block_size=8, fused=False, fuse_at=0,    # block: CPU (configs/orthrus.py)
                   denoise_steps=1),
      sol=dict(budget="0.5,0.8,8", budget_guard=DEFAULT_BUDGET_GUARD),
      planned_diffusion=dict(steps_ratio=1.0, confidence="entropy", threshold=0.0,
                             max_promises=8, max_rounds=4, plan_cap=96, full_diffusion=0,
                             pad_last=True, spread=False, window=1, pad_tail=True,
                             seed_topic=True),
      # PASTA options (runtime=pasta and the demo's PASTA part); pasta.adapter "" = no part
      pasta=dict(adapter="", alpaca_eval=6, offset=0, max_new_tokens=256, cap=256,
                 constrain_tags=True, max_threads=DEFAULT_MAX_THREADS,
                 max_topic_tokens=DEFAULT_MAX_TOPIC_TOKENS),
  ))


def help_text(config: ml_collections.ConfigDict | None = None) -> str:
  """Every config key with its value in ``config`` (default: :func:`defaults`) and one line."""
  from selforch_jax import api
  c = config if config is not None else defaults()
  docs = {f"model.{k}": f"model section: {k}" for k in c.model.keys()}
  docs.update(HELP, runtime="decoding system: " + ", ".join(api.RUNTIMES))
  return config_lib.key_lines(c, docs)


def validate(config: ml_collections.ConfigDict) -> None:
  """Validate a decode config before any work. Raises ``config_lib.ConfigError``."""
  from selforch_jax import api
  config_lib.validate(config, defaults())
  config_lib.validate_model(config.model)
  if config.runtime not in api.RUNTIMES:
    raise config_lib.ConfigError(f"runtime={config.runtime!r} is unknown; valid: "
                                 f"{', '.join(api.RUNTIMES)}")
  if config.max_new_tokens < 0:
    raise config_lib.ConfigError("max_new_tokens must be >= 1 (or 0: the runtime's default)")
  if config.runtime == "sol":
    from selforch_jax.runtime.sol_actions import parse_budget
    try:
      parse_budget(config.sol.budget)
    except ValueError as e:
      raise config_lib.ConfigError(f"sol.budget: {e}") from None
    try:
      budget_guard_option(config.sol.budget_guard)
    except ValueError as e:
      raise config_lib.ConfigError(f"sol.budget_guard: {e}") from None
  if config.runtime == "orthrus":
    o = config.orthrus
    try:
      check_orthrus_options(o.block_size, o.fused, o.fuse_at, o.denoise_steps)
    except ValueError as e:
      raise config_lib.ConfigError(str(e)) from None
  if config.runtime == "planned_diffusion":
    try:
      check_pd_options(**options(config))
    except (ValueError, TypeError) as e:
      raise config_lib.ConfigError(str(e)) from None
  if config.batch_size < 1 or config.page_size < 1 or config.budget < 1:
    raise config_lib.ConfigError("batch_size, page_size and budget must be >= 1")
  from selforch_jax.trace_render import FORMATS
  if config.trace and os.path.splitext(config.trace)[1].lower() not in FORMATS:
    raise config_lib.ConfigError(f"trace={config.trace!r} must end in {', '.join(FORMATS)}")
  from selforch_jax.runtime.sampling import SamplingParams
  try:
    SamplingParams(**config.sampling.to_dict())
  except ValueError as e:
    raise config_lib.ConfigError(f"sampling: {e}") from None
  try:
    api.resolve_adapter(config.runtime, config.adapter, config.model.preset)
  except api.ApiError as e:
    raise config_lib.ConfigError(str(e)) from None
  pc = config.pasta
  if pc.adapter:
    from selforch_jax.adapter import CONFIG_FILE, is_adapter_dir
    if not is_adapter_dir(pc.adapter):
      raise config_lib.ConfigError(
          f"pasta.adapter={pc.adapter!r} is not an adapter directory (no {CONFIG_FILE}; make one "
          "with python -m selforch_jax.export --workdir=RUN --out=DIR --adapter)")
    with open(os.path.join(pc.adapter, CONFIG_FILE)) as f:
      if not json.load(f)["model"].get("tags", False):
        raise config_lib.ConfigError(f"pasta.adapter={pc.adapter!r} was trained without the "
                                     "orchestration tags (model.tags=False): it cannot plan")
  if (min(pc.alpaca_eval, pc.max_new_tokens, pc.cap, pc.max_threads) < 1
      or min(pc.offset, pc.max_topic_tokens) < 0):
    raise config_lib.ConfigError("pasta.alpaca_eval, pasta.max_new_tokens, pasta.cap and "
                                 "pasta.max_threads must be >= 1, pasta.offset and "
                                 "pasta.max_topic_tokens >= 0")


def check_workdir(workdir: str) -> None:
  """Refuse a workdir that is a file or cannot be written (nothing is created here).

  Raises:
    ConfigError: naming the path.
  """
  if not workdir:
    raise config_lib.ConfigError("--workdir is empty")
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise config_lib.ConfigError(f"workdir {workdir!r} is a file, not a directory")
  probe = os.path.abspath(workdir)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
    raise config_lib.ConfigError(f"workdir {workdir!r} is not writable ({probe} does not allow "
                                 "creating files)")


def options(config: ml_collections.ConfigDict) -> dict:
  """The runtime's own options from a decode config (:func:`selforch_jax.api.decode_ids`)."""
  rt = config.runtime
  if rt == "pasta":
    from selforch_jax.eval.pasta import pasta_options
    return dict(pasta_options(config.pasta), cap=int(config.pasta.cap))
  if rt == "sot":
    return dict(config.sot.to_dict())
  if rt == "apar":
    return dict(config.apar.to_dict())
  if rt in ("streaming_llm", "h2o"):
    return {"budget": int(config.budget)}
  if rt == "orthrus":
    return {"block_size": int(config.orthrus.block_size), "fused": bool(config.orthrus.fused),
            "fuse_at": int(config.orthrus.fuse_at),
            "denoise_steps": int(config.orthrus.denoise_steps)}
  if rt == "sol":
    from selforch_jax import api
    return {"budget": str(config.sol.budget), "budget_guard": float(config.sol.budget_guard),
            "policy": api.resolve_adapter(rt, config.adapter or None, config.model.preset)}
  if rt == "planned_diffusion":
    o = dict(config.planned_diffusion.to_dict())
    o["threshold"] = float(o["threshold"]) or None
    o["full_diffusion"] = int(o["full_diffusion"]) or None
    return o
  return {}


def run(config: ml_collections.ConfigDict, workdir: str, prompt: str = "",
        prompts_file: str = "", stream=None) -> dict:
  """Decode every prompt with ``config.runtime`` and write ``answers.jsonl`` + ``summary.json``.

  Every check (config, workdir, prompts, adapter) runs before any model loads, and every prompt
  is encoded and checked against the context length before anything is written; answers stream
  to ``answers.jsonl.partial``, which replaces ``answers.jsonl`` (and the summary) only when the
  run completes, so a failed or interrupted run never destroys an earlier run's output. With
  ``config.pasta.adapter`` set, the PASTA part (:func:`run_pasta_part`) follows and writes
  ``pasta.jsonl`` the same way.

  Args:
    stream: a text file (e.g. ``sys.stdout``): with a single prompt, its answer is written there
      as it is decoded (token by token for AR-like runtimes), then the row's figures.

  Returns:
    the summary dict.

  Raises:
    ConfigError: a bad config, workdir, prompt or adapter (before any model loads).
    ContextLengthError: a prompt longer than the model's context (before any output).
  """
  from tqdm import tqdm

  from selforch_jax import api
  from selforch_jax.decoding.prompts import load_prompts
  from selforch_jax.runtime.generation import check_context
  from selforch_jax.runtime.sampling import SamplingParams

  validate(config)
  if prompt and prompts_file:
    raise config_lib.ConfigError("give --prompt or --prompts_file, not both")
  if prompt is not None and prompt != "" and not prompt.strip():
    raise config_lib.ConfigError("--prompt is empty (whitespace only)")
  check_workdir(workdir)
  items = load_prompts(config.inputs, prompts_file, prompt)
  for it in items:
    if not any(m["content"].strip() for m in it["messages"] if m["role"] == "user"):
      raise config_lib.ConfigError(f"prompt {it['id']} is empty")
  pasta_items = pasta_prompts(config.pasta) if config.pasta.adapter else None
  sampling = SamplingParams(**config.sampling.to_dict())
  t0 = time.perf_counter()
  model, tok, tv, _ = api.load(config, config.adapter or None, config.runtime)
  load_s = time.perf_counter() - t0
  # encode and check every prompt before any output is written (a bad prompt loses nothing)
  encoded = []
  for it in items:
    msgs = list(it["messages"])
    if config.system_prompt and msgs[0]["role"] != "system":
      msgs = [{"role": "system", "content": config.system_prompt}] + msgs
    ids = (tok.encode_chat(msgs, add_generation_prompt=True) if config.chat
           else tok.encode("\n".join(m["content"] for m in msgs)))
    encoded.append(ids)
  max_new = api.default_max_new_tokens(config.runtime, config.max_new_tokens)
  check_context([len(p) for p in encoded], max_new, model.cfg.max_position_embeddings)
  os.makedirs(workdir, exist_ok=True)
  stop = tuple(s for s in config.stop.split("|") if s)
  streaming = stream is not None and len(items) == 1
  shown: dict = {"ids": [], "text": ""}

  def on_token(i, t):
    shown["ids"].append(int(t))
    text = tok.decode(shown["ids"], skip_special_tokens=True)
    stream.write(text[len(shown["text"]):] if text.startswith(shown["text"]) else "")
    stream.flush()
    shown["text"] = text

  rows = []
  t_start = time.perf_counter()
  answers = os.path.join(workdir, "answers.jsonl")
  opts = options(config)
  bs = config.batch_size
  recorder = None
  if config.trace:   # one recorder over every batch, drawn once at the end
    from selforch_jax.runtime.trace import TraceRecorder
    recorder = TraceRecorder(token_text=lambda t: tok.decode([int(t)]), title=config.runtime)
  if streaming:
    stream.write(f"### {items[0]['id']} ({config.runtime}): {items[0]['messages'][-1]['content']}\n")
    stream.flush()
  with open(answers + ".partial", "w", encoding="utf-8") as f:
    for start in tqdm(range(0, len(items), bs), desc=f"decode ({config.runtime})", unit="batch",
                      file=sys.stderr, disable=streaming):
      batch, ids = items[start:start + bs], encoded[start:start + bs]
      res = api.decode_ids(model, tok, ids, runtime=config.runtime,
                           max_new_tokens=max_new, sampling=sampling, stop=stop,
                           tag_vocab=tv, questions=[it["messages"][-1]["content"] for it in batch],
                           page_size=config.page_size, options=opts,
                           on_token=on_token if streaming else None, trace=recorder)
      for it, p, a in zip(batch, ids, res):
        row = {"id": it["id"], "source": it["source"], "prompt": it["messages"][-1]["content"],
               "runtime": config.runtime, "text": a.text, "token_ids": a.token_ids,
               "logprobs": [round(x, 5) for x in a.logprobs],
               "finish_reason": a.finish_reason, "forwards": a.forwards,
               "tokens_per_forward": round(a.tokens_per_forward, 4),
               "wall_s": round(a.wall_s, 4), "batch": len(batch), "prompt_tokens": len(p),
               "reference": it.get("reference"), **a.figures}
        rows.append(row)
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
        if streaming:
          if shown["text"] != a.text:   # runtimes without token streaming, or a stop-string cut
            stream.write(a.text if not shown["text"] else f"\n--- final text:\n{a.text}")
          stream.write("\n\n" + figures_line(row) + "\n")
          stream.flush()
  wall = time.perf_counter() - t_start
  new_tokens = sum(len(r["token_ids"]) for r in rows)
  summary = {
      "prompts": len(rows),
      "runtime": config.runtime,
      "adapter": api.resolve_adapter(config.runtime, config.adapter or None,
                                     config.model.preset) or None,
      "max_new_tokens": max_new,
      "config": config.to_dict(),
      "prompts_file": prompts_file or None,
      "wall_s": round(wall, 3),
      "load_s": round(load_s, 3),
      "new_tokens": new_tokens,
      "tokens_per_s": round(new_tokens / wall, 2) if wall > 0 else 0.0,
      "forwards": sum(r["forwards"] for r in rows),
      "batch_size": bs,
      "finish_reasons": {k: sum(r["finish_reason"] == k for r in rows)
                         for k in ("stop", "length", "degraded")},
  }
  if recorder is not None:
    from selforch_jax.trace_render import render
    summary["trace"] = render(recorder, config.trace)
  pasta_rows = os.path.join(workdir, "pasta.jsonl")
  if pasta_items is not None:
    del model
    summary["pasta"] = run_pasta_part(config.pasta, pasta_items, pasta_rows + ".partial")
  with open(os.path.join(workdir, "summary.json.partial"), "w") as f:
    json.dump(summary, f, indent=2)
  # replace the previous run's files only now that this run is complete
  os.replace(answers + ".partial", answers)
  if pasta_items is not None:
    os.replace(pasta_rows + ".partial", pasta_rows)
  os.replace(os.path.join(workdir, "summary.json.partial"), os.path.join(workdir, "summary.json"))
  return summary


def figures_line(row: dict) -> str:
  """One line of a row's figures: finish reason, tokens, forwards, tokens/forward (the stop
  token counts: it was decoded), wall (of the whole batch the row was decoded in), and the
  runtime's own figures; ``degraded_tags`` counts tags that fell back to plain text."""
  core = (f"[{row['runtime']}] finish={row['finish_reason']} tokens={len(row['token_ids'])} "
          f"forwards={row['forwards']} tokens/forward={row['tokens_per_forward']:.2f} "
          f"wall={row['wall_s']:.2f}s" + (f" (batch of {row['batch']})" if row.get("batch", 1) > 1
                                          else ""))
  known = {"id", "source", "prompt", "runtime", "text", "token_ids", "logprobs",
           "finish_reason", "forwards", "tokens_per_forward", "wall_s", "prompt_tokens",
           "reference", "batch", "raw"}
  extra = " ".join(f"{k}={v}" for k, v in row.items() if k not in known and k != "degraded")
  deg = row.get("degraded")
  return core + (f" {extra}" if extra else "") + (f" degraded_tags={len(deg)}" if deg else "")


def pasta_prompts(pc: ml_collections.ConfigDict) -> list[dict]:
  """The PASTA part's prompts: AlpacaEval rows ``pc.offset .. pc.offset + pc.alpaca_eval - 1``
  as ``{"id": "alpaca_eval/<i>", "messages"}`` (the ids of :func:`load_prompts`' rows).

  Raises:
    ConfigError: the file has fewer rows.
  """
  from selforch_jax.data import sources
  end = pc.offset + pc.alpaca_eval
  rows = sources.load_examples("alpaca_eval", split="test", max_examples=end)
  if len(rows) < end:
    raise config_lib.ConfigError(f"pasta.offset + pasta.alpaca_eval = {end} exceeds the "
                                 f"{len(rows)} AlpacaEval prompts")
  return [{"id": f"alpaca_eval/{i}", "messages": sources.prompt_and_reference(ex)[0]}
          for i, ex in enumerate(rows[pc.offset:], pc.offset)]


def run_pasta_part(pc: ml_collections.ConfigDict, items: list[dict], path: str) -> dict:
  """PASTA vs AR with the adapter's model on ``items`` (batch 1, greedy, one engine).

  Every step size and sampling shape is compiled first, and one short untimed run of each
  system precedes the timed ones, so wall times exclude compiles.

  Args:
    pc: the ``pasta`` config section (``adapter`` set). items: :func:`pasta_prompts`' rows.
    path: where the JSONL rows go, one per prompt: ``id``, ``prompt``, ``raw`` (the tagged
      output in canonical order: PLAN, each round's chunks in promise order, tags written),
      ``text`` (the final text in logical order, tags dropped, chunks joined by the separator
      their layout implies), ``threads``, ``rounds``,
      ``forwards`` (engine steps on the critical path, prefill included), ``tokens`` (tags and
      stop included), ``tokens_per_forward``, ``theoretical_speedup``, ``well_formed``
      (no degradation rule applied), ``parsed`` (none but the cut at ``max_new_tokens``),
      ``finish_reason``, ``degraded`` (the degradation rules applied), ``pasta_wall_s``, ``ar_wall_s`` (seconds),
      ``wall_ratio`` (AR / PASTA), ``ar_text``, ``ar_tokens``.

  Returns:
    the summary block: ``adapter``, ``n``, ``ids``, ``threads`` (total forked),
    ``tokens_per_forward`` and ``theoretical_speedup`` (means), ``wall_ratio_ar_over_pasta``
    (geometric mean), ``parse_rate`` (fraction parsed: no degradation rule but the cut at
    ``max_new_tokens``), ``parse_rate_strict`` (fraction well-formed), ``load_s``, ``warmup_s``,
    ``wall_s`` (the timed runs), ``max_new_tokens``, ``cap``.
  """
  import math

  from tqdm import tqdm

  from selforch_jax.eval.pasta import (pasta_constraint_ids, pasta_options, run_ar, run_pasta,
                                       warm_up)
  from selforch_jax.runtime.build import DEFAULT_PAGE_SIZE, make_engine
  from selforch_jax.runtime.schedulers.pasta import POOL_TAG_TOKENS
  from selforch_jax.eval.run import load_finetuned
  from selforch_jax.lang import TagVocab

  t0 = time.perf_counter()
  model, tok = load_finetuned(pc.adapter)
  tv = TagVocab.from_tokenizer(tok)
  load_s = time.perf_counter() - t0
  prompts = [tok.encode_chat(it["messages"], add_generation_prompt=True) for it in items]
  P, ps = max(len(p) for p in prompts), DEFAULT_PAGE_SIZE
  # a thread's pages are its own: spare pages for the partial last page of each thread
  opts = pasta_options(pc)
  engine = make_engine(model, P, pc.max_new_tokens, page_size=ps,
                       threads=int(opts.get("max_threads") or pc.max_threads),
                       extra_tokens=POOL_TAG_TOKENS)
  t0 = time.perf_counter()
  warm_up(engine, max(P, 64), pasta_constraint_ids(tv, tok, opts))
  run_pasta(engine, tok, tv, prompts[0], 8, pc.cap, **opts)
  run_ar(engine, tok, prompts[0], 8)
  warmup_s = time.perf_counter() - t0
  recs = []
  t0 = time.perf_counter()
  with open(path, "w", encoding="utf-8") as f:
    for it, p in zip(tqdm(items, desc="pasta", unit="prompt", file=sys.stderr), prompts):
      a = run_pasta(engine, tok, tv, p, pc.max_new_tokens, pc.cap, **opts)
      b = run_ar(engine, tok, p, pc.max_new_tokens)
      r = {"id": it["id"], "prompt": it["messages"][-1]["content"], "raw": a["raw"],
           "text": a["display_text"], "threads": a["threads"], "rounds": a["rounds"],
           "forwards": a["forwards"], "tokens": a["tokens"],
           "tokens_per_forward": round(a["tokens_per_forward"], 4),
           "theoretical_speedup": round(a["theoretical_speedup"], 4),
           "well_formed": a["parsed_strict"], "parsed": a["parsed"],
           "finish_reason": a["finish_reason"], "degraded": a["degraded"],
           "pasta_wall_s": round(a["wall_s"], 3), "ar_wall_s": round(b["wall_s"], 3),
           "wall_ratio": round(b["wall_s"] / a["wall_s"], 4), "ar_text": b["text"],
           "ar_tokens": b["tokens"]}
      recs.append(r)
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
      f.flush()
  n = len(recs)
  return {
      "adapter": pc.adapter, "n": n, "ids": [r["id"] for r in recs],
      "threads": sum(r["threads"] for r in recs),
      "tokens_per_forward": round(sum(r["tokens_per_forward"] for r in recs) / n, 4),
      "theoretical_speedup": round(sum(r["theoretical_speedup"] for r in recs) / n, 4),
      "wall_ratio_ar_over_pasta": round(
          math.exp(sum(math.log(r["wall_ratio"]) for r in recs) / n), 4),
      "parse_rate": round(sum(r["parsed"] for r in recs) / n, 4),
      "parse_rate_strict": round(sum(r["well_formed"] for r in recs) / n, 4),
      "load_s": round(load_s, 3), "warmup_s": round(warmup_s, 3),
      "wall_s": round(time.perf_counter() - t0, 3),
      "max_new_tokens": pc.max_new_tokens, "cap": pc.cap,
  }
