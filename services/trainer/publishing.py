"""Publishing a job's trained steps as its next policy version: the files first (the
registry's layout, every rank's shard under torchrun), then one transaction with the
``policy_versions`` row, the ledger's steps, the job's ``policy_version`` and the
``policy.updates`` and ``policy.version`` messages through the outbox."""

from __future__ import annotations

import asyncio

from sqlalchemy import update

from services.trainer import ledger
from services.trainer.buffer import TrainingJob
from services.trainer.learners import publish_tokenizer
from services.trainer.ranks import Ranks
from temper import registry
from temper.db import Database, Job, PolicyVersion
from temper.events import LifecycleEvent, PolicyUpdate, Topics
from temper.outbox import enqueue
from temper.storage import ObjectStore
from temper.training import StepStats


async def publish(
    job: TrainingJob, *, db: Database, store: ObjectStore, ranks: Ranks, stats: StepStats | None = None
) -> tuple[int, str]:
    """Publish the learner's weights as the next version; returns it and its manifest key. Called with the job's
    ``train_lock`` held. The learner's version and the job's step bookkeeping move on only
    once the transaction committed."""
    learner = job.learner
    version = learner.version + 1
    prefix = registry.version_prefix(job.tenant_id, job.job_id, version)
    base_model = job.spec.policy.init or job.spec.policy.model
    tokenizer = await asyncio.to_thread(publish_tokenizer, job.spec)
    if ranks.sharded:
        # every rank writes its shard of the state; rank 0 the served weights and manifest
        args = {"job_id": job.job_id, "prefix": prefix, "version": version, "base_model": base_model}
        async with ranks.turn("publish", args):
            key = await learner.publish_version(
                store, prefix, job_id=job.job_id, version=version, base_model=base_model, tokenizer=tokenizer
            )
    else:
        key = await learner.publish_version(
            store, prefix, job_id=job.job_id, version=version, base_model=base_model, tokenizer=tokenizer
        )
    summary = stats.as_dict() if stats is not None else {}
    async with db.session() as s:
        s.add(
            PolicyVersion(
                job_id=job.job_id,
                version=version,
                checkpoint_key=key,
                step=learner.step_count,
                metrics=summary,
                train_s=round(job.seconds_since_checkpoint, 6),
            )
        )
        await ledger.record_steps(s, job.uncheckpointed)
        await s.execute(
            update(Job)
            .where(Job.id == job.job_id, Job.policy_version < version)
            .values(policy_version=version)
        )
        enqueue(
            s,
            Topics.POLICY_UPDATES,
            PolicyUpdate(job_id=job.job_id, version=version, checkpoint_key=key, step=learner.step_count),
        )
        enqueue(
            s,
            Topics.EVENTS,
            LifecycleEvent(
                event="policy.version", job_id=job.job_id, tenant=job.tenant_id, version=version, data=summary
            ),
        )
    learner.version = version
    job.uncheckpointed.clear()
    job.steps_since_checkpoint = 0
    job.seconds_since_checkpoint = 0.0
    return version, key
