"""Jobs without episodes in the trainer (sft, dpo, reward_model): the task set's data is
what they learn from, conversations (sft) or preference pairs (dpo, reward_model).

The trainer's loop looks up the running jobs of these kinds it owns (every second), loads
each like an RL job (:func:`services.trainer.learners.build_learner`: the initial policy,
or for a reward model a sequence classifier on its body; LoRA or full weights; the latest
version restored on top), encodes the job's data once with the policy's tokenizer
(:func:`encode_tasks`), and makes one step at a time, in turn with the RL jobs: step
``k``'s batch is a function of the seed and ``k`` alone
(:meth:`temper.jobspec.JobSpec.sft_batch`). Versions are published by the RL jobs' path
every ``checkpoint_every`` steps and after the last step; the dispatcher completes the
job once a version holds the last step. A crash loses the steps since the last version,
and a restarted trainer trains them again from it, on the same batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from temper.db import Database, Job, Task
from temper.jobspec import OFFLINE_DATA, Algorithm, JobSpec
from temper.lifecycle import JobState
from temper.policy.tokenizer import ChatTokenizer
from temper.tasks.service import sampleable
from temper.training import Learner, StepStats, reward_model
from temper.training.sft import encode_chat

# sft: (ids, trained mask); dpo: ((ids, mask), (ids, mask)); reward_model: (chosen ids, rejected ids)
Encoded = list[Any]
SHARDED_REFUSAL = (
    "sft, dpo and reward_model jobs are not built for a sharded trainer (torchrun); run a single-process "
    "trainer for them"
)


async def running_sft_jobs(db: Database, job_id: str | None) -> list[str]:
    """The running jobs without episodes (all, or ``job_id`` only), oldest first."""
    query = select(Job.id, Job.spec).where(Job.state == JobState.running).order_by(Job.created_at, Job.id)
    if job_id:
        query = query.where(Job.id == job_id)
    async with db.session() as s:
        rows = list(await s.execute(query))
    offline = {a.value for a in OFFLINE_DATA}
    return [jid for jid, spec in rows if (spec.get("algorithm") or {}).get("name") in offline]


async def conversations(db: Database, spec: JobSpec) -> list[Task]:
    """The job's data: the sampleable tasks of its task set, in id order."""
    async with db.session() as s:
        rows = await s.scalars(select(Task).where(sampleable(spec.tasks.taskset)).order_by(Task.id))
        return list(rows)


def encode_tasks(tok: ChatTokenizer, rows: list[Task], spec: JobSpec) -> Encoded:
    """The job's data encoded for its step: sft, each conversation as (ids, mask of its
    trained turns); dpo, each pair as two of those (the prompt's turns untrained); a
    reward model, each pair as the ids of its two whole conversations. A task of another
    kind is an error naming it."""
    from temper.tasks.chat import ChatMessage

    kind = spec.data_kind
    out: Encoded = []
    for row in rows:
        data = row.spec or {}
        if row.kind != kind:
            raise ValueError(
                f"task {row.key} is a {row.kind} task; a {spec.algorithm.name} job trains on {kind} tasks only"
            )
        tools = data.get("tools") or None
        prompt = [ChatMessage.model_validate(m) for m in data.get("messages") or []]
        if spec.algorithm.name is Algorithm.sft:
            out.append(
                encode_chat(
                    tok, [m.template_message() for m in prompt], [m.trained for m in prompt], tools=tools
                )
            )
            continue
        sides: list[Any] = []
        for name in ("chosen", "rejected"):
            said = [ChatMessage.model_validate(m) for m in data.get(name) or []]
            messages = [m.template_message() for m in (*prompt, *said)]
            if spec.algorithm.name is Algorithm.reward_model:
                sides.append(reward_model.encode(tok, messages, tools=tools))
            else:
                sides.append(
                    encode_chat(tok, messages, [False] * len(prompt) + [m.trained for m in said], tools=tools)
                )
        out.append((sides[0], sides[1]))
    return out


def step_of(spec: JobSpec, learner: Learner) -> Callable[[Encoded], StepStats]:
    """The learner's step for the job's algorithm (the batch as :func:`encode_tasks` gives it)."""
    if spec.algorithm.name is Algorithm.dpo:
        return learner.step_pairs
    if spec.algorithm.name is Algorithm.reward_model:
        return learner.step_preferences
    return learner.step_conversations
