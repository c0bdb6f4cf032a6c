r"""Answer extraction and exact-match checking for GSM8K / MATH / AIME style outputs.

Three functions:

* :func:`extract_answer` finds the final answer in a model output: the last complete
  ``\boxed{...}`` (``\fbox{...}`` too), else the text after the last ``####``, else (optional
  fallback) the last number in the text.
* :func:`normalize_answer` puts an answer string into a canonical form (the list of rules is in
  its docstring), so that e.g. ``"$1,000.00"``, ``"1000"`` and ``"\boxed{1,000}"`` all become
  ``"1000"`` and ``"1/3"``, ``"\dfrac13"`` and ``"\frac{1}{3}"`` all become ``"\frac{1}{3}"``.
* :func:`is_correct` compares a model output with a reference (a GSM8K solution, whose answer
  follows ``####``, a MATH-style solution with a ``\boxed{}``, or a bare answer): equal
  normalized strings, or both parse as numbers and agree within a relative tolerance of 1e-6.

Symbolic equivalence is ``math-verify``'s (Hugging Face's checker, sympy underneath): when the
string/number rules above do not decide and one side is not a plain number, :func:`is_correct`
asks ``math_verify.verify`` (so ``\frac{\sqrt{2}}{2}`` = ``\frac{1}{\sqrt{2}}``, ``(x+1)^2`` =
``x^2+2x+1``). The extraction and normalisation stay ours: math-verify alone reads ``"18
dollars"`` as the product ``18*d*o*l*l*a*r*s`` and so rejects it against ``18``
(``tests/test_libraries.py`` pins this), and it knows nothing of GSM8K's ``####``.
"""

from __future__ import annotations

import math
import re
import threading
from decimal import Decimal, InvalidOperation
from fractions import Fraction

__all__ = ["extract_answer", "normalize_answer", "is_correct", "parse_number", "answer_fraction",
           "last_boxed", "extract_reference_answer", "symbolic_equal", "REL_TOL"]

