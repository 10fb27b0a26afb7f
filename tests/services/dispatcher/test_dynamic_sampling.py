"""Dynamic sampling: the dispatcher starts one fresh group for each group the trainer's
ledger marks skipped for zero reward variance, once, up to
``algorithm.max_replacement_groups`` an iteration, and says so in the job's metrics.

The trainer here is the ledger rows it writes (``trained_trajectories``): the real
trainer's skip is tested in tests/services/trainer; what these tests check is the
hand-off and the bookkeeping on SQLite and on the real Postgres."""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict

import pytest
from episode_peers import episodes_of, job_spec, job_state, seed, start_harness, submit_job, wait_for
from prometheus_client import REGISTRY
from sqlalchemy import select, update

from services.dispatcher.api import repo
from services.dispatcher.sampling import replacements_due
from temper.db import SKIPPED_ZERO_VARIANCE, Database, Episode, Job, TrainedTrajectory

pytestmark = pytest.mark.timeout(90)


def test_replacements_are_due_once_per_skip_and_bounded_per_iteration():
    due = dict(per_iteration=4, group_size=2, max_per_iteration=2)
    assert replacements_due(skipped=0, started={0: 4}, iteration=0, **due) == 0
    assert replacements_due(skipped=1, started={0: 4}, iteration=0, **due) == 1
    # started: the iteration holds its 4 episodes and one replacement group
    assert replacements_due(skipped=1, started={0: 6}, iteration=0, **due) == 0
    assert replacements_due(skipped=5, started={0: 6}, iteration=0, **due) == 1
    assert replacements_due(skipped=5, started={0: 8}, iteration=0, **due) == 0  # the bound
    # what one iteration could not replace, the next one does (its own bound)
    assert replacements_due(skipped=5, started={0: 8, 1: 0}, iteration=1, **due) == 2
    # a replacement counts as a whole group even when it started short of group_size
    assert replacements_due(skipped=1, started={0: 5}, iteration=0, **due) == 0


def spec(**over):
    base = {
        "tasks__group_size": 2, "tasks__curriculum": "uniform", "algorithm__groups_per_step": 1,
        "algorithm__dynamic_sampling": True, "algorithm__max_replacement_groups": 2,
        "schedule__iterations": 1, "schedule__episodes_per_iteration": 4,
    }  # fmt: skip
    return job_spec(**{**base, **over})


async def groups_of(db: Database, job_id: str) -> dict[str, list[Episode]]:
    out: dict[str, list[Episode]] = defaultdict(list)
    for e in await episodes_of(db, job_id):
        out[e.group_id].append(e)
    return dict(out)


async def ledger_skip(db: Database, job_id: str, episodes: list[Episode]) -> None:
    """What the trainer writes for a zero-variance group: its rows, then ``skipped``."""
    async with db.session() as s:
        known = set(
            (
                await s.execute(
                    select(TrainedTrajectory.episode_id).where(
                        TrainedTrajectory.episode_id.in_([e.id for e in episodes])
                    )
                )
            ).scalars()
        )
        for e in episodes:
            if e.id not in known:
                s.add(TrainedTrajectory(episode_id=e.id, job_id=job_id, trajectory_key=f"t/{e.id}",
                                        group_id=e.group_id))  # fmt: skip
    async with db.session() as s:
        await s.execute(
            update(TrainedTrajectory)
            .where(TrainedTrajectory.episode_id.in_([e.id for e in episodes]))
            .values(skipped=SKIPPED_ZERO_VARIANCE)
        )


async def count_stays(db: Database, job_id: str, n: int, ticks_s: float = 0.6) -> None:
    await wait_for(lambda: _has(db, job_id, n), what=f"{n} episodes")
    await asyncio.sleep(ticks_s)  # a dozen scheduler passes
    assert len(await episodes_of(db, job_id)) == n


async def _has(db: Database, job_id: str, n: int) -> bool:
    return len(await episodes_of(db, job_id)) >= n


async def sampling_of(db: Database, job_id: str):
    async with db.session() as s:
        job = await s.get(Job, job_id)
        return (await repo.job_metrics(s, job=job)).sampling


def replacements_counted(job_id: str) -> float:
    return REGISTRY.get_sample_value("temper_dispatcher_replacement_groups_total", {"job_id": job_id}) or 0


