"""Annotators: real data -> the orchestration language (one interface, :mod:`.base`).

Importing this package registers every annotator, so ``get_annotator(name)`` knows them all.
"""

from selforch_jax.lang.annotators.base import (
  Annotation, Annotator, annotator_names, get_annotator, register,
)

__all__ = ["Annotation", "Annotator", "annotator_names", "get_annotator", "register"]
