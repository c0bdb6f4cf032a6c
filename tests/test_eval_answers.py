r"""Tests of selforch_jax.eval: answer extraction / normalization / exact match, bootstrap CIs."""

from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np
import pytest

from selforch_jax.eval import (bootstrap_ci, extract_answer, format_ci, is_correct,
                               normalize_answer, paired_bootstrap_diff, parse_number)

REPO = pathlib.Path(__file__).resolve().parents[1]


def _gsm8k_test_path() -> pathlib.Path:
  for p in (REPO / "data/gsm8k/test.jsonl",):
    if p.exists():
      return p
  raise FileNotFoundError("data/gsm8k/test.jsonl is missing from the checkout")


# --- extraction + normalization: each asserts a value -------------------------------------------


def test_hashes_with_thousands_comma():
  assert extract_answer("So the total is 1000.\n#### 1,000") == "1,000"
  assert normalize_answer(extract_answer("#### 1,000")) == "1000"
  assert is_correct("#### 1,000", "1000")


def test_dollar_decimal():
  assert normalize_answer("$9.50") == "9.5"
  assert normalize_answer("\\$9.50") == "9.5"
  assert normalize_answer("$9.50 per hour") == "9.5"
  assert is_correct("He earns $9.50", "9.5")
  assert is_correct("#### $9.50 per hour", "9.5")


def test_boxed_thousands():
  assert extract_answer("The answer is $\\boxed{8,000}$.") == "8,000"
  assert normalize_answer("\\boxed{8,000}") == "8000"
  assert is_correct("The answer is $\\boxed{8,000}$.", "8000")


def test_boxed_fraction_vs_latex_and_slash():
  pred = "Thus the probability is $\\boxed{\\frac{1}{3}}$."
  assert extract_answer(pred) == "\\frac{1}{3}"
  assert normalize_answer("\\frac{1}{3}") == "\\frac{1}{3}"
  assert normalize_answer("1/3") == "\\frac{1}{3}"
  assert is_correct(pred, "\\frac{1}{3}")
  assert is_correct(pred, "1/3")
  assert not is_correct(pred, "\\frac{2}{3}")


def test_frac_short_forms_and_dfrac():
  assert normalize_answer("\\frac12") == "\\frac{1}{2}"
  assert normalize_answer("\\dfrac{1}{2}") == "\\frac{1}{2}"
  assert normalize_answer("\\tfrac12") == "\\frac{1}{2}"
  assert normalize_answer("\\sqrt2") == "\\sqrt{2}"
  assert is_correct("\\boxed{\\frac12}", "\\frac{1}{2}")
  assert is_correct("\\boxed{\\dfrac{1}{2}}", "0.5")  # equal as numbers


def test_boxed_repeated_twice():
  text = "We get $\\boxed{17}$. Checking again, the answer is \\boxed{17}."
  assert extract_answer(text) == "17"
  assert is_correct(text, "17")


def test_last_boxed_wins():
  assert extract_answer("first \\boxed{3}, corrected: \\boxed{4}") == "4"
  assert extract_answer("\\boxed{5} then a truncated \\boxed{6") == "5"


def test_trailing_text_after_hashes():
  assert extract_answer("#### 42 dollars.") == "42 dollars."
  assert normalize_answer("42 dollars.") == "42"
  assert is_correct("blah\n#### 42 dollars.", "#### 42")


def test_negative_numbers():
  assert normalize_answer("-3") == "-3"
  assert normalize_answer("\u22123") == "-3"  # Unicode minus
  assert is_correct("#### -3", "-3")
  assert is_correct("The change is -3 degrees", "-3")  # last-number fallback
  assert not is_correct("#### -3", "3")
  assert not is_correct("\\boxed{3}", "-3")


def test_nested_braces():
  text = "so $x = \\boxed{\\frac{\\sqrt{2}}{2}}$"
  assert extract_answer(text) == "\\frac{\\sqrt{2}}{2}"
  assert is_correct(text, "\\frac{\\sqrt{2}}{2}")
  assert is_correct(text, "\\dfrac{\\sqrt 2}{2}")
  assert not is_correct(text, "\\frac{\\sqrt{3}}{2}")


def test_no_answer():
  assert extract_answer("I am not sure how to solve this.") is None
  assert extract_answer("") is None
  assert extract_answer(None) is None
  assert not is_correct("I am not sure how to solve this.", "18")
  assert not is_correct("", "18")


def test_fallback_is_configurable():
  assert extract_answer("The answer is 1,234.50 dollars.") == "1,234.50"
  assert extract_answer("The answer is 1,234.50 dollars.", fallback=None) is None
  assert not is_correct("The answer is 12.", "12", fallback=None)
  with pytest.raises(ValueError):
    extract_answer("x", fallback="first_number")


