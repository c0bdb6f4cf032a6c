"""Random annotated sequences of every kind, for the train = decode oracle and engine fuzzing.

Each generator returns token ids in the canonical layout (DESIGN.md §3), written with the lang
serializer (:func:`selforch_jax.lang.serialize`), plus the :func:`build_layout` options its
kind needs. Text tokens are drawn from ``text_ids`` (ids that are neither tags nor digits), so
the same generators serve a tiny random model and the real SmolLM2.

Kinds (:data:`KINDS`):

* ``pasta``: prefix, a round with 2-4 promises (AR threads that fork at the end of their
  promise), chunks, ``<sync/>``, continuation; sometimes two rounds.
* ``diffusion``: the same plan; chunks hold ``<|mask|>``/``[PAD]`` fillers and text,
  bidirectional, each sees the whole PLAN (``async_sees_full_plan``).
* ``tip``: a prompt, then reasoning steps ``<reg_k> ...`` that reuse registers (evictions).
* ``threads_tip``: a PASTA round whose chunks use registers inside (evictions in threads).
* ``packed``: two or three packed documents of the above kinds (separated by EOS).
* ``noise``: a random stream of text and tags (malformed input: stray, unclosed, nested tags).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from selforch_jax.lang import Promise, Round, TagVocab, build_layout, serialize

KINDS = ("pasta", "diffusion", "tip", "threads_tip", "packed", "noise")


def _text(rng: np.random.Generator, text_ids: np.ndarray, lo: int, hi: int) -> list[int]:
  return [int(t) for t in rng.choice(text_ids, size=int(rng.integers(lo, hi + 1)))]


def _steps(rng, tv: TagVocab, text_ids, n_steps: int) -> list[int]:
  """``<reg_k> text...`` steps with registers drawn from the first min(3, K) (reuse likely)."""
  k = max(1, min(3, len(tv.registers)))
  out = []
  for _ in range(n_steps):
    out.append(tv.registers[int(rng.integers(0, k))])
    out += _text(rng, text_ids, 1, 4)
  return out


def _round(rng, tv: TagVocab, text_ids, *, fill: bool = False, regs: bool = False) -> Round:
  n = int(rng.integers(2, 5))
  plan: list = _text(rng, text_ids, 0, 2)
  for _ in range(n):
    plan.append(Promise(tuple(_text(rng, text_ids, 1, 3)), int(rng.integers(1, 3))))
    plan += _text(rng, text_ids, 0, 2)
  chunks = []
  for _ in range(n):
    if regs:
      c = _text(rng, text_ids, 0, 2) + _steps(rng, tv, text_ids, int(rng.integers(2, 4)))
    else:
      c = _text(rng, text_ids, 2, 7)
    if fill:
      c = [int(rng.choice([tv.mask, tv.pad])) if rng.random() < 0.4 else t for t in c]
    chunks.append(tuple(c))
  return Round(plan=tuple(plan), chunks=tuple(chunks), sync=True)


def random_annotated(kind: str, rng: np.random.Generator, tv: TagVocab,
                     text_ids: Sequence[int]) -> tuple[list[int], dict]:
  """One random annotated sequence of ``kind``.

  Args:
    kind: one of :data:`KINDS`.
    rng: numpy Generator.
    tv: the tag vocabulary (needs ``digit_ids``; ``eos_ids`` for ``packed``).
    text_ids: candidate text token ids (no tag, digit, space or EOS id).

  Returns:
    ``(token_ids, layout_kwargs)``: ``build_layout(token_ids, tv, **layout_kwargs)`` is its
    layout.

  Raises:
    ValueError: unknown kind; ``packed`` without an EOS id in ``tv``.
  """
  text_ids = np.asarray(text_ids)
  if kind == "pasta":
    parts = [*_text(rng, text_ids, 2, 5), _round(rng, tv, text_ids), *_text(rng, text_ids, 1, 4)]
    if rng.random() < 0.5:
      parts += [_round(rng, tv, text_ids), *_text(rng, text_ids, 1, 3)]
    return serialize(parts, tv), {}
  if kind == "diffusion":
    parts = [*_text(rng, text_ids, 2, 5), _round(rng, tv, text_ids, fill=True),
             *_text(rng, text_ids, 1, 4)]
    return serialize(parts, tv), dict(async_sees_full_plan=True, chunk_bidirectional=True)
  if kind == "tip":
    parts = _text(rng, text_ids, 2, 5) + _steps(rng, tv, text_ids, int(rng.integers(4, 8)))
    return serialize(parts, tv), {}
  if kind == "threads_tip":
    parts = [*_text(rng, text_ids, 2, 4), _round(rng, tv, text_ids, regs=True),
             *_steps(rng, tv, text_ids, 2)]
    return serialize(parts, tv), {}
  if kind == "packed":
    if not tv.eos_ids:
      raise ValueError("packed sequences need an EOS id in the TagVocab")
    out: list[int] = []
    for _ in range(int(rng.integers(2, 4))):
      sub = str(rng.choice(["pasta", "tip", "threads_tip"]))
      ids, _ = random_annotated(sub, rng, tv, text_ids)
      out += ids + [tv.eos_ids[0]]
    return out, {}
  if kind == "noise":
    tags = [tv.promise_open, tv.promise_close, tv.async_open, tv.async_close, tv.sync, tv.mask,
            tv.pad, *tv.registers[:3], *tv.digit_ids[:3], *tv.eos_ids]
    n = int(rng.integers(20, 60))
    out = [int(rng.choice(tags)) if rng.random() < 0.3 else int(rng.choice(text_ids))
           for _ in range(n)]
    return out, dict(chunk_bidirectional="auto")
  raise ValueError(f"unknown kind {kind!r}; known: {KINDS}")


def random_layout(kind: str, rng: np.random.Generator, tv: TagVocab, text_ids: Sequence[int],
                  max_tokens: int | None = None):
  """``build_layout`` of :func:`random_annotated` (redrawn until it has at most ``max_tokens``
  tokens, up to 50 tries; then the last draw is returned)."""
  for _ in range(50):
    ids, kw = random_annotated(kind, rng, tv, text_ids)
    if max_tokens is None or len(ids) <= max_tokens:
      break
  return build_layout(ids, tv, **kw)
