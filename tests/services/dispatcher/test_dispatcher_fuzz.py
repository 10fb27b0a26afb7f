"""Schemathesis against the dispatcher: a real dispatcher process (embedded mode, SQLite,
an API key), every operation with positive and negative cases from a fixed seed, and no
check may fail (server errors, undeclared statuses, content types, response schemas,
schema-violating requests accepted). Under a minute; ``make fuzz`` runs longer."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = 20  # cases per operation and mode: about 900 cases in all (make fuzz runs more)
BUDGET_S = 120.0
MAX_GROWTH_MB = 100

pytestmark = pytest.mark.timeout(300)


def load_fuzzer():
    spec = importlib.util.spec_from_file_location("temper_bench_fuzz", ROOT / "bench" / "fuzz.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_schemathesis_finds_no_failure(tmp_path):
    fuzzer = load_fuzzer()
    with fuzzer.dispatcher(tmp_path) as (base, key, proc):
        rss_before = fuzzer.rss_mb(proc.pid)
        result = fuzzer.fuzz(base, key, examples=EXAMPLES, seed=20261201, budget_s=BUDGET_S)
        assert proc.poll() is None, "the dispatcher died under the fuzzer"
        rss_peak = fuzzer.rss_mb(proc.pid, "VmHWM")
    # bounded memory: about 100 MB at start and a few MB more after thousands of cases
    assert rss_peak < rss_before + MAX_GROWTH_MB, (rss_before, rss_peak)
    assert result.operations >= 20 and result.cases >= 500, result
    assert result.failures == {}, "\n".join(
        f"{n} x {name}: {result.examples[name]}" for name, n in result.failures.items()
    )
    assert result.server_errors == 0 and result.schema_failures == 0
