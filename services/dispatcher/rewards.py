"""The reward result: the episode is scored.

Two transactions, with object storage between them: the first reads the episodes and
their steps and builds each trajectory and episode log; they are put under keys fixed
per episode (a retry overwrites the same objects); the second locks the episodes again,
checks each result is still the one awaited, records the reward, moves the episode to
``scored`` and writes ``TrajectoryReady``, the ``episode.reward`` event and the task's
outcome. Object storage is slow, and no transaction waits on it. Reward results handed
over together (``batches.py``) share both transactions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from services.dispatcher import evaluation, repo
from services.dispatcher.episodes import EpisodeMachine, is_current
from services.dispatcher.trajectories import build_agent_trajectory, build_trajectory
from services.dispatcher.turns import observe_step
from temper.agent_traces import calls_of
from temper.clock import utcnow
from temper.db import Episode, Step, rows
from temper.db.core import CoreTx
from temper.episode_log import build_episode_log, log_key
from temper.episode_steps import read_steps_of
from temper.events import LifecycleEvent, RewardResult, Topics, TrajectoryReady
from temper.jobspec import AGENT_KIND, JobSpec
from temper.lifecycle import EpisodeState, complete_step, transition_episode
from temper.logs import log_context, log_event
from temper.outbox import enqueue
from temper.rewards import passed
from temper.storage import object_key
from temper.tasks.service import outcome_row
from temper.trajectory import Trajectory

log = logging.getLogger("temper.dispatcher.rewards")

E = EpisodeState


async def on_reward(machine: EpisodeMachine, msg: RewardResult) -> None:
    await on_rewards(machine, [msg])


@dataclass
class _Scored:
    """What the first transaction read for one awaited reward result."""

    msg: RewardResult
    key: str
    trajectory: Trajectory
    spec: JobSpec


async def on_rewards(machine: EpisodeMachine, messages: Sequence[RewardResult]) -> None:
    """Reward results of distinct episodes: one transaction reads them all (the episodes,
    their steps), the trajectories and logs are put, and one transaction takes them (each
    checked again: a duplicate that raced this one is ignored)."""
    ids = [m.episode_id for m in messages]
    if None in ids or len(set(ids)) < len(ids):
        raise ValueError("a batch of reward results is of distinct episodes")
    scored: list[_Scored] = []
    puts = []
    async with machine.core_tx() as tx:
        locked = await repo.lock_episodes(tx, sorted(i for i in ids if i), "reward")
        steps_of = await read_steps_of(tx, machine.store, [found.ep for found in locked.values()])
        for msg in messages:
            ep, step, _, _ = locked.get(msg.episode_id or "") or (None, None, None, 0)
            with log_context(
                job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt
            ):
                why = is_current(ep, step, msg, E.scoring)
                if why:
                    machine.ignore(why, msg)
                    continue
                assert ep is not None and step is not None
                if msg.error:
                    await machine.retry_or_fail(tx, ep, step, f"reward_error: {msg.error}")
                    continue
                steps = steps_of[ep.id]
                spec = await machine.spec_of(tx, ep.job_id)
                tok = machine.tok_of(spec)
                if spec.environment.kind == AGENT_KIND:  # its model calls are on record at the gateway
                    calls = await calls_of(tx, machine.store, ep.id)
                    trajectory = build_agent_trajectory(ep, steps, calls, msg, tok, finished_at=utcnow())
                else:
                    trajectory = build_trajectory(ep, steps, msg, tok, finished_at=utcnow())
                key = object_key(ep.tenant_id, ep.job_id, "trajectories", f"{ep.id}.json")
                # The log beside it, in one write: every step's sandbox output, timings and reward.
                puts.append(machine.store.put(key, trajectory.model_dump_json().encode(), "application/json"))
                log_bytes = build_episode_log(ep, steps, msg)
                puts.append(
                    machine.store.put(
                        log_key(ep.tenant_id, ep.job_id, ep.id), log_bytes, "application/x-ndjson"
                    )
                )
                scored.append(_Scored(msg, key, trajectory, spec))
    if not scored:
        return
    await asyncio.gather(*puts)
    async with machine.core_tx() as tx:
        locked = await repo.lock_episodes(tx, sorted(s.msg.episode_id or "" for s in scored), "reward")
        for item in scored:
            msg = item.msg
            ep, step, _, _ = locked.get(msg.episode_id or "") or (None, None, None, 0)
            with log_context(
                job_id=msg.job_id, episode_id=msg.episode_id, turn=msg.turn, attempt=msg.attempt
            ):
                why = is_current(ep, step, msg, E.scoring)
                if why:
                    machine.ignore(why, msg)
                    continue
                assert ep is not None and step is not None
                _score(tx, ep, step, item)
    for _ in scored:
        machine.on_finished()


def _score(tx: CoreTx, ep: Episode, step: Step, item: _Scored) -> None:
    """Record the reward, move the episode to ``scored``, write ``TrajectoryReady``, the
    ``episode.reward`` event and the task's outcome. An evaluation job's episode writes its
    evaluation verdict instead of the last two (``evaluation.py``): it is never trained on and
    no training pass rate counts it."""
    msg, key, trajectory = item.msg, item.key, item.trajectory
    verdict = evaluation.outcome(ep, item.spec, msg, trajectory) if item.spec.evaluate is not None else None
    if isinstance(verdict, str):  # sampled by another version than the one it evaluates
        complete_step(step, {"reward": msg.reward, "components": {}})
        transition_episode(tx, ep, E.failed, reason=verdict)
        rows.stage(tx, ep, step)
        log_event(log, "episode failed", logging.WARNING, reason=verdict)
        return
    components = {k: v.model_dump(mode="json") for k, v in msg.components.items()}
    complete_step(step, {"reward": msg.reward, "components": components})
    observe_step(step)
    ep.reward = msg.reward
    ep.rewards = components
    ep.trajectory_key = key
    ep.timings = {**ep.timings, **trajectory.timings}
    transition_episode(tx, ep, E.scored)
    enqueue(
        tx,
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
    if verdict is not None:
        rows.stage(tx, ep, step, verdict)
        log_event(
            log, "evaluation episode scored", reward=msg.reward, passed=verdict.passed, turns=ep.turn + 1
        )
        return
    enqueue(
        tx,
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
    rows.stage(tx, ep, step, outcome)
    log_event(log, "episode scored", reward=msg.reward, passed=ok, turns=ep.turn + 1)
