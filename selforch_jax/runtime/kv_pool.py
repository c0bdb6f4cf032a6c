"""A paged KV pool: host-side bookkeeping of which KV slot holds which token.

The device keeps one flat KV row of ``S = num_pages * page_size`` slots (see
:class:`selforch_jax.runtime.engine.Engine`); slot ``page * page_size + offset`` is the
``offset``-th token of page ``page``. This module owns everything about those slots that
lives on the host (levanter ``inference/page_table.py`` and vLLM's block manager are the
models; eviction is the project's addition, DESIGN.md §2):

* a **free list** of pages and one **page table** per owner (a sequence or a thread):
  the pages the owner writes into, in order; an owner fills its last page before it takes
  a new one, and a new page is always the lowest-numbered free one (a min-heap), so the used
  slots stay packed at the front of the pool and the engine attends over a short prefix
  (:meth:`selforch_jax.runtime.engine.Engine.step`'s key window);
* **per-slot metadata** (numpy, length ``S``): ``state`` (FREE / RESERVED / ALIVE / DEAD),
  ``position`` (RoPE id), ``segment`` (segment id, DESIGN.md §2), ``order`` (decode index,
  the causal order inside a segment) and ``owner``;
* **eviction** (:meth:`KVPool.evict`): slots become DEAD (never attended to again); a page
  none of whose slots is ALIVE or RESERVED goes back to the free list and is reused;
* **live-KV accounting**: ALIVE slots in tokens and bytes
  (``bytes = tokens * 2 * L * Hkv * Dh * itemsize``: K and V of every layer), with peaks.

Slot lifecycle: ``FREE --allocate--> RESERVED --write--> ALIVE --evict--> DEAD``; a page
returns to FREE as a whole (:meth:`KVPool.free_pages`, :meth:`KVPool.free_owner`, or when
eviction leaves it without live slots). :meth:`KVPool.rollback` un-reserves/un-writes the
newest slots of an owner (crop after a rejected speculative draft).

**Sequences and relabel** (DESIGN.md §2.5). Each owner also has a *sequence*: the slots it
holds (per-slot ``owner``), in the order they became its own (allocation order, then
relabels). :meth:`KVPool.rollback` crops the newest of them. :meth:`KVPool.relabel` makes
kept slots of a tree / verify step (held by a scratch owner) the newest slots of a sequence
without copying K/V, at page granularity by **page transfer**: every page holding a relabeled
slot moves whole into the target's page table (inserted before the target's page being
filled, so ``page_table(o)[-1]`` stays the page new slots go to). Other slots on a moved page
stay their owner's (*foreign* slots): they still die by :meth:`KVPool.evict` / rollback /
:meth:`KVPool.free_owner` of their own owner (which turns them into FREE *holes* that are not
reused until the page is released), and a moved page returns to the free list by the usual
rule (no ALIVE or RESERVED slot left). Freeing the page's holder while a foreign slot on it is
still ALIVE/RESERVED hands the page to that slot's owner instead of releasing it, so no live
slot is ever freed under its owner.

Exhaustion is never a silent overwrite: :meth:`KVPool.allocate` raises
:class:`PoolExhausted` *before* changing anything, so the caller may evict and retry.
"""

from __future__ import annotations

import heapq
from typing import Iterable, Sequence

import numpy as np

FREE, RESERVED, ALIVE, DEAD = 0, 1, 2, 3
STATE_NAMES = {FREE: "free", RESERVED: "reserved", ALIVE: "alive", DEAD: "dead"}


class PoolExhausted(RuntimeError):
  """The pool has too few free pages for an allocation.

  Attributes:
    owner: who asked (an int, or a tuple of owners for a multi-owner step); n_tokens: slots
    asked; needed_pages / free_pages: pages required vs. available;
    live_tokens: ALIVE slots at the time (evicting some of them may make room).
  """

  def __init__(self, owner, n_tokens: int, needed_pages: int, free_pages: int,
               live_tokens: int, num_pages: int, page_size: int):
    self.owner, self.n_tokens = owner, n_tokens
    self.needed_pages, self.free_pages, self.live_tokens = needed_pages, free_pages, live_tokens
    who = f"owners {list(owner)}" if isinstance(owner, tuple) else f"owner {owner}"
    super().__init__(
        f"KV pool exhausted: {who} need(s) {n_tokens} slot(s) = {needed_pages} new page(s) "
        f"of {page_size} tokens, but only {free_pages} of {num_pages} pages are free "
        f"({live_tokens} live tokens). Evict (KVPool.evict), free finished owners "
        f"(KVPool.free_owner), or build the Engine with more pages.")


