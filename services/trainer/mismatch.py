"""What the trainer does with the logprob canary's verdict on a batch
(``temper.training.canary``; the job's ``algorithm.mismatch``): the metrics, a log line,
and the job's reason while its engine's logprobs are not its version's, or (``halt``) the
job paused with that reason."""

from __future__ import annotations

import logging

from services.trainer.buffer import TrainingJob
from services.trainer.observe import observe_canary
from services.trainer.publishing import set_stuck_reason
from temper.db import Database, Job, PolicyVersion
from temper.jobspec import OnMismatch
from temper.lifecycle import JobState, transition_job
from temper.logs import log_event
from temper.training import StepStats

log = logging.getLogger("temper.trainer")


async def record_canary(db: Database, job: TrainingJob, stats: StepStats) -> None:
    """Record a step's canary figures. A failed batch logs an error with the figures and sets
    the job's reason (``stuck: logprob mismatch ...``); the next batch that passes clears the
    reason it set (a publish failure's reason is left alone)."""
    observe_canary(job.job_id, stats)
    if not stats.canary:
        return
    await on_version_row(db, job.job_id, stats)
    m = job.spec.algorithm.mismatch
    if stats.mismatch_tokens == 0:
        log_event(log, "policy version not checked by the canary: none of its tokens in the batch",
                  logging.WARNING, job_id=job.job_id, version=stats.version)  # fmt: skip
        return
    if not stats.mismatch_failed:
        if job.mismatch_reason and job.publish_error is None:
            job.mismatch_reason = None
            await set_stuck_reason(db, job.job_id, None)
        return
    what = "refused" if stats.refused else "trained on"
    why = (
        f"logprob mismatch at v{stats.version}: {stats.mismatch_share:.1%} of {stats.mismatch_tokens} "
        f"tokens past {m.tolerance:g} (mean {stats.mismatch_mean:.3g}, max {stats.mismatch_max:.3g}); "
        f"the batch was {what} (algorithm.mismatch.on_mismatch: {m.on_mismatch})"
    )
    log_event(log, "behaviour logprobs are not the version's", logging.ERROR, job_id=job.job_id,
              version=stats.version, tokens=stats.mismatch_tokens, share=round(stats.mismatch_share, 4),
              mean=stats.mismatch_mean, max=stats.mismatch_max, refused=bool(stats.refused))  # fmt: skip
    if m.on_mismatch is OnMismatch.halt:
        await pause(db, job.job_id, why)
        return
    job.mismatch_reason = why
    await set_stuck_reason(db, job.job_id, why)


async def on_version_row(db: Database, job_id: str, stats: StepStats) -> None:
    """Add a canary step's figures to the row of the version it checked (``metrics.logprob_canary``:
    tokens checked, mean and max |Δ|, tokens past the tolerance, failed batches; ``tokens``
    0: not checked). Version 0, the base, has no row."""
    if stats.version < 1:
        return
    try:
        async with db.session() as s:
            row = await s.get(PolicyVersion, (job_id, stats.version))
            if row is None:
                return
            was = dict((row.metrics or {}).get("logprob_canary") or {})
            tokens = int(was.get("tokens", 0)) + stats.mismatch_tokens
            total = (
                float(was.get("mean", 0.0)) * int(was.get("tokens", 0))
                + stats.mismatch_mean * stats.mismatch_tokens
            )
            canary = {
                "tokens": tokens,
                "mean": total / tokens if tokens else 0.0,
                "max": max(float(was.get("max", 0.0)), stats.mismatch_max),
                "over": int(was.get("over", 0)) + round(stats.mismatch_share * stats.mismatch_tokens),
                "failed_batches": int(was.get("failed_batches", 0)) + int(stats.mismatch_failed),
            }
            row.metrics = {**(row.metrics or {}), "logprob_canary": canary}
    except Exception as exc:  # noqa: BLE001 - figures, not state: the step goes on
        log_event(log, "cannot record the canary on the version row", logging.WARNING, job_id=job_id,
                  version=stats.version, error=repr(exc)[:200])  # fmt: skip


async def pause(db: Database, job_id: str, why: str) -> None:
    """Pause a running job with ``why`` as its reason (a person resumes it over the API)."""
    try:
        async with db.session() as s:
            row = await s.get(Job, job_id)
            if row is not None and row.state == JobState.running:
                await transition_job(s, row, JobState.paused, reason=why[:500])
    except Exception as exc:  # noqa: BLE001 - the database may be what is down; /health says so
        log_event(log, "cannot pause the job", logging.ERROR, job_id=job_id, error=repr(exc)[:200])
