"""PASTA training records from real instructions (issue 5, "Data and annotation").

Prompts (user turns) come from real instruction data in the repository's ``data/`` folder:

* ``alpaca`` — ``alpaca/alpaca_en_demo.json`` (999 rows): instruction [+ input], reference output;
* ``alpaca_seed`` — ``alpaca/stanford_alpaca_seed_tasks.jsonl`` (175 human-written Self-Instruct
  seed tasks): each instance's input and output;
* ``mt_bench`` — ``mt_bench/question.jsonl`` (80): the first turn; a reference response only
  for the 30 questions with a GPT-4 reference answer (``mt_bench/reference_answer_gpt-4.jsonl``).

AlpacaEval instructions are evaluation prompts and never enter training: every prompt whose
instruction (or whole user turn), lower-cased with whitespace collapsed, equals an AlpacaEval
instruction is dropped (2 MT-Bench questions are), and :func:`check_no_eval_overlap` asserts the
result before any record is written.

Responses: the provided reference responses, plus the base model's own responses
(self-distillation, DESIGN.md §6) generated batched with
:func:`selforch_jax.api.decode_ids` (AR on the engine; :func:`generate_responses`).

Records (JSON lines, the ``chat`` dataset format of :mod:`selforch_jax.data.sources`)::

  {"messages": [{"role": "user", ...}, {"role": "assistant", "content": <annotated text>}],
   "source": "alpaca" | "alpaca_seed" | "mt_bench", "response_from": "reference" | "base_model",
   "annotated": bool, "chunks": int}

The assistant content is the annotator's text (tags inline) when it annotated the response, else
the plain response (kept: the model also learns when not to fork). :func:`strip_tags` gives the
Baseline-SFT records: the same examples, the assistant text in logical order without tags.

CLI (writes ``train.jsonl``, ``train_baseline.jsonl`` and ``annotation_report.json``; the
committed ``data/pasta/`` was made with this command)::

  python -m selforch_jax.data.pasta_data --out=data/pasta --self_distill=32 --max_new_tokens=320 \
      --write_baseline=0
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any

from selforch_jax.data import sources

__all__ = ["load_prompts", "eval_instructions", "normalize", "check_no_eval_overlap",
           "generate_responses", "build_records", "strip_tags", "write_jsonl", "main"]


def normalize(text: str) -> str:
  """Lower-cased text with runs of whitespace collapsed to one space (for overlap checks)."""
  return re.sub(r"\s+", " ", text.strip().lower())


def eval_instructions(path: str = "alpaca_eval/gpt4_1106_preview_model_outputs.json") -> set[str]:
  """The :func:`normalize`-d AlpacaEval instructions (the evaluation prompts)."""
  return {normalize(r["instruction"]) for r in sources.read_json(path)}


def _example(source: str, instruction: str, input_text: str | None, response: str | None
             ) -> dict[str, Any]:
  return {"source": source, "instruction": instruction,
          "prompt": sources.alpaca_prompt(instruction, input_text), "response": response}


def load_prompts(include: Sequence[str] = ("alpaca", "alpaca_seed", "mt_bench"),
                 drop_eval: bool = True) -> list[dict[str, Any]]:
  """Training prompts with their reference responses (None where there is none).

  Args:
    include: sources among ``alpaca``, ``alpaca_seed``, ``mt_bench`` (module docstring).
    drop_eval: drop prompts that match an AlpacaEval instruction.

  Returns:
    ``[{"source", "instruction", "prompt" (the user turn), "response" (str | None)}]`` in file
    order.

  Raises:
    ValueError: an unknown source name. FileNotFoundError: a missing data file.
  """
  out: list[dict[str, Any]] = []
  for name in include:
    if name == "alpaca":
      for r in sources.read_json("alpaca/alpaca_en_demo.json"):
        out.append(_example(name, r["instruction"], r.get("input"), r["output"]))
    elif name == "alpaca_seed":
      for r in sources.read_jsonl("alpaca/stanford_alpaca_seed_tasks.jsonl"):
        for inst in r["instances"]:
          out.append(_example(name, r["instruction"], inst.get("input"), inst["output"]))
    elif name == "mt_bench":
      refs = {r["question_id"]: r["choices"][0]["turns"][0]
              for r in sources.read_jsonl("mt_bench/reference_answer_gpt-4.jsonl")}
      for r in sources.read_jsonl("mt_bench/question.jsonl"):
        out.append(_example(name, r["turns"][0], None, refs.get(r["question_id"])))
    else:
      raise ValueError(f"unknown prompt source {name!r}; known: alpaca, alpaca_seed, mt_bench")
  if drop_eval:
    ev = eval_instructions()
    out = [e for e in out
           if normalize(e["instruction"]) not in ev and normalize(e["prompt"]) not in ev]
  return out


def check_no_eval_overlap(records: Iterable[dict[str, Any]]) -> int:
  """Assert that no user turn of ``records`` is an AlpacaEval instruction.

  Args:
    records: chat records (``{"messages": [...]}``).

  Returns:
    The number of user turns checked.

  Raises:
    ValueError: naming the first overlapping prompts.
  """
  ev = eval_instructions()
  bad, n = [], 0
  for r in records:
    for m in r["messages"]:
      if m["role"] == "user":
        n += 1
        u = normalize(m["content"])
        if u in ev or u.split("\n\n")[0] in ev:
          bad.append(m["content"][:80])
  if bad:
    raise ValueError(f"{len(bad)} training prompts are AlpacaEval instructions: {bad[:3]}")
  return n


def generate_responses(prompts: Sequence[str], model: Any, tokenizer: Any, *,
                       max_new_tokens: int = 256, batch_size: int = 8, sampling: Any = None
                       ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """The base model's own responses to ``prompts``, decoded in batches with
  AR on the engine (:func:`selforch_jax.api.decode_ids`: chat template, stop at every EOS id).

  Args:
    prompts: user turns.
    model: the NNX Transformer (e.g. the real SmolLM2 from ``config_lib.load_model``).
    tokenizer: its tokenizer (``encode_chat``, ``decode``, ``stop_ids``).
    max_new_tokens: token budget per response.
    batch_size: prompts decoded together (rows do not affect each other).
    sampling: :class:`~selforch_jax.runtime.sampling.SamplingParams` (None = greedy).

  Returns:
    ``(rows, stats)``: per prompt ``{"text", "num_tokens", "finish_reason"}``; stats ``{"prompts",
    "new_tokens", "seconds", "tokens_per_s"}`` (wall clock, compilation included).

  Raises:
    ValueError: ``batch_size < 1``; ContextLengthError: a prompt too long for the context.
  """
  from selforch_jax.api import decode_ids

  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  rows: list[dict[str, Any]] = []
  t0 = time.perf_counter()
  from selforch_jax.progress import progress
  for s in progress(range(0, len(prompts), batch_size), "generate responses", unit="batch"):
    batch = [tokenizer.encode_chat([{"role": "user", "content": p}], add_generation_prompt=True)
             for p in prompts[s:s + batch_size]]
    res = decode_ids(model, tokenizer, batch, runtime="ar", max_new_tokens=max_new_tokens,
                     sampling=sampling)
    rows += [{"text": r.text, "num_tokens": len(r.token_ids), "finish_reason": r.finish_reason}
             for r in res]
  dt = time.perf_counter() - t0
  new = sum(r["num_tokens"] for r in rows)
  return rows, {"prompts": len(rows), "new_tokens": new, "seconds": round(dt, 2),
                "tokens_per_s": round(new / dt, 2) if dt > 0 else None}


def build_records(examples: Sequence[dict[str, Any]], annotator: Any,
                  response_from: str = "reference") -> tuple[list[dict[str, Any]], list[Any]]:
  """Annotate each example's response and make a chat record of it.

  Args:
    examples: ``{"source", "prompt", "response"}`` (examples without a response are skipped).
    annotator: a :class:`~selforch_jax.lang.annotators.base.Annotator`.
    response_from: ``"reference"`` or ``"base_model"``, stored in each record.

  Returns:
    ``(records, annotations)`` (one Annotation per record; see the module docstring for the
    record fields).
  """
  records, anns = [], []
  from selforch_jax.progress import progress
  for ex in progress(examples, "pasta annotate", unit="example"):
    resp = ex.get("response")
    if not resp or not resp.strip():
      continue
    a = annotator.annotate(ex["prompt"], resp)
    records.append({"messages": [{"role": "user", "content": ex["prompt"]},
                                 {"role": "assistant", "content": a.text if a.text else resp}],
                    "source": ex["source"], "response_from": response_from,
                    "annotated": a.text is not None, "chunks": int(a.info.get("chunks", 0))})
    anns.append(a)
  return records, anns


def strip_tags(records: Sequence[dict[str, Any]], tokenizer: Any, tag_vocab: Any
               ) -> list[dict[str, Any]]:
  """Baseline-SFT records: the same records with every assistant turn in logical order without
  tags, promise topics or lengths (:func:`selforch_jax.lang.assemble.assemble_text`)."""
  from selforch_jax.lang.assemble import assemble_text

  out = []
  for r in records:
    r2 = dict(r, messages=[dict(m) for m in r["messages"]], annotated=False, chunks=0)
    for m in r2["messages"]:
      if m["role"] == "assistant":
        m["content"] = assemble_text(tokenizer.encode(m["content"]), tag_vocab, tokenizer)
    out.append(r2)
  return out


def _round_robin(examples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Examples taken one source at a time in turn (file order within a source)."""
  by: dict[str, list[dict[str, Any]]] = {}
  for e in examples:
    by.setdefault(e["source"], []).append(e)
  out, k = [], 0
  while any(k < len(v) for v in by.values()):
    out += [v[k] for v in by.values() if k < len(v)]
    k += 1
  return out


