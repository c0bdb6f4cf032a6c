"""What one engine step computes (DESIGN.md §2.5): :class:`StepPlan`, :class:`ForwardSpec`,
:class:`StepResult`.

A scheduler hands the engine a :class:`StepPlan`: the queries, their visibility, the pool
changes before the step (free, rollback, evict, relabel), whether the step is scratch, and a
:class:`ForwardSpec`. The spec's *static* part (:meth:`ForwardSpec.static`) chooses the compiled
program; its *array* part is data of the step. A spec with everything off is the plain step.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import jax
import numpy as np

OUTPUTS = ("logits", "hidden", "attn_mass", "usage")
_SPARSITY = re.compile(r"^(none|(quest|quest_gather)\((\d+)\)|recency\((\d+),\s*(\d+)\))$")


def parse_sparsity(sparsity: str) -> tuple:
  """``"none"`` -> ``("none",)``; ``"quest(P)"`` -> ``("quest", P)``; ``"quest_gather(P)"`` ->
  ``("quest_gather", P)``; ``"recency(S, W)"`` -> ``("recency", S, W)``.

  Raises:
    ValueError: any other string, or a zero page size.
  """
  m = _SPARSITY.match(str(sparsity).strip())
  if not m:
    raise ValueError(f"sparsity must be 'none', 'quest(page_size)', 'quest_gather(page_size)' "
                     f"or 'recency(sinks, window)', got {sparsity!r}")
  if m.group(2) is not None:
    if int(m.group(3)) < 1:
      raise ValueError(f"quest page size must be >= 1, got {sparsity!r}")
    return (m.group(2), int(m.group(3)))
  if m.group(4) is not None:
    return ("recency", int(m.group(4)), int(m.group(5)))
  return ("none",)


def gathered_sparsity(sparsity: str) -> str:
  """The compute-saving form of a sparsity string: ``"quest(P)"`` -> ``"quest_gather(P)"`` (the
  same page selection, attention over the gathered kept pages only); any other rule unchanged.

  Raises:
    ValueError: a bad sparsity string (:func:`parse_sparsity`).
  """
  sp = parse_sparsity(sparsity)
  return f"quest_gather({sp[1]})" if sp[0] == "quest" else str(sparsity)


@dataclasses.dataclass(frozen=True)
class ForwardSpec:
  """What one step computes beyond "next-token logits of every query over the base weights".

  Static (each distinct value compiles its own program; :meth:`static`):
    view: which weights: ``"base"``, or the name of an extra attention view of the model
      (``ModelConfig.attn_views``, e.g. Orthrus's ``"diffusion"``; added with
      :func:`~selforch_jax.models.transformer.add_attn_view`). A view step writes its K/V into
      its slots like any step (the K/V of the view's projections); a scheduler that must not
      keep them runs the step as scratch.
    outputs: any of :data:`OUTPUTS`: ``logits`` (float32 ``[T, V]``), ``hidden`` (the last
      layer's normed hidden state, ``[T, D]`` in the compute dtype), ``attn_mass`` (float32
      ``[S]``: the attention probability each slot got, summed over layers, heads and queries;
      H2O's accumulated attention, Zhang et al. 2023), ``usage`` (float32 ``[T, 3]``: the
      compute each query got, ``[kept fraction of the keys it sees (mean over layers and KV
      heads), kept fraction of MLP input channels (mean over layers), MLP-output bits / 16]``;
      SOL's budget accounting, what the step applied).
    sparsity: ``"none"``, ``"quest(page_size)"`` (QUEST page top-k, Tang et al. 2024: for each
      query and KV head, pages scored by ``sum_d max(q_d maxK_d, q_d minK_d)``, the top
      ``ceil(keep_frac * kv_len / page_size)`` pages kept) or ``"recency(sinks, window)"`` (the
      first ``sinks`` and the newest ``ceil(keep_frac * kv_len)`` keys, at least ``window``;
      age = the pool's decode order). Steps whose query sees at most ``sinks + window + 1`` keys
      are dense (SOL's rule, akhauriyash/SOL "Compute Where it Counts"; QUEST uses ``sinks=4,
      window=2``: ``transformer.SPARSE_DENSE_SINKS / SPARSE_DENSE_WINDOW``), as are queries with
      ``keep_frac >= 1``. QUEST pages are ``page_size`` consecutive slots of the step's key
      window; each page's key min/max is computed inside the step over the slots some query of
      the step sees; GQA: a KV head's query group shares one selection, its page score summed
      over the group (:func:`~selforch_jax.models.transformer.quest_key_mask`).
      ``"quest_gather(page_size)"`` is the same selection with the compute saved: each (query,
      KV head) gathers its kept pages' K/V from the cache and attends over those only
      (:func:`~selforch_jax.models.transformer.quest_gather_attention`; the engine picks the
      static page count per step, :func:`~selforch_jax.runtime.engine.quest_gather_pages`, and
      runs the ``quest`` mask program instead where gathering would not read fewer keys than
      the key window, where every query is dense (so a dense action is still the plain step
      exactly) or for steps of more than
      :data:`~selforch_jax.runtime.engine.GATHER_MAX_QUERIES` padded queries); logits equal
      ``quest``'s up to float summation order; not with ``attn_mass``. All need ``keep_frac``
      and the dense mask path (a ``"paged"`` engine runs these steps on it).
    act_bits: MLP-output fake-quant bits (per-token absmax, symmetric); 16 = off.

  Arrays (data; None = off):
    query_key_keep: bool ``[T, S]``: query t may see slot s only where True (ANDed with the
      visibility mask); the per-step ``[S]`` form is :attr:`StepPlan.key_keep`.
    mlp_keep: bool or float ``[D]`` or ``[T, D]``: MLP input channels kept (1) / dropped (0).
    keep_frac: float ``[T]``: token-attention keep fraction per query for ``sparsity``.
    mlp_keep_frac: float ``[T]``: every layer keeps the top ``ceil(frac * D)`` MLP input
      channels of each query by ``|h|`` (SOL's structured activation pruning,
      :func:`~selforch_jax.models.transformer.channel_keep_mask`); ``>= 1`` keeps all.
    query_bits: ``[T]`` MLP-output fake-quant bits per query in [2, 16] (16 = off; SOL's bits
      knob when the queries of one step carry different actions,
      :func:`~selforch_jax.models.transformer.fake_quant_rows`).
    query_view: bool ``[T]``: per-query view selection, with ``view`` naming the view: query t
      uses ``view``'s attention projections where True and the base ones where False (Orthrus's
      fused step: the AR verify of block k and the diffusion draft of block k+1 in one forward).
      None: every query uses ``view``.

  Raises:
    ValueError: unknown output or view name, bad sparsity string, act_bits outside [2, 16],
      ``query_view`` with ``view="base"``, ``quest_gather`` with the ``attn_mass`` output.
  """

  view: str = "base"
  outputs: tuple[str, ...] = ("logits",)
  sparsity: str = "none"
  act_bits: int = 16
  query_key_keep: Any = None
  mlp_keep: Any = None
  keep_frac: Any = None
  mlp_keep_frac: Any = None
  query_bits: Any = None
  query_view: Any = None

  def __post_init__(self):
    outs = (self.outputs,) if isinstance(self.outputs, str) else tuple(self.outputs)
    object.__setattr__(self, "outputs", outs)
    bad = [o for o in outs if o not in OUTPUTS]
    if bad or not outs:
      raise ValueError(f"ForwardSpec.outputs must be a non-empty subset of {OUTPUTS}, got {outs}")
    if parse_sparsity(self.sparsity)[0] == "quest_gather" and "attn_mass" in outs:
      raise ValueError("sparsity 'quest_gather' attends over gathered keys: no attn_mass output "
                       "(use 'quest')")
    if not 2 <= int(self.act_bits) <= 16:
      raise ValueError(f"act_bits must be in [2, 16] (16 = off), got {self.act_bits}")
    if self.query_bits is not None:
      qb = np.asarray(self.query_bits)
      if qb.size and not ((qb >= 2) & (qb <= 16)).all():
        raise ValueError(f"query_bits must be in [2, 16] (16 = off), got {qb.min()}..{qb.max()}")
    if not isinstance(self.view, str) or not self.view:
      raise ValueError(f"view must be a non-empty string, got {self.view!r}")
    if self.query_view is not None and self.view == "base":
      raise ValueError("query_view selects between the base and a view: set view to its name")

  def static(self) -> tuple:
    """The hashable part that chooses the compiled program: ``(view, outputs, sparsity,
    act_bits, has_query_key_keep, mlp_keep_rank, has_keep_frac, has_mlp_keep_frac,
    has_query_bits[, True if query_view])``."""
    mk = None if self.mlp_keep is None else int(np.ndim(self.mlp_keep))
    return (self.view, tuple(sorted(self.outputs)), parse_sparsity(self.sparsity),
            int(self.act_bits), self.query_key_keep is not None, mk, self.keep_frac is not None,
            self.mlp_keep_frac is not None, self.query_bits is not None) + \
        ((True,) if self.query_view is not None else ())

  @property
  def is_plain(self) -> bool:
    """True when the spec is everything off (the plain step's program)."""
    return self.static() == PLAIN.static()


PLAIN = ForwardSpec()


@dataclasses.dataclass
class StepPlan:
  """One engine step and the pool changes before it.

  Attributes:
    tokens, positions: int ``[T]``.
    segments: int ``[T]`` segment of each query (``< G``).
    owners: int ``[T]`` (or one int) page-table owner of each query's slot.
    visible: bool ``[G, G]`` segment visibility; bidir: bool ``[G]``.
    orders: optional int ``[T]`` decode indices (default: the engine's counter).
    evict: slots to kill before the step.
    free_owners: owners whose pages are released before the step.
    rollback: ``{owner: n}``: crop the newest n slots of each owner before the step.
    relabel: ``(slots, owner, segment)`` triples applied before the step: the slots (held by a
      tree / verify step's owner) become the newest slots of ``owner`` in ``segment`` (no K/V
      copy; positions and orders are kept).
    write_slots: optional int ``[T]``: rewrite in place: query t writes its K/V to this slot,
      already held by its owner (diffusion re-denoising), instead of a newly allocated one.
    scratch: release this step's slots right after it (verify without writing back).
    scratch_owners: owners whose slots this step allocates are released right after it, the
      other queries' slots are kept (a fused step's draft queries, Orthrus; ``scratch`` releases
      every query's).
    key_keep: optional bool ``[S]`` keys hidden for this step only.
    spec: the :class:`ForwardSpec` (what the step computes).
    tag: anything the scheduler wants back in ``Scheduler.on_step``.
  """

  tokens: Any
  positions: Any
  segments: Any
  owners: Any
  visible: Any
  bidir: Any
  orders: Any = None
  evict: Any = ()
  free_owners: tuple[int, ...] = ()
  rollback: Mapping[int, int] = dataclasses.field(default_factory=dict)
  relabel: Sequence[tuple[Any, int, int]] = ()
  write_slots: Any = None
  scratch: bool = False
  scratch_owners: tuple[int, ...] = ()
  key_keep: Any = None
  spec: ForwardSpec = PLAIN
  tag: Any = None


@dataclasses.dataclass
class StepResult:
  """What one step produced.

  Attributes:
    logits: float32 ``[T, V]`` device array (row t = next-token logits of query t), or None
      when the spec did not ask for logits.
    slots: int32 ``[T]`` slots the queries were written to (released if ``scratch``).
    released_pages: pages returned to the free list by this plan's evictions.
    hidden: ``[T, D]`` device array of the last layer's hidden state, when asked for.
    attn_mass: float32 ``[S]`` device array, when asked for.
    usage: float32 ``[T, 3]`` device array (see :class:`ForwardSpec` ``outputs``), when asked.
  """

  logits: jax.Array | None
  slots: np.ndarray
  released_pages: list[int]
  hidden: jax.Array | None = None
  attn_mass: jax.Array | None = None
  usage: jax.Array | None = None
