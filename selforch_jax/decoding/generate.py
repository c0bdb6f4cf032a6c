"""Jitted prefill + KV-cache decode for batches of prompts of different lengths.

The model is split once (``nnx.split``); prefill and the whole decode loop are pure
functions under ``jax.jit`` (the decode loop is one ``lax.while_loop`` with the KV
cache donated), following tunix ``generate/sampler.py`` and tpu-inference
``runner/decode_loop.py``.

Cache layout: each row owns ``S = T_pad + max_new_tokens`` slots. The (padded) prompt
fills slots ``[0, T_pad)``; the i-th generated token is written to slot ``T_pad + i``
in every row. ``slot_valid [B, S]`` marks which slots hold real tokens, so left and
right padding are both masked out and position ids skip padding: a padded row
computes exactly what it computes alone.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.runtime.sampling import SamplingParams, sample_token
from selforch_jax.models.transformer import KVCache, Transformer

PROMPT_BUCKET = 32  # prompts are padded to a multiple of this many tokens (fewer compiles)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
  """Carry of the decode ``while_loop`` (all arrays; B rows, S slots, N max new tokens)."""

  step: jax.Array          # int32 scalar: index of the next token to produce
  cache: KVCache           # [L, B, S, K, Dh]
  slot_valid: jax.Array    # [B, S] bool
  last_token: jax.Array    # [B] int32: token produced at step-1
  next_pos: jax.Array      # [B] int32: RoPE position of last_token
  tokens: jax.Array        # [B, N] int32 produced tokens
  logprobs: jax.Array      # [B, N] float32 log p(token) under the model (temperature 1)
  done: jax.Array          # [B] bool: a stop token was produced
  num_tokens: jax.Array    # [B] int32: produced tokens incl. the stop token


@dataclasses.dataclass
class GenerationResult:
  """Output of :meth:`Generator.generate` for one prompt.

  Attributes:
    token_ids: generated ids, without the stop token.
    logprobs: float log-probabilities of ``token_ids`` under the model (natural log).
    finish_reason: ``"stop"`` (a stop token) or ``"length"`` (max_new_tokens reached).
  """

  token_ids: list[int]
  logprobs: list[float]
  finish_reason: str


@dataclasses.dataclass
class GenerationStats:
  """Timing of one :meth:`Generator.generate` call (compilation excluded).

  Attributes:
    prefill_ms: wall-clock ms of the batched prefill.
    decode_s: wall-clock seconds of the decode loop.
    new_tokens: tokens generated over all rows (stop tokens included).
    decode_tokens_per_s: ``new_tokens / decode_s`` (tokens of all rows per second).
    compile_s: seconds spent compiling in this call (0 when cached).
    batch: rows; prompt_len: padded prompt length; steps: decode loop iterations.
  """

  prefill_ms: float
  decode_s: float
  new_tokens: int
  decode_tokens_per_s: float
  compile_s: float
  batch: int
  prompt_len: int
  steps: int


def _round_up(n: int, m: int) -> int:
  return max(m, -(-n // m) * m)


class Generator:
  """Prefill + decode of a :class:`Transformer` with a KV cache.

  Args:
    model: the NNX model (split once here; later changes to ``model`` are not seen).

  Example::

    gen = Generator(model)
    results, stats = gen.generate([[1, 2, 3]], max_new_tokens=16, stop_ids=[2])
  """

  def __init__(self, model: Transformer):
    self.cfg = model.cfg
    self.graphdef, self.state = nnx.split(model)
    self._compiled: dict = {}

  # --- pure functions ---------------------------------------------------------------------
  def _forward(self, state, tokens, positions, mask, cache, cache_index):
    model = nnx.merge(self.graphdef, state)
    return model(tokens, positions, mask, cache, cache_index)

  def _prefill(self, state, tokens, valid, cache, key, *, params: SamplingParams,
               max_new: int, stop_ids: tuple[int, ...]):
    B, T = tokens.shape
    S = cache.max_len
    positions = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)
    slot_valid = jnp.zeros((B, S), bool).at[:, :T].set(valid)
    tri = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]  # [T, S]
    mask = tri[None] & slot_valid[:, None, :] & valid[:, :, None]
    logits, cache = self._forward(state, tokens, positions, mask, cache, 0)
    lengths = valid.sum(axis=1).astype(jnp.int32)
    last_idx = T - 1 - jnp.argmax(valid[:, ::-1], axis=1)  # last real token of each row
    last_logits = jnp.take_along_axis(logits, last_idx[:, None, None], axis=1)[:, 0]
    tok = sample_token(last_logits, jax.random.fold_in(key, 0), params)
    lp = jnp.take_along_axis(jax.nn.log_softmax(last_logits, -1), tok[:, None], axis=1)[:, 0]
    done = jnp.isin(tok, jnp.asarray(stop_ids, jnp.int32)) if stop_ids else jnp.zeros((B,), bool)
    toks = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(tok)
    lps = jnp.zeros((B, max_new), jnp.float32).at[:, 0].set(lp)
    return DecodeState(step=jnp.int32(1), cache=cache, slot_valid=slot_valid, last_token=tok,
                       next_pos=lengths, tokens=toks, logprobs=lps, done=done,
                       num_tokens=jnp.ones((B,), jnp.int32))

  def _decode(self, state, ds: DecodeState, key, *, params: SamplingParams, prompt_len: int,
              max_new: int, stop_ids: tuple[int, ...]):
    stops = jnp.asarray(stop_ids, jnp.int32) if stop_ids else None
    S = ds.cache.max_len

    def cond(ds):
      return (ds.step < max_new) & ~jnp.all(ds.done)

    def body(ds):
      slot = prompt_len + ds.step - 1
      slot_valid = ds.slot_valid.at[:, slot].set(True)
      mask = (slot_valid & (jnp.arange(S)[None, :] <= slot))[:, None, :]
      logits, cache = self._forward(state, ds.last_token[:, None], ds.next_pos[:, None], mask,
                                    ds.cache, slot)
      logits = logits[:, 0]
      tok = sample_token(logits, jax.random.fold_in(key, ds.step), params)
      lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tok[:, None], axis=1)[:, 0]
      active = ~ds.done
      tok = jnp.where(active, tok, ds.last_token)
      is_stop = jnp.isin(tok, stops) if stops is not None else jnp.zeros_like(active)
      return DecodeState(
          step=ds.step + 1, cache=cache, slot_valid=slot_valid, last_token=tok,
          next_pos=ds.next_pos + 1,
          tokens=jax.lax.dynamic_update_index_in_dim(ds.tokens, tok, ds.step, axis=1),
          logprobs=jax.lax.dynamic_update_index_in_dim(ds.logprobs, lp, ds.step, axis=1),
          done=ds.done | (active & is_stop),
          num_tokens=ds.num_tokens + active.astype(jnp.int32))

    return jax.lax.while_loop(cond, body, ds)

  # --- compilation cache ------------------------------------------------------------------
  def _get(self, B: int, T: int, max_new: int, params: SamplingParams, stop_ids):
    key = (B, T, max_new, params, stop_ids)
    if key in self._compiled:
      return self._compiled[key], 0.0
    t0 = time.perf_counter()
    S = T + max_new
    cache = jax.eval_shape(lambda: KVCache.zeros(self.cfg, B, S))
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
    valid = jax.ShapeDtypeStruct((B, T), jnp.bool_)
    rng = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    static = dict(params=params, max_new=max_new, stop_ids=stop_ids)
    prefill = jax.jit(functools.partial(self._prefill, **static), donate_argnums=(3,)).lower(
        self.state, tokens, valid, cache, rng).compile()
    ds = jax.eval_shape(functools.partial(self._prefill, **static), self.state, tokens, valid,
                        cache, rng)
    decode = jax.jit(functools.partial(self._decode, prompt_len=T, **static),
                     donate_argnums=(1,)).lower(self.state, ds, rng).compile()
    self._compiled[key] = (prefill, decode)
    return (prefill, decode), time.perf_counter() - t0

  # --- public API -------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               padding: str = "left", pad_id: int = 0
               ) -> tuple[list[GenerationResult], GenerationStats]:
    """Generate continuations for a batch of token-id prompts.

    Args:
      prompts: B non-empty lists of int token ids (lengths may differ).
      max_new_tokens: maximum tokens to generate per prompt (>= 1).
      sampling: :class:`SamplingParams` (greedy by default).
      stop_ids: token ids that end a row (e.g. EOS, ``<|im_end|>``).
      padding: ``"left"`` or ``"right"``; the output does not depend on it.
      pad_id: token id written into padding slots (never attended to).

    Returns:
      ``(results, stats)``: one :class:`GenerationResult` per prompt, and
      :class:`GenerationStats` for the call.

    Raises:
      ValueError: for an empty batch or prompt, ``max_new_tokens < 1``, an unknown
        ``padding``, a token id outside the vocabulary, or a prompt that with
        ``max_new_tokens`` exceeds the model's context length.
    """
    if not prompts:
      raise ValueError("generate() needs at least one prompt")
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if padding not in ("left", "right"):
      raise ValueError(f"padding must be 'left' or 'right', got {padding!r}")
    ctx = self.cfg.max_position_embeddings
    V = self.cfg.vocab_size
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise ValueError(f"prompt {i} is empty")
      if len(p) + max_new_tokens > ctx:
        raise ValueError(
            f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it exceeds "
            f"the model's context length of {ctx} tokens")
      if min(p) < 0 or max(p) >= V:
        raise ValueError(f"prompt {i} has a token id outside [0, {V})")
    B = len(prompts)
    T = _round_up(max(len(p) for p in prompts), PROMPT_BUCKET)
    tokens = np.full((B, T), pad_id, np.int32)
    valid = np.zeros((B, T), bool)
    for i, p in enumerate(prompts):
      sl = slice(T - len(p), T) if padding == "left" else slice(0, len(p))
      tokens[i, sl] = p
      valid[i, sl] = True
    stop_ids = tuple(sorted(set(int(s) for s in stop_ids)))
    (prefill, decode), compile_s = self._get(B, T, max_new_tokens, sampling, stop_ids)
    key = jax.random.PRNGKey(sampling.seed)
    cache = KVCache.zeros(self.cfg, B, T + max_new_tokens)

    t0 = time.perf_counter()
    ds = prefill(self.state, jnp.asarray(tokens), jnp.asarray(valid), cache, key)
    jax.block_until_ready(ds.tokens)
    t1 = time.perf_counter()
    ds = decode(self.state, ds, key)
    out_tokens, out_lps, done, num = jax.device_get((ds.tokens, ds.logprobs, ds.done, ds.num_tokens))
    steps = int(ds.step)
    t2 = time.perf_counter()

    results = []
    for i in range(B):
      n = int(num[i])
      ids = out_tokens[i, :n].tolist()
      lps = out_lps[i, :n].tolist()
      if done[i]:
        ids, lps, reason = ids[:-1], lps[:-1], "stop"
      else:
        reason = "length"
      results.append(GenerationResult(ids, lps, reason))
    new_tokens = int(num.sum())
    decode_tokens = max(new_tokens - B, 0)  # the first token of each row comes from prefill
    stats = GenerationStats(
        prefill_ms=1000 * (t1 - t0), decode_s=t2 - t1, new_tokens=new_tokens,
        decode_tokens_per_s=decode_tokens / (t2 - t1) if t2 > t1 else 0.0,
        compile_s=compile_s, batch=B, prompt_len=T, steps=steps)
    return results, stats
