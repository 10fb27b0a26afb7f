"""bench/learn.py's figures (make bench-learn): how a round where a side never reached 0.75
counts in the medians that decide the issue's targets."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _learn() -> ModuleType:
    spec = importlib.util.spec_from_file_location("temper_bench_learn", ROOT / "bench" / "learn.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


learn = _learn()


def side(to: float | None, rl_s: float, per_s: float = 10.0) -> dict[str, Any]:
    return {"samples_per_s": per_s, "seconds_to_0_75": to, "reward_at_equal_time": 0.5, "rl_s": rl_s,
            "last_3_batches": 0.7}  # fmt: skip


def round_(temper: dict[str, Any], bwrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {"temper": temper, "trl_bwrap": bwrap, "trl_plain": bwrap}


def test_a_round_where_both_reached_it_is_the_measured_ratio():
    assert learn.time_ratio(side(30.0, 70.0), side(120.0, 330.0)) == (0.25, False)


def test_a_round_where_only_trl_missed_is_bounded_by_its_whole_rl_time():
    # TRL ran 330 s without reaching 0.75: its time to it is longer, the ratio below 60/330
    value, bound = learn.time_ratio(side(60.0, 70.0), side(None, 330.0))
    assert bound and math.isclose(value, 60.0 / 330.0)


def test_a_round_where_temper_missed_counts_as_infinitely_slow_whatever_trl_did():
    assert learn.time_ratio(side(None, 70.0), side(120.0, 330.0)) == (math.inf, False)
    assert learn.time_ratio(side(None, 70.0), side(None, 330.0)) == (math.inf, False)


def test_the_median_counts_a_temper_miss_and_keeps_the_measured_middle_round():
    rounds = [
        round_(side(None, 78.0), side(250.0, 328.0)),  # Temper missed
        round_(side(52.0, 70.0), side(250.0, 332.0)),  # 0.208
        round_(side(60.0, 73.0), side(None, 359.0)),  # TRL missed: < 0.167
    ]
    out = learn.summarise(rounds)
    assert out["seconds_to_0_75_over_trl_bwrap"] == round(52.0 / 250.0, 3)
    assert out["seconds_to_0_75_over_trl_bwrap_is_bound"] is False
    assert out["rounds_seconds_to_0_75_over_trl_bwrap"] == "never, 0.208, <0.167"
    # a side's own median: the miss is the slowest, the middle is measured
    assert out["temper_seconds_to_0_75"] == 60.0
    assert out["trl_bwrap_seconds_to_0_75"] == 250.0


def test_a_median_that_rests_on_a_bound_says_so_and_one_on_misses_is_null():
    bounded = learn.summarise(
        [
            round_(side(60.0, 73.0), side(None, 300.0)),
            round_(side(70.0, 73.0), side(None, 350.0)),
            round_(side(None, 73.0), side(100.0, 300.0)),
        ]
    )
    assert bounded["seconds_to_0_75_over_trl_bwrap"] == 0.2  # max(60/300, 70/350)
    assert bounded["seconds_to_0_75_over_trl_bwrap_is_bound"] is True
    assert bounded["trl_bwrap_seconds_to_0_75"] is None  # two of three TRL rounds missed
    missed = learn.summarise(
        [round_(side(None, 73.0), side(100.0, 300.0))] * 2 + [round_(side(1.0, 2.0), side(1.0, 2.0))]
    )
    assert missed["seconds_to_0_75_over_trl_bwrap"] is None
    assert missed["temper_seconds_to_0_75"] is None
