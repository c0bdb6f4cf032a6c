"""Token sampling: greedy, temperature, top-k and nucleus (top-p).

Top-p follows Holtzman et al. 2020 ("The Curious Case of Neural Text Degeneration"):
keep the smallest set of most likely tokens whose probability mass reaches ``top_p``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick each next token.

  Attributes:
    temperature: 0 means greedy (argmax); > 0 divides the logits before sampling.
    top_k: keep only the k most likely tokens (0 = no limit).
    top_p: keep the smallest prefix of the sorted distribution with mass >= top_p (1 = off).
    seed: PRNG seed; the key of step i is ``fold_in(PRNGKey(seed), i)``, so a shorter
      run is an exact prefix of a longer one with the same seed.
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


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
  return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
