"""Reward components: one interface, :class:`Component`, and Temper's own components
(named by :class:`ComponentName`). Every component, Temper's and an operator's, is
registered under the ``temper.rewards`` entry points (:mod:`temper.plugins`) and found
there by name (:func:`component_of`); a plugin may register a :class:`Component` or a
plain function of the :class:`ScoreContext` (:class:`FunctionComponent`).

Each component computes one value from a :class:`ScoreContext` and returns a
:class:`temper.events.RewardComponent`: ``value`` with ``ok=True`` when it was
measured (a zero comes with a ``reason``), or ``ok=False`` with a ``reason`` when it
could not be measured (does not apply to the task kind, the sandbox failed, no
reference solution). The expensive runs (hidden tests, coverage, reference timing) are
shared between components through the context, each in its own fresh sandbox.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import reprlib
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from temper.events import RewardComponent
from temper.limits import LanguageName
from temper.problems import field_path, message
from temper.rewards.answers import DEFAULT_REL_TOL, answers_match, extract_answer
from temper.rewards.graders import Graders
from temper.rewards.models import CandidateRun, ComponentName, Submission
from temper.rewards.runner import ScoringError, TestRunner
from temper.rewards.transcript import Transcript
from temper.tasks.models import TaskKind, TaskSpec

CODE_KINDS = (TaskKind.code, TaskKind.shell)
EFFICIENCY_FLOOR_S = 0.001  # added to both times so microsecond-scale noise cannot swing the ratio
TIMING_REPEAT = 3


class Skip(Exception):
    """The component cannot be measured; the message says why."""


@dataclass
class ScoreContext:
    task: TaskSpec
    submission: Submission
    runner: TestRunner
    turns_used: int = 0
    max_turns: int = 1
    format_ok: bool = True
    want_timing: bool = False
    reference_times: dict[str, float] | None = None  # shared cache: task tests hash -> seconds
    # the job's settings of the components given with some (rewards: {name: {weight, ...}})
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the episode as a conversation (temper.rewards.transcript), for the components that read
    # it (reward_model, judge); None where the caller has no episode to read it from
    load_transcript: Callable[[], Awaitable[Transcript]] | None = None
    job_id: str | None = None  # the episode's job (a judge asked to grade with the policy serves it)
    policy: dict[str, Any] | None = None  # the job spec's policy block (model, init, backend_pool)
    graders: Graders | None = None  # the process's models and gateway, for the components that grade with one
    _memo: dict[str, asyncio.Future[Any]] = field(default_factory=dict)

    async def transcript(self) -> Transcript:
        """The episode's conversation, read once per score."""
        if self.load_transcript is None:
            raise Skip("no transcript of the episode is available to this scorer")
        return await self._once("transcript", self.load_transcript)  # type: ignore[no-any-return]

    async def _once(self, key: str, make: Callable[[], Awaitable[Any]]) -> Any:
        if key not in self._memo:
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self._memo[key] = fut
            try:
                fut.set_result(await make())
            except BaseException as exc:
                fut.set_exception(exc)
                fut.exception()  # retrieved here so an unawaited failure is not logged twice
        return await self._memo[key]

    def code(self) -> str | None:
        return self.submission.code_for(self.task.solution_file, self.task.language)

    def files(self) -> dict[str, str]:
        files = dict(self.submission.files)
        code = self.code()
        if code is not None:
            files[self.task.solution_file] = code
        return files

    async def test_run(self) -> CandidateRun:
        """The agent's code against the hidden tests (timed when efficiency is wanted)."""
        if self.task.kind not in CODE_KINDS:
            raise Skip(f"a {self.task.kind} task has no hidden tests")
        if self.code() is None and not self.submission.files:
            raise _NoCode()

        async def make() -> CandidateRun:
            repeat = TIMING_REPEAT if self.want_timing else 1
            runs, _ = await self.runner.run(self.task, [("agent", None)], files=self.files(), repeat=repeat)
            return runs[0]

        return await self._once("tests", make)

    async def coverage_run(self) -> tuple[CandidateRun, dict[str, Any]]:
        if self.task.kind not in CODE_KINDS:
            raise Skip(f"a {self.task.kind} task has no code to cover")
        if self.task.language is not LanguageName.python:
            raise Skip(f"coverage is measured in Python only, not {self.task.language}")
        if self.code() is None:
            raise _NoCode()

        async def make() -> tuple[CandidateRun, dict[str, Any]]:
            runs, report = await self.runner.run(
                self.task, [("agent", None)], files=self.files(), coverage=True
            )
            assert report is not None
            return runs[0], report

        return await self._once("coverage", make)

    async def reference_time(self) -> float:
        if not self.task.solution:
            raise Skip("the task has no reference solution to compare run time with")
        key = self.task.tests_hash + ":" + str(hash(self.task.solution))
        if self.reference_times is not None and key in self.reference_times:
            return self.reference_times[key]

        async def make() -> float:
            runs, _ = await self.runner.run(
                self.task, [("reference", self.task.solution)], files=self.task.files, repeat=TIMING_REPEAT
            )
            ref = runs[0]
            if not ref.all_passed or ref.best_s is None:
                raise Skip(f"the reference solution fails the tests ({ref.first_failure()})")
            return ref.best_s

        seconds = await self._once("reference", make)
        if self.reference_times is not None:
            if len(self.reference_times) > 10000:
                self.reference_times.clear()
            self.reference_times[key] = seconds
        return float(seconds)


