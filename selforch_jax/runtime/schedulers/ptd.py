"""PTD, Progressive Tree Drafting (MINE-USTC/PTD; seed_systems.md §3) on the engine, lossless.

Every forward of the unmodified model carries the last committed token, a **draft tree** grown
from the model's own argmax (it only feeds the n-gram cache; never verified, never kept) and a
**guess tree** (the trie of continuations of the last committed token in the
:class:`~selforch_jax.runtime.ngram.TrieCache`), which is verified
(:mod:`selforch_jax.runtime.verify`: greedy longest-prefix match; for temperature > 0 exact
multi-draft recursive rejection sampling with the residual rule, SpecInfer, Miao et al. 2024,
*not* upstream's argmax-of-the-residual fallback). The step layout, relabel of the accepted
path and the loop are :class:`~selforch_jax.runtime.schedulers.spec_base.SpecScheduler`'s.

Draft tree (upstream ``trees/draft_tree.py``; values in ``configs/ptd.py``): a virtual root whose
children are the *first-level* nodes. Initialised with ``ini_nodes = 2`` first-level nodes of
random prompt tokens, each with a random chain of depth ``1..ini_max_depth`` (random prompt
tokens). Layout: first-level node k sees first-level nodes ``0..k-1``; a deeper node sees that
chain and its ancestors; a node at depth d of subtree i sits at ``last_pos + d + i``. After each
step, in upstream's order: (1) each fed node stores the argmax at its row; (2) every fed node adds
it as a child unless present or already ``max_child`` children (a stop id is never added:
upstream's ``remove_eos_sub_trees`` with the model's EOS ids, not id 2); (3) the root: with more
than ``min_child`` first-level nodes the oldest goes; with fewer, the last first-level node's
argmax becomes a new first-level node (moved up from that node's children); (4) when a subtree
reaches ``max_depth``, every fed node's subtree (plus the node's argmax as an extra child) is merged
into ``cache[node.token]`` (capped at ``trie_cap`` = 60 nodes, oldest first-level child dropped),
then each such subtree is replaced by its first child's subtree (or dropped if that token already
is first-level).

Beyond upstream (marked in ``configs/ptd.py``): the step has at most ``1 + max_tree`` queries and
the guess tree at most ``max_guess`` nodes, chosen from the measured step-cost curve
(:func:`choose_sizes`); the draft takes whatever the guess tree leaves of the bucket (padding
queries cost the same); nodes are fed in (sibling-rank, depth) order so every subtree's main chain
is fed first; ``cache_from_output`` also records the committed text's n-grams; ``pld_init``
(upstream ``PLD_INI``) seeds the cache with the prompt's 5-grams; ``lookup_ngram > 0`` grafts a
prompt-lookup chain (:func:`~selforch_jax.runtime.ngram.prompt_lookup` over prompt + output, the
PLD baseline's draft, matched on up to ``lookup_ngram`` tokens of context, not just the last
one) onto the guess tree as its first branch (:func:`~selforch_jax.runtime.ngram.graft_chain`),
inside the same ``max_guess`` budget.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from selforch_jax.runtime.ngram import TrieCache, graft_chain, prompt_lookup
from selforch_jax.runtime.registry import register
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.schedulers.spec_base import Draft, Request, SpecScheduler, spec_factory
from selforch_jax.runtime.verify import greedy_tree

# upstream configs/tree_config.json + cache settings (configs/ptd.py holds them with the CPU
# overrides)
UPSTREAM = dict(max_depth=6, max_child=4, min_child=4, ini_max_depth=2, ini_nodes=2,
                trie_cap=60, pld_init=False, pld_n=5)


class _Node:
  __slots__ = ("token", "children", "draft")

  def __init__(self, token: int):
    self.token = int(token)
    self.children: list[_Node] = []
    self.draft: int | None = None

  def child(self, token: int):
    return next((c for c in self.children if c.token == token), None)

  def depth(self) -> int:
    return 1 + max((c.depth() for c in self.children), default=0)

  def as_dict(self) -> dict:
    """``{child token: {...}}`` with the node's argmax as an extra leaf child."""
    d = {c.token: c.as_dict() for c in self.children}
    if self.draft is not None and self.draft not in d:
      d[self.draft] = {}
    return d


