"""SOL's compute policy: a tiny causal transformer over decode steps (akhauriyash/SOL
``predictor.py::RecurrentActorCriticPolicy``; Akhauri & Abdelfattah 2026, "Compute Where it
Counts"), in Flax NNX.

Decode step t's observation is the concatenation of

* ``h_prev [D]``: the frozen LM's last-layer (normed) hidden state at the previous token;
* ``emb [D]``: the LM input embedding of the current token;
* 8 scalars ``[t / T, eff, C_tok, C_pru, C_q, mean_keep - C_tok, mean_prune - C_pru,
  mean_q - C_q]`` (step fraction, whether the step is controllable, the three targets in usage
  units and the running usage gaps), through Linear(8, 64) + GELU + LayerNorm;
* the embedding of the previous action (``Embedding(A + 1, 32)``, index A = BOS),

projected to ``d_model`` plus a learned absolute position embedding, then ``num_layers`` pre-LN
blocks (causal multi-head attention, GELU MLP of ratio 4) and a final LayerNorm. The logits are
``pi(x) + budget_head([C_tok, C_pru, C_q])`` (budget head MLP 3 -> 32 -> A); upstream divides
by a temperature (1.3 for rollouts, greedy argmax at evaluation), done by the caller. GRPO uses
no value head (upstream's is multiplied by 0), so there is none.

:meth:`SolPolicy.__call__` runs whole sequences (training replay); :meth:`SolPolicy.step` runs
one step per row against the policy's own KV cache (:class:`PolicyCache`); both compute the
same logits (tests/test_sol_policy.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

NUM_SCALARS = 8


@dataclasses.dataclass(frozen=True)
class SolPolicyConfig:
  """Sizes of a :class:`SolPolicy`.

  Attributes:
    lm_dim: the LM's hidden size D (SmolLM2-135M: 576). num_actions: A.
    d_model, num_heads, num_layers: the transformer (upstream's shipped configs 512 / 4 / 1;
      CPU 128 / 4 / 1). action_dim: previous-action embedding width (32). scalar_dim: 64.
    max_len: most decode steps one sequence may have (the position table; upstream 512).

  Raises:
    ValueError: non-positive sizes or ``d_model % num_heads != 0``.
  """

  lm_dim: int
  num_actions: int
  d_model: int = 128
  num_heads: int = 4
  num_layers: int = 1
  action_dim: int = 32
  scalar_dim: int = 64
  max_len: int = 512

  def __post_init__(self):
    if min(self.lm_dim, self.num_actions, self.d_model, self.num_heads, self.num_layers,
           self.action_dim, self.scalar_dim, self.max_len) < 1:
      raise ValueError(f"SolPolicyConfig sizes must be >= 1: {self}")
    if self.d_model % self.num_heads:
      raise ValueError(f"d_model {self.d_model} must be a multiple of num_heads {self.num_heads}")

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PolicyCache:
  """The policy's own KV cache: ``k, v`` float32 ``[num_layers, N, max_len, d_model]``."""

  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, cfg: SolPolicyConfig, n: int) -> "PolicyCache":
    shape = (cfg.num_layers, n, cfg.max_len, cfg.d_model)
    return cls(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


class _Block(nnx.Module):
  def __init__(self, d: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
    self.out = nnx.Linear(d, d, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
    self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)


def _attend(q, k, v, mask, heads):
  """q ``[N, T, d]``, k/v ``[N, S, d]``, mask bool ``[T, S]`` or ``[N, T, S]`` -> ``[N, T, d]``."""
  N, T, d = q.shape
  S = k.shape[1]
  dh = d // heads
  qh, kh, vh = (a.reshape(N, -1, heads, dh) for a in (q, k, v))
  s = jnp.einsum("nthd,nshd->nhts", qh, kh) * dh ** -0.5
  m = mask[None, None] if mask.ndim == 2 else mask[:, None]
  p = jax.nn.softmax(jnp.where(m, s, -1e30), axis=-1)
  return jnp.einsum("nhts,nshd->nthd", p, vh).reshape(N, T, d)


class SolPolicy(nnx.Module):
  """The policy network (module docstring). Parameters float32."""

  def __init__(self, cfg: SolPolicyConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, A = cfg.d_model, cfg.num_actions
    self.scalar_proj = nnx.Linear(NUM_SCALARS, cfg.scalar_dim, rngs=rngs)
    self.scalar_ln = nnx.LayerNorm(cfg.scalar_dim, rngs=rngs)
    self.action_embed = nnx.Embed(A + 1, cfg.action_dim, rngs=rngs)
    self.obs_proj = nnx.Linear(2 * cfg.lm_dim + cfg.scalar_dim + cfg.action_dim, d, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.max_len, d)))
    for i in range(cfg.num_layers):
      setattr(self, f"block_{i}", _Block(d, rngs))
    self.ln_f = nnx.LayerNorm(d, rngs=rngs)
    self.pi = nnx.Linear(d, A, rngs=rngs)
    self.budget_fc1 = nnx.Linear(3, 32, rngs=rngs)
    self.budget_fc2 = nnx.Linear(32, A, rngs=rngs)

  def _embed(self, h_prev, emb, scalars, prev_action, positions):
    s = self.scalar_ln(jax.nn.gelu(self.scalar_proj(scalars.astype(jnp.float32))))
    x = jnp.concatenate([h_prev.astype(jnp.float32), emb.astype(jnp.float32), s,
                         self.action_embed(prev_action)], -1)
    return self.obs_proj(x) + jnp.take(self.pos[...], positions, axis=0)

  def _head(self, x, scalars):
    b = self.budget_fc2(jax.nn.gelu(self.budget_fc1(scalars[..., 2:5].astype(jnp.float32))))
    return self.pi(self.ln_f(x)) + b

  def __call__(self, h_prev, emb, scalars, prev_action):
    """Logits of whole step sequences.

    Args:
      h_prev, emb: float ``[N, T, D]``. scalars: float ``[N, T, 8]``. prev_action: int
        ``[N, T]`` in ``[0, A]`` (A = BOS at step 0).

    Returns:
      float32 ``[N, T, A]`` logits (no temperature).

    Raises:
      ValueError: ``T > max_len``.
    """
    N, T = prev_action.shape
    if T > self.cfg.max_len:
      raise ValueError(f"policy sequence of {T} steps exceeds max_len {self.cfg.max_len}")
    x = self._embed(h_prev, emb, scalars, prev_action, jnp.arange(T)[None])
    causal = jnp.tril(jnp.ones((T, T), bool))
    for i in range(self.cfg.num_layers):
      blk = getattr(self, f"block_{i}")
      q, k, v = jnp.split(blk.qkv(blk.ln1(x)), 3, axis=-1)
      x = x + blk.out(_attend(q, k, v, causal, self.cfg.num_heads))
      x = x + blk.fc2(jax.nn.gelu(blk.fc1(blk.ln2(x))))
    return self._head(x, scalars)

  def step(self, h_prev, emb, scalars, prev_action, cache: PolicyCache, t):
    """One decode step for N rows at step index ``t`` (int scalar, the same for all rows).

    Args:
      h_prev, emb: float ``[N, D]``. scalars: ``[N, 8]``. prev_action: int ``[N]``.
      cache: the rows' :class:`PolicyCache` (steps ``0..t-1`` written).

    Returns:
      ``(logits float32 [N, A], cache)`` with step t's keys / values written.
    """
    pos = jnp.asarray(t, jnp.int32)
    x = self._embed(h_prev[:, None], emb[:, None], scalars[:, None], prev_action[:, None],
                    pos[None, None])
    seen = jnp.arange(self.cfg.max_len)[None] <= pos               # [1, max_len]
    ks, vs = [], []
    for i in range(self.cfg.num_layers):
      blk = getattr(self, f"block_{i}")
      q, k, v = jnp.split(blk.qkv(blk.ln1(x)), 3, axis=-1)
      kc = jax.lax.dynamic_update_slice(cache.k[i], k, (0, pos, 0))
      vc = jax.lax.dynamic_update_slice(cache.v[i], v, (0, pos, 0))
      ks.append(kc)
      vs.append(vc)
      x = x + blk.out(_attend(q, kc, vc, seen, self.cfg.num_heads))
      x = x + blk.fc2(jax.nn.gelu(blk.fc1(blk.ln2(x))))
    return self._head(x, scalars[:, None])[:, 0], PolicyCache(jnp.stack(ks), jnp.stack(vs))


def init_policy(cfg: SolPolicyConfig, seed: int = 0) -> SolPolicy:
  """A randomly initialised :class:`SolPolicy`."""
  return SolPolicy(cfg, rngs=nnx.Rngs(params=seed))