REL_TOL = 1e-6
"""Relative tolerance of the numeric comparison in :func:`is_correct`."""

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A number as written in prose: optional sign, digits with optional thousands commas, optional
# decimals; or a bare ".5".
_NUMBER = r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(rf"^{_NUMBER}$")
# In running text (the last-number fallback): not part of a word, optional "/denominator".
_TEXT_NUMBER_RE = re.compile(rf"(?<![\w.]){_NUMBER}(?:/\d+(?![\d,]))?")
_FRAC_RE = re.compile(r"^([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}$")
_SLASH_FRAC_RE = re.compile(r"^([+-]?)(\d+)/(\d+)$")
_TEXT_WRAPPERS = ("\\text", "\\textbf", "\\textit", "\\textrm", "\\mbox", "\\mathrm",
                  "\\mathbf", "\\mathit")
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|mathit)\s*\{")
# A trailing unit in a LaTeX text command, with an optional square/cube exponent.
_UNIT_SUFFIX_RE = re.compile(
  r"(.+?)\s*\\(?:text|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .]*\}(?:\s*\^\s*\{?\s*[23]\s*\}?)?", re.S)
_FRAC_ARGS_RE = re.compile(r"[+-]?\\frac\s*(?:\{[^{}]+\}|\d)\s*(?:\{[^{}]+\}|\d)")
# Trailing text that is units / words ("per hour", "dollars.", "km/h"): letters, spaces and
# light punctuation only, no digits or LaTeX.
_UNIT_TAIL_RE = re.compile(r"^\s+[A-Za-z][A-Za-z\s.,;:!'/\-]*$|^[\s.,;:!]*$")


# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------


def _balanced(text: str, open_pos: int) -> int | None:
  """Index just past the ``}`` that closes the ``{`` at ``open_pos``, or None if unbalanced."""
  depth = 0
  i = open_pos
  while i < len(text):
    ch = text[i]
    if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
      i += 2  # escaped brace \{ or \}
      continue
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return i + 1
    i += 1
  return None


def _boxed_spans(text: str) -> list[str]:
  r"""Contents of every complete ``\boxed{...}`` / ``\fbox{...}`` / ``\boxed X``, in order."""
  found: list[tuple[int, str]] = []
  for cmd in _BOX_COMMANDS:
    for m in re.finditer(re.escape(cmd) + r"(?![A-Za-z])", text):
      j = m.end()
      while j < len(text) and text[j] in " \t":
        j += 1
      if j < len(text) and text[j] == "{":
        end = _balanced(text, j)
        if end is not None:  # an unclosed box (truncated output) is skipped
          found.append((m.start(), text[j + 1:end - 1]))
      elif j > m.end():  # "\boxed 5": one space-delimited token
        tok = re.match(r"[^\s$]+", text[j:])
        if tok:
          found.append((m.start(), tok.group(0)))
  found.sort(key=lambda t: t[0])
  return [s for _, s in found]


def last_boxed(text: str) -> str | None:
  r"""Content of the last complete, non-empty ``\boxed{...}`` (or ``\fbox{...}``) in ``text``.

  Braces are matched with nesting (``\boxed{\frac{\sqrt{2}}{2}}`` gives ``\frac{\sqrt{2}}{2}``),
  escaped braces ``\{ \}`` are not counted, and an unclosed box is ignored. Returns None when
  there is none.
  """
  spans = [s.strip() for s in _boxed_spans(text)]
  spans = [s for s in spans if s]
  return spans[-1] if spans else None


def _after_hashes(text: str) -> str | None:
  """The first non-empty line after the last ``####``, or None."""
  if "####" not in text:
    return None
  tail = text.rsplit("####", 1)[1]
  for line in tail.splitlines():
    if line.strip():
      return line.strip()
  return None


def _last_number(text: str) -> str | None:
  text = text.replace("\u2212", "-").replace("{,}", ",")
  text = re.sub(r"(?<=\d)\\,(?=\d{3})", ",", text)  # LaTeX thin-space thousands: 1\,000
  matches = _TEXT_NUMBER_RE.findall(text)
  return matches[-1] if matches else None


def extract_answer(text: str | None, fallback: str | None = "last_number") -> str | None:
  r"""The final answer written in a model output, as raw (un-normalized) text.

  In order of preference:

  1. the content of the last complete ``\boxed{...}`` (see :func:`last_boxed`); a solution that
     boxes the same answer twice gives that answer once;
  2. else the first non-empty line after the last ``####`` (GSM8K's format), e.g.
     ``"#### 42 dollars."`` gives ``"42 dollars."`` (:func:`normalize_answer` makes it ``"42"``);
  3. else, if ``fallback == "last_number"`` (the default), the last number in the text
     (sign, thousands commas, decimals and a ``/denominator`` included, e.g. ``"-1,200.5"``,
     ``"3/4"``); with ``fallback=None`` nothing.

  Returns None when no answer is found (or ``text`` is None/empty).
  """
  if fallback not in (None, "last_number"):
    raise ValueError(f"fallback={fallback!r} must be 'last_number' or None")
  if not text:
    return None
  boxed = last_boxed(text)
  if boxed is not None:
    return boxed
  hashed = _after_hashes(text)
  if hashed is not None:
    return hashed
  if fallback == "last_number":
    return _last_number(text)
  return None


def extract_reference_answer(reference: str) -> str:
  r"""The answer part of a reference: after the last ``####`` (GSM8K solution), else the last
  ``\boxed{}`` (MATH solution), else the whole string (a bare answer), stripped."""
  hashed = _after_hashes(reference)
  if hashed is not None:
    return hashed
  boxed = last_boxed(reference)
  if boxed is not None:
    return boxed
  return reference.strip()


# ---------------------------------------------------------------------------------------------
# Normalization
# ---------------------------------------------------------------------------------------------


def _canonical_number(s: str) -> str | None:
  """``"1,000.50"`` -> ``"1000.5"``; None if ``s`` is not a plain decimal number."""
  if not _NUMBER_RE.match(s):
    return None
  try:
    d = Decimal(s.replace(",", ""))
  except InvalidOperation:
    return None
  if d == 0:
    return "0"
  out = format(d.normalize(), "f")
  return out[1:] if out.startswith("+") else out


def _unwrap_commands(s: str, commands_re: re.Pattern) -> str:
  r"""Replace ``\cmd{X}`` by ``X`` for every command matched by ``commands_re`` (nesting ok)."""
  while True:
    m = commands_re.search(s)
    if not m:
      return s
    open_pos = m.end() - 1
    end = _balanced(s, open_pos)
    if end is None:  # unbalanced: drop just the command name
      return s[:m.start()] + s[open_pos:]
    s = s[:m.start()] + s[open_pos + 1:end - 1] + s[end:]


def _frac_arg(s: str, i: int) -> tuple[str, int] | None:
  """One argument of ``\\frac``/``\\sqrt`` at ``s[i:]``: ``{...}`` or a single token."""
  while i < len(s) and s[i] == " ":
    i += 1
  if i >= len(s):
    return None
  if s[i] == "{":
    end = _balanced(s, i)
    if end is None:
      return None
    return s[i:end], end
  if s[i] == "\\":
    m = re.match(r"\\[A-Za-z]+", s[i:])
    if m:
      return "{" + m.group(0) + "}", i + m.end()
    return None
  return "{" + s[i] + "}", i + 1


def _brace_args(s: str, command: str, nargs: int) -> str:
  r"""Give ``\frac12``-style arguments braces: ``\frac12`` -> ``\frac{1}{2}``."""
  out, i = [], 0
  pat = re.compile(re.escape(command) + r"(?![A-Za-z])")
  while True:
    m = pat.search(s, i)
    if not m:
      out.append(s[i:])
      return "".join(out)
    out.append(s[i:m.end()])
    j = m.end()
    args = []
    for _ in range(nargs):
      got = _frac_arg(s, j)
      if got is None:
        break
      args.append(got[0])
      j = got[1]
    if len(args) == nargs:
      out.append("".join(args))
      i = j
    else:
      i = m.end()


def _strip_spaces(s: str) -> str:
  r"""Remove whitespace, except one space between a ``\command`` and a following letter."""
  def repl(m: re.Match) -> str:
    before, after = m.string[:m.start()], m.string[m.end():]
    if re.search(r"\\[A-Za-z]+$", before) and after[:1].isalpha():
      return " "
    return ""
  return re.sub(r"\s+", repl, s)


def normalize_answer(s: str | None) -> str:
  r"""Canonical form of an answer string, for exact-match comparison.

  Applied in this order:

  1. surrounding whitespace; a whole-string ``\boxed{X}``/``\fbox{X}`` wrapper becomes ``X``;
     markdown bold ``**X**`` becomes ``X``; the Unicode minus ``−`` becomes ``-``;
  2. removed: dollar signs (``\$`` and ``$``), ``\left`` and ``\right``, ``\displaystyle``, LaTeX
     spacing (``\!``, ``\,``, ``\:``, ``\;``, ``~``), percent signs (``\%``, ``%``), degree marks
     (``^\circ``, ``^{\circ}``, ``°``); ``{,}`` becomes ``,``; ``\dfrac`` and ``\tfrac`` become
     ``\frac``; a trailing unit in ``\text{}``/``\mbox{}``/``\mathrm{}`` (optionally squared or
     cubed) after a number or a fraction is dropped (``\frac{1}{3}\text{ of the cake}``,
     ``4\text{ units}^2``);
  3. a leading single-letter assignment ``x = `` is dropped (``"x = 5"`` -> ``"5"``);
  4. a number followed by nothing, by trailing punctuation, by words after a space
     (``"9.50 per hour"``, ``"42 dollars."``) or by ``\text{...}`` units (``"5\text{ cm}"``)
     becomes that number in canonical decimal form: thousands commas dropped (``"1,000"`` ->
     ``"1000"``), leading ``+`` and leading zeros dropped, trailing zeros of decimals and a
     trailing ``.0`` dropped (``"9.50"`` -> ``"9.5"``, ``"5.0"`` -> ``"5"``, ``"007"`` -> ``"7"``,
     ``".5"`` -> ``"0.5"``, ``"-0"`` -> ``"0"``);
  5. otherwise: ``\text{X}`` (also ``\textbf \textit \textrm \mbox \mathrm \mathbf \mathit``)
     becomes ``X``; trailing periods are dropped; if what is left is a number, it gets the
     canonical form of step 4; an integer fraction ``a/b`` becomes ``\frac{a}{b}`` (sign kept in
     front: ``"-1/3"`` -> ``"-\frac{1}{3}"``); single-token arguments get braces (``\frac12`` ->
     ``\frac{1}{2}``, ``\sqrt2`` -> ``\sqrt{2}``); all whitespace is removed (except a single
     space between a ``\command`` and a following letter).

  Not normalized: symbolic equivalence (``\frac{2}{4}`` stays ``\frac{2}{4}``; :func:`is_correct`
  still compares such simple fractions by value), order of set/tuple elements, case of letters.
  ``None`` gives ``""``.
  """
  if s is None:
    return ""
  s = s.strip().replace("\u2212", "-")
  # 1. whole-string wrappers
  for _ in range(3):
    boxed = _boxed_spans(s)
    if len(boxed) == 1 and re.fullmatch(r"\\(?:boxed|fbox)\s*(?:\{.*\}|\S+)", s, re.S):
      s = boxed[0].strip()
    m = re.fullmatch(r"\*\*(.+)\*\*", s, re.S)
    if m:
      s = m.group(1).strip()
  # 2. removals and renames
  s = s.replace("\\$", "").replace("$", "")
  s = re.sub(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])|\\displaystyle", "", s)
  s = re.sub(r"\\[!,:;]|~", " ", s)
  s = s.replace("\\%", "").replace("%", "")
  s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", s)
  s = s.replace("{,}", ",")
  s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
  s = s.strip()
  # 2b. trailing units after a number or fraction: "\frac{1}{3}\text{ of the cake}", "4\text{ units}^2"
  m = _UNIT_SUFFIX_RE.fullmatch(s)
  if m and (_NUMBER_RE.match(m.group(1).strip()) or _FRAC_ARGS_RE.fullmatch(m.group(1).strip())):
    s = m.group(1).strip()
  # 3. leading "x = "
  s = re.sub(r"^[A-Za-z]\s*=\s*(?=\S)", "", s)
  # 4. number (+ units / trailing words)
  m = re.match(rf"^({_NUMBER})(.*)$", s, re.S)
  if m:
    num, rest = m.group(1), m.group(2)
    rest_units = re.sub(r"^\s*\\(?:text|mbox|mathrm)\s*\{[^{}]*\}", " x", rest)
    if _UNIT_TAIL_RE.match(rest) or (rest_units != rest and _UNIT_TAIL_RE.match(rest_units)):
      canon = _canonical_number(num)
      if canon is not None:
        return canon
  # 5. everything else
  s = _unwrap_commands(s, _TEXT_WRAPPER_RE)
  s = s.strip().rstrip(".").strip()
  canon = _canonical_number(s)
  if canon is not None:
    return canon
  m = _SLASH_FRAC_RE.match(s.replace(" ", ""))
  if m:
    sign = "-" if m.group(1) == "-" else ""
    return f"{sign}\\frac{{{int(m.group(2))}}}{{{int(m.group(3))}}}"
  s = _brace_args(s, "\\frac", 2)
  s = _brace_args(s, "\\sqrt", 1)
  s = _strip_spaces(s)
  if s.startswith("+"):
    s = s[1:]
  return s


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


