"""Sft jobs in the trainer: no rollouts, the task set's conversations are the data.

The trainer's loop looks up the running sft jobs it owns (every second), loads each like
an RL job (:func:`services.trainer.learners.build_learner`: the initial policy, LoRA or
full weights, the latest version restored on top), encodes the job's conversations once
with the policy's tokenizer (:func:`temper.training.sft.encode_chat`), and makes one
step at a time, in turn with the RL jobs: step ``k``'s batch is a function of the seed
and ``k`` alone (:meth:`temper.jobspec.JobSpec.sft_batch`). Versions are published by
the RL jobs' path every ``checkpoint_every`` steps and after the last step; the
dispatcher completes the job once a version holds the last step. A crash loses the steps
since the last version, and a restarted trainer trains them again from it, on the same
batches.
"""

from __future__ import annotations

from sqlalchemy import select

from temper.db import Database, Job, Task
from temper.jobspec import JobSpec
from temper.lifecycle import JobState
from temper.policy.tokenizer import ChatTokenizer
from temper.tasks.service import sampleable
from temper.training.sft import encode_chat

Encoded = list[tuple[list[int], list[bool]]]
SHARDED_REFUSAL = (
    "sft jobs are not built for a sharded trainer (torchrun); run a single-process trainer for them"
)


async def running_sft_jobs(db: Database, job_id: str | None) -> list[str]:
    """The running sft jobs (all, or ``job_id`` only), oldest first."""
    query = select(Job.id, Job.spec).where(Job.state == JobState.running).order_by(Job.created_at, Job.id)
    if job_id:
        query = query.where(Job.id == job_id)
    async with db.session() as s:
        rows = list(await s.execute(query))
    return [jid for jid, spec in rows if (spec.get("algorithm") or {}).get("name") == "sft"]


async def conversations(db: Database, spec: JobSpec) -> list[Task]:
    """The job's data: the sampleable tasks of its task set, in id order."""
    async with db.session() as s:
        rows = await s.scalars(select(Task).where(sampleable(spec.tasks.taskset)).order_by(Task.id))
        return list(rows)


def encode_tasks(tok: ChatTokenizer, rows: list[Task]) -> Encoded:
    """Each chat task as (ids, mask of its trained turns); a task that is not a
    conversation (a task set of another kind) is an error naming it."""
    from temper.tasks.chat import ChatMessage

    out: Encoded = []
    for row in rows:
        spec = row.spec or {}
        if row.kind != "chat" or not spec.get("messages"):
            raise ValueError(f"task {row.key} is a {row.kind} task; an sft job trains on chat tasks only")
        messages = [ChatMessage.model_validate(m) for m in spec["messages"]]
        out.append(
            encode_chat(
                tok,
                [m.template_message() for m in messages],
                [m.trained for m in messages],
                tools=spec.get("tools") or None,
            )
        )
    return out
