"""Oracle validation: a task's reference solution must score full marks, and an agent
that does nothing must not pass, when both are scored by the :class:`Scorer` the reward
scorer uses (same components, default weights, fresh scoring sandboxes).

- code: the oracle submits the starting files with the reference in ``solution_file``;
  the do-nothing agent submits the starting files unchanged.
- math: the oracle submits the reference's final answer (or the task's answer); the
  do-nothing agent submits no answer.
- shell with an ``oracle`` script (Harbor's ``solution.sh``): the script runs in a fresh
  sandbox holding the starting files, and the workspace it leaves is the submission; the
  do-nothing agent submits the starting files.

:func:`run_oracle` returns what :func:`temper.tasks.validation.validate_taskset` stores
in ``tasks.validation`` and the reasons the task is invalid.
"""

from __future__ import annotations

from typing import Any

from temper.events import RewardResult
from temper.rewards import Scorer
from temper.rewards.answers import extract_answer
from temper.rewards.models import Submission
from temper.rewards.outcome import passed
from temper.rewards.runner import SCORING_LIMITS, ScoringError
from temper.rewards.scorer import DEFAULT_WEIGHTS
from temper.sandbox import Action
from temper.tasks.models import TaskKind, TaskSpec

ORACLE_SCRIPT = ".temper_oracle.sh"
MAX_WORKSPACE_FILES = 500
EPSILON = 1e-9


async def oracle_submission(scorer: Scorer, task: TaskSpec) -> Submission | None:
    """What the reference solution submits; None when the task has none."""
    if task.kind is TaskKind.math:
        answer = extract_answer(task.solution) if task.solution else task.answer
        return Submission(answer=answer, text=task.solution or task.answer or "")
    if task.oracle:
        return Submission(files=await run_oracle_script(scorer, task))
    if task.solution is None:
        return None
    return Submission(files={**task.files, task.solution_file: task.solution})


def null_submission(task: TaskSpec) -> Submission:
    """What an agent that does nothing submits: the starting files, no answer."""
    return Submission(files=dict(task.files), answer=None, text="")


async def run_oracle_script(scorer: Scorer, task: TaskSpec) -> dict[str, str]:
    """Run the task's oracle script with bash in a fresh sandbox holding the starting
    files; the text files it leaves in the workspace."""
    manager = scorer.runner.manager
    try:
        sb = await manager.acquire(task.limits or SCORING_LIMITS)
    except Exception as exc:  # noqa: BLE001 - any failure to start is the machinery's
        raise ScoringError(f"cannot start a sandbox for the oracle: {exc}") from exc
    try:
        for path, content in {**task.files, ORACLE_SCRIPT: task.oracle or ""}.items():
            res = await manager.execute(sb, Action(kind="write_file", path=path, content=content))
            if res.error:
                raise ScoringError(f"cannot write {path} into the oracle's sandbox: {res.error}")
        run = await manager.execute(sb, Action(kind="run_command", command=["bash", ORACLE_SCRIPT]))
        if not run.ok:
            tail = (run.stderr or run.stdout).strip()[-300:]
            why = f"killed ({run.kill_reason})" if run.kill_reason else f"exit status {run.exit_code}"
            raise OracleFailed(f"the oracle script failed: {why}: {tail}")
        listing = await manager.execute(sb, Action(kind="list_files"))
        files: dict[str, str] = {}
        for info in (listing.files or [])[:MAX_WORKSPACE_FILES]:
            if info.is_dir or info.path == ORACLE_SCRIPT:
                continue
            read = await manager.execute(sb, Action(kind="read_file", path=info.path))
            if read.error is None and read.content is not None and read.encoding == "utf-8":
                files[info.path] = read.content
        return files
    finally:
        await manager.release(sb)


class OracleFailed(RuntimeError):
    """The oracle script itself failed (the task's fault, not the machinery's)."""


def _summary(result: RewardResult) -> dict[str, Any]:
    failures = [f"{name}: {c.reason}" for name, c in result.components.items() if c.reason and c.value != 1.0]
    return {
        "reward": result.reward,
        "passed": passed(result),
        "failure": failures[0][:300] if failures else None,
    }


async def _score(scorer: Scorer, task: TaskSpec, submission: Submission) -> dict[str, Any]:
    reward, components = await scorer.score(task, submission, DEFAULT_WEIGHTS[task.kind])
    return _summary(RewardResult(task_id=task.id, reward=reward, components=components))


async def run_oracle(scorer: Scorer, task: TaskSpec) -> tuple[dict[str, Any], list[str]]:
    """``({"oracle", "null", "full_marks"}, reasons)``: the two runs' reward and verdict,
    and why the task is invalid (empty when both behave). Raises :class:`ScoringError`
    when the sandbox machinery failed."""
    full = sum(w for w in DEFAULT_WEIGHTS[task.kind].values() if w > 0)
    result: dict[str, Any] = {"full_marks": full, "oracle": None, "null": None}
    reasons: list[str] = []
    try:
        oracle = await oracle_submission(scorer, task)
    except OracleFailed as exc:
        result["oracle"] = {"reward": None, "passed": False, "failure": str(exc)}
        reasons.append(str(exc))
        oracle = None
    if oracle is not None:
        result["oracle"] = await _score(scorer, task, oracle)
        if not result["oracle"]["passed"] or result["oracle"]["reward"] < full - EPSILON:
            why = result["oracle"]["failure"] or "no failure recorded"
            reasons.append(f"the oracle solution scores {result['oracle']['reward']:g} of {full:g}: {why}")
    result["null"] = await _score(scorer, task, null_submission(task))
    if result["null"]["passed"]:
        reasons.append(
            f"a do-nothing agent passes (reward {result['null']['reward']:g}): the tests are too weak"
        )
    return result, reasons