def parse_number(s: str) -> float | None:
  r"""The value of a *normalized* answer if it is a number, else None.

  Numbers are plain decimals (``"-12.5"``) and simple fractions of decimals
  (``"\frac{1}{3}"``, ``"-\frac{3}{4}"``); anything else (``\sqrt``, ``\pi``, tuples) is not a
  number. Non-finite values and zero denominators give None.
  """
  if _NUMBER_RE.match(s):
    v = float(s.replace(",", ""))
    return v if math.isfinite(v) else None
  m = _FRAC_RE.match(s)
  if m and _NUMBER_RE.match(m.group(2)) and _NUMBER_RE.match(m.group(3)):
    num, den = float(m.group(2).replace(",", "")), float(m.group(3).replace(",", ""))
    if den == 0:
      return None
    v = num / den * (-1.0 if m.group(1) == "-" else 1.0)
    return v if math.isfinite(v) else None
  return None


def answer_fraction(s: str) -> Fraction | None:
  r"""The exact rational value of a *normalized* answer, or None.

  Plain decimals (``"9.5"`` -> 19/2) and fractions of decimals (``"\frac{1}{3}"``,
  ``"-\frac{3}{4}"``, ``"\frac{-1}{3}"``) have one; anything else (``\sqrt``, tuples) or a zero
  denominator gives None. Exact, so ``\frac{1}{3}`` equals ``\frac{2}{6}`` and not ``0.333333``.
  """
  def dec(x: str) -> Fraction | None:
    x = x.strip()
    return Fraction(Decimal(x.replace(",", ""))) if _NUMBER_RE.match(x) else None
  if _NUMBER_RE.match(s):
    return dec(s)
  m = _FRAC_RE.match(s)
  if m:
    num, den = dec(m.group(2)), dec(m.group(3))
    if num is None or den is None or den == 0:
      return None
    return num / den * (-1 if m.group(1) == "-" else 1)
  return None


