"""N-gram caches for the training-free lossless drafters (PTD, PLD, Lookahead; DESIGN.md §2.5).

* :class:`Trie`: a token trie (children in insertion order, a node count, a cap that drops the
  oldest first-level child), flattened into a guess tree ``(parents, tokens)`` for one verify
  step (:func:`selforch_jax.runtime.verify.verify_tree`'s layout: node 0 is the root = the last
  committed token, ``parents[0] = -1``).
* :class:`TrieCache`: first token -> :class:`Trie` of continuations (PTD's ``ContextCacheTree``,
  MINE-USTC/PTD ``cache_server.py``; Lookahead's n-gram pool, Fu et al. ICML 2024, is the same
  map with chains of length N-1).
* :func:`prompt_lookup`: prompt-lookup decoding's draft (Saxena 2023,
  apoorvumang/prompt-lookup-decoding ``find_candidate_pred_tokens``): the continuation of the
  earliest earlier occurrence of the context's last n-gram, n from ``max_ngram`` down to
  ``min_ngram``.

Everything is host-side Python over int token ids.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

__all__ = ["Trie", "TrieCache", "prompt_lookup"]


class Trie:
  """A trie of token continuations.

  Attributes:
    children: ``{token: Trie}`` in insertion order (oldest first).
    size: number of nodes below this one (this node not counted).
  """

  __slots__ = ("children", "size")

  def __init__(self):
    self.children: dict[int, Trie] = {}
    self.size = 0

  def insert(self, seq: Iterable[int]) -> int:
    """Add the chain ``seq`` below this node; returns the number of new nodes."""
    node, path, added = self, [], 0
    for t in seq:
      t = int(t)
      child = node.children.get(t)
      if child is None:
        child = node.children[t] = Trie()
        added += 1
      path.append(node)
      node = child
    if added:
      self._recount_path(path, added)
    return added

  def _recount_path(self, path, added):
    # every node on the path gained at most `added` nodes below it; recount exactly (cheap)
    for n in reversed(path):
      n.size = sum(1 + c.size for c in n.children.values())

  def merge(self, tree: dict) -> None:
    """Merge a nested ``{token: {token: ...}}`` dict below this node."""
    for t, sub in tree.items():
      t = int(t)
      child = self.children.get(t)
      if child is None:
        child = self.children[t] = Trie()
      child.merge(sub)
    self.size = sum(1 + c.size for c in self.children.values())

  def cap(self, max_nodes: int) -> None:
    """Drop the oldest first-level children until at most ``max_nodes`` nodes remain (PTD's
    ``MAX_N`` rule); a single child too large is kept (nothing else can go)."""
    while self.size > max_nodes and len(self.children) > 1:
      t = next(iter(self.children))
      self.size -= 1 + self.children.pop(t).size

  def touch(self, token: int) -> None:
    """Move first-level child ``token`` to the newest end (least recently used goes first)."""
    if token in self.children:
      self.children[token] = self.children.pop(token)

  def flatten(self, max_nodes: int, max_depth: int | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ``max_nodes`` nodes in breadth-first order (newest child first), as a tree.

    Returns:
      ``(parents int64 [N + 1], tokens int64 [N + 1], depth int64 [N + 1])``: node 0 is the
      root (token 0, parent -1, depth 0); every other node's parent is an earlier node, so
      any prefix of the order is closed under ancestors.
    """
    parents, tokens, depth = [-1], [0], [0]
    frontier = [(0, self)]
    while frontier and len(tokens) - 1 < max_nodes:
      nxt = []
      for idx, node in frontier:
        for t in reversed(list(node.children)):
          if len(tokens) - 1 >= max_nodes:
            break
          d = depth[idx] + 1
          if max_depth is not None and d > max_depth:
            continue
          parents.append(idx)
          tokens.append(t)
          depth.append(d)
          nxt.append((len(tokens) - 1, node.children[t]))
      frontier = nxt
    return (np.asarray(parents, np.int64), np.asarray(tokens, np.int64),
            np.asarray(depth, np.int64))