async def test_each_skipped_group_is_replaced_once_up_to_the_bound(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, peers={"hold": True}, trainer_attached=True)
    try:
        await seed(h.db, tasks={"a": {}, "b": {}, "c": {}})
        job = await submit_job(h.db, spec())
        await count_stays(h.db, job, 4)
        first, second = (await groups_of(h.db, job)).values()

        await ledger_skip(h.db, job, first)
        await count_stays(h.db, job, 6)
        groups = await groups_of(h.db, job)
        (third,) = [g for gid, g in groups.items() if gid not in (first[0].group_id, second[0].group_id)]
        assert len(third) == 2 and {e.iteration for e in third} == {0}

        # the trainer crashed and replays: it marks the same group again; nothing new starts
        await ledger_skip(h.db, job, first)
        await count_stays(h.db, job, 6)

        # two more skips, one replacement left under the bound of 2
        await ledger_skip(h.db, job, second)
        await ledger_skip(h.db, job, third)
        await count_stays(h.db, job, 8)
        sampling = await sampling_of(h.db, job)
        assert sampling.dynamic_sampling is True
        assert (sampling.zero_variance_groups, sampling.replacement_groups, sampling.unreplaced_groups) == (
            3,
            2,
            1,
        )
        assert replacements_counted(job) == 2
    finally:
        h.peers.hold = False
        await h.stop()


async def test_without_dynamic_sampling_a_skip_is_only_counted(tmp_path, database_url):
    h = await start_harness(tmp_path, database_url, peers={"hold": True}, trainer_attached=True)
    try:
        await seed(h.db, tasks={"a": {}, "b": {}})
        job = await submit_job(h.db, spec(algorithm__dynamic_sampling=False))
        await count_stays(h.db, job, 4)
        first = next(iter((await groups_of(h.db, job)).values()))
        await ledger_skip(h.db, job, first)
        await count_stays(h.db, job, 4)
        sampling = await sampling_of(h.db, job)
        assert (sampling.zero_variance_groups, sampling.replacement_groups, sampling.unreplaced_groups) == (
            1,
            0,
            1,
        )
        assert replacements_counted(job) == 0
    finally:
        h.peers.hold = False
        await h.stop()


REWARD = {"solved": 1.0, "unsolved": 0.0}


async def fake_trainer(db: Database, job_id: str, stop: asyncio.Event) -> list[list[float]]:
    """Reads scored groups and writes the ledger as the trainer does: a group with zero
    reward variance is skipped, any other is trained (``step``). Returns the trained groups' rewards."""
    trained: list[list[float]] = []
    seen: set[str] = set()
    while not stop.is_set():
        for gid, eps in (await groups_of(db, job_id)).items():
            if gid in seen or len(eps) < 2 or any(e.reward is None for e in eps):
                continue
            seen.add(gid)
            rewards = [float(e.reward or 0.0) for e in eps]
            if len(set(rewards)) == 1:
                await ledger_skip(db, job_id, eps)
                continue
            async with db.session() as s:
                for e in eps:
                    s.add(TrainedTrajectory(episode_id=e.id, job_id=job_id, trajectory_key=f"t/{e.id}",
                                            group_id=gid, step=len(trained)))  # fmt: skip
            trained.append(rewards)
        await asyncio.sleep(0.05)
    return trained


async def test_a_job_with_settled_tasks_trains_on_groups_with_signal_and_completes(tmp_path, database_url):
    """Tasks every sample solves, none solves, or half solve: every zero-variance group is
    replaced until the per-iteration bound, the job completes, the count is in the metrics."""
    turns: Counter[str] = Counter()

    def reward(req) -> float:
        if req.task_id in REWARD:
            return REWARD[req.task_id]
        turns[req.task_id] += 1  # "mixed": every other sample passes
        return float(turns[req.task_id] % 2)

    h = await start_harness(tmp_path, database_url, peers={"reward_fn": reward}, trainer_attached=True)
    stop = asyncio.Event()
    try:
        await seed(h.db, tasks={"solved": {}, "unsolved": {}, "mixed": {}})
        job = await submit_job(h.db, spec(schedule__iterations=2, schedule__max_concurrent_episodes=2))
        trainer = asyncio.create_task(fake_trainer(h.db, job, stop))

        async def done() -> bool:
            return await job_state(h.db, job) in ("completed", "failed")

        await wait_for(done, limit_s=60, what="the job to finish")
        stop.set()
        trained = await trainer
        assert await job_state(h.db, job) == "completed"
        groups = await groups_of(h.db, job)
        sampling = await sampling_of(h.db, job)
    finally:
        stop.set()
        await h.stop()
    per_iteration = Counter(e.iteration for g in groups.values() for e in g)
    # both iterations ran their own 4 episodes: replacements did not stand in for them
    assert set(per_iteration) == {0, 1} and min(per_iteration.values()) >= 4, per_iteration
    replaced = {it: (n - 4) // 2 for it, n in per_iteration.items()}
    # each iteration draws two distinct tasks of three, so at least one settled one: a replacement
    assert sampling.zero_variance_groups >= 1 and sampling.replacement_groups >= 1, sampling
    assert sampling.replacement_groups == sum(replaced.values()) <= sampling.zero_variance_groups
    assert all(0 <= r <= 2 for r in replaced.values()), replaced
    if sampling.unreplaced_groups:  # the job ended with skips left: the last iteration used its bound
        assert replaced[1] == 2
    assert sampling.zero_variance_groups + len(trained) == len(groups)
    assert all(len(set(r)) > 1 for r in trained)
