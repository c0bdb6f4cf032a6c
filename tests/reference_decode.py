"""A test oracle for AR decoding: every token from the model's uncached training forward over
the whole sequence so far (no KV cache, no engine), sampled exactly as the AR scheduler samples
(step i draws all B rows at once with ``fold_in(PRNGKey(seed), i)``; finished rows pass their
last logits). Slow (quadratic) on purpose: it shares no code with the engine's decode path."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from selforch_jax.models.transformer import causal_mask, positions_from_valid
from selforch_jax.runtime.generation import GenerationResult
from selforch_jax.runtime.sampling import SamplingParams, sample

_forward = jax.jit(lambda graphdef, state, t, p, m: nnx.merge(graphdef, state)(t, p, m)[0],
                   static_argnums=0)


def last_logits(model, ids, pad_to: int = 64) -> np.ndarray:
  """float32 ``[V]``: next-token logits after ``ids`` from the uncached forward (right-padded to
  a multiple of ``pad_to`` so one compile serves many lengths)."""
  n = len(ids)
  N = -(-n // pad_to) * pad_to
  t = np.zeros((1, N), np.int32)
  t[0, :n] = ids
  valid = np.zeros((1, N), bool)
  valid[0, :n] = True
  graphdef, state = nnx.split(model)
  out = _forward(graphdef, state, t, positions_from_valid(valid), causal_mask(valid))
  return np.asarray(out[0, n - 1])


class ReferenceDecoder:
  """``generate(prompts, max_new_tokens, sampling, stop_ids) -> (results, None)``."""

  def __init__(self, model):
    self.model = model

  def generate(self, prompts, *, max_new_tokens, sampling=SamplingParams(), stop_ids=()):
    stops = {int(s) for s in stop_ids}
    B = len(prompts)
    key = jax.random.PRNGKey(sampling.seed)
    toks = [[] for _ in range(B)]
    lps = [[] for _ in range(B)]
    done = [False] * B
    last = [None] * B
    for step in range(max_new_tokens):
      for i in range(B):
        if not done[i]:
          last[i] = last_logits(self.model, list(prompts[i]) + toks[i])
      tok, lp = jax.device_get(sample(np.stack(last), key, step, sampling))
      for i in range(B):
        if done[i]:
          continue
        toks[i].append(int(tok[i]))
        lps[i].append(float(lp[i]))
        done[i] = int(tok[i]) in stops or len(toks[i]) >= max_new_tokens
      if all(done):
        break
    out = []
    for ids, l in zip(toks, lps):
      if ids and ids[-1] in stops:
        out.append(GenerationResult(ids[:-1], l[:-1], "stop"))
      else:
        out.append(GenerationResult(ids, l, "length"))
    return out, None
