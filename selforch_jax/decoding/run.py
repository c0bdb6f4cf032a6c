"""The decode run behind ``python -m selforch_jax.decode``: config schema, validation,
batching prompts through :class:`~selforch_jax.decoding.generate.Generator`, writing JSONL.
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
  from selforch_jax.decoding.sampling import SamplingParams
  try:
    SamplingParams(**config.sampling.to_dict())
  except ValueError as e:
    raise config_lib.ConfigError(f"sampling: {e}") from None


def run(config: ml_collections.ConfigDict, workdir: str, prompt: str = "",
        prompts_file: str = "") -> dict:
  """Decode every prompt and write ``answers.jsonl`` + ``summary.json`` under ``workdir``.

  Every prompt is encoded and checked against the context length before anything is
  written; answers stream to ``answers.jsonl.partial``, which replaces ``answers.jsonl``
  (and the summary) only when the run completes, so a failed or interrupted run never
  destroys an earlier run's output.

  Returns:
    the summary dict.
  """
  from tqdm import tqdm

  from selforch_jax.decoding.generate import Generator
  from selforch_jax.decoding.prompts import load_prompts
  from selforch_jax.decoding.sampling import SamplingParams

  validate(config)
  items = load_prompts(config.inputs, prompts_file, prompt)
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
  with open(os.path.join(workdir, "summary.json.partial"), "w") as f:
    json.dump(summary, f, indent=2)
  # replace the previous run's files only now that this run is complete
  os.replace(answers + ".partial", answers)
  os.replace(os.path.join(workdir, "summary.json.partial"), os.path.join(workdir, "summary.json"))
  return summary


