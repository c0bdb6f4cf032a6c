"""Planned Diffusion joint loss (issue 21; planned-diffusion/planned-diffusion, thesis ch. 3).

AR cross-entropy on plan / control / continuation tokens plus (1/t)-weighted masked-diffusion
cross-entropy on chunk tokens replaced by ``<|mask|>``, with t ~ U(eps, 1) per sequence. Prompt
tokens carry no loss (the caller leaves them out of both masks).

Semi-autoregressive noise (``suffix_p`` > 0, off by default = the issue's i.i.d. rule): a row
drawn with probability ``suffix_p`` masks, in every chunk of length L, the last ``k = ceil(t * L)``
tokens instead of each token with probability t. A chunk decoded left to right (the scheduler's
``window=1``) is always in such a state (a clean prefix, a masked rest), which i.i.d. masking at
rate t reaches with probability ``(1 - t)^m t^r`` only (LLaDA's semi-autoregressive remasking
decodes in this order; BD3-LM trains clean earlier blocks before a masked one, the same states
when a block is one token). A masked token of such a chunk is weighted ``L / k`` (its chunk's
masked fraction in place of t), so a chunk's weights sum to L, the expectation of the i.i.d.
rule's; (1/t) itself would put up to ``1 / eps`` on a chunk's last token, which every suffix
draw masks. Within a chunk the expected weight still grows toward its end (a later token is
masked by more draws).

Normalisation: the weighted sum is divided by the number of loss tokens in the batch (AR targets
plus chunk tokens, masked or not), i.e. a per-token mean of the ELBO-style terms. Upstream also
divides the AR terms by t; that is ``ar_over_t=True`` here (default False = the paper's formula).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from selforch_jax.trainers.loss import token_cross_entropy

__all__ = ["chunk_offsets", "noise_chunks", "joint_loss"]


def chunk_offsets(chunk_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each chunk position's offset from its chunk's first position and its chunk's length.

  Args:
    chunk_mask: bool [B, N]; a chunk is a maximal run of True.

  Returns:
    (offset int32 [B, N], length int32 [B, N]); both 0 outside chunks.
  """
  n = chunk_mask.shape[1]
  pos = jnp.arange(n, dtype=jnp.int32)[None, :]
  prev = jnp.pad(chunk_mask[:, :-1], ((0, 0), (1, 0)))
  nxt = jnp.pad(chunk_mask[:, 1:], ((0, 0), (0, 1)))
  start = jax.lax.cummax(jnp.where(chunk_mask & ~prev, pos, 0), axis=1)
  end = jax.lax.cummin(jnp.where(chunk_mask & ~nxt, pos, n), axis=1, reverse=True)
  offset = jnp.where(chunk_mask, pos - start, 0)
  length = jnp.where(chunk_mask, end - start + 1, 0)
  return offset.astype(jnp.int32), length.astype(jnp.int32)


def noise_chunks(key: jax.Array, token_ids: jax.Array, chunk_mask: jax.Array, mask_id: int,
                 eps: float = 1e-3, suffix_p: float = 0.0
                 ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Forward masking process on chunk tokens.

  Args:
    key: PRNG key.
    token_ids: int32 [B, N] clean tokens.
    chunk_mask: bool [B, N], the chunk content positions that may be masked.
    mask_id: the ``<|mask|>`` token id.
    eps: lower end of t's range, 0 < eps < 1.
    suffix_p: a Python float in [0, 1] (fixed at trace time): the probability that a row masks
      the last ``ceil(t * length)`` tokens of each chunk (module docstring) instead of each
      chunk token with probability t.

  Returns:
    (noisy int32 [B, N], masked bool [B, N] (a subset of chunk_mask), t float32 [B] in
    [eps, 1), rate float32 [B, N]: the masking rate whose inverse weights each position's
    diffusion CE: t on i.i.d. rows and outside chunks, the chunk's masked fraction ``k / L``
    inside the chunks of a suffix row).

  Raises:
    ValueError: eps outside (0, 1) or suffix_p outside [0, 1].
  """
  if not 0.0 < eps < 1.0:
    raise ValueError(f"noise_chunks: eps must be in (0, 1), got {eps}")
  if not 0.0 <= suffix_p <= 1.0:
    raise ValueError(f"noise_chunks: suffix_p must be in [0, 1], got {suffix_p}")
  kt, km = jax.random.split(key)     # (suffix_p = 0 draws what it drew before the option)
  b = token_ids.shape[0]
  t = jax.random.uniform(kt, (b,), jnp.float32, minval=eps, maxval=1.0)
  masked = chunk_mask & (jax.random.uniform(km, token_ids.shape) < t[:, None])
  rate = jnp.broadcast_to(t[:, None], token_ids.shape)
  if suffix_p > 0.0:
    offset, length = chunk_offsets(chunk_mask)
    k = jnp.ceil(t[:, None] * length).astype(jnp.int32)            # masks per chunk, >= 1
    suffix = chunk_mask & (offset >= length - k)
    row = jax.random.uniform(jax.random.fold_in(key, 2), (b, 1)) < suffix_p
    masked = jnp.where(row, suffix, masked)
    frac = k.astype(jnp.float32) / jnp.maximum(length, 1).astype(jnp.float32)
    rate = jnp.where(row & chunk_mask, frac, rate)
  return jnp.where(masked, mask_id, token_ids).astype(jnp.int32), masked, t, rate


def joint_loss(logits: jax.Array, targets: jax.Array, ar_mask: jax.Array, masked: jax.Array,
               chunk_mask: jax.Array, t: jax.Array, ar_over_t: bool = False
               ) -> tuple[jax.Array, dict]:
  """Joint AR + masked-diffusion loss.

  Args:
    logits: [B, N, V] predictions already aligned to ``targets`` (caller shifts).
    targets: int32 [B, N] clean tokens.
    ar_mask: bool [B, N], AR loss positions (plan / control / continuation; not prompt).
    masked: bool [B, N], chunk positions that were replaced by ``<|mask|>``.
    chunk_mask: bool [B, N], all chunk positions (the diffusion term's normaliser share).
    t: float32 [B] noise levels, or [B, N] per-target rates (``noise_chunks``' ``rate`` aligned
      to ``targets``): a masked target's CE is divided by its t.
    ar_over_t: also divide AR terms by t (upstream's code), default False (the paper).

  Returns:
    (scalar float32 loss, metrics {"ar_ce", "diff_ce", "tokens"}).
  """
  ce = token_cross_entropy(logits, targets)
  ar = ar_mask.astype(jnp.float32)
  dm = masked.astype(jnp.float32)
  inv_t = 1.0 / (t[:, None] if t.ndim == 1 else t)
  ar_w = ar * (inv_t if ar_over_t else 1.0)
  tokens = jnp.maximum(jnp.sum(ar) + jnp.sum(chunk_mask.astype(jnp.float32)), 1.0)
  loss = (jnp.sum(ce * ar_w) + jnp.sum(ce * dm * inv_t)) / tokens
  metrics = {"ar_ce": jnp.sum(ce * ar) / jnp.maximum(jnp.sum(ar), 1.0),
             "diff_ce": jnp.sum(ce * dm) / jnp.maximum(jnp.sum(dm), 1.0), "tokens": tokens}
  return loss, metrics
