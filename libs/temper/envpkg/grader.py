"""Grade an episode of a tenant package: its ``grade`` program runs in a fresh sandbox
from the scorer's pool (never the agent's), holding the final workspace (the text files
of the episode's last snapshot) and the package's hidden files under ``<hidden>/``. It
reads the task as JSON on stdin and prints a JSON object of the rubric's components as
its last line of output; the reward is their weighted sum.

A grader that fails (non-zero exit, killed by a limit, a last line that is not a JSON
object of exactly the rubric's finite numbers) gives every component ``ok: false`` with
a reason starting ``reward_error:`` and the grader's stderr and stdout tails in its
details, which the episode log keeps. Only a failure of the sandbox machinery itself
raises (:class:`ScoringError`: the step is retried)."""

from __future__ import annotations

import json
import math
from typing import Any

from temper.envpkg.archive import read_package
from temper.events import RewardComponent
from temper.rewards.models import files_from_snapshot
from temper.rewards.runner import SCORING_LIMITS, ScoringError
from temper.rewards.scorer import combine
from temper.sandbox import Action, SandboxLimits, SandboxManager
from temper.storage import ObjectStore
from temper.tasks.models import TaskSpec

TAIL = 4000  # characters of the grader's stderr/stdout kept in a failed component


class GradeFailed(ValueError):
    pass


def read_components(stdout: str, rubric: dict[str, float]) -> dict[str, float]:
    """The rubric's values from the grader's last line of output; :class:`GradeFailed` says what is wrong."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise GradeFailed(
            "the grader printed nothing; it must print a JSON object of the rubric's components"
        )
    try:
        values = json.loads(lines[-1])
    except json.JSONDecodeError:
        raise GradeFailed(f"the grader's last line is not JSON: {lines[-1][:200]!r}") from None
    if not isinstance(values, dict):
        raise GradeFailed(f"the grader printed {type(values).__name__}, not a JSON object")
    missing = sorted(set(rubric) - set(values))
    extra = sorted(set(values) - set(rubric))
    if missing or extra:
        raise GradeFailed(
            f"the grader's components do not match the rubric {sorted(rubric)}: "
            f"missing {missing}, not in the rubric {extra}"
        )
    out = {}
    for name, value in values.items():
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise GradeFailed(f"component {name!r} is {value!r}, not a finite number")
        out[name] = float(value)
    return out


async def grade(
    manager: SandboxManager, store: ObjectStore, task: TaskSpec, submission: dict[str, Any]
) -> tuple[float, dict[str, RewardComponent]]:
    pkg_ref = submission.get("package") or {}
    rubric = {str(k): float(v) for k, v in (pkg_ref.get("rubric") or {}).items()}
    if not pkg_ref.get("key"):
        raise ValueError("the submission names no package archive")
    pkg = read_package(await store.get(str(pkg_ref["key"])))
    hidden_dir = pkg.manifest.hidden
    snapshot_key = submission.get("snapshot_key")
    if snapshot_key:  # the workspace the agent left
        files = files_from_snapshot(await store.get(str(snapshot_key)))
        setup = None
    else:  # the agent never acted: the workspace it started with
        files, setup = {**task.files, **pkg.public}, pkg.manifest.setup
    # The agent's own files under the hidden directory's name are dropped: the grader sees only the package's.
    files = {p: t for p, t in files.items() if not p.startswith(hidden_dir + "/")}
    files.update({f"{hidden_dir}/{p}": t for p, t in pkg.hidden.items()})
    limits = (
        SandboxLimits.model_validate(pkg.manifest.grade_limits)
        if pkg.manifest.grade_limits
        else SCORING_LIMITS
    )
    try:
        sb = await manager.acquire(limits)
    except Exception as exc:  # noqa: BLE001 - any failure to start is the machinery's
        raise ScoringError(f"cannot start a grading sandbox: {exc}") from exc
    try:
        for path, content in files.items():
            res = await manager.execute(sb, Action(kind="write_file", path=path, content=content))
            if res.error:
                raise ScoringError(f"cannot write {path} into the grading sandbox: {res.error}")
        if setup:
            await manager.execute(sb, Action(kind="run_command", command=setup))
        stdin = json.dumps(
            task.model_dump(mode="json", include={"id", "prompt", "answer", "solution", "metadata"})
        )
        result = await manager.execute(
            sb, Action(kind="run_command", command=pkg.manifest.grade, stdin=stdin)
        )
    finally:
        await manager.release(sb)
    details = {
        "exit_code": result.exit_code,
        "kill_reason": str(result.kill_reason) if result.kill_reason else None,
        "stderr": result.stderr[-TAIL:],
        "stdout": result.stdout[-TAIL:],
        "wall_s": result.wall_s,
    }
    try:
        if result.kill_reason is not None:
            raise GradeFailed(f"the grader was killed ({result.kill_reason})")
        if result.exit_code != 0:
            raise GradeFailed(f"the grader exited with status {result.exit_code}")
        values = read_components(result.stdout, rubric)
    except GradeFailed as exc:
        failed = {
            n: RewardComponent(ok=False, reason=f"reward_error: {exc}", details=details) for n in rubric
        }
        return 0.0, failed
    components = {n: RewardComponent(value=v, details={"weight": rubric[n]}) for n, v in values.items()}
    reward, _ = combine(rubric, components)
    return reward, components
