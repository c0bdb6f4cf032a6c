"""PASTA training data and SFT config (issue 5): real prompts without AlpacaEval, records whose
assistant turns parse, the Baseline-SFT variant, the base model's own responses, and the config's
batches (PASTA mask vs plain causal mask on the same examples)."""

import json
import os

import numpy as np
import pytest

from selforch_jax.data import pasta_data, sources
from selforch_jax.lang import Degraded, add_tags, parse
from tests.repo_files import load_config


@pytest.fixture(scope="module")
def tok_tv():
  from selforch_jax import config_lib
  tok = config_lib.load_tokenizer("smollm2_gguf")  # make test installs the GGUF: a missing one fails
  return tok, add_tags(tok)


def load_pasta_config(arg):
  return load_config("configs/pasta.py", arg)


def test_alpaca_eval_prompts_never_enter_training(tok_tv):
  from selforch_jax.lang.annotators import get_annotator
  ev = pasta_data.eval_instructions()
  assert len(ev) == 805
  raw = pasta_data.load_prompts(drop_eval=False)
  kept = pasta_data.load_prompts()
  # 2 MT-Bench first turns are verbatim AlpacaEval instructions: they are dropped
  leaked = [e for e in raw if pasta_data.normalize(e["instruction"]) in ev]
  assert len(leaked) == 2 and {e["source"] for e in leaked} == {"mt_bench"}
  assert len(raw) - len(kept) == 2
  assert not any(pasta_data.normalize(e["prompt"]) in ev for e in kept)
  recs, anns = pasta_data.build_records(kept, get_annotator("pasta_rules", tokenizer=tok_tv[0]))
  assert pasta_data.check_no_eval_overlap(recs) == len(recs) >= 1100
  bad = [{"messages": [{"role": "user", "content": leaked[0]["prompt"]},
                       {"role": "assistant", "content": "x"}]}]
  with pytest.raises(ValueError, match="AlpacaEval"):
    pasta_data.check_no_eval_overlap(recs[:3] + bad)


def test_records_and_baseline_are_the_same_examples(tok_tv):
  from selforch_jax.lang.annotators import get_annotator
  tok, tv = tok_tv
  exs = pasta_data.load_prompts(["alpaca"])[:120]
  recs, anns = pasta_data.build_records(exs, get_annotator("pasta_rules", tokenizer=tok))
  base = pasta_data.strip_tags(recs, tok, tv)
  assert len(recs) == len(base) == len(anns) == 120
  n_ann = 0
  for ex, r, b, a in zip(exs, recs, base, anns):
    assert r["messages"][0]["content"] == b["messages"][0]["content"] == ex["prompt"]
    assert b["messages"][1]["content"] == ex["response"]            # tags stripped: the reference
    assert r["annotated"] == (a.text is not None) and not b["annotated"]
    if r["annotated"]:
      n_ann += 1
      ids = tok.encode(r["messages"][1]["content"])
      assert not [e for e in parse(ids, tv) if isinstance(e, Degraded)]
      assert r["chunks"] == a.info["chunks"] >= 2
    else:
      assert r["messages"][1]["content"] == ex["response"]
  assert n_ann >= 20


def test_committed_records(tok_tv):
  """data/pasta/train.jsonl (built by the pasta_data CLI) holds no AlpacaEval prompt, its
  annotated turns parse cleanly, and it includes the base model's own responses."""
  tok, tv = tok_tv
  recs = sources.read_jsonl("pasta/train.jsonl")
  assert pasta_data.check_no_eval_overlap(recs) == len(recs)
  assert {r["source"] for r in recs} == {"alpaca", "alpaca_seed", "mt_bench"}
  assert any(r["response_from"] == "base_model" for r in recs)
  for r in recs:
    if r["annotated"]:
      ids = tok.encode(r["messages"][1]["content"])
      assert not [e for e in parse(ids, tv) if isinstance(e, Degraded)]
  rep = json.load(open(os.path.join(sources.data_dir(), "pasta", "annotation_report.json")))
  assert rep["records"] == len(recs)
  assert rep["all"]["annotated"] == sum(r["annotated"] for r in recs)


def test_base_model_responses_are_batched_greedy(tok_tv):
  """generate_responses on a toy-width model: batching does not change any response."""
  from selforch_jax.models.config import get_preset
  from selforch_jax.models.transformer import init_model
  tok, _ = tok_tv
  model = init_model(get_preset("tiny_smollm2", vocab_size=tok.vocab_size), 1)
  prompts = [e["prompt"] for e in pasta_data.load_prompts(["mt_bench"])[:3]]
  rows, stats = pasta_data.generate_responses(prompts, model, tok, max_new_tokens=5, batch_size=3)
  solo, _ = pasta_data.generate_responses(prompts[1:2], model, tok, max_new_tokens=5, batch_size=1)
  assert len(rows) == 3 and rows[1] == solo[0]
  assert stats["prompts"] == 3 and stats["new_tokens"] == sum(r["num_tokens"] for r in rows)
  assert all(r["finish_reason"] in ("stop", "length") and r["num_tokens"] <= 5 for r in rows)


def test_config_sft_and_baseline_share_the_recipe():
  from selforch_jax.trainers.run import validate
  sft, base = load_pasta_config("sft"), load_pasta_config("baseline")
  validate(sft)
  validate(base)
  a, b = json.loads(sft.to_json()), json.loads(base.to_json())
  diff = {f"{s}.{k}" for s in a if isinstance(a[s], dict) for k in a[s] if a[s][k] != b[s][k]}
  assert diff == {"data.strip_tags"}
  assert sft.model.tags and sft.model.lora_rank == 8 and sft.train.train_embed_rows_from == 49152
  assert (sft.data.seq_len, sft.data.batch_size, sft.train.steps) == (512, 4, 150)
  assert sft.data.annotated_repeats == 3 and sft.optim.lr == 4e-4
  alp = load_pasta_config("sft,data=alpaca")
  assert alp.data.annotator == "pasta_rules" and load_pasta_config(
      "baseline,data=alpaca").data.annotator is None


def test_config_batches_pasta_mask_vs_causal(tok_tv):
  """The config's data section: PASTA rows have a chunk that does not see its sibling; the
  baseline rows of the same examples are plainly causal and tag-free."""
  from selforch_jax.data.pipeline import make_dataset
  tok, tv = tok_tv
  T = 512
  cfg = load_pasta_config(f"sft,data=alpaca,seq_len={T},batch_size=8").data.to_dict()
  cfg.update(eval_fraction=0.0, shuffle=False, num_threads=1, max_examples=40, num_epochs=1)
  batch = next(iter(make_dataset(cfg, tok, "train")))
  rows = [i for i in range(8) if (batch["tokens"][i] == tv.async_open).sum() >= 2]
  assert rows, "no annotated row among the first examples"
  i = rows[0]
  ids = batch["tokens"][i]
  opens, closes = np.flatnonzero(ids == tv.async_open), np.flatnonzero(ids == tv.async_close)
  assert not batch["mask"][i, opens[1] + 1, opens[0]:closes[0] + 1].any()
  assert not np.array_equal(batch["mask"][i], np.tril(np.ones((T, T), bool)))
  plain = next(iter(make_dataset(dict(cfg, annotator=None, strip_tags=True), tok, "train")))
  n = int(plain["loss_mask"][i].nonzero()[0].max()) + 1
  assert not np.isin(plain["tokens"][i, :n], list(tv.tag_ids)).any()
  np.testing.assert_array_equal(plain["mask"][i, :n, :n], np.tril(np.ones((n, n), bool)))
