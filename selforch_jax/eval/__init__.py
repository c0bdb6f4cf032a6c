"""Evaluation: answer extraction and exact match (GSM8K, MATH, AIME), bootstrap CIs."""

from selforch_jax.eval.answers import (extract_answer, extract_reference_answer, is_correct,
                                       last_boxed, normalize_answer, parse_number)
from selforch_jax.eval.stats import bootstrap_ci, format_ci, paired_bootstrap_diff

__all__ = [
    "extract_answer", "extract_reference_answer", "is_correct", "last_boxed",
    "normalize_answer", "parse_number", "bootstrap_ci", "paired_bootstrap_diff", "format_ci",
]
