"""The validation pipeline of a task set (run by the Celery task
``temper.validate_taskset``, or directly).

For every task:
- code and shell tasks: the hidden tests parse and contain assertions; the reference
  solution passes every test; each *trivial* solution — the entry point's body replaced
  by ``pass``, ``return None``, or a constant (0, 1, True, False, "", []); in another
  language than Python, an empty file — fails at least one test, else the tests are too
  weak. All of them run in one fresh sandbox
  per task.
- math tasks: the answer parses; a worked reference solution (``... #### 42``) ends in
  that answer; the trivial answer ``0`` does not match (unless the answer is 0).
- across the set: a task whose normalised prompt or whose tests repeat an earlier
  task's is a duplicate.

Then every task goes through :func:`temper.tasks.oracle.run_oracle`: its reference
(or oracle script) and a do-nothing agent are scored by the reward scorer's
:class:`Scorer`; the oracle must score full marks and the do-nothing agent must not
pass. Both runs are stored in ``tasks.validation``.

Each task ends ``valid`` or ``invalid`` with its reasons; invalid tasks are never
sampled.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from temper.db import Database
from temper.limits import LanguageName
from temper.rewards import Scorer
from temper.rewards.answers import answers_match, extract_answer
from temper.rewards.polyglot import names_of
from temper.rewards.runner import ScoringError, TestRunner
from temper.rewards.testsplit import split_tests
from temper.tasks import service
from temper.tasks.models import TaskKind, TaskSpec, TaskStatus
from temper.tasks.oracle import run_oracle

TRIVIAL_BODIES: list[tuple[str, str]] = [
    ("empty body (pass)", "pass"),
    ("return None", "return None"),
    ("return 0", "return 0"),
    ("return 1", "return 1"),
    ("return True", "return True"),
    ("return False", "return False"),
    ('return ""', 'return ""'),
    ("return []", "return []"),
]

Progress = Callable[[int, int], Awaitable[None] | None]


def trivial_variants(solution: str, entry_point: str | None) -> list[tuple[str, str]]:
    """Trivial solutions derived from the reference: the entry point's body swapped for
    each of :data:`TRIVIAL_BODIES` (its docstring and the rest of the file kept). Without
    an entry point, an empty file."""
    if not entry_point:
        return [("empty file", "")]
    tree = ast.parse(solution)
    target = next(
        (
            n
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == entry_point
        ),
        None,
    )
    if target is None:
        return [("empty file", "")]
    variants = []
    doc = (
        target.body[:1]
        if target.body
        and isinstance(target.body[0], ast.Expr)
        and isinstance(getattr(target.body[0], "value", None), ast.Constant)
        else []
    )
    original = target.body
    for label, body in TRIVIAL_BODIES:
        target.body = [*doc, *ast.parse(body).body]
        variants.append((label, ast.unparse(tree)))
    target.body = original
    return variants


async def check_task(runner: TestRunner, task: TaskSpec) -> list[str]:
    """Reasons the task is invalid (empty when it is valid)."""
    if task.kind is TaskKind.math:
        return _check_math(task)
    python = task.language is LanguageName.python
    try:
        split = split_tests(task.tests or "", task.entry_point) if python else None
    except SyntaxError as exc:
        return [f"hidden tests do not parse: {exc.msg} (line {exc.lineno})"]
    tests = split.chunks if split is not None else names_of(runner.language_tests.statements(task))
    if not tests:
        return ["hidden tests contain no assertions"]
    if not task.solution:
        # a shell task's oracle script is run and scored by temper.tasks.oracle instead
        return [] if task.oracle else ["no reference solution"]
    try:
        # another language's trivial solution is an empty file (it compiles to nothing the tests call)
        trivial = trivial_variants(task.solution, task.entry_point) if python else [("empty file", "")]
    except SyntaxError as exc:
        return [f"reference solution does not parse: {exc.msg} (line {exc.lineno})"]
    candidates: list[tuple[str, str | None]] = [("reference", task.solution), *trivial]
    runs, _ = await runner.run(task, candidates, files=task.files)
    reasons = []
    ref = runs[0]
    if not ref.all_passed:
        reasons.append(
            f"reference solution fails {len(ref.tests) - ref.passed} of {len(ref.tests)} tests: {ref.first_failure()}"
        )
    weak = [run.label for run in runs[1:] if run.all_passed]
    if weak:
        reasons.append(f"tests too weak: a trivial solution passes every test ({', '.join(weak)})")
    return reasons


def _check_math(task: TaskSpec) -> list[str]:
    reasons = []
    answer = task.answer or ""
    if task.solution:
        final = extract_answer(task.solution)
        ok, how = answers_match(final, answer)
        if not ok:
            reasons.append(f"reference solution's answer disagrees with the task's answer: {how}")
    ok_zero, _ = answers_match("0", answer)
    ok_self, how_self = answers_match(answer, answer)
    if not ok_self:
        reasons.append(f"the answer does not match itself: {how_self}")
    if ok_zero and answer.strip() not in ("0", "0.0"):
        reasons.append("tests too weak: the answer 0 matches")
    return reasons


def duplicate_reasons(rows: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    """rows: (key, prompt_hash, tests_hash) in set order -> key: reasons for later copies."""
    first_prompt: dict[str, str] = {}
    first_tests: dict[str, str] = {}
    out: dict[str, list[str]] = {}
    for key, prompt_hash, tests_hash in rows:
        if prompt_hash in first_prompt:
            out.setdefault(key, []).append(f"duplicate prompt of {first_prompt[prompt_hash]}")
        else:
            first_prompt[prompt_hash] = key
        if tests_hash and tests_hash in first_tests:
            out.setdefault(key, []).append(f"duplicate tests of {first_tests[tests_hash]}")
        elif tests_hash:
            first_tests[tests_hash] = key
    return out


async def validate_taskset(
    db: Database,
    scorer: Scorer,
    taskset_id: str,
    *,
    progress: Progress | None = None,
    concurrency: int = 4,
) -> dict[str, int]:
    """Validate every task of a set with the reward scorer's ``scorer``, writing each
    status and its oracle runs as they are decided. Returns the counts by status."""
    async with db.session() as session:
        rows = await service.task_rows(session, taskset_id)
        await service.set_taskset_status(session, taskset_id, "validating")
        tasks = [(row.id, service.spec_of(row), row.prompt_hash, row.tests_hash) for row in rows]
    dups = duplicate_reasons([(spec.id, ph, th) for _id, spec, ph, th in tasks])
    total = len(tasks)
    done = 0
    gate = asyncio.Semaphore(concurrency)
    lock = asyncio.Lock()

    async def one(row_id: str, spec: TaskSpec) -> None:
        nonlocal done
        async with gate:
            runs: dict[str, Any] | None = None
            try:
                if spec.kind in (TaskKind.chat, TaskKind.preference):
                    reasons = []  # a conversation's format, checked at upload, is all there is to check
                else:
                    reasons = await check_task(scorer.runner, spec)
                    runs, oracle_reasons = await run_oracle(scorer, spec)
                    reasons += [r for r in oracle_reasons if r not in reasons]
            except ScoringError as exc:
                reasons = [f"could not be validated: {exc}"]
        reasons = dups.get(spec.id, []) + reasons
        status = TaskStatus.invalid if reasons else TaskStatus.valid
        async with db.session() as session:
            await service.set_task_status(session, row_id, status, reasons, validation=runs)
        async with lock:
            done += 1
            if progress is not None:
                res = progress(done, total)
                if asyncio.iscoroutine(res):
                    await res

    if progress is not None:
        res = progress(0, total)
        if asyncio.iscoroutine(res):
            await res
    await asyncio.gather(*(one(row_id, spec) for row_id, spec, _p, _t in tasks))
    async with db.session() as session:
        counts = await service.status_counts(session, taskset_id)
        await service.set_taskset_status(session, taskset_id, "validated")
    return counts
