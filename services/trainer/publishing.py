"""Publishing a job's trained steps as its next policy version: the files first (the
registry's layout, every rank's shard under torchrun), then one transaction with the
``policy_versions`` row, the ledger's steps, the job's ``policy_version`` and the
``policy.updates`` (not for jobs without episodes, which nothing serves) and
``policy.version`` messages through the outbox. A publish that
fails (object store or database down) is retried by the trainer's loop with backoff;
meanwhile the job says why (``stuck: ...``) and ``/health`` answers 503."""

from __future__ import annotations

import asyncio
import logging
import time

from sqlalchemy import update

from services.trainer import ledger
from services.trainer.buffer import TrainingJob
from services.trainer.learners import publish_tokenizer
from services.trainer.ranks import Ranks
from temper import faults, metrics, registry
from temper.bus.errors import DATABASE, NETWORK, OBJECT_STORE, unavailable_dependency
from temper.db import Database, Job, PolicyVersion
from temper.events import LifecycleEvent, PolicyUpdate, Topics
from temper.lifecycle import mark_job_stuck
from temper.logs import dependency_failed, dependency_recovered, log_event
from temper.outbox import enqueue
from temper.storage import ObjectStore
from temper.training import StepStats

log = logging.getLogger("temper.trainer")


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
    await faults.hold("trainer.publish", job_id=job.job_id, version=version)
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
        if not job.spec.is_offline:  # a job without episodes (sft, dpo, reward_model) is served nothing
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


PUBLISH_BACKOFF_MAX_S = 30.0


async def publish_failed(db: Database, job: TrainingJob, exc: BaseException) -> None:
    """A publish failed: keep the steps, retry with backoff (1 s doubling to 30 s), show why
    on the job (``stuck: ...``) and in the metrics."""
    now = time.monotonic()
    if job.publish_error is None:
        job.publish_failing_since = now
    job.publish_failures += 1
    job.publish_error = repr(exc)[:300]
    job.next_publish_at = now + min(PUBLISH_BACKOFF_MAX_S, 2.0 ** min(job.publish_failures - 1, 10))
    metrics.TRAINER_PUBLISH_FAILING.labels(job.job_id).set(1)
    metrics.TRAINER_PUBLISH_FAILURES.labels(job.job_id).inc()
    dependency = unavailable_dependency(exc)
    if dependency is not None:
        dependency_failed(log, dependency, exc, job_id=job.job_id, waiting="publishing a policy version")
    else:
        log_event(log, "policy version not published; retrying", logging.ERROR, job_id=job.job_id,
                  attempt=job.publish_failures, error=job.publish_error)  # fmt: skip
    why = f"trainer cannot publish policy version v{job.learner.version + 1}: {job.publish_error}"
    await set_stuck_reason(db, job.job_id, why)


async def publish_recovered(db: Database, job: TrainingJob, version: int) -> None:
    """A version was published after failures: clear the job's reason and the failing state."""
    stuck_s = time.monotonic() - job.publish_failing_since
    log_event(log, "policy version published after failures", job_id=job.job_id, version=version,
              failures=job.publish_failures, stuck_s=round(stuck_s, 1))  # fmt: skip
    job.publish_error, job.publish_failures, job.next_publish_at = None, 0, 0.0
    metrics.TRAINER_PUBLISH_FAILING.labels(job.job_id).set(0)
    for dependency in (OBJECT_STORE, DATABASE, NETWORK):
        dependency_recovered(log, dependency)
    await set_stuck_reason(db, job.job_id, None)


async def set_stuck_reason(db: Database, job_id: str, why: str | None) -> None:
    """Show (or clear) why the job does not move (:func:`temper.lifecycle.mark_job_stuck`)."""
    try:
        async with db.session() as s:
            await mark_job_stuck(s, job_id, why)
    except Exception as exc:  # noqa: BLE001 - the database may be what is down; /health says so
        log_event(log, "cannot record the job's stuck reason", logging.WARNING, job_id=job_id,
                  error=repr(exc)[:200])  # fmt: skip
