"""The staleness gate reads the trainer's progress: the version it published, the groups it
has not stepped on (its ledger) and the version the gateway serves; never the iteration
number. Rows are written as the scheduler, the trainer and the gateway write them."""

from __future__ import annotations

import uuid

import pytest

from services.dispatcher.scheduler import Scheduler
from services.dispatcher.staleness import trained_at
from temper.clock import utcnow
from temper.db import Episode, Job, PolicyVersion, TrainedTrajectory
from temper.jobspec import JobSpec
from tests.services.dispatcher.episode_peers import job_spec, seed, submit_job

pytestmark = pytest.mark.timeout(60)

# 2 groups of 2 per iteration, 2 groups a step: one version per iteration when nothing is skipped
SPEC = job_spec(
    tasks__group_size=2,
    schedule__episodes_per_iteration=4,
    schedule__iterations=6,
    schedule__max_staleness=1,
    algorithm__groups_per_step=2,
)


def test_trained_at_counts_the_groups_ahead() -> None:
    spec = JobSpec.model_validate(SPEC)
    assert trained_at(spec, 3, 0) == 3, "nothing ahead: its own 2 groups make the next step, on v3"
    assert trained_at(spec, 3, 1) == 4, "one group ahead: its last group waits for a second step"
    assert trained_at(spec, 3, 2) == 4
    assert trained_at(spec, 3, 4) == 5
    every_other = JobSpec.model_validate(job_spec(**{**_over(), "algorithm__checkpoint_every": 2}))
    assert trained_at(every_other, 3, 2) == 3, "two steps make one version"


def _over() -> dict[str, object]:
    return {
        "tasks__group_size": 2,
        "schedule__episodes_per_iteration": 4,
        "schedule__iterations": 6,
        "algorithm__groups_per_step": 2,
    }


async def _episodes(s, job: str, iteration: int, groups: int, state: str, version: int) -> list[Episode]:  # noqa: ANN001
    out = []
    for _ in range(groups):
        group = uuid.uuid4().hex
        for _ in range(2):
            ep = Episode(
                id=uuid.uuid4().hex, job_id=job, tenant_id="acme", task_id="t1", group_id=group,
                iteration=iteration, state=state, behaviour_version=version, timings={}, rewards={},
            )  # fmt: skip
            s.add(ep)
            out.append(ep)
    return out


async def _ledger(s, job: str, episodes: list[Episode], **row: object) -> None:  # noqa: ANN001
    for ep in episodes:
        s.add(
            TrainedTrajectory(
                episode_id=ep.id, job_id=job, trajectory_key=f"t/{ep.id}", group_id=ep.group_id, **row
            )
        )


async def _version(s, job: str, version: int, *, served: bool) -> None:  # noqa: ANN001
    s.add(
        PolicyVersion(
            job_id=job, version=version, checkpoint_key=f"ckpt/{version}", step=version,
            served_at=utcnow() if served else None, served_by=["fake"] if served else None,
        )
    )  # fmt: skip
    (await s.get(Job, job)).policy_version = version


async def test_a_skipped_group_does_not_hold_the_pipeline(database) -> None:  # noqa: ANN001
    """Iteration 0's groups were both skipped (zero variance), so v1 trained iteration 1 and
    versions lag iterations by one. Counting versions from the iteration number held
    iteration 3 until iteration 2 had trained (no overlap of generation and training);
    from the trainer's progress it may start while iteration 2 is generated and trained:
    iteration 2's groups make the step to v2, and iteration 3's are trained on v2 at the
    latest, one version after the v1 that generates them."""
    await seed(database, tasks={"t1": {}})
    job = await submit_job(database, SPEC)
    spec = JobSpec.model_validate(SPEC)
    gate = Scheduler(None, None, trainer_attached=True, wait_for_training=False)  # type: ignore[arg-type]
    async with database.session() as s:
        (await s.get(Job, job)).state = "running"
        skipped = await _episodes(s, job, 0, 2, "scored", 0)
        trained = await _episodes(s, job, 1, 2, "trained", 0)
        in_flight = await _episodes(s, job, 2, 2, "awaiting_action", 1)
        await s.flush()
        await _ledger(s, job, skipped, skipped="zero_reward_variance")
        await _ledger(s, job, trained, step=1)
        await _version(s, job, 1, served=True)
    async with database.session() as s:
        row = await s.get(Job, job)
        assert await gate._fresh_enough(s, row, spec, 3), "iteration 3 overlaps iteration 2's training"
    async with database.session() as s:
        await _episodes(s, job, 3, 2, "awaiting_action", 1)
    async with database.session() as s:
        row = await s.get(Job, job)
        assert not await gate._fresh_enough(s, row, spec, 4), "two iterations ahead would be trained stale"
    assert len(in_flight) == 4


async def test_a_version_the_gateway_does_not_serve_yet_holds_the_next_iteration(database) -> None:  # noqa: ANN001
    """Episodes started now are generated on what the gateway serves: the trainer's new v2,
    published but not yet loaded, would make iteration 3's data two versions old when it
    trains. It waits for the gateway, not for the trainer."""
    await seed(database, tasks={"t1": {}})
    job = await submit_job(database, SPEC)
    spec = JobSpec.model_validate(SPEC)
    gate = Scheduler(None, None, trainer_attached=True, wait_for_training=False)  # type: ignore[arg-type]
    async with database.session() as s:
        (await s.get(Job, job)).state = "running"
        first = await _episodes(s, job, 0, 2, "trained", 0)
        second = await _episodes(s, job, 1, 2, "trained", 1)
        await _episodes(s, job, 2, 2, "awaiting_action", 1)
        await s.flush()
        await _ledger(s, job, first, step=1)
        await _ledger(s, job, second, step=2)
        await _version(s, job, 1, served=True)
        await _version(s, job, 2, served=False)
    async with database.session() as s:
        row = await s.get(Job, job)
        assert not await gate._fresh_enough(s, row, spec, 3), "v2 is the trainer's word only"
        (await s.get(PolicyVersion, (job, 2))).served_at = utcnow()  # type: ignore[union-attr]
        await s.flush()
        assert await gate._fresh_enough(s, row, spec, 3), "the gateway serves v2: iteration 3 goes"


async def test_a_trainer_short_of_a_step_opens_the_gate(database) -> None:  # noqa: ANN001
    """With max_staleness 0 a new iteration waits for every earlier group to train; but the
    trainer holds one group, too few for a step: waiting would deadlock, so it starts."""
    over = {**_over(), "schedule__max_staleness": 0}
    raw = job_spec(**over)
    await seed(database, tasks={"t1": {}})
    job = await submit_job(database, raw)
    spec = JobSpec.model_validate(raw)
    gate = Scheduler(None, None, trainer_attached=True, wait_for_training=False)  # type: ignore[arg-type]
    async with database.session() as s:
        (await s.get(Job, job)).state = "running"
        skipped = await _episodes(s, job, 0, 1, "scored", 0)
        held = await _episodes(s, job, 0, 1, "scored", 0)
        await s.flush()
        await _ledger(s, job, skipped, skipped="zero_reward_variance")
        await _ledger(s, job, held)  # buffered: no step yet
    async with database.session() as s:
        assert await gate._fresh_enough(s, await s.get(Job, job), spec, 1)
