"""EpisodeMachine.on_results: several results in one transaction, each taken or ignored
exactly as alone (SQLite, and Postgres under the ``postgres`` marker)."""

from __future__ import annotations

import pytest
from episode_peers import TOK, engine_settings, job_spec, seed
from sqlalchemy import select

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
