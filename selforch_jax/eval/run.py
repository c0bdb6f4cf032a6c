"""The eval run behind ``python -m selforch_jax.eval``: exact-match accuracy on a fixed
subset of GSM8K / MATH-500 / AIME for the base model and a fine-tuned one, in one run,
each with a bootstrap 95% CI and n, plus the paired difference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import ml_collections
import numpy as np

from selforch_jax import config_lib

DATASETS = ("gsm8k",)  # datasets of data.sources with a test split and checkable answers


def defaults() -> ml_collections.ConfigDict:
  """Keys of an eval config.

  model: the base model (``config_lib.model_defaults``); finetuned: a training workdir
  (its latest checkpoint, LoRA merged), an adapter directory or an HF directory, ``""`` = base
  only;
  eval.dataset / n / offset: the fixed subset ``rows[offset:offset+n]`` in file order.
  """
  return ml_collections.ConfigDict(dict(
      model=config_lib.model_defaults(),
      finetuned="",
      eval=dict(dataset="gsm8k", n=100, offset=0, max_new_tokens=256, batch_size=16,
                system_prompt="", prompt_suffix="", n_boot=10000, seed=0),
  ))


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ``config_lib.ConfigError`` before any work."""
  config_lib.validate(config, defaults())
  config_lib.validate_model(config.model)
  if config.eval.dataset not in DATASETS:
    raise config_lib.ConfigError(f"eval.dataset={config.eval.dataset!r}; known: {sorted(DATASETS)}")
  if config.eval.n < 1 or config.eval.batch_size < 1 or config.eval.max_new_tokens < 1:
    raise config_lib.ConfigError("eval.n, eval.batch_size and eval.max_new_tokens must be >= 1")
  ft = config.finetuned
  if ft and not is_model_dir(ft):
    raise config_lib.ConfigError(f"finetuned={ft!r} is {MODEL_DIRS}")


MODEL_DIRS = ("neither a training workdir (with checkpoints/), an adapter directory (with "
              "adapter_config.json) nor a Hugging Face directory (with config.json)")


def is_model_dir(path: str) -> bool:
  """Whether ``path`` is a directory :func:`load_finetuned` loads (``MODEL_DIRS``: the error)."""
  return any(os.path.exists(os.path.join(path, f))
             for f in ("checkpoints", "adapter_config.json", "config.json"))


def load_finetuned(path: str):
  """``(model, tokenizer)`` from a training workdir (latest checkpoint, LoRA merged), an adapter
  directory (:func:`selforch_jax.adapter.load_adapter`) or an HF directory."""
  from selforch_jax.adapter import is_adapter_dir, load_adapter
  if is_adapter_dir(path):
    return load_adapter(path)
  if os.path.isdir(os.path.join(path, "checkpoints")):
    from selforch_jax.trainers.restore import restore_run
    from selforch_jax.models.transformer import merged_model
    _, model, tok, _ = restore_run(path)
    return merged_model(model), tok
  mc = config_lib.model_defaults()
  mc.weights = path
  _, model, tok = config_lib.load_model(mc)
  return model, tok


def evaluate_model(model, tok, rows, ec) -> dict:
  """Greedy-decode every question (AR on the engine, batches of ``ec.batch_size``); returns
  per-example records and a summary (``decode_tokens_per_s`` counts compiles too)."""
  from selforch_jax.api import decode_ids
  from selforch_jax.eval.answers import extract_answer, is_correct
  from selforch_jax.eval.stats import bootstrap_ci

  from selforch_jax.data.sources import prompt_and_reference

  records, decode_s, new_tokens = [], 0.0, 0
  for s in range(0, len(rows), ec.batch_size):
    batch = rows[s:s + ec.batch_size]
    prompts, refs, questions = [], [], []
    for r in batch:
      msgs, ref = prompt_and_reference(r)
      msgs[-1] = dict(msgs[-1], content=msgs[-1]["content"] + ec.prompt_suffix)
      if ec.system_prompt:
        msgs.insert(0, {"role": "system", "content": ec.system_prompt})
      prompts.append(tok.encode_chat(msgs, add_generation_prompt=True))
      refs.append(ref)
      questions.append(msgs[-1]["content"])
    t0 = time.perf_counter()
    answers = decode_ids(model, tok, prompts, runtime="ar", max_new_tokens=ec.max_new_tokens)
    decode_s += time.perf_counter() - t0
    new_tokens += sum(len(a.token_ids) + (a.finish_reason == "stop") for a in answers)
    for q, ref, a in zip(questions, refs, answers):
      text = a.text
      records.append({"question": q, "reference": ref, "output": text,
                      "extracted": extract_answer(text), "correct": bool(is_correct(text, ref)),
                      "finish_reason": a.finish_reason})
    print(f"  {len(records)}/{len(rows)} done", file=sys.stderr)
  correct = np.array([x["correct"] for x in records], np.float64)
  return {"records": records,
          "accuracy": bootstrap_ci(correct, n_boot=ec.n_boot, seed=ec.seed),
          "decode_tokens_per_s": new_tokens / decode_s if decode_s else 0.0,
          "new_tokens": new_tokens}


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Evaluate base (and fine-tuned) models; writes ``eval_results.json`` and answers JSONL."""
  from selforch_jax.data.sources import default_path, load_examples
  from selforch_jax.eval.stats import format_ci, paired_bootstrap_diff

  validate(config)
  ec = config.eval
  rel = os.path.relpath(default_path(ec.dataset, "test"))
  rows = load_examples(ec.dataset, split="test", max_examples=ec.offset + ec.n)[ec.offset:]
  os.makedirs(workdir, exist_ok=True)
  models = [("base", lambda: config_lib.load_model(config.model)[1:])]
  if config.finetuned:
    models.append(("finetuned", lambda: load_finetuned(config.finetuned)))
  out = {"dataset": ec.dataset, "file": rel, "subset": [ec.offset, ec.offset + len(rows)],
         "n": len(rows), "config": config.to_dict(), "models": {}}
  correct = {}
  for name, load in models:
    t0 = time.perf_counter()
    model, tok = load()
    if tok is None:
      raise config_lib.ConfigError(f"{name} model has no tokenizer")
    print(f"evaluating {name} on {len(rows)} {ec.dataset} questions", file=sys.stderr)
    res = evaluate_model(model, tok, rows, ec)
    with open(os.path.join(workdir, f"answers_{name}.jsonl"), "w", encoding="utf-8") as f:
      for r in res["records"]:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")
    correct[name] = np.array([r["correct"] for r in res["records"]], np.float64)
    out["models"][name] = {"accuracy": res["accuracy"], "accuracy_str": format_ci(res["accuracy"]),
                           "decode_tokens_per_s": round(res["decode_tokens_per_s"], 2),
                           "seconds": round(time.perf_counter() - t0, 1),
                           "source": config.finetuned if name == "finetuned" else config.model.weights,
                           "model_config": dataclasses.asdict(model.cfg)}
  if "finetuned" in correct:
    d = paired_bootstrap_diff(correct["finetuned"], correct["base"], n_boot=ec.n_boot, seed=ec.seed)
    out["finetuned_minus_base"] = d | {"str": format_ci(d)}
  with open(os.path.join(workdir, "eval_results.json"), "w") as f:
    json.dump(out, f, indent=2)
  return out