def is_correct(prediction_text: str | None, reference_answer: str,
               fallback: str | None = "last_number", rel_tol: float = REL_TOL) -> bool:
  r"""Whether a model output's final answer matches the reference.

  ``prediction_text`` is a full model output; its answer is found by
  :func:`extract_answer` (with ``fallback``). ``reference_answer`` is a GSM8K solution (the
  answer after the last ``####`` is used), a MATH solution (its last ``\boxed{}``) or a bare
  answer (see :func:`extract_reference_answer`). Both are put through
  :func:`normalize_answer`; they match when the normalized strings are equal, when both have
  the same exact rational value (:func:`answer_fraction`), or when both
  parse as numbers (:func:`parse_number`) and ``|a - b| <= rel_tol * max(|a|, |b|)``, except
  that two integers (both written without a decimal point or fraction) must be equal exactly, so
  that ``1450001`` does not match ``1450000``. When one side is not a number, the last word is
  :func:`symbolic_equal` (math-verify).
  No answer, or an empty normalized answer on either side, is never correct.
  """
  pred = extract_answer(prediction_text, fallback=fallback)
  if pred is None:
    return False
  p, r = normalize_answer(pred), normalize_answer(extract_reference_answer(reference_answer))
  if not p or not r:
    return False
  if p == r:
    return True
  fa, fb = answer_fraction(p), answer_fraction(r)
  if fa is not None and fb is not None and fa == fb:
    return True  # equal as exact fractions (\frac{2}{6} = 1/3, 2.5 = \frac{5}{2})
  a, b = parse_number(p), parse_number(r)
  if a is None or b is None:
    return symbolic_equal(p, r)
  if _is_integer_literal(p) and _is_integer_literal(r):
    return False  # distinct integers: an off-by-one is never rounding (1450001 != 1450000)
  return math.isclose(a, b, rel_tol=rel_tol, abs_tol=0.0)


