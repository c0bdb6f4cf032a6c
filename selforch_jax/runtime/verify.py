"""Lossless verification of drafts, shared by PTD, PLD, Lookahead and Orthrus (DESIGN.md §2.5).

A verify step runs the target model once over the last committed token (the *root*) and a
draft: a chain, or a tree given by parent indices. Row ``i`` of the target logits is the
model's next-token prediction after the root-to-node-``i`` path. This module decides what is
committed:

* **greedy** (temperature 0): longest-prefix match. From the root, while the model's argmax
  at the current node is the token of one of its children, accept that child; then the argmax
  at the last accepted node is the *bonus* token. Identical to greedy AR decoding.
* **speculative sampling** (temperature > 0): exact, i.e. the committed tokens are
  distributed as AR sampling from :func:`~selforch_jax.runtime.sampling.filtered_logits` of the
  target under the same :class:`~selforch_jax.runtime.sampling.SamplingParams`
  (temperature / top-k / top-p / min-p):

  - chain: Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
    Decoding") / Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"):
    accept draft token x with probability ``min(1, p(x) / q(x))``; on the first rejection
    sample from ``norm(max(p - q, 0))`` and stop; if all are accepted, the bonus comes from p
    at the last node.
  - tree: multi-draft recursive rejection sampling (SpecInfer, Miao et al. 2024, "multi-step
    speculative sampling"; SpecTr, Sun et al. 2023): at a node, try its children in index
    order, each with probability ``min(1, r(x_c) / q_c(x_c))`` against the residual r
    (initially p); a rejection updates ``r <- norm(max(r - q_c, 0))``; an accepted child
    becomes the current node (with its own p); when every child is rejected (or the node is
    a leaf) the last token is sampled from r. Exact when each child's token was drawn from its
    ``q_c`` independently of its siblings; for deterministic drafts (PTD's trie / argmax
    drafts, PLD / Lookahead n-grams) ``q_c`` is one-hot, the default here, and the rule
    becomes: accept child c with probability ``r(x_c)``, else zero ``r(x_c)`` and renormalize.

Everything runs on the host on small arrays (numpy; the target probabilities come from one
jitted call). Randomness is a ``numpy.random.Generator``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from selforch_jax.runtime.sampling import SamplingParams, filtered_logits

__all__ = ["VerifyResult", "target_probs", "greedy_chain", "greedy_tree", "speculative_chain",
           "speculative_tree", "verify_chain", "verify_tree"]


@dataclasses.dataclass(frozen=True)
class VerifyResult:
  """What a verify step commits.

  Attributes:
    path: int64 ``[A]``: the accepted nodes, root to leaf (tree node indices, root excluded;
      for a chain, indices into the draft, i.e. ``0..A-1``).
    tokens: int32 ``[A + 1]``: the accepted draft tokens, then the bonus (all accepted / a leaf
      reached) or correction (a rejection) token sampled from the target.
  """

  path: np.ndarray
  tokens: np.ndarray

  @property
  def num_accepted(self) -> int:
    """A: draft tokens accepted (the bonus token not counted)."""
    return int(self.path.size)


@functools.partial(jax.jit, static_argnums=(1,))
def _probs(logits, params):
  return jax.nn.softmax(filtered_logits(logits, params), axis=-1)


def target_probs(logits, params: SamplingParams) -> np.ndarray:
  """The distributions AR sampling draws from: ``softmax(filtered_logits(logits, params))``.

  Args:
    logits: float ``[N, V]`` (numpy or jax). params: :class:`SamplingParams`, temperature > 0.

  Returns:
    float64 ``[N, V]`` numpy, each row summing to 1 (filtered tokens exactly 0).

  Raises:
    ValueError: greedy params (temperature 0 has no distribution; use the greedy functions).
  """
  if params.greedy:
    raise ValueError("target_probs needs temperature > 0 (greedy verification uses argmax)")
  p = np.asarray(_probs(jnp.asarray(logits, jnp.float32), params), np.float64)
  return p / p.sum(axis=-1, keepdims=True)


def _check_tree(parents, tokens, n_rows: int) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
  parents = np.asarray(parents, np.int64).reshape(-1)
  tokens = np.asarray(tokens, np.int64).reshape(-1)
  N = parents.size
  if N == 0 or tokens.shape != (N,) or n_rows != N:
    raise ValueError(f"tree: parents [{N}], tokens {tokens.shape} and target rows {n_rows} must "
                     f"all be [N] with N >= 1")
  if parents[0] != -1 or np.any(parents[1:] < 0) or np.any(parents[1:] >= np.arange(1, N)):
    raise ValueError(f"tree: node 0 must be the root (parent -1) and every other node's parent "
                     f"an earlier node (0 <= parents[i] < i), got {parents.tolist()[:16]}")
  children: list[list[int]] = [[] for _ in range(N)]
  for i in range(1, N):
    children[int(parents[i])].append(i)
  return parents, tokens, children


def _chain_tree(draft, n_rows: int):
  draft = np.asarray(draft, np.int64).reshape(-1)
  K = draft.size
  if n_rows != K + 1:
    raise ValueError(f"chain: a draft of {K} tokens needs K + 1 = {K + 1} target rows "
                     f"(the root, then after each draft token), got {n_rows}")
  return np.arange(-1, K), np.concatenate([[0], draft])


def _result(path, tokens, last) -> VerifyResult:
  path = np.asarray(path, np.int64)
  return VerifyResult(path=path, tokens=np.asarray([*tokens[path].tolist(), int(last)], np.int32))


def greedy_tree(parents, tokens, target) -> VerifyResult:
  """Greedy longest-prefix match over a draft tree.

  Args:
    parents: int ``[N]``: ``parents[0] = -1`` (node 0 is the root: the last committed token)
      and ``0 <= parents[i] < i``.
    tokens: int ``[N]`` token of each node (the root's is not used).
    target: the model at every node: int argmax ``[N]`` or float logits ``[N, V]`` (argmax
      taken, first index on ties, as the greedy sampler does).

  Returns:
    :class:`VerifyResult`: the walk from the root while the argmax is a child's token (the
    first such child in index order), then the argmax at the last node as the bonus.

  Raises:
    ValueError: malformed tree or shapes.
  """
  target = np.asarray(target)
  am = target.argmax(-1) if target.ndim == 2 else target.reshape(-1)
  parents, tokens, children = _check_tree(parents, tokens, am.shape[0])
  node, path = 0, []
  while True:
    nxt = next((c for c in children[node] if tokens[c] == am[node]), None)
    if nxt is None:
      return _result(path, tokens, am[node])
    path.append(nxt)
    node = nxt


def greedy_chain(draft, target) -> VerifyResult:
  """Greedy longest-prefix match of a chain draft.

  Args:
    draft: int ``[K]`` draft tokens.
    target: int argmax ``[K + 1]`` or float logits ``[K + 1, V]``: row 0 after the last
      committed token, row i after ``draft[:i]``.

  Returns:
    :class:`VerifyResult` with ``path = 0..A-1`` (draft indices).

  Raises:
    ValueError: shapes.
  """
  target = np.asarray(target)
  parents, tokens = _chain_tree(draft, target.shape[0])
  r = greedy_tree(parents, tokens, target)
  return VerifyResult(path=r.path - 1, tokens=r.tokens)


def _sample(r: np.ndarray, rng: np.random.Generator) -> int:
  c = np.cumsum(r)
  return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), r.size - 1))


def speculative_tree(parents, tokens, target_logits, params: SamplingParams,
                     rng: np.random.Generator, draft_probs=None) -> VerifyResult:
  """Exact speculative sampling over a draft tree (multi-draft recursive rejection sampling,
  SpecInfer / SpecTr; see the module docstring). Greedy ``params`` -> :func:`greedy_tree`.

  Args:
    parents, tokens: the tree (see :func:`greedy_tree`); node 0 is the root.
    target_logits: float ``[N, V]``: the target's logits at every node (row i = after the
      root-to-i path); the target distribution is :func:`target_probs` of it.
    params: :class:`SamplingParams` of the request (the same as AR sampling would use).
    rng: ``numpy.random.Generator``.
    draft_probs: None (every draft token deterministic: one-hot q, PTD / PLD / Lookahead), or
      float ``[N, V]``: row i is the distribution node i's token was drawn from (independently
      of its siblings; the root's row is not used; a one-hot row = a deterministic node).

  Returns:
    :class:`VerifyResult`; ``tokens`` is distributed as AR sampling of ``A + 1`` tokens.

  Raises:
    ValueError: malformed tree or shapes, negative ``draft_probs``, a draft token with
      ``q = 0`` under its own row.
  """
  target_logits = np.asarray(target_logits)
  if params.greedy:
    return greedy_tree(parents, tokens, target_logits)
  parents, tokens, children = _check_tree(parents, tokens, target_logits.shape[0])
  N, V = target_logits.shape
  if draft_probs is not None:
    q = np.asarray(draft_probs, np.float64)
    if q.shape != (N, V) or np.any(q < 0):
      raise ValueError(f"draft_probs must be non-negative [N, V] = [{N}, {V}], got {q.shape}")
    if N > 1 and np.any(q[np.arange(1, N), tokens[1:]] <= 0):
      raise ValueError("draft_probs: a draft token has probability 0 under its own row")
  p = target_probs(target_logits, params)
  node, path = 0, []
  while True:
    r = p[node].copy()
    accepted = None
    for c in children[node]:
      x = int(tokens[c])
      if draft_probs is None:          # one-hot q: accept with probability r(x)
        qc = None
        ok = rng.random() < r[x]
      else:
        qc = q[c] / q[c].sum()
        ok = rng.random() * qc[x] < r[x]
      if ok:
        accepted = c
        break
      if qc is None:
        r[x] = 0.0
      else:
        r = np.maximum(r - qc, 0.0)
      s = r.sum()
      if s <= 0:  # r == q_c: a rejection had probability 0 (rounding); keep the target
        r = p[node].copy()
      else:
        r /= s
    if accepted is None:
      return _result(path, tokens, _sample(r, rng))
    path.append(accepted)
    node = accepted


def speculative_chain(draft, draft_probs, target_logits, params: SamplingParams,
                      rng: np.random.Generator) -> VerifyResult:
  """Exact speculative sampling of a chain draft (Leviathan et al. 2023; Chen et al. 2023).
  Greedy ``params`` -> :func:`greedy_chain`.

  Args:
    draft: int ``[K]`` draft tokens.
    draft_probs: None (deterministic drafts: one-hot q) or float ``[K, V]``: row i is the
      distribution ``draft[i]`` was sampled from.
    target_logits: float ``[K + 1, V]``: row 0 after the last committed token, row i after
      ``draft[:i]``.
    params: the request's :class:`SamplingParams`. rng: ``numpy.random.Generator``.

  Returns:
    :class:`VerifyResult` (``path = 0..A-1``): accept ``draft[i]`` with probability
    ``min(1, p_i(x) / q_i(x))``; on the first rejection the last token is sampled from
    ``norm(max(p_i - q_i, 0))``; after K acceptances it is the bonus from ``p_K``.

  Raises:
    ValueError: shapes (see :func:`speculative_tree`).
  """
  target_logits = np.asarray(target_logits)
  parents, tokens = _chain_tree(draft, target_logits.shape[0])
  q = None
  if draft_probs is not None:
    dq = np.asarray(draft_probs, np.float64)
    if dq.shape != (tokens.size - 1, target_logits.shape[-1]):
      raise ValueError(f"draft_probs must be [K, V] = [{tokens.size - 1}, "
                       f"{target_logits.shape[-1]}], got {dq.shape}")
    q = np.concatenate([np.full((1, dq.shape[1]), 1.0 / dq.shape[1]), dq])
  r = speculative_tree(parents, tokens, target_logits, params, rng, draft_probs=q)
  return VerifyResult(path=r.path - 1, tokens=r.tokens)


def verify_tree(parents, tokens, target_logits, params: SamplingParams,
                rng: np.random.Generator | None = None, draft_probs=None) -> VerifyResult:
  """Greedy match (temperature 0) or exact speculative sampling of a tree draft, as ``params``
  says: :func:`greedy_tree` / :func:`speculative_tree` (``rng`` required when sampling)."""
  if params.greedy:
    return greedy_tree(parents, tokens, target_logits)
  if rng is None:
    raise ValueError("verify_tree: sampling (temperature > 0) needs an rng")
  return speculative_tree(parents, tokens, target_logits, params, rng, draft_probs)


def verify_chain(draft, target_logits, params: SamplingParams,
                 rng: np.random.Generator | None = None, draft_probs=None) -> VerifyResult:
  """:func:`greedy_chain` or :func:`speculative_chain`, as ``params`` says."""
  if params.greedy:
    return greedy_chain(draft, target_logits)
  if rng is None:
    raise ValueError("verify_chain: sampling (temperature > 0) needs an rng")
  return speculative_chain(draft, draft_probs, target_logits, params, rng)
