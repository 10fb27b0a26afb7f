"""EpisodeMachine.on_results: several results in one transaction, each taken or ignored
exactly as alone (SQLite, and Postgres under the ``postgres`` marker)."""

from __future__ import annotations

import asyncio

import pytest
from episode_peers import TOK, engine_settings, job_spec, seed
from sqlalchemy import select

from services.dispatcher import repo
from services.dispatcher.batches import ResultBatches
from services.dispatcher.episodes import EpisodeMachine
from temper.db import Database, Episode, Job, OutboxRow, Step
from temper.events import InferenceResult, SandboxRequest, SandboxResult, Topics, decode
from temper.storage import LocalStore

pytestmark = pytest.mark.timeout(60)

RUN = "```bash\ntrue\n```"


def answer(episode_id: str, *, turn: int = 0, attempt: int = 0, text: str = RUN) -> InferenceResult:
    tokens = [*TOK.encode(text), TOK.stop_ids[0]]
    return InferenceResult(
        job_id="job-b",
        episode_id=episode_id,
        turn=turn,
        attempt=attempt,
        token_ids=tokens,
        logprobs=[-0.5] * len(tokens),
        text=text,
        finish_reason="stop",
    )


async def started(database: Database, tmp_path, n: int) -> tuple[EpisodeMachine, list[str]]:
    await seed(database)
    machine = EpisodeMachine(database, LocalStore(tmp_path / "objects"), engine_settings(), tokenizer=TOK)
    async with database.session() as s:
        s.add(Job(id="job-b", tenant_id="acme", name="b", spec=job_spec(), state="running"))
    async with machine.tx() as s:
        job = await s.get(Job, "job-b")
        assert job is not None
        spec = await machine.spec_of(s, job.id)
        task = await machine.task_of(s, "t1")
        ids = [
            machine.start_episode(
                s, job=job, spec=spec, task=task, group_id="g", iteration=0, episode_id=f"e{i}"
            ).id
            for i in range(n)
        ]
    return machine, ids


async def steps(database: Database, episode_id: str) -> list[tuple[int, str, str, int]]:
    async with database.session() as s:
        rows = await s.execute(
            select(Step.turn, Step.kind, Step.state, Step.attempt)
            .where(Step.episode_id == episode_id)
            .order_by(Step.turn, Step.id)
        )
        return [tuple(r) for r in rows]  # type: ignore[misc]


async def sandbox_requests(database: Database) -> list[SandboxRequest]:
    async with database.session() as s:
        payloads = (
            await s.execute(select(OutboxRow.payload).where(OutboxRow.topic == Topics.SANDBOX_REQUESTS))
        ).scalars()
        return [m for m in map(decode, payloads) if isinstance(m, SandboxRequest)]


async def test_a_batch_takes_each_awaited_result_once_and_ignores_stale_and_duplicate_ones(
    database: Database, tmp_path
):
    machine, (a, b, c) = await started(database, tmp_path, 3)
    # a: awaited; b: an old attempt (stale); c: an error (retried); "nope": no such episode
    failed = answer(c).model_copy(update={"error": "backend down", "token_ids": [], "logprobs": []})
    await machine.on_results([answer(a), answer(b, attempt=1), failed, answer("nope")])
    assert await steps(database, a) == [(0, "inference", "done", 0), (0, "sandbox", "leased", 0)]
    assert await steps(database, b) == [(0, "inference", "leased", 0)]
    assert await steps(database, c) == [(0, "inference", "leased", 1)], "sent again, attempt 1"
    assert machine.ignored == 2

    # a again (a duplicate, redelivered), b's and c's awaited results, and a's sandbox result
    # cannot share a batch with its inference result: the next batch takes it.
    await machine.on_results([answer(a), answer(b), answer(c, attempt=1)])
    assert await steps(database, a) == [(0, "inference", "done", 0), (0, "sandbox", "leased", 0)]
    assert await steps(database, b) == [(0, "inference", "done", 0), (0, "sandbox", "leased", 0)]
    assert await steps(database, c) == [(0, "inference", "done", 1), (0, "sandbox", "leased", 0)]
    assert machine.ignored == 3
    requests = await sandbox_requests(database)
    assert sorted(m.episode_id or "" for m in requests) == [a, b, c], "one command per result taken"

    ran = {"exit_code": 0, "stdout": "ok", "stderr": "", "wall_s": 0.1}
    await machine.on_results(
        [
            SandboxResult(job_id="job-b", episode_id=e, turn=0, session_id=e, result=ran, worker="w")
            for e in (a, b)
        ]
    )
    assert (await steps(database, a))[-2:] == [(0, "sandbox", "done", 0), (1, "inference", "leased", 0)]
    async with database.session() as s:
        states = dict((await s.execute(select(Episode.id, Episode.state))).all())
        assert states == {a: "awaiting_action", b: "awaiting_action", c: "acting"}
        turns = dict((await s.execute(select(Episode.id, Episode.turn))).all())
        assert turns == {a: 1, b: 1, c: 0}


