"""Math answers: find the final answer in a response and compare it with the known one.

Pure string handling (never ``eval``): integers, decimals, thousands separators
(``1,234``), fractions (``3/4``, ``\\frac{3}{4}``, ``\\dfrac``), mixed numbers
(``1 1/2``), percentages, currency and unit words around a number, ``\\boxed{...}``
and GSM8K's ``#### 42``. Numbers compare with a relative tolerance; anything that
is not a number compares as normalised text.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

DEFAULT_REL_TOL = 1e-4
DEFAULT_ABS_TOL = 1e-6

_NUMBER = r"[-−+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-−+]?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([^{}]+?)\s*\}\s*\{\s*([^{}]+?)\s*\}")
_SIMPLE_FRAC = re.compile(rf"^({_NUMBER})\s*/\s*({_NUMBER})$")
_MIXED = re.compile(rf"^({_NUMBER})\s+(\d+)\s*/\s*(\d+)$")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), if any."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        rest = text[start + len("\\boxed") :].strip()
        return rest.split()[0] if rest else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


# "Answer: x" on a line of its own (markdown bold allowed): a committed final answer.
_ANSWER_LINE = re.compile(r"^\s*\**(?:final\s+)?answer\**\s*[:=]", re.I | re.M)


def extract_answer(text: str, *, strict: bool = False) -> str | None:
    """The final answer in a response: ``\\boxed{}``, else after ``####``, else after
    "answer is"/"answer:", else the last number in the text.

    ``strict`` reads only a committed answer (``\\boxed{}``, ``####``, or an
    ``Answer:`` line), as an environment deciding whether the model has answered yet
    must: "I think the answer is four" is prose, not a submission."""
    if not text or not text.strip():
        return None
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return (
            text.rsplit("####", 1)[1].strip().splitlines()[0].strip()
            if text.rsplit("####", 1)[1].strip()
            else None
        )
    if strict and not _ANSWER_LINE.search(text):
        return None
    m = list(re.finditer(r"answer\s*(?:is|:|=)\s*(.+)", text, re.I))
    if m:
        tail = m[-1].group(1).strip()
        num = _NUMBER_RE.search(tail.replace("$", ""))
        return num.group(0) if num else tail.rstrip(".").strip()
    if strict:
        return None
    nums = _NUMBER_RE.findall(_FRAC_RE.sub(lambda f: f"{f.group(1)}/{f.group(2)}", text))
    return nums[-1] if nums else None


def _clean(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = s.replace("−", "-").replace("\\!", "").replace("\\,", "").replace("{,}", ",")
    s = re.sub(r"\\(?:text|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\left|\\right|\\\$|\\%", "", s)
    s = s.rstrip(".").strip()
    return s


def parse_number(s: str) -> Fraction | float | None:
    """A number from an answer string, exactly as a Fraction where possible."""
    s = _clean(s)
    frac = _FRAC_RE.fullmatch(s)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        if num is None or den is None or den == 0:
            return None
        return (
            Fraction(num) / Fraction(den)
            if isinstance(num, Fraction) and isinstance(den, Fraction)
            else float(num) / float(den)
        )
    percent = s.endswith("%")
    s = s.rstrip("%").strip()
    # strip currency and unit words: "$1,234.50", "12 apples", "USD 5"
    s = re.sub(r"^[^\d\-+.]*(?=[-+]?[\d.])", "", s)
    mixed = _MIXED.match(s)
    if mixed:
        whole, n, d = _to_fraction(mixed.group(1)), int(mixed.group(2)), int(mixed.group(3))
        if whole is None or d == 0:
            return None
        sign = -1 if whole < 0 else 1
        return whole + sign * Fraction(n, d)
    simple = _SIMPLE_FRAC.match(s)
    if simple:
        n2, d2 = _to_fraction(simple.group(1)), _to_fraction(simple.group(2))
        if n2 is None or d2 is None or d2 == 0:
            return None
        value: Fraction | float | None = n2 / d2
    else:
        m = _NUMBER_RE.match(s)
        if not m:
            return None
        rest = s[m.end() :].strip()
        if rest and re.match(r"^[\d/.]", rest):
            return None  # "12.3.4" or similar: not one number
        value = _to_fraction(m.group(0))
    if value is None:
        return None
    return value / 100 if percent else value


def _to_fraction(s: str) -> Fraction | None:
    s = s.replace(",", "").replace("−", "-")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def normalise_text(s: str) -> str:
    return " ".join(_clean(s).lower().split())


def answers_match(
    given: str | None, expected: str, *, rel_tol: float = DEFAULT_REL_TOL, abs_tol: float = DEFAULT_ABS_TOL
) -> tuple[bool, str]:
    """Whether ``given`` (already extracted) equals ``expected``; the second value says how
    it was decided."""
    if given is None or not given.strip():
        return False, "no answer found"
    expected_inner = extract_answer(expected) if ("####" in expected or "\\boxed" in expected) else expected
    want = parse_number(expected_inner or expected)
    got = parse_number(given)
    if want is not None:
        if got is None:
            return False, f"{given!r} is not a number (expected {expected_inner})"
        if isinstance(want, Fraction) and isinstance(got, Fraction) and want == got:
            return True, "equal"
        ok = math.isclose(float(got), float(want), rel_tol=rel_tol, abs_tol=abs_tol)
        return ok, ("within tolerance" if ok else f"{float(got):g} != {float(want):g}")
    ok = normalise_text(given) == normalise_text(expected_inner or expected)
    return ok, ("same text" if ok else f"{given!r} != {expected_inner!r}")