def _is_integer_literal(s: str) -> bool:
  return re.fullmatch(r"-?\d+", s) is not None


def symbolic_equal(prediction: str, reference: str, timeout_s: int = 5) -> bool:
  r"""Whether two answers are mathematically equal, by ``math_verify`` (sympy).

  Both are parsed as LaTeX math (``$...$``); ``math_verify.verify(gold, target)`` decides
  (numbers rounded to 6 decimals, sets/intervals/matrices/equations compared structurally).
  Its timeouts use ``signal.alarm``, which only works in the main thread: elsewhere it runs
  without a timeout.

  Args:
    prediction: the model's (normalized) answer, e.g. ``"rac{1}{\sqrt{2}}"``.
    reference: the reference answer, e.g. ``"rac{\sqrt{2}}{2}"``.
    timeout_s: seconds for each parse and for the comparison (main thread only).

  Returns:
    bool; False when either side does not parse (never raises).
  """
  from math_verify import parse, verify  # noqa: PLC0415 - sympy import is slow

  timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
  try:
    gold = parse(f"${reference}$", parsing_timeout=timeout)
    pred = parse(f"${prediction}$", parsing_timeout=timeout)
    if not gold or not pred:
      return False
    return bool(verify(gold, pred, timeout_seconds=timeout))
  except Exception:  # noqa: BLE001 - a checker failure is a wrong answer, never a crash
    return False
