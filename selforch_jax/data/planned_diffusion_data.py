"""Planned Diffusion training data for the synthetic cities task (issue 21): chat JSONL records
whose assistant turn is the tagged answer (:func:`selforch_jax.data.synthetic_cities.annotate`:
one promise and one chunk per city, then ``<sync/>``), with upstream's stochastic padding
(planned-diffusion ``train/pad.py``: 0-10 ``[PAD]`` tokens, uniform, appended inside every chunk
before ``</async>``; ``pad=False`` leaves it out: PASTA's records of the same task, whose chunks
are decoded autoregressively and end at ``</async>``) and the ablations of upstream's trainer:
``no_topic`` (every topic becomes ``topic k``, ``--ablate_topic``) and ``no_sync`` (no
``<sync/>``: the round ends the answer, ``--ablate_sync``).

Padding is drawn once per record from ``(seed, index)`` (upstream draws it per sample in its
collator); the record set is a pure function of its arguments, so the cache file is rebuilt
only when they change (:func:`ensure_cities_data`).

:func:`chat_pd_records` converts PASTA-annotated chat records (``data/pasta/train.jsonl``: the
assistant turn ``<promise>TOPIC N</promise>...<async>chunk</async>...<sync/>``) to Planned
Diffusion records: every N becomes ``ceil(chunk tokens / 10)`` (the decoder scaffolds 10*N masks
per chunk, so a chunk longer than that would be cut), the ``[PAD]`` tokens are appended in every
chunk with the padded chunk held to the scaffold (module docstring of :func:`chat_pd_records`), and
a missing ``<sync/>`` is added before continuation text. :func:`ensure_chat_pd_data` caches them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import math

import numpy as np

from selforch_jax.data import synthetic_cities
from selforch_jax.lang.tags import (ASYNC_CLOSE, ASYNC_OPEN, FIXED_TAGS, PAD, PROMISE_CLOSE,
                                    PROMISE_OPEN, SYNC, TOKENS_PER_UNIT)

__all__ = ["cities_records", "ensure_cities_data", "chat_pd_records", "ensure_chat_pd_data",
           "MAX_PAD", "CHAT_PD_SOURCE"]

CHAT_PD_SOURCE = "data/pasta/train.jsonl"   # PASTA-annotated chat records (Alpaca + others)

MAX_PAD = 10   # upstream: randint(0, 11)


def _tagged(example: dict[str, Any], count_tokens: Callable[[str], int], rng: np.random.Generator,
            no_topic: bool, no_sync: bool, pad: bool = True) -> str:
  text = synthetic_cities.annotate(example, count_tokens)
  if pad:
    text = text.replace(ASYNC_CLOSE, "\0")
    parts = text.split("\0")
    text = "".join(p + (PAD * int(rng.integers(0, MAX_PAD + 1)) + ASYNC_CLOSE
                        if i < len(parts) - 1 else "") for i, p in enumerate(parts))
  if no_topic:
    k = iter(range(1, 1000))
    text = re.sub(re.escape(PROMISE_OPEN) + r" (\S+) (\d+) " + re.escape(PROMISE_CLOSE),
                  lambda m: f"{PROMISE_OPEN} topic {next(k)} {m.group(2)} {PROMISE_CLOSE}", text)
  if no_sync:
    text = text.replace(SYNC, "")
  return text


def cities_records(n: int, seed: int, count_tokens: Callable[[str], int], *, min_k: int = 2,
                   max_k: int = 6, no_topic: bool = False, no_sync: bool = False,
                   pad: bool = True) -> list[dict[str, Any]]:
  """n chat records ``{"messages": [user, assistant], "cities": [...], "annotated": True}``.

  Args:
    n: examples (:func:`~selforch_jax.data.synthetic_cities.generate_split` with ``seed``).
    seed: split seed; the padding uses ``(seed, index)``.
    count_tokens: the tokenizer's token count of a string (promise lengths).
    min_k, max_k: cities per example.
    no_topic, no_sync: upstream's ablations (module docstring).
    pad: the 0-10 ``[PAD]`` per chunk (False: PASTA's records, the plain annotated answer).
  """
  out = []
  for i, ex in enumerate(synthetic_cities.generate_split(n, seed, min_k, max_k)):
    rng = np.random.default_rng([seed, i])
    out.append({"messages": [{"role": "user", "content": ex["prompt"]},
                             {"role": "assistant",
                              "content": _tagged(ex, count_tokens, rng, no_topic, no_sync,
                                                 pad)}],
                "cities": ex["cities"], "annotated": True})
  return out


def ensure_cities_data(path: str, count_tokens: Callable[[str], int], *, n: int, seed: int,
                       no_topic: bool = False, no_sync: bool = False, pad: bool = True) -> str:
  """Write :func:`cities_records` to ``path`` (JSONL, one record a line) unless a file made
  with the same arguments is there (``<path>.meta.json``); returns ``path``.

  Raises:
    ValueError: ``n < 1``.
  """
  if n < 1:
    raise ValueError(f"ensure_cities_data: n must be >= 1, got {n}")
  meta = {"n": int(n), "seed": int(seed), "no_topic": bool(no_topic), "no_sync": bool(no_sync),
          "source": "selforch_jax.data.synthetic_cities"}
  if not pad:
    meta["pad"] = False
  mpath = path + ".meta.json"
  if os.path.exists(path) and os.path.exists(mpath):
    with open(mpath, encoding="utf-8") as f:
      if json.load(f) == meta:
        return path
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  rows = cities_records(n, seed, count_tokens, no_topic=no_topic, no_sync=no_sync, pad=pad)
  with open(path, "w", encoding="utf-8") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  with open(mpath, "w", encoding="utf-8") as f:
    json.dump(meta, f)
  return path


class _Malformed(ValueError):
  """An annotated answer whose tags do not form ``prefix (PLAN chunk* [<sync/>] text)*``."""


def _pieces(text: str) -> list[str]:
  """``text`` split into tag strings (:data:`~selforch_jax.lang.tags.FIXED_TAGS`) and the text
  between them (empty texts dropped)."""
  out, i = [], 0
  while i < len(text):
    hits = [(j, t) for t in FIXED_TAGS if (j := text.find(t, i)) >= 0]
    if not hits:
      out.append(text[i:])
      break
    j, t = min(hits)
    if j > i:
      out.append(text[i:j])
    out.append(t)
    i = j + len(t)
  return out


def _split_promise(inner: str) -> tuple[str, int]:
  """``"TOPIC N"`` -> (``"TOPIC"``, N); raises :class:`_Malformed` without a trailing N."""
  head, _, n = inner.strip().rpartition(" ")
  if not n.isdigit() or not head:
    raise _Malformed(f"promise {inner!r} has no topic and length")
  return head, int(n)


def _pd_answer(text: str, count_tokens: Callable[[str], int], rng: np.random.Generator,
               pad: bool, cap_pad: bool) -> tuple[str, dict[str, int]]:
  """One assistant answer rewritten (see :func:`chat_pd_records`); returns (text, stats)."""
  pieces = _pieces(text)
  out: list[str] = []
  plan: list[tuple[str, int]] = []     # (topic, original N) of the round being read
  chunks: list[str] = []                # its chunk texts
  stats = {"rounds": 0, "chunks": 0, "n_changed": 0, "pads": 0, "sync_added": 0}

  def flush(sync_needed: bool) -> None:
    if len(chunks) != len(plan):
      raise _Malformed(f"{len(plan)} promises but {len(chunks)} chunks in a round")
    ntoks = [count_tokens(c) for c in chunks]
    ns = [max(1, math.ceil(t / TOKENS_PER_UNIT)) for t in ntoks]
    for (topic, n_old), n in zip(plan, ns):
      stats["n_changed"] += int(n != n_old)
      out.append(f"{PROMISE_OPEN}{topic} {n}{PROMISE_CLOSE}")
    for chunk, ntok, n in zip(chunks, ntoks, ns):
      k = int(rng.integers(0, MAX_PAD + 1)) if pad else 0
      if cap_pad:
        k = min(k, TOKENS_PER_UNIT * n - ntok)
      stats["pads"] += k
      out.append(ASYNC_OPEN + chunk + PAD * k + ASYNC_CLOSE)
    if sync_needed:
      out.append(SYNC)
      stats["sync_added"] += 1
    stats["rounds"] += 1
    stats["chunks"] += len(chunks)
    plan.clear()
    chunks.clear()

  i, state = 0, "main"                  # main | plan | chunks (a round's chunks were read)
  while i < len(pieces):
    p = pieces[i]
    if p == PROMISE_OPEN:
      if state == "chunks":
        flush(sync_needed=True)         # a new round right after the chunks: sync first
      if i + 2 >= len(pieces) or pieces[i + 2] != PROMISE_CLOSE or pieces[i + 1] in FIXED_TAGS:
        raise _Malformed("an unclosed promise")
      plan.append(_split_promise(pieces[i + 1]))
      state, i = "plan", i + 3
      continue
    if p == ASYNC_OPEN:
      if state == "main":
        raise _Malformed("a chunk without a plan")
      if i + 2 >= len(pieces) or pieces[i + 1] in FIXED_TAGS or pieces[i + 2] != ASYNC_CLOSE:
        raise _Malformed("an empty chunk, a tag inside a chunk or no </async>")
      chunks.append(pieces[i + 1])
      state, i = "chunks", i + 3
      continue
    if p == SYNC:
      if state == "plan":
        raise _Malformed("<sync/> right after a plan")
      if state == "chunks":
        flush(sync_needed=False)
      out.append(SYNC)
      state, i = "main", i + 1
      continue
    if p in FIXED_TAGS:
      raise _Malformed(f"a stray {p}")
    if state == "plan":
      raise _Malformed("text between a plan's promises and its chunks")
    if state == "chunks":
      flush(sync_needed=True)           # continuation text after the round: sync before it
      state = "main"
    out.append(p)
    i += 1
  if state == "plan":
    raise _Malformed("a plan without chunks")
  if state == "chunks":
    flush(sync_needed=False)            # the round ends the answer (EOS joins it)
  return "".join(out), stats


def chat_pd_records(rows: list[dict[str, Any]], count_tokens: Callable[[str], int], seed: int, *,
                    keep_plain: bool = False, pad: bool = True, cap_pad: bool = True
                    ) -> tuple[list[dict[str, Any]], dict[str, int]]:
  """Planned Diffusion records from PASTA-annotated chat records.

  For every row whose last (assistant) message holds a ``<promise>``:

  * every promise's length N becomes ``max(1, ceil(count_tokens(chunk) / 10))`` for its chunk
    (the k-th chunk of a round answers the k-th promise of that round, as the parser reads it);
  * each chunk gets ``u ~ U{0..MAX_PAD}`` ``[PAD]`` tokens before ``</async>`` (drawn from
    ``(seed, row index)``, in chunk order); with ``cap_pad`` (default) ``u`` is capped at
    ``10*N - tokens`` so the padded chunk fits the decoder's ``10*N``-mask scaffold exactly
    (``pad=False``: no ``[PAD]``);
  * a round followed by text or by another round without ``<sync/>`` gets one (a round that ends
    the answer is left as it is: EOS joins it).

  Rows without a promise are dropped, or kept unchanged (plain AR text, ``"annotated": False``)
  with ``keep_plain``; rows whose tags do not parse (a promise count unlike the chunk count, a
  stray or nested tag, an empty chunk) are dropped. Records keep their other fields and get
  ``"annotated"`` and ``"chunks"`` set.

  Returns:
    (records, stats): stats counts ``rows``, ``kept``, ``plain_dropped``, ``plain_kept``,
    ``malformed``, ``rounds``, ``chunks``, ``n_changed``, ``pads``, ``sync_added``.
  """
  stats = {"rows": len(rows), "kept": 0, "plain_dropped": 0, "plain_kept": 0, "malformed": 0,
           "rounds": 0, "chunks": 0, "n_changed": 0, "pads": 0, "sync_added": 0}
  out = []
  for i, row in enumerate(rows):
    msgs = row["messages"]
    answer = msgs[-1]["content"]
    if msgs[-1]["role"] != "assistant" or PROMISE_OPEN not in answer:
      if keep_plain and msgs[-1]["role"] == "assistant":
        out.append(dict(row, annotated=False, chunks=0))
        stats["plain_kept"] += 1
        stats["kept"] += 1
      else:
        stats["plain_dropped"] += 1
      continue
    rng = np.random.default_rng([seed, i])
    try:
      text, s = _pd_answer(answer, count_tokens, rng, pad, cap_pad)
    except _Malformed:
      stats["malformed"] += 1
      continue
    for k, v in s.items():
      stats[k] += v
    out.append(dict(row, messages=list(msgs[:-1]) + [{"role": "assistant", "content": text}],
                    annotated=True, chunks=s["chunks"]))
    stats["kept"] += 1
  return out, stats


def ensure_chat_pd_data(path: str, count_tokens: Callable[[str], int], *,
                        src: str = CHAT_PD_SOURCE, seed: int = 0, keep_plain: bool = False,
                        pad: bool = True) -> str:
  """Write :func:`chat_pd_records` of the JSONL file ``src`` to ``path`` unless a file made
  with the same arguments (and the same ``src`` size and mtime) is there
  (``<path>.meta.json``, which also holds the conversion stats); returns ``path``.

  Raises:
    FileNotFoundError: ``src`` is missing. ValueError: no record survives the conversion.
  """
  st = os.stat(src)
  meta = {"src": os.path.abspath(src), "src_size": st.st_size, "src_mtime": int(st.st_mtime),
          "seed": int(seed), "keep_plain": bool(keep_plain), "pad": bool(pad),
          "source": "selforch_jax.data.planned_diffusion_data.chat_pd_records"}
  mpath = path + ".meta.json"
  if os.path.exists(path) and os.path.exists(mpath):
    with open(mpath, encoding="utf-8") as f:
      old = json.load(f)
    if {k: old.get(k) for k in meta} == meta:
      return path
  with open(src, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  recs, stats = chat_pd_records(rows, count_tokens, seed, keep_plain=keep_plain, pad=pad)
  if not recs:
    raise ValueError(f"ensure_chat_pd_data: no Planned Diffusion record in {src} ({stats})")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for r in recs:
      f.write(json.dumps(r) + "\n")
  with open(mpath, "w", encoding="utf-8") as f:
    json.dump(meta | {"stats": stats}, f)
  return path
