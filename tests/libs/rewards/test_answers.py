from __future__ import annotations

import pytest

from temper.rewards.answers import answers_match, extract_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the total is 12.\n#### 42", "42"),
        ("The answer is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
        ("\\boxed{1{,}234}", "1{,}234"),
        ("Therefore the answer is $1,234.50.", "1,234.50"),
        ("I computed 3, then 7, then 18", "18"),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("given", "expected", "ok"),
    [
        ("42", "42", True),
        ("42.0", "42", True),
        ("1,234", "1234", True),
        ("$1,234.00", "1234", True),
        ("3/4", "0.75", True),
        ("\\frac{3}{4}", "3/4", True),
        ("\\dfrac{6}{8}", "0.75", True),
        ("1 1/2", "1.5", True),
        ("50%", "0.5", True),
        ("0.3333333", "1/3", True),  # within the relative tolerance
        ("0.33", "1/3", False),
        ("41", "42", False),
        ("-7", "−7", True),
        ("12 apples", "12", True),
        ("x + 1", "x+1", False),
        ("Paris", "paris", True),
        ("forty-two", "42", False),
        (None, "42", False),
        ("42", "worked\n#### 42", True),
    ],
)
def test_answers_match(given, expected, ok):
    assert answers_match(given, expected)[0] is ok


def test_a_looser_tolerance_accepts_rounded_answers():
    assert answers_match("3.14", "3.14159", rel_tol=1e-2)[0]
    assert not answers_match("3.14", "3.14159")[0]
