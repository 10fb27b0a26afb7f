"""Agent episodes (``environment.kind: agent``): the episode is one sandbox step, the run
of the user's agent program, which calls the policy through the gateway at the episode's
own base URL (``temper.envs.agent``); the gateway records every call
(``temper.agent_traces``). When the run ends the episode is scored like any other, and
its trajectory is built from the recorded calls (``trajectories.build_agent_trajectory``).

Nothing here reads or writes the database but the count of calls: the caller locked the
rows and writes what changed.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import bindparam, func, select

from services.dispatcher.fairshare import sandbox_cpu_s, sandbox_memory_gb_s
from services.dispatcher.turns import Turns, observe_step
from temper.agent_traces import issue_key
from temper.clock import utcnow
from temper.db import AgentCall, Episode, Step
from temper.db.core import CoreTx
from temper.db.rows import HasInfo
from temper.envs import AgentEnvironment, ParsedAction, truncate_middle
from temper.events import SandboxRequest, SandboxResult
from temper.jobspec import JobSpec
from temper.lifecycle import EpisodeState, complete_step, transition_episode

E = EpisodeState
_c = AgentCall.__table__.c
_CALLS = select(func.count(), func.coalesce(func.sum(_c.prompt_tokens + _c.completion_tokens), 0)).where(
    _c.episode_id == bindparam("episode_id"), _c.attempt == bindparam("attempt")
)


def start_run(
    turns: Turns,
    session: HasInfo,
    ep: Episode,
    spec: JobSpec,
    env: AgentEnvironment,
    *,
    gateway_url: str,
) -> Step:
    """The agent's run as the episode's first step: a key for this episode (kept until
    every attempt of the run could have ended), the sandbox request that runs the agent's
    command with its base URL and key, on an allowlist network that reaches the gateway."""
    wall_s = float(env.limits["wall_s"])
    attempts = turns.settings.max_step_attempts
    expires_at = utcnow() + timedelta(seconds=attempts * (wall_s + turns.settings.lease_s))
    key = issue_key(
        session, episode_id=ep.id, job_id=ep.job_id, tenant_id=ep.tenant_id, expires_at=expires_at
    )
    request = SandboxRequest(
        job_id=ep.job_id,
        episode_id=ep.id,
        turn=0,
        session_id=ep.session_id or ep.id,
        action=env.run_action(gateway_url=gateway_url, episode_id=ep.id, key=key, model=spec.policy.model),
        limits=env.sandbox_limits(gateway_url),
        files=env.setup_files(),
        setup=env.setup_actions(),
    )
    step = turns.issue(session, ep, "sandbox", request, extra_s=wall_s)
    transition_episode(session, ep, E.acting)
    return step


async def take_run(
    turns: Turns,
    tx: CoreTx,
    ep: Episode,
    step: Step,
    msg: SandboxResult,
    spec: JobSpec,
    env: AgentEnvironment,
) -> Step | None:
    """The agent's run ended: record it, then ask for the reward (its answer is the last
    line it printed; the workspace is in the snapshot). A run that made no model call
    has nothing to learn from: the episode fails with what the program said."""
    (found,) = await tx.rows(_CALLS, {"episode_id": ep.id, "attempt": step.attempt})
    calls, tokens = int(found[0]), int(found[1])
    result = msg.result or {}
    stdout, stderr = str(result.get("stdout") or ""), str(result.get("stderr") or "")
    ep.sandbox_cpu_s = (ep.sandbox_cpu_s or 0.0) + sandbox_cpu_s(msg)
    ep.sandbox_memory_gb_s = (ep.sandbox_memory_gb_s or 0.0) + sandbox_memory_gb_s(msg)
    ep.inference_tokens = (ep.inference_tokens or 0) + tokens
    complete_step(
        step,
        {
            "exec": result,
            "worker": msg.worker,
            "snapshot_key": msg.snapshot_key,
            "calls": calls,
            "observation": truncate_middle(stdout, turns.settings.max_observation_chars),
        },
    )
    observe_step(step)
    if msg.snapshot_key:
        ep.snapshot_key = msg.snapshot_key
    if calls == 0:
        status = result.get("kill_reason") or f"exit code {result.get('exit_code')}"
        said = truncate_middle((stderr or stdout).strip(), 1500) or "no output"
        transition_episode(
            tx, ep, E.failed, reason=f"agent_error: the agent made no model call ({status}): {said}"
        )
        return None
    return turns.issue_reward(tx, ep, spec, env, ParsedAction("submit"), final_text=stdout, turns_used=calls)
