"""KV-cache policies on the AR scheduler: dense, StreamingLLM, H2O, paged H2O (and the hook TIP
uses), with per-request live-KV accounting from the pool.

:class:`PolicyScheduler` is :class:`~selforch_jax.runtime.schedulers.ar.ARScheduler` (same steps, same
sampling, token for token equal to it when nothing is evicted) with one :class:`KVPolicy` per
request. Around every engine step the policy decides, for its request:

* which page-table **owner** each new token is written to (:meth:`KVPolicy.route`; TIP starts
  every reasoning step on a new owner, so on a fresh page);
* which slots die **before** the step (:meth:`KVPolicy.before_step`): every eviction goes
  through :meth:`KVPool.evict <selforch_jax.runtime.kv_pool.KVPool.evict>` (or
  :meth:`KVPool.free_owner` for an owner all of whose tokens died), so the live-KV counts are
  the pool's.

Budget policies (Xiao et al. 2023, *Efficient Streaming Language Models with Attention Sinks*;
Zhang et al. 2023, *H2O: Heavy-Hitter Oracle*), each with a budget of ``budget`` live tokens per
request:

* :class:`StreamingLLMPolicy`: the first ``n_sink`` tokens (attention sinks) + the most recent
  ones;
* :class:`H2OPolicy`: a recent window of ``round(recent_ratio * budget)`` tokens + the heavy
  hitters, i.e. the tokens with the largest accumulated attention (the attention probability
  every later query gave them, summed over layers, heads and queries: the ``attn_mass`` output
  its steps ask for in their :class:`~selforch_jax.runtime.step.ForwardSpec`); token
  granular: the lowest-score token outside the window is evicted;
* :class:`PagedH2OPolicy`: the same scores summed per KV page; whole pages are evicted (the
  lowest-score page outside the recent window), so freed pages return to the pool.

Budget rule (all three): the budget holds from the first decode step on: before each decode step
the policy evicts until the request's live tokens plus the token about to run are ``<= budget``
(the query attends to at most ``budget`` tokens, itself included; paged H2O may stay up to
``page_size - 1`` below). Prefill is dense (the prompt runs in one step; a prompt longer than the
budget is cut down before the first decode step). Where the published methods differ: one
eviction decision per request shared by every layer and head (the pool's slots are shared; H2O
keeps per-head caches), and RoPE positions are not re-indexed after eviction (StreamingLLM
re-indexes positions inside its cache to run past the trained context; our sequences stay within
it).

Live KV per request (:attr:`PolicyScheduler.kv_stats`): the request's ALIVE pool slots after its
prefill and after each decode step; mean and peak over those steps, in tokens and bytes
(``tokens * KVPool.bytes_per_token``), plus the pages the request holds (resident KV, which
includes dead and unfilled slots of partly used pages).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Sequence

import jax
import numpy as np

from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.schedulers.ar import ARScheduler
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.kv_pool import ALIVE
from selforch_jax.runtime.registry import fresh_bases
from selforch_jax.runtime.scheduler import StepPlan, StepResult
from selforch_jax.runtime.step import PLAIN, ForwardSpec

__all__ = ["Route", "KVPolicy", "DensePolicy", "StreamingLLMPolicy", "H2OPolicy",
           "PagedH2OPolicy", "PolicyScheduler", "make_policy", "POLICIES"]


@dataclasses.dataclass(frozen=True)
class Route:
  """Where one new token goes and what it kills.

  Attributes:
    owner: page-table owner the token's slot is allocated from.
    kill: indices (in the request's token sequence: prompt then generated tokens) of tokens
      that die before this token runs.
  """

  owner: int
  kill: tuple[int, ...] = ()


class KVPolicy:
  """One request's KV policy (base class = dense: one owner, nothing evicted).

  The scheduler calls, per request: :meth:`bind` once; then for every token, in order,
  :meth:`route` (when the token is fed), :meth:`before_step` (right before the step that runs
  it; returns the pool changes) and :meth:`written` (after the step, with the token's slot).
  """

  needs_attention = False  # True: the steps ask for the attention mass (H2O)

  def bind(self, sched: "PolicyScheduler", row: int) -> None:
    """Attach to request ``row`` of ``sched`` (its pool, its first owner, its score array)."""
    self.sched, self.row = sched, row
    self.pool = sched.engine.pool
    self.owner = int(sched.owners[row])
    self.slot_of: list[int] = []          # token index -> slot (-1 until written)

  def owners(self) -> list[int]:
    """Every page-table owner this request has used."""
    return [self.owner]

  def route(self, token: int) -> Route:
    """Feed the next token of the request (prompt or generated); returns its :class:`Route`."""
    return Route(self.owner)

  def before_step(self, routes: Sequence[Route], prefill: bool) -> tuple[list[int], list[int]]:
    """Pool changes before a step that runs ``routes`` (this request's new tokens).

    Returns:
      ``(evict_slots, free_owners)``: slots to kill with ``KVPool.evict`` and owners whose
      pages are released whole (``KVPool.free_owner``); the two never overlap.
    """
    return [], []

  def written(self, slots: Sequence[int]) -> None:
    """The slots the last routed tokens were written to (in token order)."""
    self.slot_of.extend(int(s) for s in slots)

  # --- helpers for budget policies --------------------------------------------------------
  def alive_slots(self) -> np.ndarray:
    """int slots of this request that are ALIVE, oldest first (decode order)."""
    pool = self.pool
    s = np.flatnonzero((pool.state == ALIVE) & np.isin(pool.owner, self.owners()))
    return s[np.argsort(pool.order[s], kind="stable")]


class DensePolicy(KVPolicy):
  """No eviction (the dense baseline)."""


class _BudgetPolicy(KVPolicy, abc.ABC):
  """Evicts before each decode step so that live + new tokens <= ``budget``."""

  def __init__(self, budget: int):
    if int(budget) < 1:
      raise ValueError(f"KV budget must be >= 1 token, got {budget}")
    self.budget = int(budget)

  def before_step(self, routes, prefill):
    if prefill:
      return [], []
    alive = self.alive_slots()
    excess = alive.size + len(routes) - self.budget
    if excess <= 0:
      return [], []
    return [int(s) for s in self.choose(alive, excess)], []

  @abc.abstractmethod
  def choose(self, alive: np.ndarray, excess: int) -> np.ndarray:
    """Slots to evict (at least ``excess`` of ``alive``, oldest first order given)."""


class StreamingLLMPolicy(_BudgetPolicy):
  """StreamingLLM (Xiao et al. 2023): keep the first ``n_sink`` tokens and the most recent ones.

  Args:
    budget: live tokens per request (>= n_sink + 2: the sinks, one recent token, the new one).
    n_sink: attention-sink tokens kept from the start (the paper uses 4).

  Raises:
    ValueError: budget too small for the sinks.
  """

  def __init__(self, budget: int, n_sink: int = 4):
    super().__init__(budget)
    if n_sink < 0 or self.budget < n_sink + 2:
      raise ValueError(f"StreamingLLM needs budget >= n_sink + 2, got budget={budget}, "
                       f"n_sink={n_sink}")
    self.n_sink = int(n_sink)

  def choose(self, alive, excess):
    # alive is oldest first: evict the oldest tokens after the sinks
    return alive[self.n_sink:self.n_sink + excess]


class H2OPolicy(_BudgetPolicy):
  """H2O (Zhang et al. 2023), token granular: a recent window + heavy hitters by accumulated
  attention; evicts the lowest-score tokens outside the window (ties: the older first).

  Args:
    budget: live tokens per request (>= 2).
    recent_ratio: share of the budget kept as the recent window (the paper's 50/50 split by
      default); the window counts the token about to run.

  Raises:
    ValueError: budget < 2 or recent_ratio outside [0, 1).
  """

  needs_attention = True

  def __init__(self, budget: int, recent_ratio: float = 0.5):
    super().__init__(budget)
    if self.budget < 2 or not 0.0 <= recent_ratio < 1.0:
      raise ValueError(f"H2O needs budget >= 2 and 0 <= recent_ratio < 1, got {budget}, "
                       f"{recent_ratio}")
    self.recent = max(1, int(round(recent_ratio * self.budget)))

  def choose(self, alive, excess):
    n_protect = min(self.recent - 1, alive.size - excess)   # recent window minus the new token
    cand = alive[:alive.size - n_protect] if n_protect > 0 else alive
    score = self.sched.attn_score[cand]
    order = np.lexsort((np.arange(cand.size), score))     # lowest score, then oldest
    return cand[order[:excess]]


class PagedH2OPolicy(_BudgetPolicy):
  """Page-granular H2O: a page's score is the accumulated attention of its live tokens; whole
  pages outside the recent window are evicted, lowest score first, until live + new <= budget
  (so the request may stay up to ``page_size - 1`` tokens below the budget).

  Args:
    budget: live tokens per request (>= 2 pages' worth is sensible; any >= 1 is accepted).
    recent_ratio: share of the budget kept as the recent window (pages holding any of its
      tokens are protected, as is the page being filled).

  Raises:
    ValueError: budget < 1 or recent_ratio outside [0, 1).
  """

  needs_attention = True

  def __init__(self, budget: int, recent_ratio: float = 0.5):
    super().__init__(budget)
    if not 0.0 <= recent_ratio < 1.0:
      raise ValueError(f"recent_ratio must be in [0, 1), got {recent_ratio}")
    self.recent = max(1, int(round(recent_ratio * self.budget)))

  def choose(self, alive, excess):
    P = self.pool.page_size
    pages = alive // P
    protected = set(pages[-max(self.recent - 1, 1):].tolist())
    protected.add(int(self.pool.page_table(self.owner)[-1]))    # the page being filled
    cand = [p for p in dict.fromkeys(pages.tolist()) if p not in protected]   # oldest first
    if not cand:
      return np.zeros(0, np.int64)
    score = self.sched.attn_score
    page_score = np.array([score[alive[pages == p]].sum() for p in cand])
    order = np.lexsort((np.arange(len(cand)), page_score))
    out, freed = [], 0
    for j in order:
      if freed >= excess:
        break
      s = alive[pages == cand[j]]
      out.append(s)
      freed += s.size
    return np.concatenate(out)


POLICIES = {"dense": DensePolicy, "streaming_llm": StreamingLLMPolicy, "h2o": H2OPolicy,
            "paged_h2o": PagedH2OPolicy}


def make_policy(name: str, budget: int | None = None, **kw) -> KVPolicy:
  """A fresh policy by name: ``dense`` (no budget), ``streaming_llm``, ``h2o``, ``paged_h2o``.

  Raises:
    KeyError: unknown name. ValueError: a budget policy without a budget.
  """
  if name not in POLICIES:
    raise KeyError(f"unknown KV policy {name!r}; known: {sorted(POLICIES)}")
  if name == "dense":
    return DensePolicy()
  if budget is None:
    raise ValueError(f"KV policy {name!r} needs a budget (live tokens per request)")
  return POLICIES[name](int(budget), **kw)


class PolicyScheduler(ARScheduler):
  """AR decoding of a batch of prompts with one :class:`KVPolicy` per request.

  Args:
    engine: the :class:`Engine` the job runs on (its pool is read for routing and accounting;
      fresh owner and segment ids are chosen above those already in the pool).
    prompts: B non-empty lists of int token ids.
    policies: B :class:`KVPolicy` objects (one per request, not shared).
    max_new_tokens, sampling, stop_ids: as :class:`ARScheduler` (ignored ``max_new_tokens``
      with ``forced``).
    forced: optional B token lists: teacher forcing. Token k of request i is ``forced[i][k]``
      instead of a sample (its log-probability is still recorded); a request ends after its
      forced tokens or at a stop id.
    keep_logits: keep, per request, the float32 ``[V]`` logits each generated token was drawn
      from (:attr:`step_logits`), for oracles.

  After :func:`~selforch_jax.runtime.scheduler.run`: :attr:`results` (one
  ``GenerationResult`` per prompt, tags included), :attr:`kv_stats` (one dict per request,
  see :meth:`kv_summary`), :attr:`live_trace` (per request, live tokens after prefill and
  after each decode step) and :attr:`owners` (every page-table owner used; free them after).

  With an H2O policy every step's spec asks for ``outputs=("logits", "attn_mass")`` (the
  engine runs those steps on the dense-mask path, also on a ``"paged"`` engine).

  Raises:
    ValueError: a policy count other than B; or as :class:`ARScheduler`.
  """

  def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]],
               policies: Sequence[KVPolicy], max_new_tokens: int = 1,
               sampling: SamplingParams = SamplingParams(), stop_ids: Sequence[int] = (),
               forced: Sequence[Sequence[int]] | None = None, keep_logits: bool = False):
    if len(policies) != len(prompts):
      raise ValueError(f"{len(policies)} policies for {len(prompts)} prompts")
    if forced is not None:
      if len(forced) != len(prompts) or any(len(f) == 0 for f in forced):
        raise ValueError("forced needs one non-empty token list per prompt")
      max_new_tokens = max(len(f) for f in forced)
    owner_base, segment_base = fresh_bases(engine)
    super().__init__(prompts, max_new_tokens, sampling, stop_ids, owner_base=owner_base,
                     segment_base=segment_base)
    self.engine = engine
    self.forced = None if forced is None else [list(map(int, f)) for f in forced]
    self.keep_logits = keep_logits
    self.step_logits: list[list[np.ndarray]] = [[] for _ in prompts]
    self.row_owners = self.owners.copy()
    self._next_owner = int(self.owners[-1]) + 1
    self.policies = list(policies)
    self.attn_score = np.zeros(engine.num_slots, np.float32)
    self.spec = (ForwardSpec(outputs=("logits", "attn_mass"))
                 if any(p.needs_attention for p in self.policies) else PLAIN)
    for i, p in enumerate(self.policies):
      p.bind(self, i)
    self.live_trace: list[list[int]] = [[] for _ in prompts]
    self.page_trace: list[list[int]] = [[] for _ in prompts]
    self.kv_stats: list[dict] | None = None
    self._prefill_pos = 0          # next prompt token of the request being prefilled
    self._carry: tuple[int, Route] | None = None   # a routed prompt token not yet run

  def new_owner(self) -> int:
    """A fresh page-table owner id (policies call this to start a new page)."""
    o = self._next_owner
    self._next_owner += 1
    return o

  # --- planning ------------------------------------------------------------------------------
  def _prefill_chunk(self, i: int) -> StepPlan:
    """The next prefill step of request i: prompt tokens up to the next owner change or kill."""
    pol, prompt = self.policies[i], self.prompts[i]
    start = self._prefill_pos
    routes = []
    j = start
    while j < len(prompt):
      if self._carry is not None:
        r = self._carry[1]
        self._carry = None
      else:
        r = pol.route(prompt[j])
        if routes and (r.kill or r.owner != routes[-1].owner):
          self._carry = (j, r)        # starts the next chunk
          break
      routes.append(r)
      j += 1
    evict, free = pol.before_step(routes, prefill=True)
    self._prefill_pos = j
    last = j == len(prompt)
    tag = ("prefill", [i]) if last else ("prefill_part", [i])
    return StepPlan(tokens=prompt[start:j], positions=np.arange(start, j),
                    segments=np.full(j - start, self.segs[i]), owners=[r.owner for r in routes],
                    visible=self.visible, bidir=self.bidir, evict=evict,
                    free_owners=tuple(free), spec=self.spec, tag=tag)

  def next_step(self) -> StepPlan | None:
    plan = super().next_step()
    if plan is None:
      return None
    kind, rows = plan.tag
    if kind == "prefill":
      p = self._prefill_chunk(rows[0])
      return dataclasses.replace(p, tag=(p.tag, plan.free_owners))
    owners, evict, free = [], [], []
    for i, t in zip(rows, plan.tokens):
      r = self.policies[i].route(int(t))
      ev, fr = self.policies[i].before_step([r], prefill=False)
      owners.append(r.owner)
      evict += ev
      free += fr
    for o in plan.free_owners:       # finished requests release every owner they used
      free += self.policies[int(o) - int(self.row_owners[0])].owners()
    return dataclasses.replace(plan, owners=np.asarray(owners), evict=evict,
                               free_owners=tuple(dict.fromkeys(free)), spec=self.spec,
                               tag=(plan.tag, plan.free_owners))

  # --- after a step --------------------------------------------------------------------------
  def on_step(self, plan: StepPlan, result: StepResult) -> None:
    (kind, rows), ar_free = plan.tag
    slots = np.asarray(result.slots)
    if kind == "decode":
      for j, i in enumerate(rows):
        self.policies[i].written([slots[j]])
    else:
      self.policies[rows[0]].written(slots)
    if result.attn_mass is not None:
      self.attn_score[slots] = 0.0
      self.attn_score += np.asarray(jax.device_get(result.attn_mass), np.float32)
    if kind != "prefill_part":
      pool = self.engine.pool
      alive = pool.state == ALIVE
      for i in rows:
        own = self.policies[i].owners()
        self.live_trace[i].append(int(np.count_nonzero(alive & np.isin(pool.owner, own))))
        self.page_trace[i].append(int(np.count_nonzero(np.isin(pool.page_owner, own))))
    if kind == "prefill_part":
      return
    if kind == "prefill":
      self._prefill_pos = 0
    super().on_step(dataclasses.replace(plan, free_owners=ar_free, tag=(kind, rows)), result)

  def _sample_all(self) -> None:
    if self.keep_logits:
      for i in range(len(self.prompts)):
        if not self.done[i]:
          self.step_logits[i].append(np.asarray(self._last_logits[i], np.float32))
    if self.forced is None:
      super()._sample_all()
      return
    for i in range(len(self.prompts)):
      if self.done[i]:
        continue
      k = len(self.tokens[i])
      t = self.forced[i][k]
      lg = np.asarray(self._last_logits[i], np.float64)
      lse = lg.max() + np.log(np.exp(lg - lg.max()).sum())
      self.tokens[i].append(t)
      self.logprobs[i].append(float(lg[t] - lse))
      if t in self.stops or k + 1 >= len(self.forced[i]):
        self.done[i] = True
    self.step += 1
    if self.done.all():
      self._finish()

  def _finish(self) -> None:
    super()._finish()
    everyone = list(dict.fromkeys(
        [int(o) for o in self.row_owners] + [o for p in self.policies for o in p.owners()]))
    self.owners = np.asarray(everyone)
    self.kv_stats = [self.kv_summary(i) for i in range(len(self.prompts))]

  def kv_summary(self, i: int) -> dict:
    """Live KV of request i: ``mean_live_tokens``, ``peak_live_tokens``, the same in bytes,
    ``mean_resident_tokens`` / ``peak_resident_tokens`` (pages held x page size) and
    ``steps`` (prefill + decode steps counted)."""
    live = np.asarray(self.live_trace[i], np.float64)
    pages = np.asarray(self.page_trace[i], np.float64) * self.engine.pool.page_size
    bpt = self.engine.pool.bytes_per_token
    if live.size == 0:
      return dict(mean_live_tokens=0.0, peak_live_tokens=0, mean_live_bytes=0.0,
                  peak_live_bytes=0, mean_resident_tokens=0.0, peak_resident_tokens=0, steps=0)
    return dict(mean_live_tokens=float(live.mean()), peak_live_tokens=int(live.max()),
                mean_live_bytes=float(live.mean() * bpt), peak_live_bytes=int(live.max() * bpt),
                mean_resident_tokens=float(pages.mean()), peak_resident_tokens=int(pages.max()),
                steps=int(live.size))


# --- registry factories (appended; the registry's "streaming_llm" and "h2o") -----------------
def _policy_factory(name: str):
  def factory(engine: Engine, prompts: Sequence[Sequence[int]], *, budget: int | None = None,
              tag_vocab=None, stop_strings: Sequence[str] = (), decode=None, on_token=None,
              n_sink: int | None = None, recent_ratio: float | None = None, **kw):
    from selforch_jax.runtime.generation import StopStringWatcher, check_context
    if budget is None:
      raise ValueError(f"the {name!r} scheduler needs budget= (live KV tokens per request)")
    if "max_new_tokens" in kw:
      check_context([len(p) for p in prompts], kw["max_new_tokens"],
                    engine.cfg.max_position_embeddings)
    pkw = {}
    if name == "streaming_llm" and n_sink is not None:
      pkw["n_sink"] = int(n_sink)
    if name != "streaming_llm" and recent_ratio is not None:
      pkw["recent_ratio"] = float(recent_ratio)
    sched = PolicyScheduler(engine, prompts, [make_policy(name, budget, **pkw) for _ in prompts],
                            **kw)
    if stop_strings:   # the AR scheduler's stop-string and streaming hooks
      if decode is None:
        raise ValueError("stop_strings need a decode callable (ids -> text)")
      sched.stop_strings = tuple(stop_strings)
      sched.watchers = [StopStringWatcher(decode, sched.stop_strings) for _ in prompts]
    sched.on_token = on_token
    return sched
  factory.__doc__ = (f"{name} (:class:`PolicyScheduler` with one ``make_policy({name!r}, "
                     "budget)`` per prompt); needs ``budget``; takes ``max_new_tokens``, "
                     "``sampling``, ``stop_ids``, ``stop_strings`` + ``decode``, ``on_token``.")
  return factory


def _register_policies() -> None:
  from selforch_jax.runtime.registry import register, registered
  for name in ("streaming_llm", "h2o", "paged_h2o"):
    if name not in registered().names():
      register(name)(_policy_factory(name))


_register_policies()
