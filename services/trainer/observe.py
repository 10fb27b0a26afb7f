"""The trainer's per-job metrics, apart from the component so that they load without torch
(tests/deploy/test_dashboard_series.py runs them as the trainer does)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from temper import metrics

if TYPE_CHECKING:
    from temper.training import StepStats


def init_job_metrics(job_id: str, version: int) -> None:
    """A loaded job's policy version, and its step, skip and publish-failure counts at 0
    (metrics.zero says why)."""
    metrics.POLICY_VERSION.labels(job_id).set(version)
    metrics.TRAINER_PUBLISH_FAILING.labels(job_id).set(0)
    for counter in (
        metrics.TRAINER_STEPS,
        metrics.TRAINER_SKIPPED_GROUPS,
        metrics.TRAINER_PUBLISH_FAILURES,
        metrics.TRAINER_LOGPROB_CHECKED,
        metrics.TRAINER_MISMATCHED_BATCHES,
        metrics.TRAINER_UNCHECKED_VERSIONS,
    ):
        metrics.zero(counter, job_id)


def observe_step(job_id: str, stats: StepStats) -> None:
    """One optimizer step's figures: the last-step gauges of the trainer's panels."""
    metrics.TRAINER_STEPS.labels(job_id).inc()
    metrics.TRAINER_LOSS.labels(job_id).set(stats.loss)
    metrics.TRAINER_REWARD_MEAN.labels(job_id).set(stats.reward_mean)
    metrics.TRAINER_REWARD_STD.labels(job_id).set(stats.reward_std)
    metrics.TRAINER_KL.labels(job_id).set(stats.kl)
    metrics.TRAINER_CLIP_FRACTION.labels(job_id).set(stats.clip_fraction)
    metrics.TRAINER_TOKENS_PER_SECOND.labels(job_id).set(stats.tokens_per_s)
    for s in stats.staleness:
        metrics.TRAINER_STALENESS.observe(s)
    metrics.TRAINER_TOKEN_STALENESS.labels(job_id, "mean").set(stats.token_staleness_mean)
    metrics.TRAINER_TOKEN_STALENESS.labels(job_id, "max").set(stats.token_staleness_max)
    metrics.TRAINER_MULTI_VERSION_SHARE.labels(job_id).set(stats.multi_version_share)


def observe_canary(job_id: str, stats: StepStats) -> None:
    """The logprob canary's figures of a step that ran it (``stats.canary``): a step with
    nothing to check counts as an unchecked version, never as a pass."""
    if not stats.canary:
        return
    if stats.mismatch_tokens == 0:
        metrics.TRAINER_UNCHECKED_VERSIONS.labels(job_id).inc()
        return
    metrics.TRAINER_LOGPROB_CHECKED.labels(job_id).inc(stats.mismatch_tokens)
    for stat, value in (
        ("mean", stats.mismatch_mean),
        ("max", stats.mismatch_max),
        ("share", stats.mismatch_share),
    ):
        metrics.TRAINER_LOGPROB_MISMATCH.labels(job_id, stat).set(value)
    if stats.mismatch_failed:
        metrics.TRAINER_MISMATCHED_BATCHES.labels(job_id).inc()