class _NoCode(Skip):
    def __init__(self) -> None:
        super().__init__("no code submitted")


class Component(ABC):
    name: str
    kinds: tuple[TaskKind, ...] = (TaskKind.code, TaskKind.math, TaskKind.shell)
    expensive: bool = False  # computed only when a job weights it
    # The settings a job may give it beside its weight (``rewards: {name: {weight: 1, ...}}``):
    # a pydantic model that forbids unknown fields; None: the component takes none.
    settings_model: ClassVar[type[BaseModel] | None] = None

    def applies(self, task: TaskSpec) -> bool:
        return task.kind in self.kinds

    def settings_errors(self, given: dict[str, Any]) -> list[tuple[str, str]]:
        """(field path, message) for each problem of the settings ``given`` (without the weight)."""
        if self.settings_model is None:
            if given:
                return [
                    ("", f"{self.name} takes no settings besides weight (given: {', '.join(sorted(given))})")
                ]
            return []
        try:
            self.settings_model.model_validate(given)
        except ValidationError as exc:
            return [(field_path(e["loc"]), message(e)) for e in exc.errors()]
        return []

    def settings(self, ctx: ScoreContext) -> Any:
        """This component's settings in ``ctx`` (validated; the defaults when none were given)."""
        if self.settings_model is None:
            return None
        return self.settings_model.model_validate(ctx.settings.get(self.name, {}))

    async def compute(self, ctx: ScoreContext) -> RewardComponent:
        if not self.applies(ctx.task):
            return RewardComponent(ok=False, reason=f"{self.name} does not apply to {ctx.task.kind} tasks")
        try:
            return await self.measure(ctx)
        except _NoCode:
            return RewardComponent(value=0.0, reason="no code submitted")
        except Skip as exc:
            return RewardComponent(ok=False, reason=str(exc))

    @abstractmethod
    async def measure(self, ctx: ScoreContext) -> RewardComponent: ...


class TestsPassed(Component):
    name = ComponentName.tests_passed
    kinds = CODE_KINDS

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        run = await ctx.test_run()
        if not run.tests:
            return RewardComponent(ok=False, reason="the task's hidden tests contain no assertions")
        details: dict[str, Any] = {
            "passed": run.passed,
            "total": len(run.tests),
            "tests": [t.model_dump() for t in run.tests],
        }
        if run.kill_reason:
            details["kill_reason"] = run.kill_reason
        reason = None if run.all_passed else run.first_failure()
        return RewardComponent(value=run.fraction, reason=reason, details=details)


class Compiles(Component):
    name = ComponentName.compiles
    kinds = CODE_KINDS

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        if ctx.code() is None:
            raise _NoCode()
        run = await ctx.test_run()
        if run.compile_error:
            return RewardComponent(value=0.0, reason=run.compile_error)
        if not run.started:
            why = f"killed by the sandbox ({run.kill_reason})" if run.kill_reason else "ended early"
            return RewardComponent(ok=False, reason=f"the run {why} before the code was compiled")
        return RewardComponent(value=1.0)


class Coverage(Component):
    name = ComponentName.coverage
    kinds = CODE_KINDS
    expensive = True

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        run, report = await ctx.coverage_run()
        if run.compile_error:
            return RewardComponent(value=0.0, reason=f"does not compile: {run.compile_error}")
        if report.get("error"):  # the run was killed or ended before coverage.py could report
            return RewardComponent(value=0.0, reason=f"no coverage measured: {report['error']}")
        files = report.get("files", {})
        if not files:
            return RewardComponent(value=0.0, reason="none of the agent's code ran under the tests")
        summary = next(iter(files.values()))["summary"]
        statements = summary.get("num_statements", 0)
        line = summary.get("covered_lines", 0) / statements if statements else 1.0
        branches = summary.get("num_branches", 0)
        branch = summary.get("covered_branches", 0) / branches if branches else 1.0
        value = (line + branch) / 2
        details = {
            "line": round(line, 4),
            "branch": round(branch, 4),
            "statements": statements,
            "covered_lines": summary.get("covered_lines", 0),
            "branches": branches,
            "covered_branches": summary.get("covered_branches", 0),
            "missing_lines": next(iter(files.values())).get("missing_lines", [])[:50],
            "tests_passed": run.passed,
        }
        return RewardComponent(value=round(value, 6), details=details)


