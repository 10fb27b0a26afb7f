"""Run a task's hidden tests in its own language against candidate solutions: each candidate's
test program (:func:`temper.rewards.polyglot.build`) compiled and run where no other run
was (``temper.sandbox.programs.run_program``), its result lines read as the Python
harness's."""

from __future__ import annotations

import asyncio
import secrets

from temper.limits import LanguageName, SandboxLimits
from temper.rewards.models import CandidateRun, TestOutcome
from temper.rewards.polyglot import LABEL, build, names_of, split
from temper.rewards.polyglot.statements import Statement
from temper.rewards.results import ScoringError, mark_unfinished, parse_output
from temper.sandbox.manager import SandboxManager
from temper.sandbox.models import ExecResult
from temper.sandbox.programs import LanguageUnavailable, run_program
from temper.tasks.models import TaskSpec


class LanguageTests:
    """The statements of each task's tests, cut once per distinct tests and language."""

    def __init__(self) -> None:
        self._split: dict[tuple[str, LanguageName], list[Statement]] = {}

    def statements(self, task: TaskSpec) -> list[Statement]:
        key = (task.tests or "", task.language)
        found = self._split.get(key)
        if found is None:
            if len(self._split) > 4096:
                self._split.clear()
            found = self._split[key] = split(key[0], task.language)
        return found


def compile_failure(result: ExecResult, timeout_s: float) -> str:
    """What a failed compile says, in a line or a few: the compiler's first error lines."""
    if result.kill_reason is not None:
        if result.kill_reason.value in ("timeout", "cpu"):
            return f"the compile ran past its {timeout_s:g}s"
        return f"the compile was killed by the sandbox ({result.kill_reason.value})"
    text = (result.stderr.strip() or result.stdout.strip()) or f"the compiler exited {result.exit_code}"
    lines = text.splitlines()
    errors = [line for line in lines if "error" in line.lower()] or lines
    return "\n".join(errors[:3])[:500]


async def run_in_language(
    manager: SandboxManager,
    statements: list[Statement],
    task: TaskSpec,
    candidates: list[tuple[str, str | None]],
    *,
    files: dict[str, str],
    limits: SandboxLimits,
    per_test_s: float,
    max_timeouts: int,
    compile_timeout_s: float,
) -> list[CandidateRun]:
    """Each candidate (label, source; None = ``task.solution_file`` in ``files``) against the
    task's tests (``statements``, from :class:`LanguageTests`), one test program each, run at
    once. ``per_test_s`` and ``max_timeouts`` bound each test where the language's runner can
    (C and C++: a timer per test); elsewhere the run's limits bound them all."""
    names = names_of(statements)
    language = manager.languages[task.language]
    workspace = {path: text.encode() for path, text in files.items() if path != task.solution_file}

    async def one(label: str, source: str | None) -> CandidateRun:
        code = source if source is not None else files.get(task.solution_file)
        if code is None:
            reason = f"cannot read {task.solution_file}: the agent wrote no such file"
            return CandidateRun(label=label, compile_error=reason, tests=_failed(names, reason))
        if not names:
            return CandidateRun(label=label, started=True)
        program = build(task.language, code, statements, task.solution_file)
        nonce = secrets.token_hex(16)
        try:
            result = await run_program(
                manager, language, program.code,
                files={**workspace, **{p: t.encode() for p, t in program.files.items()}},
                stdin=f"{nonce} {per_test_s} {max_timeouts}\n", limits=limits,
                compile_timeout_s=compile_timeout_s, sources=program.sources,
            )  # fmt: skip
        except LanguageUnavailable as exc:
            raise ScoringError(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - any failure to run is the machinery's
            raise ScoringError(f"cannot run in a scoring sandbox: {exc}") from exc
        for step in (result.compile, result.run):
            if step is not None and step.error:
                raise ScoringError(f"cannot run in a scoring sandbox: {step.error}")
        if result.run is None:
            assert result.compile is not None
            reason = compile_failure(result.compile, compile_timeout_s)
            return CandidateRun(label=label, compile_error=reason, tests=_failed(names, f"does not compile: {reason}"),
                                wall_s=result.compile.wall_s)  # fmt: skip
        ran = result.run
        run = parse_output(ran.stdout, nonce, [LABEL], names)[0]
        run.label = label
        for outcome, name in zip(run.tests, names, strict=True):
            outcome.name = outcome.name or name
        why = None
        if ran.kill_reason is not None:
            run.kill_reason = str(ran.kill_reason)
            why = f"killed by the sandbox: {ran.kill_reason}"
        elif not ran.stdout.rstrip().endswith('"ev": "end"}'):
            last = (ran.stderr.strip().splitlines() or [f"exit status {ran.exit_code}"])[-1][:300]
            why = f"the test process ended early: {last}"
        if why is not None:
            mark_unfinished([run], why)
        run.wall_s = ran.wall_s + (result.compile.wall_s if result.compile is not None else 0.0)
        return run

    return list(await asyncio.gather(*(one(label, source) for label, source in candidates)))


def _failed(names: list[str], reason: str) -> list[TestOutcome]:
    return [TestOutcome(name=name, passed=False, message=reason) for name in names]
