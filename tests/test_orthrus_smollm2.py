"""The committed Orthrus adapter (``adapters/orthrus_smollm2_135m``: SmolLM2-135M-Instruct plus
the trained diffusion view) on the real model: greedy Orthrus, unfused and fused (anchored at
the first draft), writes AR greedy's tokens on GSM8K test questions; the trained view accepts
well above the untrained ~1 token per verify step, and the fused variant uses fused drafts and
needs fewer forwards than unfused for the same tokens."""

import os

import numpy as np
import pytest

from selforch_jax.adapter import load_adapter
from selforch_jax.data.sources import load_examples
from selforch_jax.models.orthrus import mask_token_id
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.scheduler import run
from selforch_jax.runtime.schedulers import ar, make_scheduler

ADAPTER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "adapters",
                       "orthrus_smollm2_135m")
NEW = 48


@pytest.fixture(scope="module")
def real():
  model, tok = load_adapter(ADAPTER)
  rows = load_examples("gsm8k", split="test", max_examples=3)
  prompts = [tok.encode_chat([m for m in r["messages"] if m["role"] == "user"]) for r in rows]
  return model, tok, prompts


def test_trained_view_is_lossless_and_fused_saves_forwards(real):
  model, tok, prompts = real
  eng = Engine(model, num_pages=4 * (max(map(len, prompts)) + NEW) // 16 + 64, page_size=16)
  ref = ar.generate(eng, prompts, max_new_tokens=NEW, stop_ids=tok.stop_ids)
  stats = {}
  for name, opts in (("unfused", {}), ("fused_at_1", dict(fused=True, fuse_at=1))):
    stats[name] = []
    for p, r in zip(prompts, ref):
      s = make_scheduler("orthrus", eng, [p], max_new_tokens=NEW, stop_ids=tok.stop_ids,
                         mask_id=mask_token_id(model, tok), **opts)
      run(eng, s)
      for o in s.owners:
        eng.pool.free_owner(int(o))
      assert s.results[0].token_ids == r.token_ids, name
      stats[name].append(s.stats[0])
  acc = np.mean([st["mean_acceptance_length"] for st in stats["unfused"]])
  assert acc > 1.8, acc          # untrained: about 1 (the bonus alone)
  assert sum(st["fused_drafts"] for st in stats["fused_at_1"]) > 0
  assert (sum(st["forwards"] for st in stats["fused_at_1"])
          < sum(st["forwards"] for st in stats["unfused"]))