def test_normalization_rules():
  assert normalize_answer("9.50") == normalize_answer("9.5") == "9.5"
  assert normalize_answer("5.0") == "5"
  assert normalize_answer("007") == "7"
  assert normalize_answer(".5") == "0.5"
  assert normalize_answer("50\\%") == "50"
  assert normalize_answer("50%") == "50"
  assert normalize_answer("1{,}000") == "1000"
  assert normalize_answer("1000.") == "1000"
  assert normalize_answer("5\\text{ cm}") == "5"
  assert normalize_answer("\\text{(B)}") == "(B)"
  assert normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
  assert normalize_answer("x = 5") == "5"
  assert normalize_answer("90^\\circ") == "90"
  assert normalize_answer("-1/3") == "-\\frac{1}{3}"
  assert normalize_answer("(1,2)") == "(1,2)"  # a tuple keeps its comma
  assert normalize_answer(None) == ""


def test_numeric_tolerance():
  assert parse_number("\\frac{1}{4}") == 0.25
  assert parse_number("\\sqrt{2}") is None
  assert is_correct("\\boxed{0.3333333333}", "1/3")
  assert not is_correct("\\boxed{0.333}", "1/3")
  assert is_correct("#### 1000000.0000001", "1000000")
  assert not is_correct("#### 1000001", "1000000")  # integers compare exactly
  assert not is_correct("#### 1,450,001", "1,450,000")
  assert is_correct("#### 1450000.0", "1,450,000")


# --- real GSM8K references ------------------------------------------------------------------


