"""Prompt-lookup decoding (PLD; Saxena 2023, apoorvumang/prompt-lookup-decoding) on the engine,
lossless.

Each step verifies one chain: the continuation of the earliest earlier occurrence of the
context's last n-gram (n = ``max_ngram`` .. 1; :func:`~selforch_jax.runtime.ngram.prompt_lookup`
over prompt + output), up to ``num_pred`` tokens (Saxena's defaults: ``max_ngram = 3``,
``num_pred_tokens = 10``). The chain is a guess tree with one child per node
(:class:`~selforch_jax.runtime.schedulers.spec_base.SpecScheduler`: node d at ``last_pos + d``,
sees its ancestors; accepted tokens' K/V relabeled into the sequence, the rest freed); greedy
longest-prefix match or exact speculative sampling (one-hot drafts: the residual rule;
:mod:`selforch_jax.runtime.verify`). No draft tree. Beyond upstream: ``num_pred`` defaults to
fill the step bucket (``max_tree``), since a step of 11 queries costs what one of 16 does.
"""

from __future__ import annotations

import numpy as np

from selforch_jax.runtime.ngram import prompt_lookup
from selforch_jax.runtime.registry import register
from selforch_jax.runtime.sampling import SamplingParams
from selforch_jax.runtime.schedulers.spec_base import Draft, SpecScheduler, spec_factory


class PLDScheduler(SpecScheduler):
  """PLD (module docstring). Args as :class:`SpecScheduler`, plus ``max_ngram`` and ``num_pred``
  (default ``max_tree``).

  Raises:
    ValueError: as :class:`SpecScheduler`; ``max_ngram < 1``.
  """

  name = "pld"

  def __init__(self, prompts, max_new_tokens, sampling=SamplingParams(), stop_ids=(),
               owner_base=0, segment_base=0, *, max_tree=15, max_ngram=3, num_pred=None,
               max_pos=1 << 30):
    super().__init__(prompts, max_new_tokens, sampling, stop_ids, owner_base, segment_base,
                     max_tree=max_tree, max_guess=max_tree, max_pos=max_pos)
    if max_ngram < 1:
      raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
    self.max_ngram = int(max_ngram)
    self.num_pred = int(max_tree if num_pred is None else num_pred)

  def propose(self, req, budget):
    k = min(budget, self.num_pred, self.max_new - len(req.tokens))
    chain = prompt_lookup(req.context, self.max_ngram, k) if k > 0 else []
    n = len(chain)
    return (np.arange(-1, n, dtype=np.int64), np.asarray([0] + chain, np.int64), Draft.empty())


register("pld")(spec_factory(PLDScheduler))
