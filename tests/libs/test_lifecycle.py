"""The lifecycle tables: what they refuse, and the side effects they own (leases cleared
on leaving a waiting state; a failed or cancelled job ending its episodes and steps)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from temper.clock import utcnow
from temper.db import Database, Episode, Job, OutboxRow, Step, Tenant
from temper.lifecycle import (
    EPISODE_TRANSITIONS,
    JOB_TRANSITIONS,
    STEP_TRANSITIONS,
    EpisodeState,
    IllegalTransition,
    JobState,
    StepState,
    cancel_step,
    complete_step,
    fail_step,
    new_step,
    retry_step,
    transition_episode,
    transition_job,
)

pytestmark = pytest.mark.timeout(60)
E, J, S = EpisodeState, JobState, StepState


async def _job(db: Database, state: JobState = J.running) -> None:
    async with db.session() as s:
        s.add(Tenant(id="acme", name="acme"))
        await s.flush()
        s.add(Job(id="j", tenant_id="acme", name="j", spec={}, state=state))


async def _episode(
    db: Database, eid: str, state: EpisodeState, step: StepState | None = StepState.leased
) -> None:
    lease = utcnow() + timedelta(seconds=30)
    async with db.session() as s:
        s.add(Episode(id=eid, job_id="j", tenant_id="acme", task_id="t", group_id="g", state=state,
                      lease_expires_at=lease if step is S.leased else None))  # fmt: skip
        await s.flush()
        if step is not None:
            st = new_step(episode_id=eid, turn=0, kind="inference", request={}, lease_expires_at=lease)
            st.state = step
            s.add(st)


def test_every_state_but_the_first_has_a_rule_and_failing_needs_a_reason():
    assert set(JOB_TRANSITIONS) == set(J) - {J.pending}
    assert set(EPISODE_TRANSITIONS) == set(E) - {E.pending}
    assert set(STEP_TRANSITIONS) == set(S)
    for table, failed, cancelled in (
        (JOB_TRANSITIONS, J.failed, J.cancelled),
        (EPISODE_TRANSITIONS, E.failed, E.cancelled),
    ):
        assert table[failed].needs_reason and table[cancelled].needs_reason  # type: ignore[index]


async def test_illegal_job_transitions_raise_and_change_nothing(database: Database):
    await _job(database, J.completed)
    async with database.session() as s:
        job = await s.get(Job, "j")
        assert job is not None
        with pytest.raises(IllegalTransition, match="job j: completed -> running is not allowed"):
            await transition_job(s, job, J.running)
        with pytest.raises(IllegalTransition, match="completed -> cancelled is not allowed"):
            await transition_job(s, job, J.cancelled, reason="user")
        assert job.state == J.completed
        job.state = J.running
        with pytest.raises(IllegalTransition, match="running -> failed needs a reason"):
            await transition_job(s, job, J.failed)
        with pytest.raises(IllegalTransition, match="running -> pending is not allowed"):
            await transition_job(s, job, J.pending)


async def test_illegal_episode_transitions_raise(database: Database):
    await _job(database)
    await _episode(database, "e", E.scored, step=S.done)
    async with database.session() as s:
        ep = await s.get(Episode, "e")
        assert ep is not None
        for to in (E.acting, E.scoring, E.cancelled, E.pending):
            with pytest.raises(IllegalTransition, match=f"episode e: scored -> {to}"):
                transition_episode(s, ep, to, reason="x")
        ep.state = E.acting
        with pytest.raises(IllegalTransition, match="acting -> failed needs a reason"):
            transition_episode(s, ep, E.failed)
        assert ep.state == E.acting


async def test_illegal_step_transitions_raise(database: Database):
    await _job(database)
    await _episode(database, "e", E.awaiting_action)
    async with database.session() as s:
        step = (await s.execute(select(Step))).scalar_one()
        complete_step(step, {"text": "ok"})
        assert step.state == S.done and step.result == {"text": "ok"}
        for move in (fail_step, cancel_step):
            with pytest.raises(IllegalTransition, match="step inference of episode e turn 0: done -> "):
                move(step)
        with pytest.raises(IllegalTransition, match="done -> leased is not allowed"):
            retry_step(step, lease_expires_at=utcnow())
        assert step.state == S.done and step.attempt == 0


async def test_leaving_a_waiting_state_clears_the_lease(database: Database):
    await _job(database)
    await _episode(database, "e", E.awaiting_action)
    async with database.session() as s:
        ep = await s.get(Episode, "e")
        step = (await s.execute(select(Step))).scalar_one()
        assert ep is not None and ep.lease_expires_at is not None and step.lease_expires_at is not None
        later = utcnow() + timedelta(seconds=60)
        retry_step(step, lease_expires_at=later)
        assert (step.state, step.attempt, step.lease_expires_at) == (S.leased, 1, later)
        transition_episode(s, ep, E.acting)  # waiting on to another wait: the lease stays
        assert ep.lease_expires_at is not None
        fail_step(step)
        transition_episode(s, ep, E.failed, reason="sandbox_error: boom")
        assert step.lease_expires_at is None and step.completed_at is not None
        assert ep.lease_expires_at is None and ep.state_reason == "sandbox_error: boom"


@pytest.mark.parametrize("to", [J.cancelled, J.failed])
async def test_a_job_that_ends_early_ends_its_episodes_and_their_waiting_steps(database: Database, to):
    await _job(database)
    await _episode(database, "waiting", E.awaiting_action)
    await _episode(database, "pending", E.pending, step=None)
    await _episode(database, "scored", E.scored, step=S.done)
    async with database.session() as s:
        job = await s.get(Job, "j")
        assert job is not None
        await transition_job(s, job, to, reason="asked to")
    async with database.session() as s:
        job = await s.get(Job, "j")
        assert job is not None and (job.state, job.state_reason) == (to, "asked to") and job.finished_at
        eps = {e.id: e for e in (await s.execute(select(Episode))).scalars()}
        assert {k: (e.state, e.state_reason) for k, e in eps.items()} == {
            "waiting": (E.cancelled, f"job {to}"),
            "pending": (E.cancelled, f"job {to}"),
            "scored": (E.scored, None),
        }
        assert all(e.lease_expires_at is None for e in eps.values())
        steps = {st.episode_id: st for st in (await s.execute(select(Step))).scalars()}
        assert (steps["waiting"].state, steps["waiting"].lease_expires_at) == (S.cancelled, None)
        assert steps["scored"].state == S.done
        # one job event and one event per episode cancelled, in the outbox of that transaction
        assert len((await s.execute(select(OutboxRow))).scalars().all()) == 3