class TrieCache:
  """First token -> :class:`Trie` of what followed it, each capped at ``max_nodes`` nodes.

  Args:
    max_nodes: the per-trie cap (PTD: ``MAX_N = 60``).

  Raises:
    ValueError: ``max_nodes < 1``.
  """

  def __init__(self, max_nodes: int = 60):
    if max_nodes < 1:
      raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    self.max_nodes = int(max_nodes)
    self.tries: dict[int, Trie] = {}

  def __len__(self) -> int:
    return len(self.tries)

  def _trie(self, first: int) -> Trie:
    t = self.tries.get(int(first))
    if t is None:
      t = self.tries[int(first)] = Trie()
    return t

  def insert(self, first: int, seq: Sequence[int]) -> None:
    """Record that ``seq`` followed ``first`` (the chain's first token is refreshed)."""
    if len(seq) == 0:
      return
    trie = self._trie(first)
    trie.insert(seq)
    trie.touch(int(seq[0]))
    trie.cap(self.max_nodes)

  def merge(self, first: int, tree: dict) -> None:
    """Merge a nested ``{token: {...}}`` dict of continuations of ``first``."""
    if not tree:
      return
    trie = self._trie(first)
    trie.merge(tree)
    for t in tree:
      trie.touch(int(t))
    trie.cap(self.max_nodes)

  def add_ngrams(self, tokens: Sequence[int], n: int) -> None:
    """Every ``n``-gram of ``tokens``: its last ``n - 1`` tokens follow its first (PTD's
    ``PLD_INI`` prompt seeding uses n = 5)."""
    toks = [int(t) for t in tokens]
    for i in range(len(toks) - 1):
      self.insert(toks[i], toks[i + 1:i + n])

  def guess(self, first: int, max_nodes: int, max_depth: int | None = None):
    """The guess tree of ``first``: :meth:`Trie.flatten` of its trie (just the root if none)."""
    trie = self.tries.get(int(first))
    if trie is None or max_nodes < 1:
      z = np.zeros(1, np.int64)
      return np.full(1, -1, np.int64), z, z.copy()
    return trie.flatten(max_nodes, max_depth)


def prompt_lookup(context: Sequence[int], max_ngram: int = 3, num_pred: int = 10,
                  min_ngram: int = 1) -> list[int]:
  """Prompt-lookup decoding's draft (Saxena 2023): for n from ``max_ngram`` down to
  ``min_ngram``, find the earliest earlier occurrence of the last n tokens of ``context`` whose
  continuation is non-empty, and return up to ``num_pred`` tokens that followed it.

  Args:
    context: int token ids (prompt + generated so far).

  Returns:
    The draft (possibly empty: no match).

  Raises:
    ValueError: ``min_ngram < 1`` or ``max_ngram < min_ngram``.
  """
  if min_ngram < 1 or max_ngram < min_ngram:
    raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
  ctx = np.asarray(context, np.int64).reshape(-1)
  L = ctx.size
  for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
    pat = ctx[L - n:]
    win = np.lib.stride_tricks.sliding_window_view(ctx[:L - 1], n)   # starts 0..L-1-n
    hits = np.flatnonzero((win == pat).all(axis=1))
    hits = hits[hits + n < L]                       # a non-empty continuation, not the suffix
    hits = hits[hits != L - n]
    if hits.size:
      s = int(hits[0]) + n
      return ctx[s:s + num_pred].tolist()
  return []


def graft_chain(parents: np.ndarray, tokens: np.ndarray, depth: np.ndarray,
                chain: Sequence[int], max_nodes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """A guess tree with ``chain`` grafted on as its first branch (PTD + prompt lookup, beyond
  upstream): the chain's nodes come first (root to tip), then the tree's nodes in their order,
  each merged with an equal sibling already placed; at most ``max_nodes`` nodes besides the
  root, so the tree's last nodes are the ones dropped.

  Args:
    parents, tokens, depth: int64 ``[N + 1]``, a tree in :meth:`Trie.flatten`'s layout.
    chain: int token ids (e.g. :func:`prompt_lookup`'s draft).
    max_nodes: node budget (>= 0).

  Returns:
    ``(parents, tokens, depth)`` int64 ``[M + 1]``, the same layout (every parent earlier).
  """
  P, T, D = [-1], [0], [0]
  index: dict[tuple[int, int], int] = {}

  def add(parent: int, tok: int) -> int | None:
    key = (parent, int(tok))
    if key in index:
      return index[key]
    if len(T) - 1 >= max_nodes:
      return None
    P.append(parent)
    T.append(int(tok))
    D.append(D[parent] + 1)
    index[key] = len(T) - 1
    return index[key]

  node: int | None = 0
  for tok in chain:
    node = add(node, tok)
    if node is None:
      break
  where = {0: 0}
  for i in range(1, len(parents)):
    at = where.get(int(parents[i]))
    if at is not None:
      j = add(at, int(tokens[i]))
      if j is not None:
        where[i] = j
  return np.asarray(P, np.int64), np.asarray(T, np.int64), np.asarray(D, np.int64)
