"""An sft job's data from another job's episodes (rejection sampling, filtered fine-tuning).

``tasks.from_job`` names a finished job of the tenant (an RL job; any job with scored
episodes). At submission its scored episodes are filtered (reward at least
``tasks.min_reward`` when given, then each task's ``tasks.best_of`` best by reward, ties by
episode id) and each becomes a conversation (``kind: chat``) in a new task set of the
tenant, which the spec then names in ``tasks.taskset``: the sft job trains on it as on any
task set, and the set can be read like any other (``GET /v1/tasksets/{id}``). Nothing goes
through a file the user downloads and uploads again.

A conversation is the episode as its policy saw it: the environment's first messages (its
system prompt, the task) and tools, then per turn the model's reply as it wrote it (every
reply trained) and what the sandbox answered, in the environment's tool role (a turn's
several results joined, as the trajectory keeps them). The turns come from the episode's
stored trajectory, else from its steps.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from services.dispatcher.api.transcripts import load_trajectory
from temper.db import Episode, Job, Task, TaskSet
from temper.envs import environment_options, make_environment
from temper.envs.tools import call_id
from temper.episode_steps import read_steps
from temper.jobspec import OFFLINE_DATA, JobSpec
from temper.lifecycle import JOB_TERMINAL, EpisodeState
from temper.problems import clip
from temper.rewards import transcript as transcripts
from temper.tasks.models import TaskKind, TaskSpec
from temper.tasks.service import create_taskset

FIELD = "tasks.from_job"
SCORED = (EpisodeState.scored, EpisodeState.trained)


async def taskset_from_episodes(
    session: AsyncSession, *, spec: JobSpec, tenant_id: str, store: Any
) -> list[tuple[str, str]]:
    """Make the task set of ``spec.tasks.from_job``'s filtered episodes and name it in
    ``spec.tasks.taskset`` (nothing to do when it names one already: a rerun's stored
    spec); or the problems, for the field."""
    t = spec.tasks
    if t.from_job is None:
        return []
    if t.taskset:  # a rerun's stored spec names the set made from the job; any other set is refused
        made = await session.get(TaskSet, t.taskset)
        if made is None or made.tenant_id != tenant_id or made.source != f"episodes:{t.from_job}":
            return [(FIELD, f"give tasks.from_job or tasks.taskset, not both (the task set {clip(t.taskset)} "
                            f"was not made from job {clip(t.from_job)}'s episodes)")]  # fmt: skip
        return []
    source = await session.get(Job, t.from_job)
    if source is None or source.tenant_id != tenant_id:
        source = await session.scalar(select(Job).where(Job.tenant_id == tenant_id, Job.handle == t.from_job))
    if source is None:
        return [(FIELD, f"no job of yours has the id or handle {clip(t.from_job)}")]
    if source.state not in {s.value for s in JOB_TERMINAL}:
        return [(FIELD, f"job {source.id} is {source.state}: its episodes are taken once it has ended")]
    if ((source.spec.get("algorithm") or {}).get("name")) in {a.value for a in OFFLINE_DATA}:
        return [(FIELD, f"job {source.id} ran no episodes (it is a {source.spec['algorithm']['name']} job)")]
    query = select(Episode).where(
        Episode.job_id == source.id, Episode.state.in_([s.value for s in SCORED]), Episode.reward.is_not(None)
    )
    if t.min_reward is not None:
        query = query.where(Episode.reward >= t.min_reward)
    best: dict[str, list[Episode]] = {}
    for ep in (
        await session.execute(query.order_by(Episode.task_id, Episode.reward.desc(), Episode.id))
    ).scalars():
        kept = best.setdefault(ep.task_id, [])
        if len(kept) < (t.best_of or 1):
            kept.append(ep)
    if not best:
        floor = f" with reward at least {t.min_reward:g}" if t.min_reward is not None else ""
        return [(FIELD, f"job {source.id} has no scored episode{floor}")]
    source_spec = JobSpec.model_validate(source.spec)
    rows = {
        row.id: row for row in (await session.execute(select(Task).where(Task.id.in_(list(best))))).scalars()
    }
    conversations = []
    for task_id, episodes in best.items():
        for ep in episodes:
            made_one = await _conversation(session, store, source_spec, rows[task_id], ep)
            if made_one is not None:
                conversations.append(made_one)
    if not conversations:
        return [(FIELD, f"job {source.id}'s selected episodes have no reply to train on")]
    name = f"{source.handle or source.id}-best-of-{t.best_of}"
    made = await create_taskset(
        session, store, tenant_id, name, conversations, source=f"episodes:{source.id}"
    )
    t.from_job = source.id  # the id, not a handle a later job could take
    t.taskset = made.id
    return []


async def _conversation(
    session: AsyncSession, store: Any, spec: JobSpec, task: Task, ep: Episode
) -> TaskSpec | None:
    """The episode as a chat task, or None when it holds no reply."""
    env_spec = spec.environment
    env = make_environment(env_spec.kind or task.kind, task, **environment_options(env_spec))
    trajectory = await load_trajectory(store, ep.trajectory_key) if ep.trajectory_key and store else None
    if trajectory is not None and trajectory.turns:
        said = transcripts.from_trajectory("", trajectory, tool_role=env.tool_role)
    else:
        steps = await read_steps(session, store, ep)
        said = transcripts.from_steps("", steps, tool_role=env.tool_role)
    messages: list[dict[str, Any]] = list(env.first_messages())
    for i, m in enumerate(said.messages[1:]):  # the transcript's first message is its task prompt
        if m["role"] == "tool":
            m = {**m, "tool_call_id": call_id(ep.id, i)}
        messages.append(m)
    while messages and messages[-1]["role"] != "assistant":  # what follows the last reply is not trained
        messages.pop()
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return TaskSpec.model_validate(
        {
            "id": f"{task.key}/{ep.id}",
            "kind": TaskKind.chat.value,
            "messages": messages,
            "tools": env.tool_schemas(),
            "metadata": {"source": f"episode:{ep.id}", "reward": ep.reward, "task": task.key},
        }
    )