class KVPool:
  """Pages, page tables, per-slot metadata and live-KV accounting of one flat KV row.

  Args:
    num_pages: number of pages (>= 1).
    page_size: tokens per page P (>= 1).
    bytes_per_token: device bytes of one token's KV over all layers
      (``2 * L * Hkv * Dh * itemsize``; :meth:`for_model_config` computes it); 0 is allowed.

  Attributes (numpy, all of length ``num_slots = num_pages * page_size``, index = slot):
    state: int8 FREE/RESERVED/ALIVE/DEAD. position: int32 RoPE position (-1 unset).
    segment: int32 segment id (-1 unset). order: int64 decode index (-1 unset).
    owner: int32 owner id (-1 free).
    page_owner: int32 ``[num_pages]`` owner of each page (-1 free).

  Raises:
    ValueError: non-positive sizes.
  """

  def __init__(self, num_pages: int, page_size: int, bytes_per_token: int = 0):
    if num_pages < 1 or page_size < 1:
      raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
    if bytes_per_token < 0:
      raise ValueError(f"bytes_per_token must be >= 0, got {bytes_per_token}")
    self.num_pages, self.page_size = int(num_pages), int(page_size)
    self.bytes_per_token = int(bytes_per_token)
    S = self.num_slots
    self.state = np.zeros(S, np.int8)
    self.position = np.full(S, -1, np.int32)
    self.segment = np.full(S, -1, np.int32)
    self.order = np.full(S, -1, np.int64)
    self.owner = np.full(S, -1, np.int32)
    self.page_owner = np.full(self.num_pages, -1, np.int32)
    self._free: list[int] = list(range(self.num_pages))  # a min-heap of free pages
    self._tables: dict[int, list[int]] = {}
    self._fill: dict[int, int] = {}  # owner -> slots used in its last page (0..P)
    # owner -> its non-FREE slots in sequence order (a dict used as an ordered set)
    self._seq: dict[int, dict[int, None]] = {}
    self.peak_live_tokens = 0
    self.peak_used_pages = 0

  @staticmethod
  def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """``2 * L * Hkv * Dh * itemsize``: bytes of K and V of one token over all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize

  @classmethod
  def for_model_config(cls, cfg, num_pages: int, page_size: int) -> "KVPool":
    """A pool whose byte accounting matches ``cfg`` (a ``ModelConfig``; KV in ``cfg.dtype``)."""
    itemsize = np.dtype(cfg.jnp_dtype).itemsize
    return cls(num_pages, page_size,
               cls.kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, itemsize))

  # --- sizes and accounting ----------------------------------------------------------------
  @property
  def num_slots(self) -> int:
    return self.num_pages * self.page_size

  @property
  def alive(self) -> np.ndarray:
    """bool ``[num_slots]``: slots whose KV may be attended to."""
    return self.state == ALIVE

  @property
  def num_free_pages(self) -> int:
    return len(self._free)

  @property
  def live_tokens(self) -> int:
    """Number of ALIVE slots."""
    return int(np.count_nonzero(self.state == ALIVE))

  @property
  def live_bytes(self) -> int:
    """``live_tokens * bytes_per_token``."""
    return self.live_tokens * self.bytes_per_token

  @property
  def peak_live_bytes(self) -> int:
    return self.peak_live_tokens * self.bytes_per_token

  @property
  def used_pages(self) -> int:
    return self.num_pages - len(self._free)

  def owners(self) -> list[int]:
    """Owners that hold at least one page."""
    return [o for o, t in self._tables.items() if t]

  def page_table(self, owner: int) -> np.ndarray:
    """int32 ``[n_pages]``: the pages of ``owner`` in allocation order (empty if none)."""
    return np.asarray(self._tables.get(owner, []), np.int32)

  def sequence(self, owner: int) -> np.ndarray:
    """int32 ``[n]``: the slots ``owner`` holds (any state but FREE) in sequence order (the
    order they were allocated to it or relabeled into it; :meth:`rollback` crops from the end)."""
    return np.fromiter(self._seq.get(owner, {}), np.int32)

  def slots_of(self, owner: int, states: Sequence[int] = (ALIVE,)) -> np.ndarray:
    """int32 slots of ``owner`` in the given states, in slot-index order."""
    return np.flatnonzero((self.owner == owner) & np.isin(self.state, states)).astype(np.int32)

  def stats(self) -> dict:
    """Counts for logs and benchmarks (tokens, bytes, pages, peaks)."""
    return dict(live_tokens=self.live_tokens, live_bytes=self.live_bytes,
                peak_live_tokens=self.peak_live_tokens, peak_live_bytes=self.peak_live_bytes,
                used_pages=self.used_pages, free_pages=self.num_free_pages,
                peak_used_pages=self.peak_used_pages,
                dead_slots=int(np.count_nonzero(self.state == DEAD)),
                reserved_slots=int(np.count_nonzero(self.state == RESERVED)))

  # --- allocation ---------------------------------------------------------------------------
  def pages_needed(self, owner: int, n_tokens: int) -> int:
    """New pages an :meth:`allocate` of ``n_tokens`` for ``owner`` would take now."""
    room = self.page_size - self._fill[owner] if self._tables.get(owner) else 0
    return max(0, -(-(n_tokens - room) // self.page_size))

  def can_allocate(self, owner: int, n_tokens: int) -> bool:
    """Whether :meth:`allocate` of ``n_tokens`` for ``owner`` would succeed now."""
    return self.pages_needed(owner, n_tokens) <= len(self._free)

  def allocate(self, owner: int, n_tokens: int) -> np.ndarray:
    """Reserve ``n_tokens`` slots for ``owner``: the rest of its last page, then new pages.

    Args:
      owner: int >= 0 (a sequence or thread id).
      n_tokens: >= 0.

    Returns:
      int32 ``[n_tokens]`` slots, now RESERVED (invisible until :meth:`write`).

    Raises:
      PoolExhausted: not enough free pages; nothing was changed.
      ValueError: negative owner or n_tokens.
    """
    if owner < 0 or n_tokens < 0:
      raise ValueError(f"owner and n_tokens must be >= 0, got {owner}, {n_tokens}")
    need = self.pages_needed(owner, n_tokens)
    if need > len(self._free):
      raise PoolExhausted(owner, n_tokens, need, len(self._free), self.live_tokens,
                          self.num_pages, self.page_size)
    table = self._tables.setdefault(owner, [])
    if not table:
      self._fill[owner] = 0
    out = np.empty(n_tokens, np.int32)
    i = 0
    while i < n_tokens:
      if not table or self._fill[owner] == self.page_size:
        page = heapq.heappop(self._free)
        table.append(page)
        self.page_owner[page] = owner
        self._fill[owner] = 0
      page = table[-1]
      take = min(n_tokens - i, self.page_size - self._fill[owner])
      start = page * self.page_size + self._fill[owner]
      out[i:i + take] = np.arange(start, start + take)
      self._fill[owner] += take
      i += take
    self.state[out] = RESERVED
    self.owner[out] = owner
    self._seq.setdefault(owner, {}).update(dict.fromkeys(out.tolist()))
    self.peak_used_pages = max(self.peak_used_pages, self.used_pages)
    return out

  def write(self, slots, positions, segments, orders) -> None:
    """Mark RESERVED slots ALIVE with their metadata (the engine calls this for a step).

    Args:
      slots: int ``[T]`` RESERVED slots. positions: int ``[T]``. segments: int ``[T]`` >= 0.
      orders: int ``[T]`` decode indices (causal order inside a segment).

    Raises:
      ValueError: a slot is not RESERVED, or lengths differ, or a segment is negative.
    """
    slots = np.asarray(slots, np.int64)
    positions, segments, orders = (np.asarray(a) for a in (positions, segments, orders))
    if not (slots.shape == positions.shape == segments.shape == orders.shape):
      raise ValueError(f"write: shapes differ: slots {slots.shape}, positions {positions.shape}, "
                       f"segments {segments.shape}, orders {orders.shape}")
    bad = slots[self.state[slots] != RESERVED]
    if bad.size:
      raise ValueError(f"write: slots {bad.tolist()[:8]} are not RESERVED "
                       f"(states {[STATE_NAMES[int(s)] for s in self.state[bad][:8]]})")
    if segments.size and segments.min() < 0:
      raise ValueError("write: segment ids must be >= 0")
    self.position[slots] = positions
    self.segment[slots] = segments
    self.order[slots] = orders
    self.state[slots] = ALIVE
    self.peak_live_tokens = max(self.peak_live_tokens, self.live_tokens)

  def rewrite(self, slots, owners, positions, segments, orders) -> tuple:
    """Re-record the metadata of ALIVE slots a step writes new K/V into in place (diffusion
    re-denoising the same positions, DESIGN.md §2.5): no allocation, the slots keep their
    place in their owner's sequence.

    Args:
      slots: int ``[T]`` distinct slots, each ALIVE and held by ``owners[t]``.
      owners: int ``[T]`` (or one int). positions, segments (>= 0), orders: int ``[T]``.

    Returns:
      ``(position, segment, order)`` of the slots before the call (numpy copies), so a
      caller whose step then fails can put them back with :meth:`restore_metadata`.

    Raises:
      ValueError: shapes differ, a slot is out of range or repeated, not ALIVE, or held by
        another owner; a negative segment. Nothing is changed then.
    """
    slots = np.asarray(slots, np.int64).reshape(-1)
    owners = np.broadcast_to(np.asarray(owners, np.int64), slots.shape)
    positions, segments, orders = (np.asarray(a).reshape(-1) for a in (positions, segments, orders))
    if not (slots.shape == positions.shape == segments.shape == orders.shape):
      raise ValueError(f"rewrite: shapes differ: write_slots {slots.shape}, positions "
                       f"{positions.shape}, segments {segments.shape}, orders {orders.shape}")
    if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
      raise ValueError(f"rewrite: write_slots must be in [0, {self.num_slots})")
    if np.unique(slots).size != slots.size:
      raise ValueError(f"rewrite: write_slots repeat a slot: {slots.tolist()[:8]}")
    bad = np.flatnonzero((self.state[slots] != ALIVE) | (self.owner[slots] != owners))
    if bad.size:
      t = int(bad[0])
      raise ValueError(
          f"rewrite: write_slots[{t}] = slot {int(slots[t])} is not held ALIVE by the query's "
          f"owner {int(owners[t])} (it is {STATE_NAMES[int(self.state[slots[t]])]}, owner "
          f"{int(self.owner[slots[t]])}); rewrite in place only writes slots the owner already "
          f"holds ({bad.size} bad slot(s))")
    if segments.size and segments.min() < 0:
      raise ValueError("rewrite: segment ids must be >= 0")
    before = (self.position[slots].copy(), self.segment[slots].copy(), self.order[slots].copy())
    self.position[slots] = positions
    self.segment[slots] = segments
    self.order[slots] = orders
    return before

  def restore_metadata(self, slots, before) -> None:
    """Put back ``(position, segment, order)`` of ``slots`` as :meth:`rewrite` returned them."""
    slots = np.asarray(slots, np.int64).reshape(-1)
    self.position[slots], self.segment[slots], self.order[slots] = before

  # --- release ------------------------------------------------------------------------------
  def _clear_slots(self, slots) -> None:
    """Slots become FREE (owner and metadata unset) and leave their owners' sequences."""
    for slot in np.asarray(slots, np.int64).reshape(-1).tolist():
      o = int(self.owner[slot])
      if o >= 0:
        self._seq[o].pop(slot, None)
    self.state[slots] = FREE
    self.owner[slots] = -1
    self.position[slots] = self.segment[slots] = self.order[slots] = -1

  def _filling(self, page: int) -> bool:
    """Whether ``page`` is its holder's last page and still being filled."""
    owner = int(self.page_owner[page])
    table = self._tables.get(owner, [])
    return bool(table) and table[-1] == page and self._fill[owner] < self.page_size

  def _maybe_release(self, pages) -> list[int]:
    """Release every page of ``pages`` with no ALIVE/RESERVED slot that is not being filled."""
    released = []
    for page in sorted({int(p) for p in pages}):
      if self.page_owner[page] < 0:
        continue
      st = self.state[page * self.page_size:(page + 1) * self.page_size]
      if np.any((st == ALIVE) | (st == RESERVED)) or self._filling(page):
        continue
      self._release_page(page)
      released.append(page)
    return released

  def _transfer(self, page: int, to: int) -> None:
    """Move ``page`` from its holder's page table into ``to``'s, before ``to``'s last page
    (the one being filled); a table that gets its first page this way counts it as full."""
    frm = int(self.page_owner[page])
    table = self._tables[frm]
    if table[-1] == page:  # the holder's next allocation starts a fresh page
      self._fill[frm] = self.page_size
    table.remove(page)
    dest = self._tables.setdefault(to, [])
    if dest:
      dest.insert(len(dest) - 1, page)
    else:
      dest.append(page)
      self._fill[to] = self.page_size
    self._seq.setdefault(to, {})
    self.page_owner[page] = to

  def _release_page(self, page: int) -> None:
    owner = int(self.page_owner[page])
    sl = slice(page * self.page_size, (page + 1) * self.page_size)
    for slot in np.flatnonzero(self.state[sl] != FREE) + page * self.page_size:
      self._seq[int(self.owner[slot])].pop(int(slot), None)
    self.state[sl] = FREE
    self.owner[sl] = -1
    self.position[sl] = -1
    self.segment[sl] = -1
    self.order[sl] = -1
    self.page_owner[page] = -1
    table = self._tables.get(owner)
    if table is not None and page in table:
      was_last = table[-1] == page
      table.remove(page)
      if was_last:  # the owner's next allocation starts a fresh page
        self._fill[owner] = self.page_size
    heapq.heappush(self._free, page)

  def free_pages(self, pages: Iterable[int]) -> None:
    """Return whole pages to the free list (every slot FREE, dropped from page tables).

    Raises:
      ValueError: a page is out of range or already free.
    """
    pages = [int(p) for p in pages]
    for p in pages:
      if not 0 <= p < self.num_pages or self.page_owner[p] < 0:
        raise ValueError(f"free_pages: page {p} is out of range or already free")
    for p in pages:
      self._release_page(p)

  def free_owner(self, owner: int) -> None:
    """Release every page and slot of ``owner`` (a finished sequence or thread); no-op if it
    has none.

    Its pages return to the free list, except a page that still holds another owner's ALIVE
    or RESERVED slot (a relabeled page, see the module docstring): that page goes to that
    owner and only ``owner``'s slots on it become FREE holes. ``owner``'s slots on other
    owners' pages become FREE holes too (their pages are released if nothing live is left).
    """
    P = self.page_size
    for p in list(self._tables.get(owner, [])):
      sl = slice(p * P, (p + 1) * P)
      live_foreign = np.flatnonzero(((self.state[sl] == ALIVE) | (self.state[sl] == RESERVED))
                                    & (self.owner[sl] != owner))
      if live_foreign.size:
        mine = np.flatnonzero(self.owner[sl] == owner) + p * P
        self._clear_slots(mine)
        self._transfer(p, int(self.owner[p * P + live_foreign[0]]))
      else:
        self._release_page(p)
    rest = self.sequence(owner)
    self._clear_slots(rest)
    self._tables.pop(owner, None)
    self._fill.pop(owner, None)
    self._seq.pop(owner, None)
    self._maybe_release(rest // P)

  def evict(self, slots) -> list[int]:
    """Kill slots: ALIVE (or RESERVED) -> DEAD; they are never attended to again.

    A page none of whose slots is ALIVE or RESERVED afterwards, and that is full or not its
    owner's last page, returns to the free list. (An owner's partly filled last page stays
    until it fills, the owner is freed, or :meth:`free_pages`.)

    Args:
      slots: int slots; DEAD ones are ignored (eviction is idempotent).

    Returns:
      The pages returned to the free list, ascending.

    Raises:
      ValueError: a slot is out of range or FREE.
    """
    slots = np.unique(np.asarray(slots, np.int64).reshape(-1))
    if slots.size == 0:
      return []
    if slots.min() < 0 or slots.max() >= self.num_slots:
      raise ValueError(f"evict: slots must be in [0, {self.num_slots})")
    free = slots[self.state[slots] == FREE]
    if free.size:
      raise ValueError(f"evict: slots {free.tolist()[:8]} are FREE (not allocated)")
    self.state[slots] = DEAD
    return self._maybe_release(slots // self.page_size)

  def rollback(self, owner: int, n_tokens: int) -> np.ndarray:
    """Undo the newest ``n_tokens`` slots of ``owner``'s sequence (crop rejected draft tokens),
    whatever their state (allocated, written, evicted, or relabeled into it).

    The slots become FREE. Those at the end of the owner's page being filled are reused by
    its next :meth:`allocate`; others (relabeled slots on moved pages) are holes until their
    page is released. Pages left without ALIVE/RESERVED slots return to the free list.

    Returns:
      int32 the slots released, in sequence order (newest last).

    Raises:
      ValueError: ``n_tokens`` exceeds the owner's sequence length.
    """
    seq = self._seq.get(owner, {})
    if not 0 <= n_tokens <= len(seq):
      raise ValueError(f"rollback: owner {owner} has {len(seq)} allocated slots, asked {n_tokens}")
    out = [seq.popitem()[0] for _ in range(n_tokens)][::-1]  # dict.popitem is LIFO
    self._clear_slots(out)
    P = self.page_size
    table = self._tables.get(owner, [])
    # the page being filled: its FREE tail is reusable; an emptied page goes back
    while table and self._fill[owner] > 0 and \
        self.state[table[-1] * P + self._fill[owner] - 1] == FREE:
      self._fill[owner] -= 1
      if self._fill[owner] == 0:  # every slot of the page is FREE now
        page = table.pop()
        self.page_owner[page] = -1
        heapq.heappush(self._free, page)
        self._fill[owner] = P
    self._maybe_release(np.asarray(out, np.int64) // P)
    return np.asarray(out, np.int32)

  def relabel(self, slots, owner: int, segment: int) -> None:
    """Make ALIVE ``slots`` (of any owner, e.g. a tree step's scratch owner) the newest slots
    of ``owner``'s sequence, in segment ``segment``, without copying K/V (DESIGN.md §2.5).

    Positions and orders are kept (a tree node's RoPE position is its depth, already right for
    the accepted path). Every page holding one of ``slots`` moves into ``owner``'s page table
    (see the module docstring); the other slots of the source step keep their owner and may
    be evicted / rolled back / freed afterwards as usual. Live-KV counts do not change.

    Args:
      slots: int ``[n]`` distinct ALIVE slots, in sequence order (e.g. root-to-leaf).
      owner: int >= 0, the sequence they join (may be new, or their current owner).
      segment: int >= 0, their new segment id.

    Raises:
      ValueError: a slot out of range, repeated, or not ALIVE (FREE, RESERVED or DEAD); a
        negative owner or segment. Nothing is changed then.
    """
    slots = np.asarray(slots, np.int64).reshape(-1)
    if owner < 0 or segment < 0:
      raise ValueError(f"relabel: owner and segment must be >= 0, got {owner}, {segment}")
    if slots.size == 0:
      return
    if slots.min() < 0 or slots.max() >= self.num_slots:
      raise ValueError(f"relabel: slots must be in [0, {self.num_slots})")
    if np.unique(slots).size != slots.size:
      raise ValueError(f"relabel: repeated slots in {slots.tolist()[:8]}")
    bad = slots[self.state[slots] != ALIVE]
    if bad.size:
      raise ValueError(f"relabel: slots {bad.tolist()[:8]} are not ALIVE (states "
                       f"{[STATE_NAMES[int(s)] for s in self.state[bad][:8]]}); only written, "
                       f"live slots can join a sequence")
    seq = self._seq.setdefault(owner, {})
    for slot in slots.tolist():
      self._seq[int(self.owner[slot])].pop(slot)
      seq[slot] = None
    self.owner[slots] = owner
    self.segment[slots] = segment
    for page in dict.fromkeys((slots // self.page_size).tolist()):
      if self.page_owner[page] != owner:
        self._transfer(page, owner)

  def check_invariants(self) -> None:
    """Assert the bookkeeping is consistent (tests and fuzzing call this).

    Raises:
      AssertionError: naming the broken invariant.
    """
    P = self.page_size
    free = set(self._free)
    assert len(free) == len(self._free), "a page is twice in the free list"
    tabled = [p for t in self._tables.values() for p in t]
    assert len(set(tabled)) == len(tabled), "a page is in two page tables"
    assert free.isdisjoint(tabled), "a page is both free and in a page table"
    assert len(free) + len(tabled) == self.num_pages, "a page is lost"
    for o, t in self._tables.items():
      for p in t:
        assert self.page_owner[p] == o, f"page {p} owner mismatch"
    for p in free:
      assert self.page_owner[p] == -1 and np.all(self.state[p * P:(p + 1) * P] == FREE)
    used = self.state != FREE
    assert np.all(self.owner[used] >= 0) and np.all(self.owner[~used] == -1)
    seqd = [s for q in self._seq.values() for s in q]
    assert len(seqd) == len(set(seqd)) == int(np.count_nonzero(used)), "sequence/slot mismatch"
    for o, q in self._seq.items():
      assert all(self.owner[s] == o for s in q), f"owner {o}'s sequence holds a foreign slot"
    for o, t in self._tables.items():
      if t and self._fill[o] < P:
        assert np.all(self.state[t[-1] * P + self._fill[o]:(t[-1] + 1) * P] == FREE), \
            f"owner {o}: slots past the fill of its last page are in use"
    assert self.live_tokens >= 0 and self.live_tokens <= self.num_slots