class Efficiency(Component):
    name = ComponentName.efficiency
    kinds = CODE_KINDS
    expensive = True

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        run, ref_s = await asyncio.gather(ctx.test_run(), ctx.reference_time())
        if not run.all_passed:
            raise Skip(f"not measured: {len(run.tests) - run.passed} of {len(run.tests)} tests failed")
        agent_s = run.best_s if run.best_s is not None else sum(t.seconds for t in run.tests)
        value = min(1.0, max(0.0, (ref_s + EFFICIENCY_FLOOR_S) / (agent_s + EFFICIENCY_FLOOR_S)))
        return RewardComponent(
            value=round(value, 6),
            details={"agent_s": agent_s, "reference_s": ref_s, "floor_s": EFFICIENCY_FLOOR_S},
        )


class AnswerMatch(Component):
    name = ComponentName.answer_match
    kinds = (TaskKind.math,)

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        sub = ctx.submission
        given = sub.answer if sub.answer not in (None, "") else extract_answer(sub.text)
        tol = ctx.task.metadata.tolerance
        ok, how = answers_match(
            given, ctx.task.answer or "", rel_tol=tol if tol is not None else DEFAULT_REL_TOL
        )
        return RewardComponent(
            value=1.0 if ok else 0.0,
            reason=None if ok else how,
            details={"given": given, "expected": ctx.task.answer, "how": how},
        )


class Format(Component):
    name = ComponentName.format

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        if ctx.format_ok:
            return RewardComponent(value=1.0)
        return RewardComponent(value=0.0, reason="the agent's actions did not follow the action format")


class TurnPenalty(Component):
    name = ComponentName.turn_penalty

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        used, budget = max(ctx.turns_used, 1), max(ctx.max_turns, 1)
        value = 0.0 if budget <= 1 else min(1.0, (used - 1) / (budget - 1))
        return RewardComponent(
            value=round(value, 6), details={"turns_used": ctx.turns_used, "max_turns": ctx.max_turns}
        )


class FunctionComponent(Component):
    """A reward plugin given as a function ``fn(ctx: ScoreContext)`` (sync or async) that
    returns a number in [0, 1] (or any finite number: weights scale it) or a
    :class:`RewardComponent`; ``raise Skip("why")`` when it cannot be measured. Whatever
    else it returns or raises is recorded as that component's error (``ok`` false, the
    reason says what came back), never a crash of the scorer."""

    def __init__(self, name: str, fn: Callable[[ScoreContext], Any]) -> None:
        self.name = name
        self.fn = fn

    async def measure(self, ctx: ScoreContext) -> RewardComponent:
        try:
            out = self.fn(ctx)
            if inspect.isawaitable(out):
                out = await out
        except (Skip, ScoringError):  # not measurable / the sandbox machinery failed: as for any component
            raise
        except Exception as exc:  # noqa: BLE001 - the plugin's failure is its component's error
            return RewardComponent(
                ok=False, reason=f"reward {self.name!r} raised {type(exc).__name__}: {exc}"[:500]
            )
        if isinstance(out, RewardComponent):
            return out
        if isinstance(out, int | float) and math.isfinite(out):  # bool too: True is 1.0
            return RewardComponent(value=float(out))
        return RewardComponent(
            ok=False,
            reason=f"reward {self.name!r} returned {reprlib.repr(out)}, not a finite number or a RewardComponent",
        )


class NotAComponent(TypeError):
    pass


def component_of(name: str, obj: Any) -> Component:
    """The component a ``temper.rewards`` entry point names: a :class:`Component`
    instance or subclass, or a function of the :class:`ScoreContext`."""
    if isinstance(obj, Component):
        return obj
    if isinstance(obj, type) and issubclass(obj, Component):
        component = obj()
        if not getattr(component, "name", None):
            component.name = name
        return component
    if callable(obj) and not isinstance(obj, type):
        return FunctionComponent(name, obj)
    raise NotAComponent(f"reward {name!r} names {obj!r}: not a Component or a function of the ScoreContext")