class DraftTree:
  """PTD's progressive draft tree (see the module docstring).

  Args:
    prompt: int token ids (initial nodes are drawn from them).
    rng: ``numpy.random.Generator``.
    max_depth, max_child, min_child, ini_max_depth, ini_nodes: upstream's tree config.
    stop_ids: ids never added to the tree.

  Attributes:
    first: the first-level nodes (the root's children), oldest first.
  """

  def __init__(self, prompt: Sequence[int], rng: np.random.Generator, *, max_depth: int = 6,
               max_child: int = 4, min_child: int = 4, ini_max_depth: int = 2, ini_nodes: int = 2,
               stop_ids: Sequence[int] = ()):
    self.prompt = [int(t) for t in prompt]
    self.rng = rng
    self.max_depth, self.max_child, self.min_child = int(max_depth), int(max_child), int(min_child)
    self.ini_max_depth, self.ini_nodes = int(ini_max_depth), int(ini_nodes)
    self.stops = frozenset(int(s) for s in stop_ids)
    self.first: list[_Node] = []
    self._init()

  def _rand(self) -> int:
    return self.prompt[int(self.rng.integers(len(self.prompt)))]

  def _init(self) -> None:
    """``init_only_several_nodes``: random first-level nodes with random chains."""
    for _ in range(max(1, self.ini_nodes)):
      node = _Node(self._rand())
      self.first.append(node)
      for _ in range(int(self.rng.integers(1, max(1, self.ini_max_depth) + 1)) - 1):
        c = _Node(self._rand())
        node.children.append(c)
        node = c

  def layout(self, budget: int) -> tuple[list, Draft]:
    """The nodes fed this step (at most ``budget``) and their :class:`Draft` rows.

    Order: by (sum of sibling ranks on the path, depth, subtree, preorder), which is closed
    under ancestors and the first-level chain, so any prefix is a valid draft. Node at depth d
    of subtree i: offset ``d + i``, sees first-level nodes ``0..i-1`` and its ancestors."""
    items = []   # (rank, depth, i, preorder, node, parent item index or -1)
    stack = [(n, 0, 1, i, -1) for i, n in reversed(list(enumerate(self.first)))]
    while stack:
      node, rank, d, i, par = stack.pop()
      items.append((rank, d, i, len(items), node, par))
      me = len(items) - 1
      for r, c in reversed(list(enumerate(node.children))):
        stack.append((c, rank + r, d + 1, i, me))
    order = sorted(range(len(items)), key=lambda k: items[k][:4])[:max(0, budget)]
    pos = {k: j for j, k in enumerate(order)}
    fl_item = {items[k][2]: k for k in range(len(items)) if items[k][1] == 1}
    nodes, toks, offs, sees = [], [], [], []
    for k in order:
      rank, d, i, _, node, par = items[k]
      anc = [pos[fl_item[j]] for j in range(i)]
      chain, p = [], par
      while p >= 0:
        chain.append(pos[p])
        p = items[p][5]
      anc += chain[::-1]
      nodes.append(node)
      toks.append(node.token)
      offs.append(d + i)
      sees.append(anc)
    return nodes, Draft(toks, offs, sees)

  def update(self, fed: list, argmax: Sequence[int], cache: TrieCache | None) -> bool:
    """Upstream's per-step update (module docstring, steps 1-4) after a forward; returns
    whether the cache was filled."""
    for node, a in zip(fed, argmax):
      node.draft = int(a)
    for node in fed:                                   # (2) progressive growth
      a = node.draft
      if a in self.stops or node.child(a) is not None or len(node.children) >= self.max_child:
        continue
      node.children.append(_Node(a))
    if len(self.first) > self.min_child:               # (3) slide the first level
      self.first.pop(0)
    elif len(self.first) < self.min_child and self.first:
      last = self.first[-1]
      t = last.draft
      if t is not None and t not in self.stops and all(n.token != t for n in self.first):
        last.children = [c for c in last.children if c.token != t]
        self.first.append(_Node(t))
    filled = False
    deep = [n.depth() >= self.max_depth for n in self.first]
    if any(deep) and cache is not None:                # (4) fill the cache, then go deeper
      for node in fed:
        cache.merge(node.token, node.as_dict())
      filled = True
    if any(deep):
      new = []
      for n, dp in zip(self.first, deep):
        if not dp:
          new.append(n)
        elif n.children and all(m.token != n.children[0].token for m in self.first):
          new.append(n.children[0])
      self.first = new
    if not self.first:
      self._init()
    return filled

  def num_nodes(self) -> int:
    def count(n):
      return 1 + sum(count(c) for c in n.children)
    return sum(count(n) for n in self.first)


def choose_sizes(step_ms: dict, accept: dict, min_draft: int = 1) -> dict:
  """Tree sizes that maximise expected committed tokens per second.

  Args:
    step_ms: ``{T: ms}`` measured engine step cost per query count (e.g.
      ``bench/results/engine_step_cpu.json["ms"]``; the engine pads T to a power of two, so a
      step of T queries costs ``step_ms`` at the next measured T >= it).
    accept: ``{g: mean committed tokens per step with a guess budget of g}`` (e.g. measured by
      :func:`accept_curve`; ``accept[0]`` = 1, plain AR).
    min_draft: draft nodes kept in every step (the cache needs feeding).

  Returns:
    ``dict(max_tree, max_guess, bucket, tokens_per_step, ms_per_step, tokens_per_s)``: the
    bucket T and guess budget g maximising ``accept[g] / step_ms[T]`` with ``1 + g +
    min_draft <= T``; the draft gets ``T - 1 - g`` nodes (what the padding would waste).

  Raises:
    ValueError: empty inputs.
  """
  if not step_ms or not accept:
    raise ValueError("choose_sizes needs a step-cost curve and an acceptance curve")
  ms = {int(k): float(v) for k, v in step_ms.items()}
  best = None
  for T in sorted(ms):
    for g, a in accept.items():
      g = int(g)
      if 1 + g + min_draft > T and not (g == 0 and T == 1):
        continue
      rate = 1000.0 * float(a) / ms[T]
      if best is None or rate > best["tokens_per_s"] + 1e-12:
        best = dict(max_tree=T - 1, max_guess=g, bucket=T, tokens_per_step=float(a),
                    ms_per_step=ms[T], tokens_per_s=rate)
  return best


