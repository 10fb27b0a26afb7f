"""An episode as a person reads it: each turn's prompt (decoded), the model's action, the
sandbox's observation with its kill reason, and the reward vector.

A scored episode is read from its stored :class:`temper.trajectory.Trajectory`; one still
in progress (or one whose trajectory was never written or has expired) from its steps,
through :func:`temper.episode_steps.read_steps` (Postgres, or their archive).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.api import schemas
from services.dispatcher.api.repo import episode_out
from temper.db import Episode, Job
from temper.episode_log import build_episode_log, log_key
from temper.episode_steps import read_steps
from temper.storage import NotFound, ObjectStore
from temper.trajectory import Trajectory

log = logging.getLogger("temper.dispatcher.transcripts")


def decode_tokens(ids: Iterable[int] | None, policy: Any = None) -> str:
    """Token ids as text with the job's policy tokenizer (``policy``: its spec's
    ``policy`` block, if known); empty if there are none."""
    ids = list(ids or [])
    if not ids:
        return ""
    try:
        from temper.policy.tokenizer import policy_tokenizer

        model, init = (policy or {}).get("model"), (policy or {}).get("init")
        return policy_tokenizer(model, init).decode(ids, skip_special=False)
    except Exception:  # noqa: BLE001 - a transcript without text beats no transcript
        return f"<{len(ids)} tokens>"


async def load_trajectory(store: ObjectStore, key: str) -> Trajectory | None:
    try:
        return Trajectory.model_validate_json(await store.get(key))
    except NotFound:
        return None
    except ValueError:
        log.warning("trajectory %s does not parse", key)
        return None


def reward_vector(rewards: dict[str, Any]) -> dict[str, Any]:
    """The components of a stored trajectory's rewards (``{"components": {...}, "format_ok": ...}``
    as the episode state machine writes them) by name, with ``format_ok`` beside them."""
    components = rewards.get("components")
    if not isinstance(components, dict):
        return rewards
    out = dict(components)
    if "format_ok" in rewards:
        out.setdefault("format_ok", rewards["format_ok"])
    return out


def from_trajectory(episode: Episode, traj: Trajectory) -> schemas.Transcript:
    turns: list[schemas.TranscriptTurn] = []
    pending: list[str] = []
    pending_tokens = 0
    for seg in traj.segments:
        text = seg.text or decode_tokens(seg.token_ids)
        if seg.role == "model":
            turns.append(
                schemas.TranscriptTurn(
                    turn=len(turns),
                    prompt="".join(pending),
                    prompt_tokens=pending_tokens,
                    action_text=text,
                    action_tokens=len(seg.token_ids),
                    policy_version=seg.policy_version,
                )
            )
            pending, pending_tokens = [], 0
        else:
            pending.append(text)
            pending_tokens += len(seg.token_ids)
    final_observation = "".join(pending)
    for i, record in enumerate(sorted(traj.turns, key=lambda r: r.turn)):
        if i >= len(turns):
            turns.append(schemas.TranscriptTurn(turn=i, prompt="", action_text=record.action_text))
        t = turns[i]
        t.turn = record.turn
        t.action = record.action
        t.observation = record.observation
        t.exit_code = record.exit_code
        t.kill_reason = record.kill_reason
        t.timings = record.timings
        if t.policy_version is None:
            t.policy_version = record.policy_version
        if not t.action_text:
            t.action_text = record.action_text
    if traj.turns and turns and final_observation and final_observation == turns[-1].observation:
        final_observation = ""
    versions = sorted(
        {s.policy_version for s in traj.segments if s.role == "model" and s.policy_version is not None}
    )
    return schemas.Transcript(
        episode=episode_out(episode),
        source="trajectory",
        turns=turns,
        final_observation=final_observation,
        reward=traj.reward,
        rewards=reward_vector(traj.rewards) if traj.rewards else episode.rewards,
        policy_versions=versions,
        timings={**episode.timings, **traj.timings},
    )


def _dig(data: dict[str, Any] | None, *names: str) -> Any:
    """The first of ``names`` found in ``data`` or in its nested ``result``/``observation``."""
    if not isinstance(data, dict):
        return None
    for scope in (data, data.get("result"), data.get("observation")):
        if isinstance(scope, dict):
            for name in names:
                if scope.get(name) is not None:
                    return scope[name]
    return None


def _observation_text(result: dict[str, Any] | None) -> str:
    text = _dig(result, "observation_text", "text")
    if isinstance(text, str):
        return text
    obs = _dig(result, "observation")
    if isinstance(obs, str):
        return obs
    parts = []
    for stream in ("stdout", "stderr"):
        value = _dig(result, stream)
        if value:
            parts.append(f"[{stream}]\n{value}")
    if not parts and result:
        return json.dumps(result, default=str)[:4000]
    return "\n".join(parts)


async def from_steps(session: AsyncSession, store: ObjectStore, episode: Episode) -> schemas.Transcript:
    steps = await read_steps(session, store, episode)
    job_spec = await session.scalar(select(Job.spec).where(Job.id == episode.job_id))
    policy = (job_spec or {}).get("policy") if isinstance(job_spec, dict) else None
    turns: dict[int, schemas.TranscriptTurn] = {}
    seen_ids: list[int] = []
    versions: set[int] = set()
    rewards: dict[str, Any] = dict(episode.rewards or {})
    for step in steps:
        if step.kind == "reward":
            components = _dig(step.result, "components")
            if isinstance(components, dict):
                rewards = rewards or components
            continue
        turn = turns.setdefault(step.turn, schemas.TranscriptTurn(turn=step.turn, prompt="", action_text=""))
        if step.kind == "inference":
            prompt_ids = list(step.request.get("prompt_ids") or [])
            new_ids = prompt_ids[len(seen_ids) :] if prompt_ids[: len(seen_ids)] == seen_ids else prompt_ids
            turn.prompt = step.request.get("prompt_text") or decode_tokens(new_ids, policy)
            turn.prompt_tokens = len(new_ids)
            token_ids = list(_dig(step.result, "token_ids") or [])
            turn.action_text = _dig(step.result, "text") or decode_tokens(token_ids, policy)
            turn.action_tokens = len(token_ids)
            version = _dig(step.result, "policy_version")
            if isinstance(version, int):
                turn.policy_version = version
                versions.add(version)
            seen_ids = prompt_ids + token_ids
        elif step.kind == "sandbox":
            action = step.request.get("action")
            turn.action = action if isinstance(action, dict) else {}
            if step.result is not None:
                turn.observation = _observation_text(step.result)
                exit_code = _dig(step.result, "exit_code", "exit_status", "returncode")
                turn.exit_code = exit_code if isinstance(exit_code, int) else None
                kill = _dig(step.result, "kill_reason", "killed")
                turn.kill_reason = kill if isinstance(kill, str) else None
                duration = _dig(step.result, "duration_s", "duration")
                if isinstance(duration, int | float):
                    turn.timings["sandbox_s"] = float(duration)
    return schemas.Transcript(
        episode=episode_out(episode),
        source="steps",
        turns=[turns[k] for k in sorted(turns)],
        reward=episode.reward,
        rewards=rewards,
        policy_versions=sorted(versions),
        timings=episode.timings,
    )


async def stored_log_key(store: ObjectStore, episode: Episode) -> str | None:
    """The key of the episode's log if it was written (the dispatcher writes it with the trajectory)."""
    if not episode.trajectory_key:
        return None
    key = log_key(episode.tenant_id, episode.job_id, episode.id)
    return key if await store.exists(key) else None


async def stored_log(session: AsyncSession, store: ObjectStore, episode: Episode) -> bytes | None:
    """The episode's log (JSON lines) once it is scored: the one written with its trajectory
    (one read, no separate existence check) or, once retention expired it, one built again
    from its steps (Postgres or their archive)."""
    if not episode.trajectory_key:
        return None
    try:
        return await store.get(log_key(episode.tenant_id, episode.job_id, episode.id))
    except NotFound:
        steps = await read_steps(session, store, episode)
        return build_episode_log(episode, steps) if steps else None


async def transcript(session: AsyncSession, store: ObjectStore, episode: Episode) -> schemas.Transcript:
    out: schemas.Transcript | None = None
    if episode.trajectory_key:
        traj = await load_trajectory(store, episode.trajectory_key)
        if traj is not None:
            out = from_trajectory(episode, traj)
    if out is None:
        out = await from_steps(session, store, episode)
    out.log_key = await stored_log_key(store, episode)
    return out
