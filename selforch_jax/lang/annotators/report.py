"""PASTA annotation figures: per-response measurement and the annotation report.

:func:`measure_pasta` reads an annotated response the way the runtime will (tokenize, then
:func:`selforch_jax.lang.parser.parse`) and returns its rounds, chunks, promise lengths N and the
real token count of every chunk. :func:`annotation_report` aggregates the ``info`` of many
:class:`~selforch_jax.lang.annotators.base.Annotation` objects into the figures issue 5 asks for:

* ``fraction_annotated`` — annotated responses / all responses (bootstrap 95% CI over responses);
* ``chunks_per_annotated`` — chunks per annotated response (mean, bootstrap 95% CI, n);
* ``length_error`` — over all chunks of annotated responses, ``|10·N − chunk tokens|`` (mean
  absolute error in tokens, CI) and the same divided by the chunk's token count (mean relative
  error, CI). A chunk's tokens are the tokens between its ``<async>`` and ``</async>``.

CIs come from :func:`selforch_jax.eval.stats.bootstrap_ci` (percentile bootstrap, seed 0).

:mod:`selforch_jax.data.pasta_data` writes the report of its records (``annotation_report.json``);
the figures of the rule annotator on the Alpaca training file alone::

  python -m selforch_jax.data.pasta_data --sources=alpaca --out=out/pasta_alpaca
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from selforch_jax.lang.events import AsyncOpened, Degraded, PromiseClosed, Text
from selforch_jax.lang.parser import parse
from selforch_jax.lang.tags import FIXED_TAGS, TOKENS_PER_UNIT, TagVocab

__all__ = ["measure_pasta", "contains_tag_text", "annotation_report", "words_equal"]


def contains_tag_text(text: str, tag_vocab: TagVocab | None = None) -> bool:
  """Whether ``text`` holds the literal text of a tag (a tokenizer with the tags would read it as
  the tag, so such a response cannot be annotated without changing its meaning)."""
  tags = tag_vocab.tags if tag_vocab is not None else {t: 0 for t in FIXED_TAGS}
  return any(t in text for t in tags) or "<reg_" in text


def words_equal(a: str, b: str) -> bool:
  """Whether ``a`` and ``b`` have the same whitespace-separated words in the same order."""
  return a.split() == b.split()


def measure_pasta(text: str, tokenizer: Any, tag_vocab: TagVocab) -> dict[str, Any]:
  """Parse an annotated response and measure it.

  Args:
    text: a response in the orchestration language (tag strings inline).
    tokenizer: a tokenizer with the tags added (``encode(str) -> list[int]``).
    tag_vocab: its tags.

  Returns:
    ``dict(rounds: int, chunks: int, lengths: list[int] (N of each promise that got a chunk, in
    order), chunk_tokens: list[int] (tokens inside each chunk, tags excluded), degraded: list[str]
    (Degraded rules hit; empty for a well-formed response), num_tokens: int)``.
  """
  ids = tokenizer.encode(text)
  events = parse(ids, tag_vocab)
  lengths: dict[tuple[int, int], int] = {}
  chunk_tokens: dict[tuple[int, int], int] = {}
  degraded: list[str] = []
  rnd = None
  for e in events:
    if isinstance(e, PromiseClosed) and e.promise is not None:
      lengths[(e.round, e.promise)] = int(e.length)
    elif isinstance(e, AsyncOpened):
      rnd = e.round
      chunk_tokens.setdefault((e.round, e.chunk), 0)
    elif isinstance(e, Text) and e.stream >= 0:
      chunk_tokens[(rnd, e.stream)] = chunk_tokens.get((rnd, e.stream), 0) + 1
    elif isinstance(e, Degraded):
      degraded.append(e.rule)
  keys = sorted(chunk_tokens)
  return dict(rounds=len({r for r, _ in keys}), chunks=len(keys),
              lengths=[lengths.get(k, 0) for k in keys],
              chunk_tokens=[chunk_tokens[k] for k in keys], degraded=degraded,
              num_tokens=len(ids))


def _ci(values: Sequence[float]) -> dict[str, Any]:
  from selforch_jax.eval.stats import bootstrap_ci
  if len(values) == 0:
    return dict(mean=None, lo=None, hi=None, n=0)
  return bootstrap_ci(np.asarray(values, np.float64), n_boot=2000, seed=0)


def annotation_report(annotations: Iterable[Any], unit: int = TOKENS_PER_UNIT) -> dict[str, Any]:
  """Aggregate figures over annotations (see the module docstring).

  Args:
    annotations: :class:`~selforch_jax.lang.annotators.base.Annotation` objects; an annotated one
      (``text`` not None) must have ``info["lengths"]`` and ``info["chunk_tokens"]`` (lists of
      equal length, as the PASTA annotators write them); rejected/unannotated ones may carry
      ``info["reason"]`` or ``info["rejected"]``, counted in ``reasons``.
    unit: tokens per unit of N (10).

  Returns:
    JSON-serialisable dict: ``n``, ``annotated``, ``fraction_annotated`` (CI dict), ``rounds``
    (total), ``chunks`` (total), ``chunks_per_annotated`` (CI dict), ``length_abs_error_tokens``
    (CI dict over chunks), ``length_rel_error`` (CI dict over chunks), ``reasons`` (count per
    reason of the unannotated).

  Raises:
    ValueError: no annotations, or an annotated one without matching ``lengths``/``chunk_tokens``.
  """
  anns = list(annotations)
  if not anns:
    raise ValueError("annotation_report needs at least one annotation")
  done = [a for a in anns if a.text is not None]
  abs_err, rel_err, chunks = [], [], []
  rounds = 0
  for a in done:
    lengths, toks = a.info.get("lengths"), a.info.get("chunk_tokens")
    if lengths is None or toks is None or len(lengths) != len(toks):
      raise ValueError(f"annotated example without matching info lengths/chunk_tokens: {a.info}")
    chunks.append(len(toks))
    rounds += int(a.info.get("rounds", 1))
    for n, t in zip(lengths, toks):
      abs_err.append(abs(unit * n - t))
      rel_err.append(abs(unit * n - t) / max(t, 1))
  reasons: dict[str, int] = {}
  for a in anns:
    if a.text is None:
      r = str(a.info.get("rejected") or a.info.get("reason") or "unknown")
      r = r.split(":")[0]
      reasons[r] = reasons.get(r, 0) + 1
  return dict(
      n=len(anns), annotated=len(done),
      fraction_annotated=_ci([float(a.text is not None) for a in anns]),
      rounds=rounds, chunks=int(sum(chunks)),
      chunks_per_annotated=_ci(chunks),
      length_abs_error_tokens=_ci(abs_err),
      length_rel_error=_ci(rel_err),
      reasons=dict(sorted(reasons.items())))


def write_report(report: dict[str, Any], path: str) -> None:
  """Write ``report`` as indented JSON to ``path`` (parent folders created)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=2)
    f.write("\n")
