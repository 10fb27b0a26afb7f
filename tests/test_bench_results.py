"""Benchmark results are flat JSON objects: one scalar per figure, so tools can diff them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json"))


def test_every_make_bench_target_has_committed_results():
    names = {p.stem for p in RESULTS}
    assert {"sandbox", "rewards", "gateway", "dispatch", "trainer"} <= names


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_results_are_a_flat_object_of_scalars(path: Path):
    data = json.loads(path.read_text())
    assert isinstance(data, dict) and data
    nested = {k: type(v).__name__ for k, v in data.items() if isinstance(v, (dict, list))}
    assert not nested, f"{path.name}: nested values {nested}"
