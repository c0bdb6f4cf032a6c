"""Per-request state of the PASTA scheduler: :class:`PastaStats` (the figures a request reports)
and ``_Request`` (main thread, live threads, layout, pending tokens)."""

from __future__ import annotations

import dataclasses

from selforch_jax.lang import EndOfText, LayoutBuilder, PromiseClosed, Sync, TagVocab

__all__ = ["PastaStats"]


@dataclasses.dataclass
class PastaStats:
  """Per-request figures of :class:`~selforch_jax.runtime.schedulers.pasta.PASTAScheduler`.

  Definitions:

  * ``tokens``: response tokens in canonical order (tags and runtime-fed tags included) plus
    the stop token when there is one;
  * ``forwards``: engine steps that ran a token of this request, prefill included (the critical
    path in forwards: each is one sequential model call for this request);
  * ``theoretical_speedup = (content_tokens + stop) / forwards`` (PASTA's definition: the tokens
    of the sequential response — the de-tagged logical text, plus the stop token when there is
    one — over the longest chain of sequential forwards); AR decoding is exactly 1.0;
  * ``tokens_per_forward = tokens / forwards`` (tags included: what the engine actually ran).
  * ``wall_s``: wall-clock seconds from the request's prefill to its last step.

  Attributes:
    tokens: response tokens, tags and runtime-fed tags included, plus the stop token if any.
    sampled_tokens: tokens drawn from the model (stop token included).
    content_tokens: tokens of the final de-tagged text (:func:`~selforch_jax.lang.assemble`).
    forwards: engine steps that ran a token of this request (prefill included).
    theoretical_speedup: ``(content_tokens + stop) / forwards`` (AR = 1).
    tokens_per_forward: ``tokens / forwards``.
    wall_s: seconds from the request's prefill to its last step.
    rounds: joined rounds; threads: threads forked; max_parallel: largest number of threads
      decoded in one step.
    degraded: the degradation rules that applied (``"<index>: <rule>"``).
    well_formed: no degradation rule applied.
  """

  tokens: int
  sampled_tokens: int
  content_tokens: int
  forwards: int
  theoretical_speedup: float
  wall_s: float
  rounds: int
  threads: int
  max_parallel: int
  degraded: tuple[str, ...]
  well_formed: bool
  tokens_per_forward: float


class _Request:
  """One prompt's decoding state (main thread, live threads, layout)."""

  def __init__(self, prompt: list[int], tv: TagVocab, cap, length_unit: int):
    self.prompt = prompt
    self.builder = LayoutBuilder(tv, cap=cap, length_unit=length_unit)
    self.round_lengths: list[int] = []   # N of the promises of the open round
    self.promised = 0                    # promises with a length so far, all rounds
    self.length_at: int | None = None    # max_topic_tokens: where the forced length starts
    self.plan_start: int | None = None   # feed index of the open round's first <promise>
    self.prompt_plan_start: int | None = None
    self.main: list[int] = []            # canonical response tokens, main thread so far
    self.main_lp: list[float] = []
    self.main_injected: list[bool] = []
    self.threads: dict[int, list[int]] = {}
    self.threads_lp: dict[int, list[float]] = {}
    self.threads_inj: dict[int, list[bool]] = {}
    self.live: list[int] = []            # live thread indices
    self.pending: dict[int, int] = {}    # stream -> token to feed in the next step
    self.pending_injected: dict[int, bool] = {}
    self.pending_lp: dict[int, float] = {}
    self.pending_src: dict[int, int | None] = {}  # stream -> query index that sampled it
    self.pred_map: dict[int, int] = {}   # builder index -> index of the query that sampled it
    self.slot_of: dict[int, int] = {}    # builder index -> pool slot (until evicted)
    self.notes: list[str] = []           # runtime degradations (a stop token inside a thread)
    self.seg_map: dict[int, int] = {}    # builder segment -> engine segment
    self.owner_of: dict[int, int] = {}   # stream (MAIN or thread key) -> owner
    self.thread_owner_key = 0
    self.stop_token: int | None = None
    self.finish_reason: str | None = None
    self.forwards = 0
    self.sampled = 0
    self.rounds = 0
    self.n_threads = 0
    self.max_parallel = 0
    self.t0: float | None = None
    self.t1: float | None = None
    self.forced_closes: list[int] = []   # positions in main of </async> the finish implied
    self.in_promise = False              # main thread: tag-grammar state (constrain_tags)
    self.promise_inner: list[int] = []
    self.last_main: int | None = None

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  def response_len(self) -> int:
    return len(self.main) + sum(len(t) for t in self.threads.values())

  def track(self, events) -> None:
    """Follow rounds from the parser events (which promises await threads)."""
    for e in events:
      if isinstance(e, PromiseClosed) and e.promise is not None:
        if e.promise == 0:
          self.plan_start = e.open_index + self.builder.document_offset
        self.round_lengths.append(int(e.length))
        self.promised += 1
      elif isinstance(e, (Sync, EndOfText)) and (not isinstance(e, Sync) or e.round is not None):
        self.round_lengths = []
        self.plan_start = None

  def flush_threads(self) -> None:
    """Move the joined round's thread tokens into the canonical main sequence."""
    for k in sorted(self.threads):
      self.main += self.threads[k]
      self.main_lp += self.threads_lp[k]
      self.main_injected += self.threads_inj[k]
    self.threads, self.threads_lp, self.threads_inj = {}, {}, {}
