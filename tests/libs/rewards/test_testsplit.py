from __future__ import annotations

from temper.rewards.testsplit import split_tests

CHECK = """
METADATA = {}

def check(candidate):
    import math
    xs = [1, 2]
    assert candidate(xs) == 3
    assert True
    for x in range(3):
        assert candidate([x]) == x
    assert math.isclose(candidate([0.5]), 0.5), "half"
"""


def test_a_check_function_is_cut_into_one_test_per_assert_with_setup_carried_along():
    split = split_tests(CHECK, "f")
    assert split.mode == "check"
    assert len(split.chunks) == 3  # the constant assert is not a test; the loop is one test
    first, loop, last = split.chunks
    assert "import math" in first.code and "xs = [1, 2]" in first.code
    assert loop.code.startswith("for x in range(3):")
    assert "math.isclose" in last.code
    assert "METADATA" in split.prelude and "def check" not in split.prelude


def test_test_functions_and_plain_asserts():
    split = split_tests(
        "def helper():\n    return 1\n\ndef test_a():\n    assert helper() == 1\n\ndef test_b():\n    pass\n",
        None,
    )
    assert split.mode == "functions" and [c.name for c in split.chunks] == ["test_a", "test_b"]
    split = split_tests("from solution import f\nassert f(1) == 1\ny = 2\nassert f(y) == 2\n", None)
    assert split.mode == "asserts" and len(split.chunks) == 2
    assert "y = 2" in split.chunks[1].code