async def test_a_batch_that_fails_writes_nothing_and_its_results_can_go_one_by_one(
    database: Database, tmp_path
):
    machine, (a, b) = await started(database, tmp_path, 2)
    real = machine.environment
    calls = 0

    def flaky(spec, task):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("the second result of the batch fails")
        return real(spec, task)

    machine.environment = flaky  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await machine.on_results([answer(a), answer(b)])
    for e in (a, b):
        assert await steps(database, e) == [(0, "inference", "leased", 0)], "rolled back, a's too"
    assert await sandbox_requests(database) == []

    machine.environment = real  # type: ignore[method-assign]
    for e in (a, b):
        await machine.on_inference(answer(e))
        assert await steps(database, e) == [(0, "inference", "done", 0), (0, "sandbox", "leased", 0)]
    assert len(await sandbox_requests(database)) == 2


async def test_a_batch_is_results_of_one_kind_and_distinct_episodes(database: Database, tmp_path):
    machine, (a,) = await started(database, tmp_path, 1)
    with pytest.raises(ValueError):
        await machine.on_results([answer(a), answer(a)])
    ran = {"exit_code": 0, "wall_s": 0.0}
    with pytest.raises(ValueError):
        await machine.on_results(
            [answer(a), SandboxResult(job_id="job-b", episode_id="x", turn=0, session_id="x", result=ran)]
        )


async def test_results_handed_over_together_share_a_transaction_and_a_bad_one_fails_alone(
    database: Database, tmp_path
):
    """ResultBatches: calls at the same moment go through one locking query; when one
    result makes the merged transaction fail, the others are taken on their own and only
    its own call raises."""
    machine, (a, b, c, d) = await started(database, tmp_path, 4)
    batches = ResultBatches(machine)
    locks: list[list[str]] = []
    real_lock = repo.lock_episodes

    async def counted(conn, ids, kind):  # type: ignore[no-untyped-def]
        locks.append(sorted(ids))
        return await real_lock(conn, ids, kind)

    real_take = machine._take

    async def c_fails(session, msg, *rest):  # type: ignore[no-untyped-def]
        if msg.episode_id == c:
            raise RuntimeError("c's result cannot be taken")
        return await real_take(session, msg, *rest)

    repo.lock_episodes = counted  # type: ignore[assignment]
    try:
        await asyncio.gather(batches.take([answer(a)]), batches.take([answer(b)]))
        assert locks == [sorted([a, b])], "one transaction for both calls"
        for e in (a, b):
            assert await steps(database, e) == [(0, "inference", "done", 0), (0, "sandbox", "leased", 0)]

        machine._take = c_fails  # type: ignore[method-assign]
        locks.clear()
        outcomes = await asyncio.gather(
            batches.take([answer(c)]), batches.take([answer(d)]), return_exceptions=True
        )
        assert locks == [sorted([c, d]), [c], [d]], "merged, rolled back, then each alone"
        assert isinstance(outcomes[0], RuntimeError) and outcomes[1] is None, "only c's own call fails"
        assert await steps(database, c) == [(0, "inference", "leased", 0)], "c's result not taken"
        assert await steps(database, d) == [(0, "inference", "done", 0), (0, "sandbox", "leased", 0)]
        assert sorted(m.episode_id or "" for m in await sandbox_requests(database)) == sorted([a, b, d])
    finally:
        repo.lock_episodes = real_lock  # type: ignore[assignment]
        await batches.close()


async def test_a_caller_cancelled_while_it_waits_leaves_the_others_their_own_outcome(
    database: Database, tmp_path
):
    """A consumer stopping cancels its wait; when the merged transaction then fails, its
    results still run alone (taking is idempotent) and the next caller gets its own error."""
    machine, (c, d) = await started(database, tmp_path, 2)
    batches = ResultBatches(machine)
    real_take = machine._take

    async def c_fails(session, msg, *rest):  # type: ignore[no-untyped-def]
        if msg.episode_id == c:
            raise RuntimeError("c's result cannot be taken")
        return await real_take(session, msg, *rest)

    machine._take = c_fails  # type: ignore[method-assign]
    try:
        waits_d = asyncio.create_task(batches.take([answer(d)]))
        waits_c = asyncio.create_task(batches.take([answer(c)]))
        await asyncio.sleep(0)  # both queued; the batch has not run yet
        waits_d.cancel()
        with pytest.raises(RuntimeError, match="c's result cannot be taken"):
            await waits_c
        with pytest.raises(asyncio.CancelledError):
            await waits_d
        assert await steps(database, d) == [(0, "inference", "done", 0), (0, "sandbox", "leased", 0)]
        assert await steps(database, c) == [(0, "inference", "leased", 0)]
    finally:
        await batches.close()
