"""The engine: one model, one paged KV pool, one jitted step (DESIGN.md §2.4).

The device holds a :class:`~selforch_jax.models.transformer.KVCache` with ``B = 1`` and
``S = num_pages * page_size`` slots: the paged pool seen as one flat row (slot =
``page * page_size + offset``). The host holds the pool's bookkeeping
(:class:`~selforch_jax.runtime.kv_pool.KVPool`). One jitted function runs any set of T
query tokens against the pool::

  step(tokens[T], positions[T], write_slots[T], mask[T, S]) -> logits[T, V]

It writes the T new K/V into ``write_slots`` and attends with ``mask``: on CPU the model's
dense-mask jnp attention (the reference path; DESIGN.md §2.3) over the step's *key window*, the
first ``W`` slots, where ``W`` is the end of the last slot any query may see, rounded up to a
power of two (at least :data:`KEY_WINDOW_MIN`, at most S; the pool hands out the lowest free
page first, so used slots stay packed at the front and a pool that evicts, like TIP's, keeps a
short window); on a GPU the
Pallas paged kernel over the pool's alive bits and segment metadata
(:mod:`~selforch_jax.runtime.paged_backend`; ``Engine(attention=...)`` chooses). T is padded to
a power of two (1, 2, 4, 8, ...), so a run compiles at most ``log2(T_max) + 1`` programs;
padding queries write to out-of-range slots (XLA scatter drops out-of-bounds updates) and
see nothing. The KV cache is donated, so the pool is updated in place. The jitted function
lives at module level with the graphdef static: engines over models of the same structure and
the same S share every compiled program (one per step bucket and key window;
:meth:`Engine.warm_up` compiles them all ahead of timed runs).

:meth:`Engine.run_step` is what schedulers use: it allocates slots per owner, records the
queries' metadata, builds the mask with :func:`~selforch_jax.runtime.mask.step_mask` (the
one rule, shared by every scheduler) and calls :meth:`Engine.step`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from selforch_jax.models.transformer import (
    SPARSE_DENSE_SINKS, SPARSE_DENSE_WINDOW, KVCache, Transformer, unstack_layers,
)
from selforch_jax.runtime.kv_pool import KVPool, PoolExhausted
from selforch_jax.runtime.mask import step_mask
from selforch_jax.runtime.paged_backend import (
    PagedAttentionMask, build_paged_mask, default_attention_impl, needs_dense_mask,
)
from selforch_jax.runtime.step import ForwardSpec, parse_sparsity


KEY_WINDOW_MIN = 256  # slots: the shortest key window (smaller pools use all their slots)
GATHER_MAX_QUERIES = 16  # padded queries: larger "quest_gather" steps run the quest mask program
# Queries of a step a "paged" engine gives the Pallas kernel; longer steps (prefill chunks) run
# the dense reference path. The kernel holds all of a KV head's query rows ([H // K * T, D]) in
# one block: on an H200 a 2000-query prefill asked for 1 MB of shared memory (227 KB exist)
# and failed (docs/RESULTS.md §10, "SOL savings on an H200"); T <= 32 ran
# (bench/results/engine_gpu_h200.json). Long steps are matmul-bound, where the dense path loses
# nothing.
PAGED_MAX_QUERIES = 64


def gather_bucket(n: int) -> int:
  """The static page count a ``quest_gather`` step of ``n >= 1`` needed pages compiles for: the
  smallest of ``2^k`` and ``3 * 2^(k-1)`` (1, 2, 3, 4, 6, 8, 12, 16, 24, ...) that is ``>= n``
  (at most 1.5x the need, two programs per octave)."""
  b = bucket_size(max(int(n), 1))
  return 3 * b // 4 if b >= 4 and 3 * b // 4 >= n else b


def quest_gather_pages(mask: np.ndarray, keep_frac: np.ndarray, page_size: int) -> int | None:
  """The page count a ``quest_gather(page_size)`` step gathers per (query, KV head), or None
  when the step should run the ``quest`` mask program instead (same selection, no gather).

  Each query needs ``ceil(keep_frac * kv_len / page_size)`` pages (float32, as the step
  computes it) or, if dense (``kv_len <= SPARSE_DENSE_SINKS + SPARSE_DENSE_WINDOW + 1`` or
  ``keep_frac >= 1``), every page it sees a key of; the step's count is
  :func:`gather_bucket` of the largest need.

  Args:
    mask: bool ``[Tb, W]`` the step's windowed visibility (padding queries see nothing).
    keep_frac: float ``[Tb]`` keep fraction per query.
    page_size: QUEST page size.

  Returns:
    the static page count, or None when every query is dense (the mask program is the plain
    step exactly), when the bucket would cover the whole window (no key saved) or when the step
    has more than :data:`GATHER_MAX_QUERIES` queries.
  """
  Tb, W = mask.shape
  P = int(page_size)
  NP = -(-W // P)
  if Tb > GATHER_MAX_QUERIES:
    return None
  kv_len = mask.sum(-1)
  kf = np.asarray(keep_frac, np.float32).reshape(-1)
  dense = (kv_len <= SPARSE_DENSE_SINKS + SPARSE_DENSE_WINDOW + 1) | (kf >= 1.0)
  if dense.all():
    return None
  padded = np.zeros((Tb, NP * P), bool)
  padded[:, :W] = mask
  seen_pages = padded.reshape(Tb, NP, P).any(-1).sum(-1)
  need = np.ceil(kf * kv_len.astype(np.float32) / np.float32(P)).astype(np.int64)
  need = np.where(dense, seen_pages, need)
  nb = gather_bucket(int(need.max()))
  return nb if nb < NP else None


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _jitted_step(graphdef, state, cache, tokens, positions, write_slots, mask, layers=None):
  """The engine step (module level, so engines of the same model structure share compiles);
  a dense ``mask [T, W]`` attends over the first W slots (the key window). ``layers``: the
  unstacked layer weights of an unrolled model (:func:`~selforch_jax.models.transformer.
  unstack_layers`), or None."""
  model = nnx.merge(graphdef, state)
  if isinstance(mask, PagedAttentionMask):
    logits, cache = model(tokens[None], positions[None], mask, cache,
                          write_slots=write_slots[None], layer_params=layers)
  else:
    logits, cache = model(tokens[None], positions[None], mask[None], cache,
                          write_slots=write_slots[None], key_len=mask.shape[1],
                          layer_params=layers)
  return logits[0], cache


PLAIN_KEY = ("base", ("logits",), ("none",), 16)  # spec_key of the plain step


def spec_key(spec: ForwardSpec) -> tuple:
  """The static part of ``spec`` the jitted step compiles on: ``(view, sorted outputs,
  parsed sparsity, act_bits)`` (the arrays' presence and ranks are part of the pytree). For
  ``quest_gather`` :meth:`Engine.step` then sets the step's page count: ``("quest_gather", P,
  num_pages)``, or ``("quest", P)`` (:func:`quest_gather_pages`)."""
  return (spec.view, tuple(sorted(spec.outputs)), parse_sparsity(spec.sparsity),
          int(spec.act_bits))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _jitted_spec_step(graphdef, key, state, cache, tokens, positions, write_slots, mask, extras,
                      layers=None):
  """The engine step under a :class:`~selforch_jax.runtime.step.ForwardSpec` (``key`` =
  :func:`spec_key`; ``extras``: dict of the step's arrays ``mlp_keep [D] | [Tb, D]``,
  ``keep_frac [Tb]``, ``key_order [W]``, ``mlp_keep_frac [Tb]``, ``query_bits [Tb]``, absent
  when off).

  Returns ``(outputs, cache)`` with ``outputs`` a dict of the asked ``logits [Tb, V]``,
  ``hidden [Tb, D]``, ``attn_mass [S]`` (float32, 0 past the key window); with ``key ==
  PLAIN_KEY`` and no arrays it returns ``(logits, cache)`` and is :func:`_jitted_step`'s
  program (the HLO text is the same but for the module name)."""
  model = nnx.merge(graphdef, state)
  view, outputs, sparsity, act_bits = key
  kw = {}
  if view != "base":
    kw["view"] = view
  if act_bits != 16:
    kw["act_bits"] = act_bits
  if sparsity[0] != "none":
    kw["sparsity"] = sparsity
    kw["keep_frac"] = extras["keep_frac"][None]
    if "key_order" in extras:
      kw["key_order"] = extras["key_order"][None]
  if "mlp_keep" in extras:
    mk = extras["mlp_keep"]
    kw["mlp_keep"] = mk if mk.ndim == 1 else mk[None]
  for name in ("mlp_keep_frac", "query_bits", "query_view"):
    if name in extras:
      kw[name] = extras[name][None]
  want_mass, want_hidden = "attn_mass" in outputs, "hidden" in outputs
  want_usage = "usage" in outputs
  paged = isinstance(mask, PagedAttentionMask)   # (operands in _jitted_step's order)
  kl, W = ({}, cache.max_len) if paged else (dict(key_len=mask.shape[1]), mask.shape[1])
  res = model(tokens[None], positions[None], mask if paged else mask[None], cache,
              write_slots=write_slots[None],
              return_hidden=want_hidden or "logits" not in outputs, return_attn_mass=want_mass,
              return_usage=want_usage, layer_params=layers, **kl, **kw)
  first, cache = res[0], res[1]
  if key == PLAIN_KEY and not extras:
    return first[0], cache
  out = {}
  if want_hidden:
    out["hidden"] = first[0]
    if "logits" in outputs:
      out["logits"] = model.logits_from_hidden(first)[0]
  elif "logits" in outputs:
    out["logits"] = first[0]
  if want_mass:
    out["attn_mass"] = jnp.pad(res[2][0], (0, cache.max_len - W))
  if want_usage:
    out["usage"] = res[-1][0]
  return out, cache


def bucket_size(n: int) -> int:
  """The padded query count of a step of ``n >= 1`` tokens: the next power of two."""
  if n < 1:
    raise ValueError(f"a step needs at least one query token, got {n}")
  return 1 << (int(n) - 1).bit_length()


def key_windows(num_slots: int) -> list[int]:
  """Every key window a pool of ``num_slots`` slots can use, ascending: the powers of two from
  :data:`KEY_WINDOW_MIN` below ``num_slots``, then ``num_slots``."""
  out, w = [], KEY_WINDOW_MIN
  while w < num_slots:
    out.append(w)
    w *= 2
  return out + [int(num_slots)]


def key_window(mask: np.ndarray) -> int:
  """The key window of a step: the smallest of :func:`key_windows` that holds every slot a
  query of ``mask`` (bool ``[T, S]``) may see."""
  seen = np.flatnonzero(mask.any(axis=0))
  end = int(seen[-1]) + 1 if seen.size else 1
  return next(w for w in key_windows(mask.shape[1]) if w >= end)


class Engine:
  """Model + paged KV pool + jitted step.

  Args:
    model: the NNX :class:`Transformer` (split once with ``nnx.split``; later changes to
      ``model`` are not seen).
    num_pages: pages in the pool.
    page_size: tokens per page.
    attention: ``"reference"``: the model's dense-mask jnp attention over a ``bool [T, S]`` mask
      from :func:`~selforch_jax.runtime.mask.step_mask`; ``"paged"``: the Pallas paged kernel
      over the pool's per-slot metadata (:mod:`~selforch_jax.runtime.paged_backend`; dead and
      invisible pages skipped; opt-in); ``"auto"``: :func:`~selforch_jax.runtime.paged_backend.
      default_attention_impl` (reference on every backend: the kernel measured slower on a GPU).
    interpret: run the paged kernel in Pallas interpret mode (CPU tests).

  What a step computes beyond the base logits (hidden state, attention mass per slot, views,
  sparsity, MLP channel keep, fake-quant) is asked per step with a
  :class:`~selforch_jax.runtime.step.ForwardSpec` (:meth:`step`, :meth:`run_step`); a spec that
  needs the dense mask (attention mass, sparsity, a per-query key keep) runs the dense
  reference path also on a ``"paged"`` engine, and so does a step of more than
  ``PAGED_MAX_QUERIES`` queries (a prefill chunk: the kernel keeps all of a KV head's query
  rows in one block, which a long step does not fit on a GPU).

  Attributes:
    cfg: the model config. pool: the :class:`KVPool`. cache: the device :class:`KVCache`
    (``k, v: [L, 1, S, Hkv, Dh]`` in ``cfg.dtype``). num_slots: ``S``.
    num_steps / num_query_tokens: steps run and real (unpadded) query tokens processed.
    buckets_used: the padded step sizes this engine has run (each compiled once per model
    structure, S and key window, shared by all engines). windows_used: the key windows
    (:func:`key_window`) of its dense-mask steps. specs_used: the :func:`spec_key` of every
    non-plain spec it ran.

  Raises:
    ValueError: non-positive ``num_pages`` or ``page_size``.
  """

  def __init__(self, model: Transformer, num_pages: int, page_size: int, *,
               attention: str = "auto", interpret: bool = False):
    if attention == "auto":
      attention = default_attention_impl()
    if attention not in ("reference", "paged"):
      raise ValueError(f"attention must be 'auto', 'reference' or 'paged', got {attention!r}")
    self.attention = attention
    self.interpret = bool(interpret)
    self.cfg = model.cfg
    self.graphdef, self.state = nnx.split(model)
    # an unrolled layer loop reads per-layer weight arrays (no slice copies of the stacked ones)
    self.layers = unstack_layers(model) if self.cfg.resolved_layer_loop(decode=True) == "unroll" else None
    self.pool = KVPool.for_model_config(self.cfg, num_pages, page_size)
    self.num_slots = self.pool.num_slots
    self.cache = KVCache.zeros(self.cfg, 1, self.num_slots)
    self.next_order = 0
    self.num_steps = 0
    self.num_query_tokens = 0
    self.buckets_used: set[int] = set()
    self.windows_used: set[int] = set()
    self.specs_used: set[tuple] = set()

  def step(self, tokens, positions, write_slots, mask, spec: ForwardSpec | None = None):
    """Run T query tokens against the pool, writing their K/V into ``write_slots``.

    Low level: the pool's bookkeeping is not touched (:meth:`run_step` does that).

    Args:
      tokens: int ``[T]`` token ids in ``[0, V)``.
      positions: int ``[T]`` RoPE position ids.
      write_slots: int ``[T]`` distinct slots in ``[0, S)``.
      mask: bool ``[T, S]``: query t may see slot s (after this step's writes); or, on the
        kernel path, a :class:`~selforch_jax.runtime.paged_backend.PagedAttentionMask` of
        shape ``(1, bucket_size(T), S)``.
      spec: optional :class:`~selforch_jax.runtime.step.ForwardSpec`: what else the step
        computes. Its arrays: ``query_key_keep`` bool ``[T, S]`` (ANDed into ``mask``),
        ``mlp_keep`` ``[D]`` or ``[T, D]``, ``keep_frac`` float ``[T]`` (needed by a sparsity;
        fractions in [0, 1], ``>= 1`` = dense). ``quest_gather`` gathers each query's kept
        pages (:func:`quest_gather_pages` picks the static count, or the ``quest`` mask program).
        ``recency`` ages keys by the pool's decode order (``pool.order``, ties by slot). A plain spec (everything off, no arrays) runs the
        plain program. Views write their K/V into ``write_slots`` like the base (run the step
        as scratch to drop them).

    Returns:
      Without ``spec``: float32 ``[T, V]`` logits (a device array). With ``spec``: a dict
      ``{"logits": float32 [T, V] | None, "hidden": [T, D] (compute dtype) | None,
      "attn_mass": float32 [S] | None, "usage": float32 [T, 3] | None}`` (None where the spec did not ask; ``attn_mass`` is
      the attention probability each slot got, summed over layers, heads and the real
      queries, 0 past the key window).

    Raises:
      ValueError: empty step, mismatched shapes, out-of-range or repeated slots, or token
        ids outside the vocabulary; a spec naming an unknown view, a sparsity without
        ``keep_frac``, spec arrays of the wrong shape, or a spec that needs the dense mask
        given a :class:`PagedAttentionMask`.
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    positions = np.asarray(positions, np.int32).reshape(-1)
    write_slots = np.asarray(write_slots, np.int32).reshape(-1)
    paged = isinstance(mask, PagedAttentionMask)
    if not paged:
      mask = np.asarray(mask, bool)
    T, S = tokens.shape[0], self.num_slots
    if T == 0:
      raise ValueError("a step needs at least one query token")
    want = (1, bucket_size(T), S) if paged else (T, S)
    if positions.shape != (T,) or write_slots.shape != (T,) or tuple(mask.shape) != want:
      raise ValueError(f"step: tokens [{T}], positions {positions.shape}, write_slots "
                       f"{write_slots.shape}, mask {tuple(mask.shape)}; expected [T], [T], {want}")
    if write_slots.min() < 0 or write_slots.max() >= S or np.unique(write_slots).size != T:
      raise ValueError(f"step: write_slots must be distinct and in [0, {S})")
    if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
      raise ValueError(f"step: token ids must be in [0, {self.cfg.vocab_size})")
    Tb = bucket_size(T)
    if Tb != T:
      pad = Tb - T
      tokens = np.concatenate([tokens, np.zeros(pad, np.int32)])
      positions = np.concatenate([positions, np.zeros(pad, np.int32)])
      # out-of-range slots: the scatter drops these writes (mode FILL_OR_DROP)
      write_slots = np.concatenate([write_slots, S + np.arange(pad, dtype=np.int32)])
    key, extras = PLAIN_KEY, {}
    if spec is not None:
      key = spec_key(spec)
      if paged and needs_dense_mask(spec):
        raise ValueError(f"step: spec {key} needs the dense bool [T, S] mask, not a "
                         f"PagedAttentionMask (run_step builds it)")
      if spec.query_key_keep is not None:
        qkk = np.asarray(spec.query_key_keep, bool)
        if qkk.shape != (T, S):
          raise ValueError(f"step: query_key_keep {qkk.shape} != [T, S] = {(T, S)}")
        mask = mask & qkk
      extras = self._spec_arrays(spec, key, T, Tb)
    if not paged:
      W = key_window(mask)
      windowed = np.zeros((Tb, W), bool)  # padding queries see nothing
      windowed[:T] = mask[:, :W]
      mask = windowed
      self.windows_used.add(W)
      if key[2][0] == "quest_gather":   # the static page count of this step, or the mask path
        nb = quest_gather_pages(mask, extras["keep_frac"], key[2][1])
        key = key[:2] + ((("quest", key[2][1]) if nb is None else key[2] + (nb,)),) + key[3:]
      if key[2][0] == "recency":   # age rank of the window's slots: the pool's decode order
        order = self.pool.order[:W]
        extras["key_order"] = np.argsort(np.argsort(order, kind="stable"),
                                         kind="stable").astype(np.int32)
    if key == PLAIN_KEY and not extras:
      logits, self.cache = _jitted_step(self.graphdef, self.state, self.cache, tokens, positions,
                                        write_slots, mask, self.layers)
      out = {"logits": logits}
    else:
      out, self.cache = _jitted_spec_step(self.graphdef, key, self.state, self.cache, tokens,
                                          positions, write_slots, mask, extras, self.layers)
      self.specs_used.add(key)
    self.buckets_used.add(Tb)
    self.num_steps += 1
    self.num_query_tokens += T
    if Tb != T:
      out = {k: (v if k == "attn_mass" else v[:T]) for k, v in out.items()}
    if spec is None:
      return out["logits"]
    return {k: out.get(k) for k in ("logits", "hidden", "attn_mass", "usage")}

  def _spec_arrays(self, spec: ForwardSpec, key: tuple, T: int, Tb: int) -> dict:
    """The padded device-bound arrays of ``spec`` (see :func:`_jitted_spec_step`)."""
    D = self.cfg.hidden_size
    if spec.view != "base" and spec.view not in self.cfg.attn_views:
      raise ValueError(f"step: unknown view {spec.view!r}; the model has 'base' and "
                       f"{list(self.cfg.attn_views)}")
    extras = {}
    if spec.mlp_keep is not None:
      mk = np.asarray(spec.mlp_keep, np.float32)
      if mk.shape == (T, D):
        mk = np.concatenate([mk, np.ones((Tb - T, D), np.float32)])
      elif mk.shape != (D,):
        raise ValueError(f"step: mlp_keep {mk.shape} is neither [D] = [{D}] nor [T, D]")
      extras["mlp_keep"] = mk
    if key[2][0] != "none":
      if spec.keep_frac is None:
        raise ValueError(f"step: sparsity {spec.sparsity!r} needs keep_frac [T]")
      kf = np.asarray(spec.keep_frac, np.float32).reshape(-1)
      if kf.shape != (T,):
        raise ValueError(f"step: keep_frac {kf.shape} != [{T}]")
      extras["keep_frac"] = np.concatenate([kf, np.ones(Tb - T, np.float32)])
    for name, fill in (("mlp_keep_frac", 1.0), ("query_bits", 16.0)):
      arr = getattr(spec, name)
      if arr is not None:
        a = np.asarray(arr, np.float32).reshape(-1)
        if a.shape != (T,):
          raise ValueError(f"step: {name} {a.shape} != [{T}]")
        extras[name] = np.concatenate([a, np.full(Tb - T, fill, np.float32)])
    if spec.query_view is not None:
      qv = np.asarray(spec.query_view, bool).reshape(-1)
      if qv.shape != (T,):
        raise ValueError(f"step: query_view {qv.shape} != [{T}]")
      extras["query_view"] = np.concatenate([qv, np.zeros(Tb - T, bool)])
    return extras

  def warm_up(self, sizes, attn_mass: tuple[bool, ...] = (False,),
              specs: tuple[ForwardSpec, ...] = ()) -> None:
    """Compile the dense-mask step programs timed runs will use: every padded size of
    ``sizes`` (query counts; those above S are dropped) at every key window a step of that size
    can have (:func:`key_windows`; a step of ``Tb >= 256`` padded queries sees at least ``Tb / 2
    + 1`` slots, so its window is at least ``Tb``), for every spec: the plain step for each
    ``False`` in ``attn_mass``, ``ForwardSpec(outputs=("logits", "attn_mass"))`` (H2O's) for a
    ``True``, and each of ``specs`` (only their static part and which arrays they carry, with
    their ranks, matter; placeholder arrays are used). Resets the step counters. On a
    ``"paged"`` engine only the dense-mask programs compile (the kernel's compile falls in the
    first real step). A ``quest_gather`` spec compiles its ``quest`` mask programs here (the
    placeholder queries are dense); its gather programs, one per :func:`gather_bucket` page count
    and key window, compile on first use.

    Raises:
      ValueError: the pool holds allocated slots (warm up a fresh or reset engine: the
        compile steps write K/V into slots ``0..T-1``).
    """
    if self.pool.used_pages:
      raise ValueError(f"warm_up needs an empty pool; {self.pool.used_pages} pages are in use")
    S, D = self.num_slots, self.cfg.hidden_size
    sizes = sorted({bucket_size(n) for n in sizes if 1 <= n <= S})
    todo = [ForwardSpec(outputs=("logits", "attn_mass")) if m else None for m in attn_mass]
    todo += list(specs)
    for spec in todo:
      for Tb in sizes:
        T = min(Tb, S)  # real queries; the step pads them to Tb
        sp = spec
        if spec is not None:   # placeholder arrays of the spec's ranks
          mk = spec.mlp_keep
          sp = dataclasses.replace(
              spec, query_key_keep=None,
              mlp_keep=None if mk is None else np.ones((D,) if np.ndim(mk) == 1 else (T, D)),
              keep_frac=None if spec.keep_frac is None else np.full(T, 0.5),
              mlp_keep_frac=None if spec.mlp_keep_frac is None else np.full(T, 0.5),
              query_bits=None if spec.query_bits is None else np.full(T, 8.0),
              query_view=None if spec.query_view is None else np.zeros(T, bool))
        for W in key_windows(S) if self.attention == "reference" else [S]:
          if Tb >= KEY_WINDOW_MIN and W < T:
            continue
          mask = np.zeros((T, S), bool)
          mask[0, W - 1] = True
          self.step(np.zeros(T, np.int32), np.zeros(T, np.int32),
                    np.arange(T, dtype=np.int32), mask, spec=sp)
    self.num_steps = self.num_query_tokens = 0

  # --- what schedulers call ----------------------------------------------------------------
  def allocate(self, owners) -> np.ndarray:
    """Reserve one slot per query for its owner, atomically.

    Args:
      owners: int ``[T]`` owner (sequence / thread) of each query.

    Returns:
      int32 ``[T]`` slots, in query order (each owner's queries get its next slots in order).

    Raises:
      PoolExhausted: the owners together need more pages than are free; nothing changed.
    """
    owners = np.asarray(owners, np.int64).reshape(-1)
    uniq, first = np.unique(owners, return_index=True)
    uniq = uniq[np.argsort(first)]
    counts = {int(o): int(np.count_nonzero(owners == o)) for o in uniq}
    need = sum(self.pool.pages_needed(o, n) for o, n in counts.items())
    if need > self.pool.num_free_pages:
      who = int(uniq[0]) if len(uniq) == 1 else tuple(int(o) for o in uniq)
      raise PoolExhausted(who, int(owners.size), need, self.pool.num_free_pages,
                          self.pool.live_tokens, self.pool.num_pages, self.pool.page_size)
    slots = np.empty(owners.size, np.int32)
    for o, n in counts.items():
      slots[owners == o] = self.pool.allocate(o, n)
    return slots

  def run_step(self, tokens, positions, segments, owners, visible, bidir, *,
               orders=None, key_keep=None, write_slots=None,
               spec: ForwardSpec | None = None) -> tuple:
    """Allocate, record, mask and run one step (the scheduler-facing step).

    Args:
      tokens, positions: int ``[T]``.
      segments: int ``[T]`` segment id of each query (``< G``).
      owners: int ``[T]`` or an int: page-table owner of each query's slot.
      visible: bool ``[G, G]``; bidir: bool ``[G]`` (DESIGN.md §2; see
        :class:`~selforch_jax.runtime.mask.SegmentTable`).
      orders: optional int ``[T]`` decode indices (causal order inside a segment); default
        the engine's running counter, in query order.
      key_keep: optional bool ``[S]``: keys hidden for this step only.
      write_slots: optional int ``[T]``: rewrite in place (diffusion re-denoising, DESIGN.md
        §2.5): query t writes its K/V into this slot, which its owner already holds ALIVE,
        instead of a newly allocated one. Nothing is allocated; the slots' position, segment
        and order are re-recorded (:meth:`KVPool.rewrite`; put back if the step fails).
      spec: optional :class:`~selforch_jax.runtime.step.ForwardSpec` (see :meth:`step`); a
        spec that needs the dense mask gets it on a ``"paged"`` engine too.

    Returns:
      ``(logits [T, V] float32 device array, slots int32 [T])``; with ``spec``, ``(outputs,
      slots)`` with ``outputs`` the dict of :meth:`step`.

    Raises:
      PoolExhausted: not enough free pages (nothing changed; evict and retry).
      ValueError: malformed inputs (see :meth:`step`, :func:`step_mask`); ``write_slots`` not
        ``[T]``, repeated, or not held ALIVE by the query's owner (:meth:`KVPool.rewrite`).
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    T = tokens.shape[0]
    if T == 0:
      raise ValueError("a step needs at least one query token")
    owners = np.broadcast_to(np.asarray(owners, np.int64), (T,))
    segments = np.asarray(segments, np.int64).reshape(-1)
    if orders is None:
      orders = self.next_order + np.arange(T, dtype=np.int64)
    orders = np.asarray(orders, np.int64).reshape(-1)
    if segments.shape != (T,) or orders.shape != (T,):
      raise ValueError(f"run_step: segments {segments.shape} / orders {orders.shape} != [{T}]")
    in_place = write_slots is not None
    if in_place:
      slots = np.asarray(write_slots, np.int32).reshape(-1)
      if slots.shape != (T,):
        raise ValueError(f"run_step: write_slots {slots.shape} != [{T}]")
      before = self.pool.rewrite(slots, owners, positions, segments, orders)
    else:
      slots = self.allocate(owners)
    try:
      if not in_place:
        self.pool.write(slots, positions, segments, orders)
      if (self.attention == "paged" and T <= PAGED_MAX_QUERIES
          and not (spec is not None and needs_dense_mask(spec))):
        mask = build_paged_mask(self.pool, segments, orders, visible, bidir,
                                num_queries=bucket_size(T), key_keep=key_keep,
                                interpret=self.interpret)
      else:
        mask = step_mask(self.pool, segments, orders, visible, bidir, key_keep)
      logits = self.step(tokens, positions, slots, mask, spec=spec)
    except Exception:
      if in_place:
        self.pool.restore_metadata(slots, before)
      else:
        for o in np.unique(owners)[::-1]:
          self.pool.rollback(int(o), int(np.count_nonzero(owners == o)))
      raise
    self.next_order = max(self.next_order, int(orders.max()) + 1)
    return logits, slots

  def reset(self) -> None:
    """Forget every sequence: a fresh pool (device KV is left as is; no slot is alive)."""
    self.pool = KVPool.for_model_config(self.cfg, self.pool.num_pages, self.pool.page_size)
    self.next_order = 0

  def stats(self) -> dict:
    """Steps, tokens, buckets compiled and the pool's live-KV figures."""
    return dict(num_steps=self.num_steps, num_query_tokens=self.num_query_tokens,
                tokens_per_step=self.num_query_tokens / max(self.num_steps, 1),
                buckets_used=sorted(self.buckets_used), windows_used=sorted(self.windows_used),
                **self.pool.stats())
