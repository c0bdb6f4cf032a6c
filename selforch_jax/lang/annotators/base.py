"""The annotator interface: plain responses -> responses written in the orchestration language.

An annotator reads one (prompt, response) pair of real data and returns the response with tags
(DESIGN.md §3) written as their tag strings (``<promise>``, ``<async>``, ``<reg_3>``, ...), which
a tokenizer with :func:`~selforch_jax.lang.tags.add_tags` applied encodes as single tokens. It
never changes the response's words: stripping the tags (and, for PASTA, the promise topics and
lengths) gives the response back.

Each system registers its annotators by name (:func:`register`), so that configs select one with
a string (``config.data.annotator = "pasta_rules"``) and :func:`get_annotator` builds it.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable

from selforch_jax.registry import Registry

__all__ = ["Annotation", "Annotator", "register", "get_annotator", "annotator_factory",
           "annotator_names"]


@dataclasses.dataclass(frozen=True)
class Annotation:
  """One annotated response.

  Attributes:
    text: the response in the orchestration language, or None when the annotator found nothing to
      annotate (the caller keeps the plain response: an unannotated example is still valid data).
    info: per-example figures for the annotation report (e.g. ``chunks``, ``length_error``).
  """

  text: str | None
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Annotator(abc.ABC):
  """Turns a plain response into an annotated one (see the module docstring)."""

  name: str = "annotator"

  @abc.abstractmethod
  def annotate(self, prompt: str, response: str) -> Annotation:
    """Annotate ``response`` (the assistant's text) to ``prompt`` (the user's text).

    Never raises on odd text: returns ``Annotation(None, ...)`` when nothing can be annotated.
    """


_REGISTRY: Registry[Callable[..., Annotator]] = Registry("annotator", ValueError)


def register(name: str) -> Callable[[Callable[..., Annotator]], Callable[..., Annotator]]:
  """Class decorator: make an annotator buildable by ``get_annotator(name, **kwargs)``.

  Raises:
    ValueError: ``name`` is already registered.
  """
  return _REGISTRY.register(name)


def annotator_names() -> list[str]:
  """The registered annotator names, sorted."""
  return _REGISTRY.names()


def annotator_factory(name: str) -> Callable[..., Annotator]:
  """The factory (class) registered as ``name``.

  Raises:
    ValueError: unknown ``name`` (the message lists the known ones).
  """
  return _REGISTRY.get(name)


def get_annotator(name: str, **kwargs: Any) -> Annotator:
  """Build the annotator registered as ``name`` with ``kwargs``.

  Raises:
    ValueError: unknown ``name`` (the message lists the known ones).
  """
  return _REGISTRY.get(name)(**kwargs)
