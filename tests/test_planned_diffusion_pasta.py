"""PASTA on the synthetic cities task (issue 21: "Train AR-SFT, PASTA and Planned Diffusion on the
same training split"): ``configs/planned_diffusion.py:pasta`` writes the cities records without
``[PAD]`` and trains them with PASTA's mask (a chunk sees the prefix and the plan up to its
promise, is causal, and never sees a sibling), plain masked CE; its adapter decodes through the
``pasta`` runtime. On the tiny random SmolLM2."""

import numpy as np
import pytest

from selforch_jax import config_lib
from selforch_jax.api import load_config_file
from selforch_jax.data import synthetic_cities
from selforch_jax.data.planned_diffusion_data import cities_records, ensure_cities_data
from selforch_jax.lang.tags import ASYNC_OPEN, PAD, TagVocab

ARG = "model=tiny_smollm2,steps=2,seq_len=384,batch_size=2,n=8,lr=3e-3"


def test_records_without_pad(tmp_path):
  count = lambda text: len(text.split())   # noqa: E731
  plain = cities_records(6, 3, count, pad=False)
  padded = cities_records(6, 3, count)
  exs = synthetic_cities.generate_split(6, 3)
  for r, q, ex in zip(plain, padded, exs):
    text = r["messages"][1]["content"]
    assert PAD not in text and text == synthetic_cities.annotate(ex, count)
    assert q["messages"][1]["content"].replace(PAD, "") == text
  path = str(tmp_path / "c.jsonl")
  ensure_cities_data(path, count, n=4, seed=3)
  ensure_cities_data(path, count, n=4, seed=3, pad=False)      # other records: rebuilt
  with open(path) as f:
    assert PAD not in f.read()


def test_pasta_stage_mask_and_run(tmp_path):
  from selforch_jax import api
  from selforch_jax.adapter import load_adapter
  from selforch_jax.trainers.planned_diffusion_run import build_pd
  from selforch_jax.trainers.run import train
  c = load_config_file("configs/planned_diffusion.py", "pasta," + ARG)
  assert c.planned_diffusion.pasta and not c.data.async_sees_full_plan
  assert c.data.chunk_bidirectional is False and not c.data.strip_tags
  c.train.async_checkpoint = False
  c.train.eval_every = 0
  work = str(tmp_path / "run")
  _, tok, train_ds, _, ckpt = build_pd(c, work)
  ckpt.close()
  tv = TagVocab.from_tokenizer(tok)
  b = next(iter(train_ds))
  toks, mask = np.asarray(b["tokens"][0]), np.asarray(b["mask"][0])
  opens = np.flatnonzero(toks == tv.async_open)
  closes = np.flatnonzero(toks == tv.async_close)
  assert len(opens) >= 2 and tv.pad not in toks.tolist()
  a0, c0, a1 = opens[0], closes[0], opens[1]
  assert not mask[a1 + 2, a0:c0 + 1].any()              # chunk 1 never sees chunk 0
  assert not mask[a0 + 1, a0 + 2] and mask[a0 + 2, a0 + 1]   # causal inside a chunk
  plan = np.flatnonzero(toks == tv.promise_close)
  assert mask[a0 + 1, plan[0]] and not mask[a0 + 1, plan[1]]  # the plan up to its promise
  out = train(c, work)
  assert out["step"] == 2
  model, tok = load_adapter(out["adapter"])
  ex = synthetic_cities.generate_split(1, 7)[0]
  p = tok.encode_chat([{"role": "user", "content": ex["prompt"]}], add_generation_prompt=True)
  plan_prompt = p + tok.encode(synthetic_cities.annotate(ex, lambda s: len(tok.encode(s)))
                               .split(ASYNC_OPEN)[0])
  for prompt in (p, plan_prompt):
    a, = api.decode_ids(model, tok, [prompt], runtime="pasta", max_new_tokens=24,
                        tag_vocab=TagVocab.from_tokenizer(tok))
    assert a.forwards >= 1 and isinstance(a.text, str)
  with pytest.raises(config_lib.ConfigError, match="PASTA's layout"):
    c2 = load_config_file("configs/planned_diffusion.py", "pasta," + ARG)
    c2.data.chunk_bidirectional = True
    train(c2, str(tmp_path / "bad"))
