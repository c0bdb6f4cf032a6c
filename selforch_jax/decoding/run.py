"""The decode run behind ``python -m selforch_jax.decode``: config schema, validation,
batching prompts through :class:`~selforch_jax.decoding.generate.Generator`, writing JSONL.

With ``pasta.adapter`` set (a PASTA adapter directory, :mod:`selforch_jax.adapter`), the run then
decodes ``pasta.alpaca_eval`` AlpacaEval prompts (from index ``pasta.offset``; AlpacaEval never
enters PASTA training, ``data/pasta/PROVENANCE.md``) with the adapter's model, batch 1, greedy,
twice on one engine: PASTA (:mod:`selforch_jax.runtime.schedulers.pasta`) and plain AR, both timed after
every step size is compiled. It writes ``pasta.jsonl`` (one row per prompt, :func:`run_pasta_part`)
and a ``pasta`` block in ``summary.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import ml_collections

from selforch_jax import config_lib


def defaults() -> ml_collections.ConfigDict:
  """All keys of a decode config, with their default values and types."""
  return ml_collections.ConfigDict(dict(
      model=config_lib.model_defaults(),
      inputs="",             # e.g. "alpaca_eval:20,gsm8k:10"
      system_prompt="",      # optional system turn
      chat=True,             # apply the model's chat template
      max_new_tokens=128,
      batch_size=8,
      padding="left",
      sampling=dict(temperature=0.0, top_k=0, top_p=1.0, seed=0),
      # PASTA parallel decoding after the base part; adapter "" = off
      pasta=dict(adapter="", alpaca_eval=6, offset=0, max_new_tokens=256, cap=256,
                 constrain_tags=True, max_threads=16, max_topic_tokens=12),
  ))


def validate(config: ml_collections.ConfigDict) -> None:
  """Validate a decode config before any work. Raises ``config_lib.ConfigError``."""
  config_lib.validate(config, defaults())
  config_lib.validate_model(config.model)
  if config.max_new_tokens < 1:
    raise config_lib.ConfigError("max_new_tokens must be >= 1")
  if config.batch_size < 1:
    raise config_lib.ConfigError("batch_size must be >= 1")
  if config.padding not in ("left", "right"):
    raise config_lib.ConfigError(f"padding={config.padding!r} must be 'left' or 'right'")
  from selforch_jax.runtime.sampling import SamplingParams
  try:
    SamplingParams(**config.sampling.to_dict())
  except ValueError as e:
    raise config_lib.ConfigError(f"sampling: {e}") from None
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


def run(config: ml_collections.ConfigDict, workdir: str, prompt: str = "",
        prompts_file: str = "") -> dict:
  """Decode every prompt and write ``answers.jsonl`` + ``summary.json`` under ``workdir``.

  Every prompt is encoded and checked against the context length before anything is
  written; answers stream to ``answers.jsonl.partial``, which replaces ``answers.jsonl``
  (and the summary) only when the run completes, so a failed or interrupted run never
  destroys an earlier run's output. With ``config.pasta.adapter`` set, the PASTA part
  (:func:`run_pasta_part`) follows and writes ``pasta.jsonl`` the same way; its prompts are
  loaded, and the adapter checked, before any model is.

  Returns:
    the summary dict.
  """
  from tqdm import tqdm

  from selforch_jax.decoding.generate import Generator
  from selforch_jax.decoding.prompts import load_prompts
  from selforch_jax.runtime.sampling import SamplingParams

  validate(config)
  items = load_prompts(config.inputs, prompts_file, prompt)
  pasta_items = pasta_prompts(config.pasta) if config.pasta.adapter else None
  sampling = SamplingParams(**config.sampling.to_dict())
  t0 = time.perf_counter()
  cfg, model, tok = config_lib.load_model(config.model)
  load_s = time.perf_counter() - t0
  if tok is None:
    raise config_lib.ConfigError("model.weights has no tokenizer; decode needs GGUF or an HF dir")
  # encode and check every prompt before any output is written (a bad prompt loses nothing)
  encoded = []
  for it in items:
    msgs = list(it["messages"])
    if config.system_prompt and msgs[0]["role"] != "system":
      msgs = [{"role": "system", "content": config.system_prompt}] + msgs
    ids = (tok.encode_chat(msgs, add_generation_prompt=True) if config.chat
           else tok.encode("\n".join(m["content"] for m in msgs)))
    if len(ids) + config.max_new_tokens > cfg.max_position_embeddings:
      raise config_lib.ConfigError(
          f"prompt {it['id']} has {len(ids)} tokens; with max_new_tokens={config.max_new_tokens} "
          f"it exceeds the model's context length of {cfg.max_position_embeddings} tokens")
    encoded.append(ids)
  gen = Generator(model)
  os.makedirs(workdir, exist_ok=True)
  stop_ids = tok.stop_ids
  rows, all_stats = [], []
  bs = config.batch_size
  t_start = time.perf_counter()
  answers = os.path.join(workdir, "answers.jsonl")
  with open(answers + ".partial", "w", encoding="utf-8") as f:
    for start in tqdm(range(0, len(items), bs), desc="decode", unit="batch", file=sys.stderr):
      batch, ids = items[start:start + bs], encoded[start:start + bs]
      results, stats = gen.generate(ids, max_new_tokens=config.max_new_tokens, sampling=sampling,
                                    stop_ids=stop_ids, padding=config.padding, pad_id=tok.pad_id)
      all_stats.append(stats)
      for it, p, r in zip(batch, ids, results):
        row = {"id": it["id"], "source": it["source"], "prompt": it["messages"][-1]["content"],
               "text": tok.decode(r.token_ids, skip_special_tokens=True),
               "token_ids": r.token_ids, "logprobs": [round(x, 5) for x in r.logprobs],
               "finish_reason": r.finish_reason, "prompt_tokens": len(p),
               "reference": it.get("reference")}
        rows.append(row)
        f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
  decode_s = sum(s.decode_s for s in all_stats)
  decode_tokens = sum(max(s.new_tokens - s.batch, 0) for s in all_stats)
  summary = {
      "prompts": len(rows),
      "config": config.to_dict(),
      "prompts_file": prompts_file or None,
      "wall_s": round(time.perf_counter() - t_start, 3),
      "load_s": round(load_s, 3),
      "compile_s": round(sum(s.compile_s for s in all_stats), 3),
      "prefill_ms_mean": round(sum(s.prefill_ms for s in all_stats) / len(all_stats), 2),
      "decode_s": round(decode_s, 3),
      "new_tokens": sum(s.new_tokens for s in all_stats),
      "decode_tokens_per_s": round(decode_tokens / decode_s, 2) if decode_s else 0.0,
      "batch_size": bs,
      "finish_reasons": {k: sum(r["finish_reason"] == k for r in rows) for k in ("stop", "length")},
  }
  pasta_rows = os.path.join(workdir, "pasta.jsonl")
  if pasta_items is not None:
    del gen, model
    summary["pasta"] = run_pasta_part(config.pasta, pasta_items, pasta_rows + ".partial")
  with open(os.path.join(workdir, "summary.json.partial"), "w") as f:
    json.dump(summary, f, indent=2)
  # replace the previous run's files only now that this run is complete
  os.replace(answers + ".partial", answers)
  if pasta_items is not None:
    os.replace(pasta_rows + ".partial", pasta_rows)
  os.replace(os.path.join(workdir, "summary.json.partial"), os.path.join(workdir, "summary.json"))
  return summary


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
      ``text`` (the final text in logical order, tags dropped), ``threads``, ``rounds``,
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

  from selforch_jax.eval.pasta import (make_engine, pasta_constraint_ids, pasta_options,
                                       pasta_pool_slots, run_ar, run_pasta, warm_up)
  from selforch_jax.eval.run import load_finetuned
  from selforch_jax.lang import TagVocab

  t0 = time.perf_counter()
  model, tok = load_finetuned(pc.adapter)
  tv = TagVocab.from_tokenizer(tok)
  load_s = time.perf_counter() - t0
  prompts = [tok.encode_chat(it["messages"], add_generation_prompt=True) for it in items]
  P, ps = max(len(p) for p in prompts), 16
  # a thread's pages are its own: spare pages for the partial last page of each thread
  opts = pasta_options(pc)
  engine = make_engine(model, pasta_pool_slots(P, pc.max_new_tokens, ps, opts, 16), ps)
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
           "text": a["text"], "threads": a["threads"], "rounds": a["rounds"],
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
