"""The one sampler of the runtime: greedy, temperature, top-k, top-p (nucleus) and min-p.

Every scheduler (AR, PASTA, TIP, ...) and every rollout (GRPO, BoNBoN) draws its tokens with
:func:`sample` (token and its log-probability) or :func:`sample_token`. Top-p follows Holtzman
et al. 2020 ("The Curious Case of Neural Text Degeneration"): keep the smallest set of most
likely tokens whose probability mass reaches ``top_p``. Min-p follows Nguyen et al. 2024
("Turning Up the Heat: Min-p Sampling"): keep the tokens whose probability is at least
``min_p`` times the top token's.
"""

from __future__ import annotations

import dataclasses
import functools

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick each next token.

  Attributes:
    temperature: 0 means greedy (argmax); > 0 divides the logits before sampling.
    top_k: keep only the k most likely tokens (0 = no limit).
    top_p: keep the smallest prefix of the sorted distribution with mass >= top_p (1 = off).
    min_p: keep the tokens with probability >= ``min_p * p_max`` (after temperature; 0 = off).
    seed: PRNG seed; the key of step i is ``fold_in(PRNGKey(seed), i)``, so a shorter
      run is an exact prefix of a longer one with the same seed.

  Raises:
    ValueError: a negative temperature or top_k, top_p outside (0, 1], min_p outside [0, 1].
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """The logits the sampler draws from: divided by the temperature, with the tokens top-k,
  top-p and min-p drop set to the float32 minimum.

  Args:
    logits: float ``[B, V]``.
    params: static :class:`SamplingParams` with ``temperature > 0``.

  Returns:
    float32 ``[B, V]``; ``softmax`` of it is the distribution :func:`sample_token` samples
    (speculative verification compares draft and target distributions through it).
  """
  x = logits.astype(jnp.float32) / params.temperature
  neg = jnp.finfo(jnp.float32).min
  if params.top_k > 0 and params.top_k < x.shape[-1]:
    kth = jax.lax.top_k(x, params.top_k)[0][:, -1:]
    x = jnp.where(x < kth, neg, x)
  if params.top_p < 1.0:
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < params.top_p  # the top token is always kept
    cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where(x < cutoff, neg, x)
  if params.min_p > 0.0:
    # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
    top = jnp.max(x, axis=-1, keepdims=True)
    x = jnp.where(x < top + jnp.log(params.min_p), neg, x)
  return x


def sample_token(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """Pick one token per row.

  Args:
    logits: ``[B, V]`` float32 next-token logits.
    key: a PRNG key (unused when greedy).
    params: static :class:`SamplingParams`.

  Returns:
    ``[B]`` int32 token ids.
  """
  if params.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filtered_logits(logits, params), axis=-1).astype(jnp.int32)


def _sample(logits: jax.Array, key: jax.Array, step: jax.Array | int,
           params: SamplingParams) -> tuple[jax.Array, jax.Array]:
  """Draw one token per row with the key of decode step ``step``, and its log-probability.

  Args:
    logits: float32 ``[B, V]``.
    key: the request's PRNG key (``PRNGKey(params.seed)``); step i uses ``fold_in(key, i)``.
    step: int scalar, the decode step (index of the token being drawn).
    params: static :class:`SamplingParams`.

  Returns:
    ``(tokens int32 [B], logprobs float32 [B])``: the log-probability of each token under the
    model's unfiltered distribution at temperature 1 (what RL objectives and NLL use).
  """
  tok = sample_token(logits, jax.random.fold_in(key, step), params)
  lp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1), tok[:, None],
                           axis=1)[:, 0]
  return tok, lp


sample = jax.jit(_sample, static_argnums=(3,))
sample.__doc__ = _sample.__doc__


@functools.partial(jax.jit, static_argnums=(3,))
def _sample_constrained(logits, key, step, params: SamplingParams, ban, only_tags, tag_ids):
  tag_logits = jnp.where(ban, -jnp.inf, logits[:, tag_ids])
  logits = jnp.where(only_tags[:, None], -jnp.inf, logits).at[:, tag_ids].set(tag_logits)
  return _sample(logits, key, step, params)


def sample_rows(logits: jax.Array, rows: Sequence[int], key: jax.Array, step: int,
                params: SamplingParams, constraint: tuple | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
  """Sample one token from each of ``logits[rows]`` with :func:`~selforch_jax.runtime.sampling.
  sample_token` (key ``fold_in(key, step)``), rows padded to a power of two so few shapes compile.

  Args:
    logits: float32 ``[T, V]`` device array. rows: R row indices. key: PRNG key.
    step: the scheduler's step counter. params: :class:`SamplingParams`.
    constraint: None, or ``(tag_ids int[G], ban bool[R, G], only_tags bool[R])``: row r may not
      sample ``tag_ids[g]`` where ``ban[r, g]``, and samples only among ``tag_ids`` where
      ``only_tags[r]`` (the logits of excluded tokens are set to -inf before sampling, so
      log-probs are those of the constrained distribution).

  Returns:
    ``(tokens int32[R], logprobs float32[R])`` (natural log) as numpy arrays.
  """
  rows = np.asarray(rows, np.int32)
  R = rows.size
  pad = (1 << (R - 1).bit_length()) - R  # rows padded to a power of two
  padded = np.concatenate([rows, np.full(pad, rows[0], np.int32)])
  sub = jnp.take(logits, padded, axis=0)
  if constraint is None:
    tok, lp = jax.device_get(sample(sub, key, step, params))
  else:
    tag_ids, ban, only = constraint
    ban = np.concatenate([np.asarray(ban, bool), np.zeros((pad, len(tag_ids)), bool)])
    only = np.concatenate([np.asarray(only, bool), np.zeros(pad, bool)])
    tok, lp = jax.device_get(_sample_constrained(sub, key, step, params, ban, only,
                                                 np.asarray(tag_ids, np.int32)))
  return np.asarray(tok[:R]), np.asarray(lp[:R])
