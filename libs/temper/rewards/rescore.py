"""Re-score a finished job's episodes with new weights or a new verifier, without
generating anything again.

Each episode's submission comes from the scorer's durable record
(``rewards/<job>/<episode>/...json``, the original request); when there is none, it is
rebuilt from the stored trajectory (files written by ``write_file`` actions, the last
``submit`` answer, the last action text). With new weights only, components already
measured are reused and only the ones not measured before run; ``verifiers`` (name ->
component) are always run again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from temper.events import RewardComponent
from temper.rewards.components import Component
from temper.rewards.models import Submission, load_submission
from temper.rewards.scorer import Scorer, combine
from temper.rewards.transcript import Transcript, from_trajectory
from temper.storage import NotFound, ObjectStore, object_key
from temper.tasks.models import TaskSpec
from temper.trajectory import Trajectory


@dataclass
class Rescored:
    episode_id: str
    task_id: str
    old_reward: float
    reward: float
    components: dict[str, RewardComponent]
    source: str  # "record" or "trajectory": where the submission came from
    missing: list[str] = field(default_factory=list)


def submission_from_trajectory(traj: Trajectory) -> Submission:
    files: dict[str, str] = {}
    answer = None
    for turn in traj.turns:
        action = turn.action or {}
        kind = action.get("kind")
        if kind == "write_file" and action.get("path") and action.get("content") is not None:
            files[str(action["path"])] = str(action["content"])
        elif kind in ("submit", "answer") and action.get("answer") is not None:
            answer = str(action["answer"])
    text = traj.turns[-1].action_text if traj.turns else ""
    return Submission(files=files, answer=answer, text=text)


async def _latest_record(store: ObjectStore, job_id: str, episode_id: str) -> dict[str, Any] | None:
    keys = await store.list(f"rewards/{job_id}/{episode_id}/")
    if not keys:
        return None
    try:
        return json.loads(await store.get(keys[-1]))  # type: ignore[no-any-return]
    except NotFound:
        return None


async def rescore_job(
    *,
    store: ObjectStore,
    scorer: Scorer,
    tenant: str,
    job_id: str,
    weights: dict[str, float],
    load_task: Any,
    verifiers: dict[str, Component] | None = None,
    settings: dict[str, dict[str, Any]] | None = None,
    tool_role: str = "tool",
) -> list[Rescored]:
    """Re-score every stored trajectory of a job. ``load_task(task_id)`` is an async
    callable returning the :class:`TaskSpec`. ``settings``: those of the components given
    with some (a reward model, a judge), which read the episode's transcript, rebuilt from
    the trajectory (:func:`temper.rewards.transcript.from_trajectory`)."""
    if verifiers:
        scorer.components.update(verifiers)
    prefix = object_key(tenant, job_id, "trajectories") + "/"
    out = []
    for key in await store.list(prefix):
        traj = Trajectory.model_validate_json(await store.get(key))
        record = await _latest_record(store, job_id, traj.episode_id)
        request: dict[str, Any] = (record or {}).get("request", {})
        previous = {
            name: RewardComponent.model_validate(c)
            for name, c in (
                (record or {}).get("result", {}).get("components") or traj.rewards.get("components", {})
            ).items()
        }
        if "submission" in request:
            submission = await load_submission(request["submission"], store)
        else:
            submission = submission_from_trajectory(traj)
        task: TaskSpec = await load_task(traj.task_id)
        rerun = [
            n for n in weights if n not in previous or not previous[n].ok or (verifiers and n in verifiers)
        ]
        components = {n: c for n, c in previous.items() if n not in rerun}
        if rerun:

            async def transcript(task: TaskSpec = task, traj: Trajectory = traj) -> Transcript:
                return from_trajectory(task.prompt, traj, tool_role=tool_role)

            _, fresh = await scorer.score(
                task, submission, {n: weights[n] for n in rerun}, only=rerun,
                turns_used=request.get("turns_used", len(traj.turns) or 1),
                max_turns=request.get("max_turns", max(len(traj.turns), 1)),
                format_ok=request.get("format_ok", True),
                settings={**request.get("settings", {}), **(settings or {})}, transcript=transcript,
                job_id=job_id,
            )  # fmt: skip
            components.update(fresh)
        reward, missing = combine(weights, components)
        out.append(Rescored(traj.episode_id, traj.task_id, traj.reward, reward, components,
                            "record" if record else "trajectory", missing))  # fmt: skip
    return out
