"""Score one submission: compute the components a job weights (plus the cheap ones, for
the record) and their weighted sum.

The scalar reward is ``sum(weight * value)`` over the weighted components that were
measured. A weighted component that could not be measured adds nothing and says why in
its ``reason``; :func:`combine` also lists it under ``missing`` so that nothing turns
into a silent zero.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from temper import metrics, plugins
from temper.events import RewardComponent
from temper.rewards.components import Component, NotAComponent, ScoreContext, component_of
from temper.rewards.graders import Graders
from temper.rewards.models import ComponentName, Submission
from temper.rewards.runner import ScoringError, TestRunner
from temper.rewards.transcript import Transcript
from temper.sandbox import SandboxManager
from temper.tasks.models import TaskKind, TaskSpec

DEFAULT_WEIGHTS = {
    TaskKind.code: {"tests_passed": 1.0},
    TaskKind.shell: {"tests_passed": 1.0},
    TaskKind.math: {"answer_match": 1.0},
}
ALWAYS = {
    TaskKind.code: ("tests_passed", "compiles", "format", "turn_penalty"),
    TaskKind.shell: ("tests_passed", "format", "turn_penalty"),
    TaskKind.math: ("answer_match", "format", "turn_penalty"),
}


def combine(weights: dict[str, float], components: dict[str, RewardComponent]) -> tuple[float, list[str]]:
    """The weighted sum, and the weighted components that are missing or failed."""
    total = 0.0
    missing = []
    for name, weight in weights.items():
        comp = components.get(name)
        if comp is None or not comp.ok or comp.value is None:
            missing.append(name)
            continue
        total += weight * comp.value
    return round(total, 9), missing


class Scorer:
    """Computes reward components with hidden tests run in fresh sandboxes from
    ``manager``. A component is found by name among the ``temper.rewards`` plugins
    (Temper's own included) on first use; ``overrides`` replace a component's verifier
    (re-scoring with a new verifier) or add new ones by name."""

    def __init__(
        self,
        manager: SandboxManager,
        *,
        overrides: dict[str, Component] | None = None,
        graders: Graders | None = None,
    ) -> None:
        self.runner = TestRunner(manager)
        self.graders = graders or Graders()
        self.components: dict[str, Component] = dict(overrides or {})
        self.reference_times: dict[str, float] = {}

    def component(self, name: str) -> Component:
        """The component registered as ``name``; raises :class:`temper.plugins.PluginError`
        (naming what is installed) or :class:`NotAComponent`."""
        comp = self.components.get(name)
        if comp is None:
            comp = component_of(name, plugins.load(plugins.Group.rewards, name))
            self.components[name] = comp
        return comp

    async def score(
        self,
        task: TaskSpec,
        submission: Submission | dict[str, Any],
        weights: dict[str, float] | None = None,
        *,
        turns_used: int = 1,
        max_turns: int = 1,
        format_ok: bool = True,
        only: list[str] | None = None,
        settings: dict[str, dict[str, Any]] | None = None,
        transcript: Callable[[], Awaitable[Transcript]] | None = None,
        job_id: str | None = None,
        policy: dict[str, Any] | None = None,
    ) -> tuple[float, dict[str, RewardComponent]]:
        """Returns (reward, components). Raises :class:`ScoringError` only when the sandbox
        machinery itself failed for a weighted component.

        An expensive component (coverage, efficiency, a reward model or judge: runs of
        their own) weighted 0 is not computed unless ``only`` names it: it could not change
        the reward. ``settings``: the job's settings of the components given with some;
        ``transcript``: reads the episode's conversation (components that grade it);
        ``job_id`` and ``policy``: the episode's job and its spec's policy block."""
        sub = submission if isinstance(submission, Submission) else Submission.model_validate(submission)
        weights = dict(weights or DEFAULT_WEIGHTS[task.kind])
        asked = set(only or ())
        skipped = {n for n, w in weights.items() if w == 0 and n not in asked and self._expensive(n)}
        weights = {n: w for n, w in weights.items() if n not in skipped}
        names = list(dict.fromkeys([*(only or ALWAYS[task.kind]), *weights]))
        ctx = ScoreContext(
            task=task, submission=sub, runner=self.runner, turns_used=turns_used, max_turns=max_turns,
            format_ok=format_ok, want_timing="efficiency" in names, reference_times=self.reference_times,
            settings=dict(settings or {}), load_transcript=transcript, job_id=job_id, graders=self.graders,
            policy=policy,
        )  # fmt: skip
        results = await asyncio.gather(*(self._one(name, ctx, weighted=name in weights) for name in names))
        components = dict(zip(names, results, strict=True))
        reward, missing = combine(weights, components)
        for name in missing:
            components[name].details.setdefault("weight", weights[name])
        return reward, components

    def _expensive(self, name: str) -> bool:
        try:
            return self.component(name).expensive
        except (plugins.PluginError, NotAComponent):
            return False  # reported by _one when it is computed

    async def _one(self, name: str, ctx: ScoreContext, *, weighted: bool) -> RewardComponent:
        try:
            comp = self.component(name)
        except (plugins.PluginError, NotAComponent) as exc:
            metrics.REWARD_FAILURES.labels(component=name[:40], reason="unknown").inc()
            return RewardComponent(ok=False, reason=str(exc))
        t0 = time.perf_counter()
        try:
            result = await comp.compute(ctx)
        except ScoringError as exc:
            metrics.REWARD_FAILURES.labels(component=name, reason="sandbox").inc()
            if weighted:
                raise
            return RewardComponent(ok=False, reason=f"sandbox failure: {exc}")
        finally:
            metrics.REWARD_COMPONENT_SECONDS.labels(component=name).observe(time.perf_counter() - t0)
        if not result.ok:
            metrics.REWARD_FAILURES.labels(component=name, reason=_reason_label(result.reason)).inc()
        return result


def _reason_label(reason: str | None) -> str:
    if not reason:
        return "unknown"
    if "does not apply" in reason:
        return "not_applicable"
    if "reference" in reason:
        return "no_reference"
    if "killed" in reason:
        return "killed"
    if "not measured" in reason:
        return "tests_failed"
    return "other"


__all__ = ["ComponentName", "Scorer", "ScoringError", "combine"]
