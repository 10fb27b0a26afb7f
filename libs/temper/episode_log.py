"""An episode's log: one JSON line per step, stored next to its trajectory.

The trajectory keeps what the trainer needs (tokens, logprobs) and the transcript what a
person reads; the log keeps what an operator digs through afterwards: every step's
attempt and timings, the sandbox's exit code, kill reason, raw stdout/stderr and their
truncation flags, the inference finish reason and policy version, and the reward
components. The dispatcher writes it once, when the episode is scored, at
``tenants/<tenant>/jobs/<job>/logs/<episode>.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from temper.clock import utcnow
from temper.db import Episode, Step
from temper.events import RewardResult
from temper.storage import object_key

SANDBOX_FIELDS = (
    "exit_code", "signal", "kill_reason", "stdout", "stderr", "stdout_truncated", "stderr_truncated",
    "wall_s", "cpu_s", "peak_memory_mb", "error",
)  # fmt: skip


def log_key(tenant: str, job_id: str, episode_id: str) -> str:
    return object_key(tenant, job_id, "logs", f"{episode_id}.jsonl")


def _iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts is not None else None


def _duration(step: Step) -> float | None:
    if step.created_at is None or step.completed_at is None:
        return None
    return round((step.completed_at - step.created_at).total_seconds(), 6)


def step_line(ep: Episode, step: Step, reward: RewardResult | None = None) -> dict[str, Any]:
    """One step as a log line. ``reward`` stands in for the reward step's result when the
    log is written before that result is recorded on the row."""
    result = step.result or {}
    line: dict[str, Any] = {
        "job_id": ep.job_id,
        "episode_id": ep.id,
        "task_id": ep.task_id,
        "iteration": ep.iteration,
        "turn": step.turn,
        "kind": step.kind,
        "attempt": step.attempt,
        "state": step.state,
        "started_at": _iso(step.created_at),
        "completed_at": _iso(step.completed_at),
        "duration_s": _duration(step),
    }
    if step.kind == "inference":
        line.update(
            finish_reason=result.get("finish_reason"),
            policy_version=result.get("policy_version"),
            backend=result.get("backend"),
            prompt_tokens=len(step.request.get("prompt_ids") or []),
            completion_tokens=len(result.get("token_ids") or []),
            action=(result.get("action") or {}).get("kind"),
            text=result.get("text"),
        )
        if "observation" in result:  # a malformed action: its error was the observation
            line["observation"] = result["observation"]
    elif step.kind == "sandbox":
        execution = result.get("exec") or {}
        line.update(
            action=step.request.get("action"),
            worker=result.get("worker"),
            snapshot_key=result.get("snapshot_key"),
        )
        line.update({name: execution.get(name) for name in SANDBOX_FIELDS})
    elif step.kind == "reward":
        if reward is not None:  # recorded on the row in the transaction after this write
            finished = utcnow()
            started = _iso(step.created_at)
            line.update(
                state="done",
                completed_at=finished.isoformat(),
                duration_s=round((finished - datetime.fromisoformat(started)).total_seconds(), 6)
                if started
                else None,
                reward=reward.reward,
                components={k: v.model_dump(mode="json") for k, v in reward.components.items()},
            )
        else:
            line.update(reward=result.get("reward"), components=result.get("components"))
    return line


def build_episode_log(ep: Episode, steps: Sequence[Step], reward: RewardResult | None = None) -> bytes:
    """The episode's steps in order (turn, then the order they were issued), as JSON lines."""
    ordered = sorted(steps, key=lambda s: (s.turn, s.id or 0))
    lines = [
        json.dumps(step_line(ep, s, reward if s.kind == "reward" else None), default=str) for s in ordered
    ]
    return ("\n".join(lines) + "\n").encode() if lines else b""


def read_episode_log(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
