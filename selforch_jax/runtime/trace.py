"""Decode traces: what the runtime did at every engine step (issue 18).

A :class:`TraceRecorder` is an ``observer`` of :func:`selforch_jax.runtime.scheduler.run` (the one
decode loop)::

  rec = TraceRecorder(token_text=lambda t: tokenizer.decode([t]))
  rec.attach(scheduler)                     # one call per job (a scheduler run to its end)
  run(engine, scheduler, observer=rec)      # rec(plan, result) after every step
  selforch_jax.trace_render.render(rec, "out/trace.html")   # or .png / .json

Per executed :class:`~selforch_jax.runtime.step.StepPlan` it records one :class:`TraceStep`: the
step's queries as :class:`TraceToken` (id, text, position, segment, owner, slot, colour group),
the pool changes before the step (``evict``, ``free_owners``, ``rollback``, ``relabel``), the
``scratch`` flag, the forks and joins the step's visibility table shows, and what became of
every token's K/V later (:data:`FATES`: evicted, released, rolled back, rejected, ...).

Colour groups (:attr:`TraceToken.group`) say which thread / chunk / register / point a token
belongs to; they are read from the scheduler after each step (:func:`owner_groups`): PASTA
``main`` / ``thread k``, TIP ``reg k`` (the register step a token was written in), SoT
``skeleton`` / ``point k``, APAR ``main`` / ``item k``, AR and the KV policies ``answer``; prompt
(prefill) tokens are ``prompt``. A scheduler may name its own groups with a ``trace_labels()``
method returning ``{owner: group}``.

Speculative schedulers report what they accepted / rejected with an optional method
``trace_report(plan, result) -> dict | None`` (called after ``on_step``) whose keys are
``accepted`` / ``rejected`` (query indices of ``plan``) and ``notes`` (strings); or anyone may
call :meth:`TraceRecorder.annotate` after a step. Without a report, a plan that relabels slots
out of an owner and frees that owner marks the owner's other tokens ``rejected`` (the draft tree
of :mod:`selforch_jax.runtime.schedulers.spec_base`), and a ``rollback`` marks the cropped
tokens ``rolled_back``.

This module imports nothing above :mod:`selforch_jax.runtime` (text comes from the
``token_text`` callable).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["FATES", "TraceToken", "TraceStep", "TraceRecorder", "owner_groups", "step_kind"]

FATES = ("kept", "evicted", "released", "rolled_back", "rejected", "scratch", "rewritten")
PROMPT = "prompt"


@dataclasses.dataclass
class TraceToken:
  """One query of one step.

  Attributes:
    id: token id. text: ``token_text(id)``. position / segment / owner / slot: as run.
    step / query: index of the step that ran it and of the query in that step.
    group: colour group (``prompt``, ``answer``, ``main``, ``thread k``, ``reg k``, ...).
    fate: what became of its K/V (:data:`FATES`; ``kept`` = alive when the job ended).
    fate_step: the step whose plan evicted / released / rolled back / rejected it.
    accepted: a draft token the scheduler accepted (relabelled into a sequence or reported).
  """

  id: int
  text: str
  position: int
  segment: int
  owner: int
  slot: int
  step: int
  query: int
  group: str
  fate: str = "kept"
  fate_step: int | None = None
  accepted: bool = False


@dataclasses.dataclass
class TraceStep:
  """One executed engine step.

  Attributes:
    index: 0-based over the whole trace. job: the :meth:`TraceRecorder.attach` it belongs to.
    kind: ``prefill`` / ``prefill_part`` / ``decode`` (from the plan's tag) or ``step``.
    tokens: the step's queries in plan order.
    scratch: the step's K/V were released right after it (a verify step).
    evicted: ``(step, query index)`` of each token killed by this plan's ``evict``.
    freed: ``{owner: tokens released}`` by this plan's ``free_owners``.
    rollback: this plan's ``{owner: n}``. relabel: ``(n slots, owner, segment)`` per triple.
    forks: new segments on a new owner that see earlier segments (a thread / child starts).
    joins: new segments that see two segments neither of which sees the other.
    accepted / rejected: query indices the scheduler reported (or relabelled: accepted).
    rejected_earlier: tokens of earlier steps this plan discarded as rejected drafts.
    notes: free-form strings (scheduler reports).
  """

  index: int
  job: int
  kind: str
  tokens: list
  scratch: bool = False
  evicted: list = dataclasses.field(default_factory=list)
  freed: dict = dataclasses.field(default_factory=dict)
  rollback: dict = dataclasses.field(default_factory=dict)
  relabel: list = dataclasses.field(default_factory=list)
  forks: list = dataclasses.field(default_factory=list)
  joins: list = dataclasses.field(default_factory=list)
  accepted: list = dataclasses.field(default_factory=list)
  rejected: list = dataclasses.field(default_factory=list)
  rejected_earlier: int = 0
  notes: list = dataclasses.field(default_factory=list)


def step_kind(tag: Any) -> str:
  """``prefill`` / ``prefill_part`` / ``decode`` when the plan's tag (nested tuples / lists)
  holds one of those strings, else ``""``."""
  todo = [tag]
  while todo:
    x = todo.pop(0)
    if isinstance(x, str) and x in ("prefill", "prefill_part", "decode"):
      return x
    if isinstance(x, (tuple, list)) and len(x) < 16:
      todo.extend(y for y in x if isinstance(y, (str, tuple, list)))
  return ""


def owner_groups(scheduler: Any) -> dict[int, str]:
  """``{owner: colour group}`` the scheduler's state names now (see the module docstring);
  owners it does not name are absent. Never raises on an unknown scheduler (returns ``{}``)."""
  hook = getattr(scheduler, "trace_labels", None)
  if callable(hook):
    return {int(o): str(g) for o, g in hook().items()}
  from selforch_jax.runtime.schedulers.apar import APARBatch, APARScheduler
  from selforch_jax.runtime.schedulers.ar import ARScheduler
  from selforch_jax.runtime.schedulers.pasta import PASTAScheduler
  from selforch_jax.runtime.schedulers.sot import SoTScheduler
  from selforch_jax.runtime.schedulers.tip import TIPScheduler
  out: dict[int, str] = {}
  if isinstance(scheduler, PASTAScheduler):
    from selforch_jax.lang import MAIN
    for r in scheduler.reqs:
      for k, o in r.owner_of.items():
        out[int(o)] = "main" if k == MAIN else f"thread {k}"
  elif isinstance(scheduler, APARBatch):
    if scheduler._cur is not None:
      out.update(owner_groups(scheduler._cur))
  elif isinstance(scheduler, APARScheduler):
    out[int(scheduler.main.owner)] = "main"
    for i, c in enumerate(scheduler.children):
      out[int(c.owner)] = f"item {i + 1}"
  elif isinstance(scheduler, SoTScheduler):
    inner = scheduler._inner
    if scheduler.stage == 1:
      out.update({int(o): "skeleton" for o in inner.owners})
    else:
      out.update({int(o): f"point {k + 1}" for o, k in zip(inner.owners, scheduler._point_of)})
  elif isinstance(scheduler, TIPScheduler):
    out.update({int(o): "answer" for o in scheduler.row_owners})
  elif isinstance(scheduler, ARScheduler):   # AR and the KV policies: one colour
    out.update({int(o): "answer" for o in scheduler.owners})
  return out


def _register_ids(scheduler: Any) -> dict[int, int]:
  """``{token id: k}`` of ``<reg_k>`` for a TIP scheduler, else ``{}``."""
  from selforch_jax.runtime.schedulers.tip import TIPScheduler
  if not isinstance(scheduler, TIPScheduler) or not scheduler.policies:
    return {}
  return {int(t): k for k, t in enumerate(scheduler.policies[0].builder.tag_vocab.registers)}


class TraceRecorder:
  """Records every step of one or more jobs (see the module docstring).

  Args:
    token_text: ``id -> str`` (e.g. ``lambda t: tok.decode([t])``); default ``str(id)``.
    title: a heading for the renderers (e.g. the runtime's name).

  Attributes:
    steps: the :class:`TraceStep` list (one per executed engine step, in order).
    groups: colour groups in order of first appearance.
    jobs: number of :meth:`attach` calls.
  """

  def __init__(self, token_text: Callable[[int], str] | None = None, title: str = ""):
    self.token_text = token_text or (lambda t: str(t))
    self.title = str(title)
    self.steps: list[TraceStep] = []
    self.groups: list[str] = []
    self.jobs = 0
    self.scheduler: Any = None
    self._reset_job()

  def _reset_job(self) -> None:
    self._slot: dict[int, TraceToken] = {}          # live slot -> its token
    self._slot_owner: dict[int, int] = {}           # live slot -> the owner holding it now
    self._owner_slots: dict[int, list[int]] = {}    # owner -> live slots, oldest first
    self._labels: dict[int, str] = {}
    self._seen_owners: set[int] = set()
    self._seen_segs: set[int] = set()
    self._regs: dict[int, int] = {}

  def attach(self, scheduler: Any) -> "TraceRecorder":
    """Start a new job driven by ``scheduler`` (read for colour groups and reports); the pool
    bookkeeping of the previous job ends (its live tokens stay ``kept``). Returns self."""
    self.scheduler = scheduler
    self.jobs += 1
    self._reset_job()
    self._regs = _register_ids(scheduler)
    return self

  @property
  def num_steps(self) -> int:
    return len(self.steps)

  # ---- recording ------------------------------------------------------------------------------
  def _group(self, kind: str, owner: int, token: int) -> str:
    if kind in ("prefill", "prefill_part"):
      return PROMPT
    if self._regs and token in self._regs and owner not in self._seen_owners:
      self._labels[owner] = f"reg {self._regs[token]}"     # a TIP register step's first token
    g = self._labels.get(owner)
    if g is None and self._regs:
      g = "answer"          # TIP: tokens after a <sync/> / EOS start an owner of no register
    return g if g is not None else f"owner {owner}"

  def _drop(self, slot: int, fate: str, step: int) -> TraceToken | None:
    tok = self._slot.pop(int(slot), None)
    if tok is None:
      return None
    lst = self._owner_slots.get(self._slot_owner.pop(int(slot), tok.owner))
    if lst is not None and int(slot) in lst:
      lst.remove(int(slot))
    tok.fate, tok.fate_step = fate, step
    return tok

  def _hold(self, slot: int, owner: int, tok: TraceToken) -> None:
    self._slot[slot] = tok
    self._slot_owner[slot] = owner
    lst = self._owner_slots.setdefault(owner, [])
    if slot not in lst:
      lst.append(slot)

  def __call__(self, plan, result) -> None:
    """Record one executed step (the ``observer`` of :func:`~selforch_jax.runtime.scheduler.run`).

    Args:
      plan: the :class:`~selforch_jax.runtime.step.StepPlan` that ran (T queries).
      result: its :class:`~selforch_jax.runtime.step.StepResult` (``slots`` int ``[T]``).

    Raises:
      ValueError: ``result.slots`` does not hold one slot per query.
    """
    if self.scheduler is not None:
      try:
        self._labels.update(owner_groups(self.scheduler))
      except (AttributeError, TypeError, IndexError):   # a scheduler mid-transition
        pass
    s = len(self.steps)
    toks = np.asarray(plan.tokens, np.int64).reshape(-1)
    T = toks.size
    pos = np.broadcast_to(np.asarray(plan.positions, np.int64), (T,))
    segs = np.broadcast_to(np.asarray(plan.segments, np.int64), (T,))
    owners = np.broadcast_to(np.asarray(plan.owners, np.int64), (T,))
    slots = np.asarray(result.slots, np.int64).reshape(-1)
    if slots.size != T:
      raise ValueError(f"TraceRecorder: {slots.size} slots for {T} queries")
    kind = step_kind(plan.tag)
    if not kind:
      one = T > 1 and np.unique(owners).size == 1 and np.array_equal(pos, np.arange(T))
      kind = "prefill" if one else "step"
    st = TraceStep(index=s, job=self.jobs, kind=kind, tokens=[], scratch=bool(plan.scratch))
    # pool changes before the step, in execute()'s order: relabel, free, rollback, evict
    sources: set[int] = set()
    for rl_slots, o, g in plan.relabel:
      rl = np.asarray(rl_slots, np.int64).reshape(-1)
      st.relabel.append((int(rl.size), int(o), int(g)))
      for sl in rl.tolist():
        tok = self._slot.get(sl)
        if tok is None:
          continue
        src = self._slot_owner.get(sl, tok.owner)
        lst = self._owner_slots.get(src)
        if lst is not None and sl in lst:
          lst.remove(sl)
        sources.add(src)
        tok.accepted = True
        self._hold(sl, int(o), tok)
    for o in plan.free_owners:
      o = int(o)
      live = list(self._owner_slots.get(o, []))
      fate = "rejected" if o in sources else "released"
      for sl in live:
        self._drop(sl, fate, s)
      self._owner_slots.pop(o, None)
      st.freed[o] = len(live)
      if fate == "rejected":
        st.rejected_earlier += len(live)
    for o, n in dict(plan.rollback).items():
      st.rollback[int(o)] = int(n)
      lst = self._owner_slots.get(int(o), [])
      for sl in list(lst[len(lst) - int(n):]) if int(n) > 0 else []:
        self._drop(sl, "rolled_back", s)
    for sl in np.asarray(plan.evict, np.int64).reshape(-1).tolist():
      tok = self._drop(sl, "evicted", s)
      if tok is not None:
        st.evicted.append((tok.step, tok.query))
    # forks / joins: segments this step runs for the first time
    # (a fork: a new segment on a new owner that sees only earlier steps' segments; one that
    # also sees a segment new in this step extends that branch, e.g. a deeper tree node)
    vis = np.asarray(plan.visible, bool)
    here = set(segs.tolist())
    for g in dict.fromkeys(segs.tolist()):
      if g in self._seen_segs or g >= vis.shape[0]:
        continue
      sees = [int(p) for p in np.flatnonzero(vis[g]) if p != g]
      parents = [p for p in sees if p in self._seen_segs]
      sib = any(not vis[a, b] and not vis[b, a] for i, a in enumerate(parents)
                for b in parents[i + 1:])
      owner = int(owners[segs.tolist().index(g)])
      if sib:
        st.joins.append(int(g))
      elif (parents and owner not in self._seen_owners and not any(p in here for p in sees)
            and kind not in ("prefill", "prefill_part")):
        st.forks.append(int(g))
    # the step's queries
    rewrite = (None if plan.write_slots is None
               else np.asarray(plan.write_slots, np.int64).reshape(-1).tolist())
    for t in range(T):
      o, tid = int(owners[t]), int(toks[t])
      tok = TraceToken(id=tid, text=str(self.token_text(tid)), position=int(pos[t]),
                       segment=int(segs[t]), owner=o, slot=int(slots[t]), step=s, query=t,
                       group=self._group(kind, o, tid))
      if tok.group not in self.groups:
        self.groups.append(tok.group)
      st.tokens.append(tok)
      # a slot that still holds a token: rewritten in place (write_slots), or released outside
      # any plan (e.g. a scheduler calling pool.free_owner itself between its stages)
      self._drop(int(slots[t]), "released" if rewrite is None else "rewritten", s)
      self._hold(int(slots[t]), o, tok)
    self._seen_owners.update(owners.tolist())
    self._seen_segs.update(segs.tolist())
    if plan.scratch:
      for tok in st.tokens:
        self._drop(tok.slot, "scratch", s)
    self.steps.append(st)
    hook = getattr(self.scheduler, "trace_report", None)
    if callable(hook):
      rep = hook(plan, result)
      if rep:
        self.annotate(**rep)

  def annotate(self, accepted: Sequence[int] = (), rejected: Sequence[int] = (),
               notes: Sequence[str] = (), step: int = -1) -> None:
    """Add a scheduler's verdicts to a recorded step (default the last one).

    Args:
      accepted / rejected: query indices of that step's plan (``rejected`` tokens get fate
        ``rejected``; their K/V, if kept, is dropped from the bookkeeping).
      notes: strings shown with the step.

    Raises:
      IndexError: no such step, or a query index outside the step.
    """
    st = self.steps[step]
    for q in accepted:
      st.tokens[int(q)].accepted = True
      st.accepted.append(int(q))
    for q in rejected:
      tok = st.tokens[int(q)]
      if self._slot.get(tok.slot) is tok:
        self._drop(tok.slot, "rejected", st.index)
      tok.fate, tok.fate_step = "rejected", st.index
      st.rejected.append(int(q))
    st.notes.extend(str(n) for n in notes)

  # ---- output ---------------------------------------------------------------------------------
  def counts(self) -> dict:
    """Totals: ``steps``, ``tokens``, ``forks``, ``joins``, ``evicted``, ``released``,
    ``rolled_back``, ``rejected`` (tokens whose fate it is), ``scratch_steps``, ``groups``."""
    fates = {f: 0 for f in FATES}
    for st in self.steps:
      for t in st.tokens:
        fates[t.fate] += 1
    return dict(steps=len(self.steps), tokens=sum(len(st.tokens) for st in self.steps),
                forks=sum(len(st.forks) for st in self.steps),
                joins=sum(len(st.joins) for st in self.steps),
                scratch_steps=sum(st.scratch for st in self.steps),
                groups=list(self.groups), **{f: n for f, n in fates.items() if f != "kept"})

  def to_dict(self) -> dict:
    """A JSON-ready dict: ``title``, ``jobs``, ``groups``, ``counts`` and ``steps`` (each a
    :class:`TraceStep` as a dict, its tokens as dicts)."""
    steps = []
    for st in self.steps:
      d = dataclasses.asdict(st)
      d["freed"] = {str(k): v for k, v in st.freed.items()}
      d["rollback"] = {str(k): v for k, v in st.rollback.items()}
      steps.append(d)
    return dict(title=self.title, jobs=self.jobs, groups=list(self.groups),
                counts=self.counts(), steps=steps)

  def save_json(self, path: str) -> None:
    """Write :meth:`to_dict` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
      json.dump(self.to_dict(), f, ensure_ascii=False)