def write_jsonl(rows: Iterable[dict[str, Any]], path: str) -> int:
  """Write rows as JSON lines (parent folders created). Returns the row count."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  n = 0
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r, ensure_ascii=False) + "\n")
      n += 1
  return n


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """CLI (module docstring): build the records, check them, write them and the report."""
  import argparse

  from selforch_jax import config_lib
  from selforch_jax.lang import annotators
  from selforch_jax.lang.annotators.report import annotation_report, write_report
  from selforch_jax.lang.tags import add_tags

  ap = argparse.ArgumentParser(description="Build the PASTA SFT records.")
  ap.add_argument("--out", default="out/pasta_data", help="output folder")
  ap.add_argument("--annotator", default="pasta_rules")
  ap.add_argument("--sources", default="alpaca,alpaca_seed,mt_bench")
  ap.add_argument("--self_distill", type=int, default=0,
                  help="also generate the base model's responses to N prompts (taken from the "
                       "sources in turn) and annotate them; responses cut by max_new_tokens "
                       "are dropped")
  ap.add_argument("--max_new_tokens", type=int, default=256)
  ap.add_argument("--batch_size", type=int, default=8)
  ap.add_argument("--write_baseline", type=int, default=1,
                  help="also write train_baseline.jsonl (the pipeline's data.strip_tags=True "
                       "gives the same rows from train.jsonl)")
  args = ap.parse_args(argv)

  examples = load_prompts(args.sources.split(","))
  t0 = time.perf_counter()
  model = None
  if args.self_distill > 0:
    mc = config_lib.model_defaults()   # the real SmolLM2-135M-Instruct, no tags
    _, model, tok = config_lib.load_model(mc)
  else:
    tok = config_lib.load_tokenizer("smollm2_gguf")
  gen_stats = None
  distilled: list[dict[str, Any]] = []
  if args.self_distill > 0:
    order = _round_robin(examples)[:args.self_distill]
    rows, gen_stats = generate_responses([e["prompt"] for e in order], model, tok,
                                         max_new_tokens=args.max_new_tokens,
                                         batch_size=args.batch_size)
    distilled = [dict(e, response=r["text"]) for e, r in zip(order, rows)
                 if r["finish_reason"] == "stop"]   # cut-off responses are not training targets
    gen_stats["kept_finished"] = len(distilled)
  tv = add_tags(tok)
  ann = annotators.get_annotator(args.annotator, tokenizer=tok)
  recs, anns = build_records(examples, ann, "reference")
  recs_d, anns_d = build_records(distilled, ann, "base_model")
  records = recs + recs_d
  n_checked = check_no_eval_overlap(records)
  baseline = strip_tags(records, tok, tv)
  for r, b in zip(records, baseline):   # same examples; unannotated ones unchanged
    assert r["messages"][0] == b["messages"][0]
    assert r["annotated"] or r["messages"][1] == b["messages"][1]
  write_jsonl(records, os.path.join(args.out, "train.jsonl"))
  if args.write_baseline:
    write_jsonl(baseline, os.path.join(args.out, "train_baseline.jsonl"))
  report = {
      "command": "python -m selforch_jax.data.pasta_data " + " ".join(
          argv if argv is not None else __import__("sys").argv[1:]),
      "annotator": args.annotator, "records": len(records), "eval_overlap_checked": n_checked,
      "by_source": {s: sum(r["source"] == s for r in records) for s in args.sources.split(",")},
      "reference": annotation_report(anns),
      "base_model": annotation_report(anns_d) if anns_d else None,
      "all": annotation_report(anns + anns_d),
      "generation": gen_stats, "seconds": round(time.perf_counter() - t0, 1)}
  write_report(report, os.path.join(args.out, "annotation_report.json"))
  print(json.dumps({k: report[k] for k in ("records", "by_source", "generation")}, indent=1))
  print(json.dumps({k: report["all"][k] for k in ("fraction_annotated", "chunks_per_annotated",
                                                  "length_abs_error_tokens", "length_rel_error")}))
  return report


if __name__ == "__main__":
  main()
