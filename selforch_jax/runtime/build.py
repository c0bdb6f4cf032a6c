"""Build the engine for a decoding job: the one place that sizes a KV pool.

Every caller that decodes (the decode CLI, :func:`selforch_jax.generate`, the PASTA / TIP evals,
rollouts, the local judge) sizes its pool with :func:`pool_pages` and builds it with
:func:`make_engine`, which also refuses a job that cannot fit the model's context
(:func:`~selforch_jax.runtime.generation.check_context`), so every runtime gets that check.

Pool size rule: each request holds its prompt plus ``max_new_tokens`` (plus ``extra_tokens``,
e.g. PASTA's runtime-fed tags) in pages of its own page table, and every further page-table owner
a request may open (a PASTA thread, a TIP register step, an APAR child) ends in a partly filled
page of its own: ``threads`` spare pages per request. So a request needs
``ceil((prompt + max_new + extra) / page_size) + threads`` pages, and a batch the sum.
"""

from __future__ import annotations

from typing import Iterable

from selforch_jax.runtime.engine import Engine
from selforch_jax.runtime.generation import check_context

__all__ = ["DEFAULT_PAGE_SIZE", "pool_pages", "make_engine"]

DEFAULT_PAGE_SIZE = 16  # tokens per KV page


def _lengths(prompt_lens: int | Iterable[int]) -> list[int]:
  if isinstance(prompt_lens, int):
    return [int(prompt_lens)]
  return [int(n) for n in prompt_lens]


def pool_pages(prompt_lens: int | Iterable[int], max_new_tokens: int,
               page_size: int = DEFAULT_PAGE_SIZE, *, threads: int = 0,
               extra_tokens: int = 0) -> int:
  """Pages for decoding every prompt at once (see the module docstring for the rule).

  Args:
    prompt_lens: the token count of each prompt (or one int: a single prompt).
    max_new_tokens: tokens each request may generate.
    page_size: tokens per page.
    threads: page-table owners each request may open beyond its first (one spare page each).
    extra_tokens: further tokens per request (e.g. PASTA's runtime-fed tags).

  Returns:
    int >= 1.

  Raises:
    ValueError: no prompt, a negative length / count, or ``page_size < 1``.
  """
  lens = _lengths(prompt_lens)
  if not lens:
    raise ValueError("pool_pages needs at least one prompt length")
  if page_size < 1 or min(lens) < 0 or max_new_tokens < 0 or threads < 0 or extra_tokens < 0:
    raise ValueError(f"pool_pages: page_size={page_size} must be >= 1 and lengths, "
                     f"max_new_tokens={max_new_tokens}, threads={threads}, "
                     f"extra_tokens={extra_tokens} >= 0")
  per = [-(-(n + int(max_new_tokens) + int(extra_tokens)) // page_size) + int(threads)
         for n in lens]
  return max(1, sum(per))


def make_engine(model, prompt_lens: int | Iterable[int], max_new_tokens: int, *,
                page_size: int = DEFAULT_PAGE_SIZE, threads: int = 0, extra_tokens: int = 0,
                attention: str = "auto", check: bool = True, **engine_kw) -> Engine:
  """An :class:`~selforch_jax.runtime.engine.Engine` on ``model`` whose pool holds the job.

  Args:
    model: the NNX :class:`~selforch_jax.models.transformer.Transformer`.
    prompt_lens, max_new_tokens, page_size, threads, extra_tokens: as :func:`pool_pages`.
    attention: ``"auto"``, ``"reference"`` or ``"paged"`` (:class:`Engine`).
    **engine_kw: further :class:`Engine` options (e.g. ``interpret``).
    check: refuse prompts that with ``max_new_tokens`` exceed the model's
      ``max_position_embeddings`` (off for pools that hold no prompt, e.g. a judge's).

  Returns:
    the engine (``num_pages = pool_pages(...)``).

  Raises:
    ContextLengthError: a prompt plus ``max_new_tokens`` exceeds the model's context (the
      message names both numbers and the context).
    ValueError: as :func:`pool_pages` and :class:`Engine`.
  """
  lens = _lengths(prompt_lens)
  if check:
    check_context(lens, max_new_tokens, model.cfg.max_position_embeddings)
  pages = pool_pages(lens, max_new_tokens, page_size, threads=threads, extra_tokens=extra_tokens)
  return Engine(model, num_pages=pages, page_size=page_size, attention=attention, **engine_kw)