def _gsm8k_rows():
  with open(_gsm8k_test_path(), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def _perturb(answer: str) -> str:
  """A different number: the final answer plus one (thousands commas kept)."""
  value = int(answer.replace(",", "")) + 1
  return f"{value:,}" if "," in answer else str(value)


def test_gsm8k_references_against_own_solution_and_perturbed():
  rows = _gsm8k_rows()
  # 40 rows spread over the file, plus every row whose answer has a comma or a minus sign.
  picked = rows[::len(rows) // 40][:40]
  picked += [r for r in rows if re.search(r"[,-]", r["answer"].rsplit("####", 1)[1])]
  assert len(picked) >= 30
  for row in picked:
    solution = row["answer"]
    head, final = solution.rsplit("####", 1)
    final = final.strip()
    assert is_correct(solution, solution), final          # reference = full GSM8K solution
    assert is_correct(solution, final), final             # reference = bare answer
    perturbed = head + "#### " + _perturb(final)
    assert not is_correct(perturbed, solution), (final, perturbed[-20:])
    assert not is_correct(head + "#### " + str(-int(final.replace(",", "")) - 7), solution)


def test_gsm8k_all_references_self_consistent():
  rows = _gsm8k_rows()
  assert len(rows) == 1319
  for row in rows:
    final = row["answer"].rsplit("####", 1)[1].strip()
    assert normalize_answer(final) == final.replace(",", "")
    assert is_correct(row["answer"], row["answer"])


# --- bootstrap ------------------------------------------------------------------------------


def test_bootstrap_constant_vector_is_degenerate():
  d = bootstrap_ci(np.full(50, 0.7))
  assert d["n"] == 50
  assert d["lo"] == d["hi"] == d["mean"] == pytest.approx(0.7)


def test_bootstrap_binary_width_matches_normal_approximation():
  x = np.array([0, 1] * 200, dtype=np.float64)  # p = 0.5, n = 400
  d = bootstrap_ci(x, n_boot=10000, seed=0)
  width = d["hi"] - d["lo"]
  normal = 2 * 1.96 * math.sqrt(0.25 / 400)  # 0.098
  assert d["mean"] == 0.5 and d["n"] == 400
  assert abs(width - normal) / normal < 0.2, (width, normal)
  assert d["lo"] < 0.5 < d["hi"]


def test_bootstrap_same_seed_same_result():
  rng = np.random.default_rng(1)
  x = rng.integers(0, 2, size=300)
  assert bootstrap_ci(x, seed=3) == bootstrap_ci(x, seed=3)
  y = rng.random(300)  # continuous data: another seed moves the quantiles
  assert bootstrap_ci(y, seed=3) == bootstrap_ci(y, seed=3)
  assert bootstrap_ci(y, seed=3) != bootstrap_ci(y, seed=4)


def test_bootstrap_other_stat_and_errors():
  d = bootstrap_ci([1.0, 2.0, 3.0, 100.0], stat=np.median, n_boot=500)
  assert d["mean"] == 2.5 and d["lo"] <= d["hi"]
  d2 = bootstrap_ci([1.0, 2.0, 3.0, 100.0], stat=lambda v: float(np.max(v)), n_boot=200)
  assert d2["mean"] == 100.0 and d2["hi"] == 100.0
  with pytest.raises(ValueError):
    bootstrap_ci([])
  with pytest.raises(ValueError):
    paired_bootstrap_diff([1, 2], [1, 2, 3])


def test_paired_diff_identical_is_zero():
  x = np.random.default_rng(0).random(100)
  d = paired_bootstrap_diff(x, x)
  assert (d["mean"], d["lo"], d["hi"], d["n"]) == (0.0, 0.0, 0.0, 100)


def test_paired_diff_detects_shift():
  rng = np.random.default_rng(0)
  b = rng.integers(0, 2, size=500).astype(float)
  a = np.where(rng.random(500) < 0.2, 1.0, b)  # a fixes ~20% of b's errors
  d = paired_bootstrap_diff(a, b)
  assert d["lo"] > 0 and d["mean"] == pytest.approx(np.mean(a - b))


def test_format_ci():
  assert format_ci(dict(mean=0.4123, lo=0.33, hi=0.4971, n=100)) == "0.412 [0.330, 0.497] (n=100)"
  assert format_ci(dict(mean=1, lo=0, hi=2, n=3), digits=1) == "1.0 [0.0, 2.0] (n=3)"


# --- TIP "must show" cases, exact fractions, MATH-style units, MATH-500 / AIME references -------


def test_tip_must_show_answer_cases():
  from fractions import Fraction

  from selforch_jax.eval.answers import answer_fraction
  cases = [("Total: 1000.\n#### 1,000", Fraction(1000)), ("He earns $9.50", Fraction(19, 2)),
           ("So $\\boxed{8,000}$.", Fraction(8000)), ("$\\boxed{\\frac{1}{3}}$", Fraction(1, 3)),
           ("\\boxed{12} ... so again \\boxed{12}.", Fraction(12)),
           ("#### 72\nThe answer is 72 because 3 more apples", Fraction(72)),
           ("\\boxed{\\frac{1}{3}} is the answer, since 2 > 1", Fraction(1, 3))]
  for text, value in cases:
    assert answer_fraction(normalize_answer(extract_answer(text))) == value, text


def test_exact_fraction_comparison():
  from fractions import Fraction

  from selforch_jax.eval.answers import answer_fraction
  assert answer_fraction("\\frac{2}{6}") == Fraction(1, 3)
  assert answer_fraction("-\\frac{3}{4}") == Fraction(-3, 4)
  assert answer_fraction("\\frac{-1}{3}") == Fraction(-1, 3)
  assert answer_fraction("9.5") == Fraction(19, 2)
  assert answer_fraction("\\frac{1}{0}") is None and answer_fraction("\\sqrt{2}") is None
  assert is_correct("\\boxed{\\frac{2}{6}}", "1/3")
  assert is_correct("\\boxed{2.5}", "\\frac{5}{2}")
  assert is_correct("\\boxed{\\frac{-1}{3}}", "-1/3")
  assert not is_correct("\\boxed{\\frac{1}{3}}", "\\frac{1}{4}")
  # large numerators: exact, no float rounding either way
  assert is_correct("\\boxed{\\frac{100000000000000001}{3}}", "\\frac{200000000000000002}{6}")


def test_math_units_after_number_or_fraction():
  assert normalize_answer("\\frac{1}{3}\\text{ of the cake}") == "\\frac{1}{3}"
  assert normalize_answer("4\\text{ units}^2") == "4"
  assert normalize_answer("5 \\mbox{ cm}^2") == "5"
  assert normalize_answer("\\text{(C)}") == "(C)"          # a lone text answer is kept
  assert normalize_answer("x\\text{ cm}") == "xcm"  # not dropped after a non-number
  assert is_correct("\\boxed{033}", "33")                    # AIME zero padding


def test_math500_and_aime_references_self_consistent():
  rows = [json.loads(l) for l in open(REPO / "data/math500/test.jsonl", encoding="utf-8")]
  assert len(rows) == 500
  for r in rows:  # the boxed answer of every worked solution matches the answer field
    assert is_correct(r["solution"], r["answer"]), r["unique_id"]
  fr = rows[::25]
  assert sum(is_correct(a["solution"], b["answer"]) for a, b in zip(fr, fr[1:])) <= 1
  for name in ("aime_2024", "aime_2025"):
    aime = [json.loads(l) for l in open(REPO / f"data/aime/{name}.jsonl", encoding="utf-8")]
    assert len(aime) == 30
    for r in aime:
      assert is_correct(f"so the answer is $\\boxed{{{r['answer']}}}$.", str(r["answer"]))
      assert not is_correct(f"\\boxed{{{r['answer'] + 1}}}", str(r["answer"]))
