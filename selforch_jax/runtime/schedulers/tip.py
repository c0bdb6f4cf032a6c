"""TIP (Thinking in Place) runtime: AR decoding where thought-register tags evict dead steps.

The model writes reasoning steps ``<reg_k> ...``; reusing register k kills the step held there
(DESIGN.md §3, ``../shared/reference/thesis_systems.md`` §2.2). The runtime uses the *same*
death rule as training: every token (prompt and generated) goes through a
:class:`~selforch_jax.lang.mask.LayoutBuilder` (the parser + mask builder that
:func:`~selforch_jax.lang.mask.build_layout` runs for the trainer), and each
:class:`~selforch_jax.lang.events.RegisterUse` ``(register, killed)`` event evicts the
``killed`` tokens before the killing tag runs (the tag does not see them). So the incremental
logits equal the training forward with ``build_layout``'s mask (tests/test_runtime_tip.py).

Paging: every step (from its ``<reg_k>``) is written to a new page-table owner, so it starts on a
fresh page; when all of a step's tokens die, its owner is released whole
(``KVPool.free_owner``) and its pages go back to the free list, where the next allocation
reuses them; tokens of an owner that keeps live tokens are evicted with ``KVPool.evict`` (a page
returns once none of its slots lives). Layout options default to those of the SFT data
(``selforch_jax/data/annotated.py``: no EOS document split, ``eos_ids=()``), so positions run
0, 1, 2, ... over the whole conversation.

Pieces:

* :class:`RegisterKV` — the eviction logic on its own (feed index -> slot and owner; owners per
  stream and step; kills -> evict / free), reusable by any scheduler that feeds a
  ``LayoutBuilder`` (e.g. PASTA threads with registers: one ``RegisterKV`` per sequence, fed
  the builder's events of every thread token).
* :class:`TIPPolicy` — a :class:`~selforch_jax.runtime.schedulers.kv_policies.KVPolicy` (one request):
  builder + ``RegisterKV``.
* :class:`TIPScheduler` — :class:`~selforch_jax.runtime.schedulers.kv_policies.PolicyScheduler` with a
  ``TIPPolicy`` per prompt: greedy / sampled (the AR scheduler's sampling) or teacher-forced;
  live KV per request in :attr:`kv_stats` (tokens and bytes, mean and peak).

Scope: one causal main thread per request (what a TIP model writes). PASTA tags in the output
go through the parser (register files per stream, malformed ones degrade to text), but thread
visibility is not applied here; PASTA threads with registers inside are the PASTA scheduler's
job (it can use :class:`RegisterKV` for the same per-step paging).

Malformed register use degrades as the parser says (never raises; a register tag inside a
promise abandons the promise, etc.), and no text is lost: :attr:`TIPScheduler.results` keep
every generated token, and :func:`~selforch_jax.lang.assemble.assemble` gives the final text.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.lang.events import MAIN, EndOfText, Event, RegisterUse, Sync
from selforch_jax.lang.mask import LayoutBuilder
from selforch_jax.lang.tags import TagVocab
from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.registry import register
from selforch_jax.runtime.scheduler import Scheduler
from selforch_jax.runtime.schedulers.kv_policies import KVPolicy, PolicyScheduler, Route

__all__ = ["RegisterKV", "TIPPolicy", "TIPScheduler"]


class RegisterKV:
  """TIP eviction bookkeeping of one sequence over a KV pool (scheduler independent).

  Token indices are global (the builder's ``document_offset`` + feed index). Call
  :meth:`route` with the events of each fed token, :meth:`written` with its slot once it ran,
  and :meth:`resolve` with the killed indices right before the step that runs the killing tag.

  Args:
    first_owner: the owner of the main stream's tokens before its first register step.
    new_owner: returns a fresh page-table owner id (unique in the pool).

  Attributes:
    owners: every owner used, in creation order.
  """

  def __init__(self, first_owner: int, new_owner: Callable[[], int]):
    self._new_owner = new_owner
    self.owners: list[int] = [int(first_owner)]
    self._stream_owner: dict[int, int] = {MAIN: int(first_owner)}
    self._owner_of: dict[int, int] = {}
    self._slot_of: dict[int, int] = {}
    self._dead = collections.Counter()      # owner -> tokens killed
    self._routed = collections.Counter()    # owner -> tokens routed to it

  def _start(self, stream: int) -> int:
    o = int(self._new_owner())
    self.owners.append(o)
    self._stream_owner[stream] = o
    return o

  def route(self, events: Sequence[Event], offset: int = 0) -> Route:
    """The owner of the token these events stand for and the global indices it kills.

    A ``<reg_k>`` starts a new owner for its stream (a fresh page); so do a ``<sync/>`` and
    an EOS of the main thread (tokens after a step end are in no step). A thread's first
    token starts that thread's owner.

    Raises:
      ValueError: ``events`` hold no token event (feed each token once).
    """
    tok = [e for e in events if e.index is not None]
    if len(tok) != 1:
      raise ValueError(f"route needs the events of exactly one fed token, got {events}")
    e = tok[0]
    kill: tuple[int, ...] = ()
    if isinstance(e, RegisterUse):
      self._start(e.stream)
      kill = tuple(j + offset for j in e.killed)
    elif isinstance(e, (Sync, EndOfText)) and e.stream == MAIN:
      self._start(MAIN)
    owner = self._stream_owner.get(e.stream)
    if owner is None:
      owner = self._start(e.stream)
    self._owner_of[e.index + offset] = owner
    self._routed[owner] += 1
    return Route(owner, kill)

  def written(self, indices: Sequence[int], slots: Sequence[int]) -> None:
    """Record the slots the tokens at global ``indices`` were written to."""
    for i, s in zip(indices, slots):
      self._slot_of[int(i)] = int(s)

  def resolve(self, kill: Sequence[int]) -> tuple[list[int], list[int]]:
    """Pool changes for killing the tokens at global indices ``kill`` (all written).

    Returns:
      ``(evict_slots, free_owners)``: an owner all of whose routed tokens are now dead and
      that no stream writes to any more is released whole; other killed slots are evicted.

    Raises:
      KeyError: a killed token was never written.
    """
    by_owner: dict[int, list[int]] = collections.defaultdict(list)
    for i in kill:
      by_owner[self._owner_of[int(i)]].append(self._slot_of[int(i)])
    evict, free = [], []
    current = set(self._stream_owner.values())
    for o, slots in by_owner.items():
      self._dead[o] += len(slots)
      if self._dead[o] == self._routed[o] and o not in current:
        free.append(o)        # the whole step died: its pages go back whole
      else:
        evict += slots
    return evict, free


class TIPPolicy(KVPolicy):
  """One request's TIP policy: a :class:`LayoutBuilder` (sequence mode) + :class:`RegisterKV`.

  Args:
    tag_vocab: the model's tags (``<reg_k>`` ids).
    eos_ids: EOS ids the builder treats as document ends; default ``()`` as the SFT data
      (``data/annotated.py``), so positions and register files run over the whole conversation.
    builder_kw: further :class:`LayoutBuilder` options (``cap``, ``length_unit``...).
  """

  def __init__(self, tag_vocab: TagVocab, eos_ids: Sequence[int] = (), **builder_kw):
    tv = dataclasses.replace(tag_vocab, eos_ids=tuple(int(i) for i in eos_ids))
    self.builder = LayoutBuilder(tv, **builder_kw)
    self._pending: list[int] = []     # global indices routed, not yet written

  def bind(self, sched, row):
    super().bind(sched, row)
    self.regs = RegisterKV(self.owner, sched.new_owner)

  def owners(self) -> list[int]:
    return list(self.regs.owners)

  def route(self, token: int) -> Route:
    off = self.builder.document_offset
    r = self.regs.route(self.builder.feed(int(token)), off)
    self._pending.append(self.builder.num_tokens - 1)
    return r

  def before_step(self, routes, prefill):
    kill = [i for r in routes for i in r.kill]
    return self.regs.resolve(kill) if kill else ([], [])

  def written(self, slots):
    super().written(slots)
    idx, self._pending = self._pending[:len(slots)], self._pending[len(slots):]
    self.regs.written(idx, slots)


class TIPScheduler(PolicyScheduler):
  """TIP decoding of a batch of prompts (see the module docstring).

  Args:
    engine: the :class:`Engine` (pages of ``page_size`` tokens; each register step takes at
      least one page, so size the pool for ``K + 2`` partly filled pages per request beyond
      the live tokens).
    prompts: B non-empty lists of int token ids (may contain tags; prefill is split at every
      register tag so that kills apply in order).
    tag_vocab: the model's :class:`TagVocab`.
    max_new_tokens, sampling, stop_ids, forced, keep_logits: as
      :class:`~selforch_jax.runtime.schedulers.kv_policies.PolicyScheduler`.
    eos_ids, **builder_kw: as :class:`TIPPolicy`.

  After :func:`~selforch_jax.runtime.scheduler.run`: ``results``, ``kv_stats`` (per request:
  mean / peak live tokens and bytes, resident pages), ``live_trace``, ``owners`` (free them),
  and :meth:`layout` (the builder's layout of request i: the training mask of what ran).
  """

  def __init__(self, engine: Engine, prompts: Sequence[Sequence[int]], tag_vocab: TagVocab,
               max_new_tokens: int = 1, sampling: SamplingParams = SamplingParams(),
               stop_ids: Sequence[int] = (), forced: Sequence[Sequence[int]] | None = None,
               keep_logits: bool = False, eos_ids: Sequence[int] = (), **builder_kw):
    policies = [TIPPolicy(tag_vocab, eos_ids, **builder_kw) for _ in prompts]
    super().__init__(engine, prompts, policies, max_new_tokens, sampling, stop_ids,
                     forced=forced, keep_logits=keep_logits)

  def layout(self, i: int):
    """The :class:`~selforch_jax.lang.mask.Layout` of the tokens request i ran (prompt and
    every generated token fed to the engine)."""
    return self.policies[i].builder.layout()


@register("tip")
def _tip(engine: Engine, prompts: Sequence[Sequence[int]], **kw) -> Scheduler:
  """TIP: AR decoding where reusing a thought register evicts the dead step's KV pages
  (:class:`~selforch_jax.runtime.schedulers.tip.TIPScheduler`; needs ``tag_vocab``, takes
  ``max_new_tokens``, ``sampling``, ``stop_ids``, ``stop_strings`` + ``decode``, ``on_token``).

  Raises:
    ValueError: no ``tag_vocab`` (a TIP model's tags: load its adapter).
    ContextLengthError: a prompt plus ``max_new_tokens`` exceeds the model's context."""
  from selforch_jax.runtime.generation import StopStringWatcher, check_context
  if kw.get("tag_vocab") is None:
    raise ValueError("the 'tip' scheduler needs tag_vocab= (a model with the thought-register "
                     "tags, e.g. a TIP adapter)")
  if "max_new_tokens" in kw:
    check_context([len(p) for p in prompts], kw["max_new_tokens"],
                  engine.cfg.max_position_embeddings)
  stop_strings, decode = tuple(kw.pop("stop_strings", ())), kw.pop("decode", None)
  on_token = kw.pop("on_token", None)
  sched = TIPScheduler(engine, prompts, **kw)
  if stop_strings:
    if decode is None:
      raise ValueError("stop_strings need a decode callable (ids -> text)")
    sched.stop_strings = stop_strings
    sched.watchers = [StopStringWatcher(decode, stop_strings) for _ in prompts]
  sched.on_token = on_token
  return sched
