"""The reward result: the episode is scored.

Two transactions, with object storage between them: the first reads the episode and
its steps and builds the trajectory and the episode's log; both are put under keys
fixed per episode (a retry overwrites the same objects); the second locks the episode
again, checks the result is still the one awaited, records the reward, moves the
episode to ``scored`` and writes ``TrajectoryReady``, the ``episode.reward`` event and
the task's outcome. Object storage is slow, and no transaction waits on it.
"""

from __future__ import annotations

import asyncio
import logging

from services.dispatcher import repo
from services.dispatcher.episodes import EpisodeMachine, is_current
from services.dispatcher.trajectories import build_trajectory
from services.dispatcher.turns import observe_step
from temper.clock import utcnow
from temper.db import rows
from temper.episode_log import build_episode_log, log_key
from temper.episode_steps import read_steps
from temper.events import LifecycleEvent, RewardResult, Topics, TrajectoryReady
from temper.lifecycle import EpisodeState, complete_step, transition_episode
from temper.logs import log_context, log_event
from temper.outbox import enqueue
from temper.rewards import passed
from temper.storage import object_key
from temper.tasks.service import outcome_row

log = logging.getLogger("temper.dispatcher.rewards")

E = EpisodeState


async def on_reward(machine: EpisodeMachine, msg: RewardResult) -> None:
    with log_context(job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt):
        await _on_reward(machine, msg)


async def _on_reward(machine: EpisodeMachine, msg: RewardResult) -> None:
    episode_id = msg.episode_id or ""
    async with machine.tx() as session:
        conn = await session.connection()
        ep, step, _ = (await repo.lock_episodes(conn, [episode_id], "reward")).get(
            episode_id, (None, None, None)
        )
        why = is_current(ep, step, msg, E.scoring)
        if why:
            return machine.ignore(why, msg)
        assert ep is not None and step is not None
        if msg.error:
            await machine.retry_or_fail(session, ep, step, f"reward_error: {msg.error}")
            return None
        steps = await read_steps(conn, machine.store, ep)
        tok = machine.tok_of(await machine.spec_of(session, ep.job_id))
        trajectory = build_trajectory(ep, steps, msg, tok, finished_at=utcnow())
        key = object_key(ep.tenant_id, ep.job_id, "trajectories", f"{ep.id}.json")
        episode_log = build_episode_log(ep, steps, msg)
        episode_log_key = log_key(ep.tenant_id, ep.job_id, ep.id)
    # The log beside it, in one write: every step's sandbox output, timings and reward.
    await asyncio.gather(
        machine.store.put(key, trajectory.model_dump_json().encode(), "application/json"),
        machine.store.put(episode_log_key, episode_log, "application/x-ndjson"),
    )
    async with machine.tx() as session:
        conn = await session.connection()
        ep, step, _ = (await repo.lock_episodes(conn, [episode_id], "reward")).get(
            episode_id, (None, None, None)
        )
        why = is_current(ep, step, msg, E.scoring)
        if why:
            return machine.ignore(why, msg)
        assert ep is not None and step is not None
        components = {k: v.model_dump(mode="json") for k, v in msg.components.items()}
        complete_step(step, {"reward": msg.reward, "components": components})
        observe_step(step)
        ep.reward = msg.reward
        ep.rewards = components
        ep.trajectory_key = key
        ep.timings = {**ep.timings, **trajectory.timings}
        transition_episode(session, ep, E.scored)
        enqueue(
            session,
            Topics.EVENTS,
            LifecycleEvent(
                event="episode.reward",
                job_id=ep.job_id,
                episode_id=ep.id,
                turn=ep.turn,
                tenant=ep.tenant_id,
                reward=msg.reward,
                data={
                    "iteration": ep.iteration,
                    "task_id": ep.task_id,
                    "group_id": ep.group_id,
                    "components": {k: v.value for k, v in msg.components.items()},
                    "turns": ep.turn + 1,
                },
            ),
        )
        enqueue(
            session,
            Topics.TRAJECTORIES,
            TrajectoryReady(
                job_id=ep.job_id,
                episode_id=ep.id,
                task_id=ep.task_id,
                group_id=ep.group_id,
                trajectory_key=key,
                behaviour_version=trajectory.behaviour_version,
                reward=msg.reward,
            ),
        )
        # The task's outcome: this transaction is its only writer, once per scored episode.
        ok = passed(msg)
        outcome = outcome_row(
            episode_id=ep.id,
            task_id=ep.task_id,
            job_id=ep.job_id,
            policy_version=ep.behaviour_version,
            passed=ok,
            reward=msg.reward,
        )
        rows.stage(session, ep, step, outcome)
        log_event(log, "episode scored", reward=msg.reward, passed=ok, turns=ep.turn + 1)
    machine.on_finished()
    return None