class PTDScheduler(SpecScheduler):
  """PTD (module docstring). Args as :class:`SpecScheduler`, plus upstream's tree / cache options
  (:data:`UPSTREAM`), ``cache_from_output`` (record committed n-grams of length ``pld_n``),
  ``lookup_ngram`` (0: off, upstream; else the prompt-lookup chain's longest match) and
  ``record_budgets`` (guess budgets whose counterfactual acceptance is recorded per step, for
  :func:`choose_sizes`; node logits depend only on the node's path, so a BFS prefix of the guess
  tree verified on the same logits is exactly what that budget would have accepted).
  """

  name = "ptd"

  def __init__(self, prompts, max_new_tokens, sampling=SamplingParams(), stop_ids=(),
               owner_base=0, segment_base=0, *, max_tree=15, max_guess=8, max_pos=1 << 30,
               max_depth=6, max_child=4, min_child=4, ini_max_depth=2, ini_nodes=2, trie_cap=60,
               pld_init=False, pld_n=5, cache_from_output=False, lookup_ngram=0,
               record_budgets=()):
    super().__init__(prompts, max_new_tokens, sampling, stop_ids, owner_base, segment_base,
                     max_tree=max_tree, max_guess=max_guess, max_pos=max_pos)
    self.tree_kw = dict(max_depth=max_depth, max_child=max_child, min_child=min_child,
                        ini_max_depth=ini_max_depth, ini_nodes=ini_nodes)
    self.trie_cap, self.pld_init, self.pld_n = int(trie_cap), bool(pld_init), int(pld_n)
    self.cache_from_output = bool(cache_from_output)
    if lookup_ngram < 0:
      raise ValueError(f"lookup_ngram must be >= 0, got {lookup_ngram}")
    self.lookup_ngram = int(lookup_ngram)
    self.record_budgets = tuple(int(b) for b in record_budgets)

  def start(self, req: Request) -> None:
    cache = TrieCache(self.trie_cap)
    if self.pld_init:
      cache.add_ngrams(req.prompt, self.pld_n)
    req.extra.update(cache=cache, fills=0, tree=DraftTree(req.prompt, req.rng, stop_ids=self.stops,
                                                          **self.tree_kw),
                     cf={b: [] for b in self.record_budgets})

  def propose(self, req: Request, budget: int):
    remaining = self.max_new - len(req.tokens)
    n_guess = min(budget, self.max_guess)
    parents, toks, depth = req.extra["cache"].guess(req.tokens[-1], n_guess, max_depth=remaining)
    if self.lookup_ngram and n_guess > 0:   # beyond upstream: a prompt-lookup chain first
      chain = prompt_lookup(req.context, self.lookup_ngram, min(n_guess, remaining))
      if chain:
        parents, toks, _ = graft_chain(parents, toks, depth, chain, n_guess)
    nodes, draft = req.extra["tree"].layout(budget - (parents.size - 1))
    req.extra["fed"] = nodes
    req.extra["guess"] = (parents, toks)
    return parents, toks, draft

  def on_step(self, plan, result):
    kind, i, info = plan.tag
    if kind == "decode" and self.record_budgets and self.sampling.greedy:
      parents, toks, _ = info
      am = np.asarray(result.logits[:parents.size].argmax(-1))
      for b in self.record_budgets:
        n = min(b, parents.size - 1) + 1
        self.reqs[i].extra["cf"][b].append(greedy_tree(parents[:n], toks[:n], am[:n])
                                           .num_accepted + 1)
    super().on_step(plan, result)

  def observe(self, req, draft, draft_argmax, committed):
    ex = req.extra
    fed = ex["fed"][:len(draft)]
    if ex["tree"].update(fed, np.asarray(draft_argmax)[:len(fed)], ex["cache"]):
      ex["fills"] += 1
    if self.cache_from_output:
      ctx, n = req.context, self.pld_n
      for q in range(len(ctx) - len(committed), len(ctx)):
        s = q - (n - 1)
        if s >= 0:
          ex["cache"].insert(ctx[s], ctx[s + 1:q + 1])
    ex["stats"] = dict(cache_fills=ex["fills"], cache_keys=len(ex["cache"]),
                       draft_nodes=ex["tree"].num_nodes(),
                       counterfactual={b: float(np.mean(v)) for b, v in ex["cf"].items() if v})


register("ptd")(spec_factory(PTDScheduler))
