"""Skeleton-of-Thought and APAR baselines on a tiny random model with SmolLM2's tokenizer.

* SoT: the skeleton parser; the batched point expansion equals expanding each point alone
  (AR on its own prompt); a skeleton without numbered points falls back to the skeleton.
* APAR: a prompt ending in a list-item start forks a child at once; with greedy decoding the
  child's item equals AR decoding of the prompt alone (up to its first newline), and the main
  thread's continuation equals AR decoding of prompt + newline; the answer is tree-ordered.
"""

import numpy as np
import pytest

from selforch_jax import tokenizers
from selforch_jax.checkpoints import assets
from selforch_jax.models.config import get_preset
from selforch_jax.models.transformer import init_model
from selforch_jax.runtime.schedulers import ar, apar, sot
from selforch_jax.runtime.engine import Engine


@pytest.fixture(scope="module")
def setup():
  tok = tokenizers.Tokenizer.from_gguf(assets.smollm2_gguf_path())
  model = init_model(get_preset("tiny_smollm2"), seed=4)
  return tok, model, Engine(model, num_pages=192, page_size=8)


def test_parse_points():
  sk = "1. Plan the route\n2. Pack light\n 3) Check weather \n\nSome outro\n5. skipped"
  assert sot.parse_points(sk) == ["Plan the route", "Pack light", "Check weather"]
  assert sot.parse_points("1. a\n3. b") == ["a"]
  assert sot.parse_points("no points here") == []
  assert sot.parse_points("1. a\n2. b\n3. c", max_points=2) == ["a", "b"]


def test_sot_batched_expansion_equals_each_point_alone(setup):
  tok, _, engine = setup
  points = ["Pack light", "Check the weather", "Book early"]
  parts, tokens, forwards = sot.expand_points(engine, tok, "How to travel?", points,
                                              point_tokens=6, stop_ids=[])
  assert tokens == 18 and forwards == 3 + 5  # 3 prefills, then 5 batched decode steps
  for i, (p, prompt) in enumerate(zip(points, sot.point_prompts(tok, "How to travel?", points))):
    alone = ar.generate(engine, [prompt], max_new_tokens=6)[0]
    assert parts[i] == f"{i + 1}. {p}" + tok.decode(alone.token_ids, skip_special_tokens=True)
  assert engine.pool.owners() == []
  res = sot.skeleton_of_thought(engine, tok, "Name a colour.", skeleton_tokens=5, stop_ids=[])
  assert res.parsed == bool(sot.parse_points(res.skeleton)) and res.skeleton.startswith("1.")
  if not res.parsed:   # no numbered point: the skeleton is the answer (stage 1 only)
    assert res.points == [] and res.text == res.skeleton.strip() and res.forwards == 5


def test_apar_fork_at_item_start_equals_ar_of_each_branch(setup):
  tok, _, engine = setup
  prompt = tok.encode("Steps:\n1.")
  r = apar.apar_generate(engine, prompt, tok, max_new_tokens=14, child_tokens=5, max_forks=1,
                         stop_ids=[])
  assert r.forks == 1 and r.max_parallel == 2
  child_alone = ar.generate(engine, [prompt], max_new_tokens=5)[0].token_ids
  nl = tok.encode("\n")[-1]
  child = []
  for t in child_alone:
    if "\n" in tok.decode([t]):
      break
    child.append(t)
  assert r.token_ids[:len(child)] == child
  assert r.token_ids[len(child)] == nl
  main_rest = r.token_ids[len(child) + 1:]
  main_alone = ar.generate(engine, [prompt + [nl]], max_new_tokens=len(main_rest))[0].token_ids
  assert main_rest == main_alone
  # budget: every sampled token + the injected newline
  assert r.tokens == 14 and len(r.token_ids) == len(child) + 1 + len(main_rest)
  assert r.forwards < r.tokens
  assert engine.pool.owners() == []
