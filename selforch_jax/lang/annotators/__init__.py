"""Annotators: real data -> the orchestration language (one interface, :mod:`.base`).

Importing this package registers every annotator, so ``get_annotator(name)`` knows them all.
"""

from selforch_jax.lang.annotators.base import (
  Annotation, Annotator, annotator_names, get_annotator, register,
)
from selforch_jax.lang.annotators import tip_gsm8k, tip_llm  # noqa: F401  (register TIP annotators)
from selforch_jax.lang.annotators import pasta_rules  # noqa: F401,E402  registers "pasta_rules"
from selforch_jax.lang.annotators import pasta_llm  # noqa: F401,E402  registers "pasta_llm"

__all__ = ["Annotation", "Annotator", "annotator_names", "get_annotator", "register"]
