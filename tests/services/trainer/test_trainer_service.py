"""The trainer component on the in-process bus, SQLite and a local object store."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from sqlalchemy import select

from services.trainer.app import create_app
from services.trainer.component import Trainer
from services.trainer.ledger import (
    SKIP_INCOMPLETE,
    SKIP_JOB_ENDED,
    SKIP_MISMATCH,
    SKIP_STALE,
    SKIP_ZERO_VARIANCE,
)
from temper.db import Episode, Job, OutboxRow, PolicyVersion, TrainedTrajectory
from temper.db.migrate import upgrade
from temper.events import PolicyUpdate, Topics
from temper.policy import create_model, load_weights
from temper.registry import fetch_version
from temper.runtime import Runtime
from temper.settings import DatabaseSettings, LogSettings, Settings, StorageSettings
from temper.training import Learner
from tests.services.trainer.factory import TrajectoryFactory, add_job, job_spec, send_all, store_all, wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
async def settings(tmp_path) -> Settings:
    url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    await asyncio.to_thread(upgrade, url)
    return Settings(
        db=DatabaseSettings(url=url),
        storage=StorageSettings(root=tmp_path / "objects"),
        log=LogSettings(level="WARNING"),
    )


async def start(settings: Settings, **trainer: object) -> tuple[Runtime, Trainer]:
    runtime = Runtime(settings, service="trainer")
    await runtime.start()
    component = Trainer(runtime, settings=settings.trainer.model_copy(update={"device": "cpu", **trainer}))
    await component.start()
    return runtime, component


async def stop(runtime: Runtime, component: Trainer) -> None:
    await component.stop()
    await runtime.stop()


async def ledger(runtime: Runtime, job_id: str) -> dict[str, TrainedTrajectory]:
    assert runtime.db is not None
    async with runtime.db.session() as s:
        rows = (
            await s.execute(select(TrainedTrajectory).where(TrainedTrajectory.job_id == job_id))
        ).scalars()
        return {r.episode_id: r for r in rows}


async def versions(runtime: Runtime, job_id: str) -> list[tuple[int, int]]:
    assert runtime.db is not None
    async with runtime.db.session() as s:
        rows = (
            await s.execute(
                select(PolicyVersion).where(PolicyVersion.job_id == job_id).order_by(PolicyVersion.version)
            )
        ).scalars()
        return [(r.version, r.step) for r in rows]


async def test_trains_publishes_policy_versions_and_skips_flat_groups(settings, tmp_path):
    runtime, component = await start(settings)
    trainer = component.training
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-a", job_spec(group_size=4, groups_per_step=2, checkpoint_every=1))
        updates: list[PolicyUpdate] = []

        async def collect(record) -> None:
            updates.append(PolicyUpdate.model_validate_json(record.value))

        await runtime.bus.subscribe([Topics.POLICY_UPDATES], "test-gateway", collect)
        skipped_before = (
            REGISTRY.get_sample_value("temper_trainer_skipped_groups_total", {"job_id": "job-a"}) or 0
        )
        f = TrajectoryFactory("job-a")
        flat = f.group("flat", [0.5] * 4)
        made = (
            f.group("g1", [1, 0, 0, 1])
            + flat
            + f.group("g2", [0, 0, 1, 0])
            + f.group("g3", [1, 1, 0, 0.5])
            + f.group("g4", [0.2, 0.4, 0.6, 0.8])
        )
        await store_all(runtime.store, made)
        await send_all(runtime.bus, made)

        async def two_updates() -> bool:
            return len(updates) >= 2

        await wait_for(two_updates, what="two policy updates")
        rows = await ledger(runtime, "job-a")
        assert len(rows) == 20
        assert Counter(r.step for r in rows.values() if r.step is not None) == {1: 8, 2: 8}
        skipped = {e for e, r in rows.items() if r.skipped}
        assert skipped == {m.message.episode_id for m in flat}
        assert {rows[e].skipped for e in skipped} == {SKIP_ZERO_VARIANCE}
        assert await versions(runtime, "job-a") == [(1, 1), (2, 2)]
        async with runtime.db.session() as s:
            train_s = (
                await s.execute(select(PolicyVersion.train_s).where(PolicyVersion.job_id == "job-a"))
            ).scalars()
            # each version holds its step's trainer time: what a tenant's trainer quota counts
            assert all(0 < t < 30 for t in train_s)
        async with runtime.db.session() as s:
            assert (await s.get(Job, "job-a")).policy_version == 2

        async def updates_marked_sent() -> bool:
            # the relay sends a row, then marks it in the same transaction: a consumer can
            # hold the message a moment before the mark is committed
            async with runtime.db.session() as s:
                rows = list(
                    (
                        await s.execute(select(OutboxRow).where(OutboxRow.topic == Topics.POLICY_UPDATES))
                    ).scalars()
                )
            return len(rows) == 2 and all(r.published_at is not None for r in rows)

        await wait_for(updates_marked_sent, what="both policy updates marked sent")

        assert [u.version for u in updates] == [1, 2] and [u.step for u in updates] == [1, 2]
        assert all(u.job_id == "job-a" for u in updates)
        assert updates[1].checkpoint_key == "tenants/acme/jobs/job-a/versions/v2/manifest.json"
        # the gateway loads the version's verified directory; it is not the initial policy any more
        manifest = await fetch_version(runtime.store, updates[1].checkpoint_key, tmp_path / "v2")
        assert (manifest.job_id, manifest.version, manifest.kind) == ("job-a", 2, "full")
        model = load_weights(create_model("tiny", seed=0), tmp_path / "v2")
        assert not torch.equal(
            model.model.embed_tokens.weight, create_model("tiny", seed=0).model.embed_tokens.weight
        )
        assert "trainer/optimizer.safetensors" in manifest.files
        after = REGISTRY.get_sample_value("temper_trainer_skipped_groups_total", {"job_id": "job-a"})
        assert after == skipped_before + 1
        assert REGISTRY.get_sample_value("temper_policy_version", {"job_id": "job-a"}) == 2

        # Redelivered messages change nothing.
        await send_all(runtime.bus, made)

        async def drained() -> bool:
            return runtime.bus.lag(Topics.TRAJECTORIES, trainer.group) == 0  # type: ignore[union-attr]

        await wait_for(drained, what="redeliveries handled")
        await asyncio.sleep(0.2)
        assert trainer.jobs["job-a"].learner.step_count == 2
        assert len(await ledger(runtime, "job-a")) == 20
        status = trainer.status()["jobs"]["job-a"]
        assert status["policy_version"] == 2 and status["buffered_trajectories"] == 0
        assert status["skipped_groups"] == {SKIP_ZERO_VARIANCE: 1}
    finally:
        await stop(runtime, component)


async def test_a_run_of_flat_groups_with_no_step_is_counted_and_warned_once(settings, capsys):
    # A collapsed policy (every answer fails alike) makes only zero-variance groups; with
    # the skip, no step comes. The trainer says so once and counts them until a step.
    runtime, component = await start(settings)
    trainer = component.training
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-f", job_spec(group_size=4, groups_per_step=1, checkpoint_every=1))
        f = TrajectoryFactory("job-f")

        async def send(made: list) -> None:
            await store_all(runtime.store, made)
            await send_all(runtime.bus, made)

        def flat_count() -> int:
            return trainer.status()["jobs"]["job-f"]["zero_variance_since_step"]

        await send(f.group("g1", [1, 0, 0, 1]))

        async def stepped(n: int) -> bool:
            return "job-f" in trainer.jobs and trainer.jobs["job-f"].learner.step_count == n

        await wait_for(lambda: stepped(1), what="the first step")
        assert flat_count() == 0
        for i in range(3):
            await send(f.group(f"flat{i}", [0.0] * 4))

        err = ""

        async def three_flat_and_warned() -> bool:  # the warning follows the ledger's writes
            nonlocal err
            err += capsys.readouterr().err
            return flat_count() == 3 and "had zero reward variance" in err

        await wait_for(three_flat_and_warned, what="three flat groups skipped, and the warning")
        await asyncio.sleep(0.2)
        err += capsys.readouterr().err
        # said once, on reaching 2 steps' worth of groups (groups_per_step 1; one sweep may
        # skip the third with them), with the job and the version that made them
        warned = [json.loads(line) for line in err.splitlines() if "had zero reward variance" in line]
        assert len(warned) == 1, err[-2000:]
        assert warned[0]["job_id"] == "job-f" and warned[0]["version"] == 1 and warned[0]["groups"] in (2, 3)
        assert trainer.jobs["job-f"].learner.step_count == 1
        await send(f.group("g2", [0, 1, 1, 1]))

        async def stepped_again() -> bool:  # the count is reset once the step has returned
            return await stepped(2) and flat_count() == 0

        await wait_for(stepped_again, what="the step after the flat groups, and the count reset")
        assert trainer.status()["jobs"]["job-f"]["skipped_groups"] == {SKIP_ZERO_VARIANCE: 3}
    finally:
        await stop(runtime, component)


async def test_a_restarted_trainer_resumes_from_its_checkpoint_and_trains_nothing_twice(settings):
    """Step 3 was trained but never checkpointed, and a group was half received, when the
    trainer went away: after the restart both come back from the ledger, step 3 is redone
    from the v1 checkpoint, and redelivered messages are ignored."""
    runtime, component = await start(settings)
    trainer = component.training
    f = TrajectoryFactory("job-r")
    g1, g2, g3 = f.group("g1", [1, 0, 0, 0]), f.group("g2", [0, 1, 0, 1]), f.group("g3", [1, 0.5, 0, 0])
    partial = f.group("p", [0, 1, 1, 0])
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-r", job_spec(group_size=4, groups_per_step=1, checkpoint_every=2))
        await store_all(runtime.store, g1 + g2 + g3 + partial)
        await send_all(runtime.bus, g1 + g2 + g3 + partial[:2])

        async def mid_job() -> bool:
            job = trainer.jobs.get("job-r")
            return job is not None and job.learner.step_count == 3 and job.buffered == 2

        await wait_for(mid_job, what="three steps and a half group")
        rows = await ledger(runtime, "job-r")
        assert {rows[m.message.episode_id].step for m in g3 + partial[:2]} == {None}, (
            "step 3 not checkpointed"
        )
        assert await versions(runtime, "job-r") == [(1, 2)]
    finally:
        await stop(runtime, component)  # everything in memory is gone

    runtime, component = await start(settings)
    trainer = component.training
    try:
        assert runtime.bus and runtime.store
        job = trainer.jobs["job-r"]  # recovered at start, because the ledger has buffered rows

        async def redone() -> bool:
            return job.learner.step_count == 3 and job.buffered == 2

        await wait_for(redone, what="step 3 redone from the v1 checkpoint")
        await send_all(runtime.bus, g1 + g3 + partial)  # duplicates, and the rest of the half group

        async def done() -> bool:
            return len(await versions(runtime, "job-r")) == 2

        await wait_for(done, what="policy version 2")
        rows = await ledger(runtime, "job-r")
        assert len(rows) == 16 and not any(r.skipped for r in rows.values())
        assert Counter(r.step for r in rows.values()) == {1: 4, 2: 4, 3: 4, 4: 4}
        assert {rows[m.message.episode_id].step for m in g3} == {3}
        assert {rows[m.message.episode_id].step for m in partial} == {4}
        assert await versions(runtime, "job-r") == [(1, 2), (2, 4)]
        assert job.learner.step_count == 4 and job.learner.version == 2
    finally:
        await stop(runtime, component)


async def test_late_groups_and_stale_groups(settings):
    runtime, component = await start(settings, group_timeout_s=0.3)
    trainer = component.training
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-s", job_spec(group_size=4, groups_per_step=1, max_staleness=0))
        f = TrajectoryFactory("job-s")
        lonely, pair = f.group("lonely", [1.0]), f.group("pair", [0.0, 1.0])
        await store_all(runtime.store, lonely + pair)
        await send_all(runtime.bus, lonely + pair)

        async def v1() -> bool:
            return len(await versions(runtime, "job-s")) == 1

        await wait_for(v1, what="the pair trained after the group timeout")
        rows = await ledger(runtime, "job-s")
        assert rows[lonely[0].message.episode_id].skipped == SKIP_INCOMPLETE
        assert {rows[m.message.episode_id].step for m in pair} == {1}

        # sampled by version 0 while the trainer is at version 1, with max_staleness 0
        stale = f.group("stale", [0, 1, 0, 1], version=0)
        await store_all(runtime.store, stale)
        await send_all(runtime.bus, stale)

        async def skipped() -> bool:
            rows = await ledger(runtime, "job-s")
            return all(rows.get(m.message.episode_id) and rows[m.message.episode_id].skipped for m in stale)

        await wait_for(skipped, what="the stale group skipped")
        rows = await ledger(runtime, "job-s")
        assert {rows[m.message.episode_id].skipped for m in stale} == {SKIP_STALE}
        assert trainer.jobs["job-s"].learner.step_count == 1
    finally:
        await stop(runtime, component)


async def test_a_completed_jobs_leftover_groups_are_recorded_and_its_learner_let_go(settings):
    """Two groups a step: after one step, one group is left that can never make a step
    (the dispatcher completed the job). The trainer marks it ``job_ended``, drops the job's
    learner, and a trajectory of the job that comes later is recorded without loading it."""
    runtime, component = await start(settings)
    trainer = component.training
    trainer.CLOSE_CHECK_S = 3600.0  # type: ignore[misc]  # closed by the calls below, not the loop
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-e", job_spec(group_size=4, groups_per_step=2, checkpoint_every=1))
        f = TrajectoryFactory("job-e")
        g1, g2, left = f.group("g1", [1, 0, 0, 1]), f.group("g2", [0, 1, 0, 0]), f.group("left", [0, 1, 1, 0])
        await store_all(runtime.store, g1 + g2 + left)
        await send_all(runtime.bus, g1 + g2 + left)

        async def stepped() -> bool:
            job = trainer.jobs.get("job-e")
            return len(await versions(runtime, "job-e")) == 1 and job is not None and job.buffered == 4

        await wait_for(stepped, what="one step and a group left over")
        assert await trainer.close_completed_jobs() == []  # still running: nothing closed
        async with runtime.db.session() as s:
            (await s.get(Job, "job-e")).state = "completed"
        assert await trainer.close_completed_jobs() == ["job-e"]
        assert "job-e" not in trainer.jobs and "job-e" not in trainer.status()["jobs"]
        rows = await ledger(runtime, "job-e")
        assert {rows[m.message.episode_id].skipped for m in left} == {SKIP_JOB_ENDED}
        assert {rows[m.message.episode_id].step for m in g1 + g2} == {1}

        late = f.group("late", [1, 0, 1, 0])
        await store_all(runtime.store, late)
        await send_all(runtime.bus, g1 + late)  # a redelivery and a trajectory after the end

        async def recorded() -> bool:
            rows = await ledger(runtime, "job-e")
            return all(m.message.episode_id in rows for m in late)

        await wait_for(recorded, what="the late group recorded")
        rows = await ledger(runtime, "job-e")
        assert {rows[m.message.episode_id].skipped for m in late} == {SKIP_JOB_ENDED}
        assert {rows[m.message.episode_id].step for m in g1} == {1}
        assert "job-e" not in trainer.jobs, "a completed job is not loaded again"
    finally:
        await stop(runtime, component)


def test_the_app_serves_health_and_status(settings):
    settings.trainer.device = "cpu"  # type: ignore[assignment]
    with TestClient(create_app(settings)) as client:
        health = client.get("/health")
        assert health.status_code == 200, health.text
        assert set(health.json()["components"]) >= {"database", "bus", "storage", "trainer"}
        status = client.get("/v1/status").json()
        assert status["group"] == "trainer" and status["jobs"] == {}
        assert "temper_trainer_steps_total" in client.get("/metrics").text


async def test_flush_publishes_the_last_steps_and_a_failing_batch_is_skipped(settings):
    runtime, component = await start(settings)
    trainer = component.training
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-f", job_spec(group_size=2, groups_per_step=1, checkpoint_every=3))
        f = TrajectoryFactory("job-f")
        broken = f.group("broken", [0.0, 1.0])
        broken[0].trajectory.segments[1].token_ids[0] = 10_000  # not in the vocabulary: the step raises
        good = f.group("good", [1.0, 0.0])
        await store_all(runtime.store, broken + good)
        await send_all(runtime.bus, broken + good)

        async def settled() -> bool:
            rows = await ledger(runtime, "job-f")
            job = trainer.jobs.get("job-f")
            return (
                len(rows) == 4
                and job is not None
                and job.learner.step_count == 1
                and all(rows[m.message.episode_id].skipped for m in broken)
            )

        await wait_for(settled, what="one step and one skipped batch")
        rows = await ledger(runtime, "job-f")
        assert {rows[m.message.episode_id].skipped for m in broken} == {"train_error"}
        assert {rows[m.message.episode_id].step for m in good} == {None}, "trained, not yet checkpointed"
        assert await versions(runtime, "job-f") == []
        assert await trainer.flush("job-f") == 1
        assert await trainer.flush("job-f") is None
        rows = await ledger(runtime, "job-f")
        assert {rows[m.message.episode_id].step for m in good} == {1}
        assert await versions(runtime, "job-f") == [(1, 1)]
    finally:
        await stop(runtime, component)


async def test_a_failed_publish_is_retried_on_its_own_and_shows_while_it_fails(settings):
    """The object store refuses the checkpoint of the job's last step: no new step will come
    to retry it, so the trainer retries by itself; meanwhile its health check fails and the
    job's state_reason says it is stuck, and both clear once the version is published."""
    runtime, component = await start(settings)
    trainer = component.training
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-p", job_spec(group_size=4, groups_per_step=1, checkpoint_every=1))
        store = runtime.store
        real_put = store.put
        down = True

        async def put(key: str, data: bytes, content_type: str = "application/octet-stream") -> None:
            if down and "/versions/" in key:
                raise ConnectionRefusedError(111, "Connection refused")
            await real_put(key, data, content_type)

        store.put = put  # type: ignore[method-assign]
        made = TrajectoryFactory("job-p").group("g1", [1, 0, 0, 1])
        await store_all(store, made)
        await send_all(runtime.bus, made)

        async def failing() -> bool:
            return trainer.jobs.get("job-p") is not None and trainer.jobs["job-p"].publish_failures >= 2

        await wait_for(failing, what="two failed publishes")
        with pytest.raises(RuntimeError, match="cannot publish policy version v1 of job job-p"):
            await trainer.check()
        async with runtime.db.session() as s:
            reason = (await s.get(Job, "job-p")).state_reason
        assert reason.startswith("stuck: trainer cannot publish policy version v1")
        assert REGISTRY.get_sample_value("temper_trainer_publish_failing", {"job_id": "job-p"}) == 1
        assert await versions(runtime, "job-p") == []

        down = False

        async def published() -> bool:
            # the stuck reason is cleared in its own transaction, right after the publish's
            async with runtime.db.session() as s:
                job = await s.get(Job, "job-p")
                cleared = (job.state_reason, job.policy_version) == (None, 1)
            return cleared and await versions(runtime, "job-p") == [(1, 1)]

        await wait_for(published, what="the version published and the stuck reason cleared")
        await trainer.check()
        assert REGISTRY.get_sample_value("temper_trainer_publish_failing", {"job_id": "job-p"}) == 0
        assert {r.step for r in (await ledger(runtime, "job-p")).values()} == {1}
    finally:
        await stop(runtime, component)


async def test_a_lora_job_publishes_adapter_versions_and_resumes_from_them(settings, tmp_path):
    """algorithm.lora: the published versions are PEFT adapters with a manifest, and a
    restarted trainer continues the adapter (not a fresh one) from the registry."""
    spec = job_spec(group_size=4, groups_per_step=1, checkpoint_every=1, kl_coef=0.1)
    spec["algorithm"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    f = TrajectoryFactory("job-l")
    g1, g2 = f.group("g1", [1, 0, 0, 1]), f.group("g2", [0, 1, 1, 0])
    runtime, component = await start(settings)
    trainer = component.training
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-l", spec)
        await store_all(runtime.store, g1 + g2)
        await send_all(runtime.bus, g1)

        async def v1() -> bool:
            return len(await versions(runtime, "job-l")) == 1

        await wait_for(v1, what="version 1")
        key = "tenants/acme/jobs/job-l/versions/v1/manifest.json"
        async with runtime.db.session() as s:
            assert (
                await s.scalar(select(PolicyVersion.checkpoint_key).where(PolicyVersion.job_id == "job-l"))
            ) == key
        manifest = await fetch_version(runtime.store, key, tmp_path / "v1")
        assert manifest.kind == "lora" and manifest.base_model == "temper-policy"
        assert {"adapter_config.json", "adapter_model.safetensors"} <= set(manifest.served_files())
        adapter_v1 = trainer.jobs["job-l"].learner.adapter_weights()
    finally:
        await stop(runtime, component)

    runtime, component = await start(settings)
    trainer = component.training
    try:
        assert runtime.bus
        await send_all(runtime.bus, g2)

        async def v2() -> bool:
            return len(await versions(runtime, "job-l")) == 2

        await wait_for(v2, what="version 2")
        job = trainer.jobs["job-l"]
        assert job.learner.lora and job.learner.version == 2 and job.learner.step_count == 2
        # it went on from v1's adapter: restored exactly, then one step moved it
        restored = Learner(create_model("tiny", seed=0), job.learner.config, device="cpu")
        await restored.load_version(runtime.store, key)
        now = restored.adapter_weights()
        assert now.keys() == adapter_v1.keys() and all(torch.equal(now[n], p) for n, p in adapter_v1.items())
    finally:
        await stop(runtime, component)


@pytest.mark.parametrize("on_mismatch", ["skip", "halt"])
async def test_a_batch_whose_logprobs_are_not_its_versions_is_refused_and_the_job_says_why(
    settings, on_mismatch
):
    """The logprob canary (algorithm.mismatch.on_mismatch: skip or halt): a batch whose
    behaviour logprobs were planted 0.5 off the version that sampled them is not trained on,
    its groups are skipped with the reason, the job shows it (halt: the job is paused with
    it) and the metric counts it; then (skip) the next clean batch of the same version passes
    the canary, trains and clears the reason."""
    runtime, component = await start(settings)
    trainer = component.training
    try:
        assert runtime.db and runtime.bus and runtime.store
        spec = job_spec(group_size=2, groups_per_step=1, checkpoint_every=1)
        spec["algorithm"]["mismatch"] = {"on_mismatch": on_mismatch}
        job_id = f"job-m-{on_mismatch}"
        await add_job(runtime.db, job_id, spec)
        labels = {"job_id": job_id}
        f = TrajectoryFactory(job_id)
        planted = f.group("planted", [0.0, 1.0], shift=0.5)
        await store_all(runtime.store, planted)
        await send_all(runtime.bus, planted)

        async def refused() -> bool:
            rows = await ledger(runtime, job_id)
            return len(rows) == 2 and all(r.skipped for r in rows.values())

        await wait_for(refused, what="the planted batch refused")
        rows = await ledger(runtime, job_id)
        assert {r.skipped for r in rows.values()} == {SKIP_MISMATCH}
        job = trainer.jobs[job_id]
        assert job.learner.step_count == 0 and await versions(runtime, job_id) == []
        async with runtime.db.session() as s:
            row = await s.get(Job, job_id)
            assert row is not None
            state, reason = row.state, row.state_reason
        prefix = "stuck: " if on_mismatch == "skip" else ""
        assert state == ("running" if on_mismatch == "skip" else "paused")
        assert reason is not None and reason.startswith(f"{prefix}logprob mismatch at v0: 100.0% of")
        assert "past 0.0001" in reason and "refused" in reason
        assert REGISTRY.get_sample_value("temper_trainer_mismatched_batches_total", labels) == 1
        assert REGISTRY.get_sample_value("temper_trainer_logprob_mismatch", {**labels, "stat": "mean"}) == (
            pytest.approx(0.5, abs=1e-5)
        )
        checked = REGISTRY.get_sample_value("temper_trainer_logprob_checked_tokens_total", labels) or 0
        assert checked == sum(
            sum(s.role == "model" and len(s.token_ids) or 0 for s in m.trajectory.segments) for m in planted
        )

        if on_mismatch == "halt":
            return
        clean = f.group("clean", [1.0, 0.0])
        await store_all(runtime.store, clean)
        await send_all(runtime.bus, clean)

        async def published() -> bool:
            return await versions(runtime, job_id) == [(1, 1)]

        await wait_for(published, what="the clean batch trained and published")
        last = job.history[-1]
        assert last["canary"] and last["mismatch_tokens"] > 0 and last["mismatch_max"] < 1e-4
        assert not last["mismatch_failed"]
        async with runtime.db.session() as s:
            assert (await s.get(Job, job_id)).state_reason is None  # type: ignore[union-attr]
        assert REGISTRY.get_sample_value("temper_trainer_mismatched_batches_total", labels) == 1
        # an engine that answers with v0's weights under v1's label: the factory's logprobs are
        # the initial policy's, the learner's weights v1's; the v1 row records the failure
        stale_label = f.group("relabelled", [1.0, 0.0], version=1)
        await store_all(runtime.store, stale_label)
        await send_all(runtime.bus, stale_label)

        async def v1_checked_and_refused() -> bool:
            rows = await ledger(runtime, job_id)
            if not all(
                m.message.episode_id in rows and rows[m.message.episode_id].skipped for m in stale_label
            ):
                return False
            async with runtime.db.session() as s:
                row = await s.get(PolicyVersion, (job_id, 1))
                return row is not None and "logprob_canary" in (row.metrics or {})

        await wait_for(v1_checked_and_refused, what="the canary on the v1 row, the batch refused")
        async with runtime.db.session() as s:
            canary = (await s.get(PolicyVersion, (job_id, 1))).metrics["logprob_canary"]  # type: ignore[union-attr]
        assert canary["failed_batches"] == 1 and canary["tokens"] > 0 and canary["over"] > 0
        assert canary["mean"] > 1e-3, "v0's logprobs are not v1's"
        rows = await ledger(runtime, job_id)
        assert {rows[m.message.episode_id].skipped for m in stale_label} == {SKIP_MISMATCH}
    finally:
        await stop(runtime, component)


async def add_episodes(runtime: Runtime, job_id: str, group: list, states: list[str]) -> None:
    """Episode rows for ``group``'s trajectories, in ``states`` (the dispatcher's side)."""
    assert runtime.db is not None
    async with runtime.db.session() as s:
        for made, state in zip(group, states, strict=True):
            m = made.message
            s.add(Episode(
                id=m.episode_id, job_id=job_id, tenant_id="acme", task_id=m.task_id, group_id=m.group_id,
                state=state, behaviour_version=0, reward=m.reward,
                trajectory_key=m.trajectory_key if state == "scored" else None,
                state_reason="job cancelled" if state == "cancelled" else None,
            ))  # fmt: skip


async def test_a_cancelled_jobs_groups_are_trained_at_once_not_after_the_group_timeout(settings):
    """Cancelling a job cancels its episodes in flight, so some groups will never be full.
    The trainer closes such a group as soon as the database says nothing more will come
    (every member finished, every scored member's trajectory received): two or more samples
    train, one is skipped as incomplete; a group with a member still running, or a scored
    member whose trajectory is still on its way, waits. The group timeout (600 s) plays no
    part: a resumed job trains what it holds at once."""
    runtime, component = await start(settings)  # group_timeout_s: the default, 600 s
    trainer = component.training
    try:
        assert runtime.db and runtime.bus and runtime.store
        await add_job(runtime.db, "job-c", job_spec(group_size=4, groups_per_step=1, checkpoint_every=1))
        f = TrajectoryFactory("job-c")
        whole = f.group("whole", [1, 0, 0, 1])
        half = f.group("half", [1, 0, 0, 0])
        lone = f.group("lone", [1, 0, 0, 0])
        running = f.group("running", [0, 1, 0, 0])
        late = f.group("late", [0, 1, 1, 0])
        await add_episodes(runtime, "job-c", whole, ["scored"] * 4)
        await add_episodes(runtime, "job-c", half, ["scored", "scored", "cancelled", "cancelled"])
        await add_episodes(runtime, "job-c", lone, ["scored", "cancelled", "cancelled", "cancelled"])
        await add_episodes(runtime, "job-c", running, ["scored", "scored", "acting", "acting"])
        await add_episodes(runtime, "job-c", late, ["scored"] * 4)
        sent = whole + half[:2] + lone[:1] + running[:2] + late[:3]
        await store_all(runtime.store, whole + half + lone + running + late)
        await send_all(runtime.bus, sent)

        async def settled() -> bool:
            rows = await ledger(runtime, "job-c")
            done = [rows.get(m.message.episode_id) for m in whole + half[:2] + lone[:1]]
            return all(r is not None and (r.step is not None or r.skipped) for r in done) and all(
                m.message.episode_id in rows for m in sent
            )

        await wait_for(settled, within=20, what="the closed groups trained or skipped")
        rows = await ledger(runtime, "job-c")
        assert rows[lone[0].message.episode_id].skipped == SKIP_INCOMPLETE
        assert len({rows[m.message.episode_id].step for m in half[:2]}) == 1  # one step, the pair
        assert (
            rows[half[0].message.episode_id].step is not None and not rows[half[0].message.episode_id].skipped
        )
        assert all(rows[m.message.episode_id].step is not None for m in whole)
        # a member still running, a trajectory still on its way: those groups wait
        job = trainer.jobs["job-c"]
        assert set(job.groups) == {"running", "late"}
        assert all(rows[m.message.episode_id].step is None for m in running[:2] + late[:3])

        # the job is cancelled: its running members with it; the late trajectory arrives
        async with runtime.db.session() as s:
            for m in running[2:]:
                ep = await s.get(Episode, m.message.episode_id)
                ep.state, ep.state_reason = "cancelled", "job cancelled"
        await send_all(runtime.bus, late[3:])

        async def all_trained() -> bool:
            rows = await ledger(runtime, "job-c")
            return all(
                (r := rows.get(m.message.episode_id)) is not None and r.step is not None
                for m in running[:2] + late
            )

        await wait_for(all_trained, within=20, what="the last two groups trained")
        rows = await ledger(runtime, "job-c")
        assert len({rows[m.message.episode_id].step for m in late}) == 1, "the late group trained whole"
        assert not trainer.jobs["job-c"].groups
        assert [v for v, _ in await versions(runtime, "job-c")] == [1, 2, 3, 4]  # whole, half, running, late
    finally:
        await stop(runtime, component)


async def test_a_trainer_without_its_own_relay_has_the_processes_relay_send_its_versions_at_once(
    settings, monkeypatch
):
    """In one process (``temper run``) the trainer runs no relay: the dispatcher's relay
    sends the trainer's policy updates. It used to find them on its idle sweep, up to
    0.25 s after each version, and the staleness gate held the next iteration that long.
    The trainer now tells the process's relays (``Runtime.notify_outbox``). Here the relay
    sleeps 60 s when idle: the update arrives within 20 s only if it was woken."""
    from temper.outbox import OutboxRelay

    monkeypatch.setattr(OutboxRelay, "IDLE_WAIT_S", 60.0)
    runtime, component = await start(settings, run_relay=False)
    try:
        assert runtime.db and runtime.bus and runtime.store
        assert component.relay is None
        relay = OutboxRelay(runtime.db, runtime.bus)
        runtime.outbox_relays.append(relay.notify)
        runtime.spawn(relay.run(), "the-process-relay")
        await add_job(runtime.db, "job-r", job_spec(group_size=4, groups_per_step=1, checkpoint_every=1))
        updates: list[PolicyUpdate] = []

        async def collect(record) -> None:
            updates.append(PolicyUpdate.model_validate_json(record.value))

        await runtime.bus.subscribe([Topics.POLICY_UPDATES], "test-gateway", collect)
        await asyncio.sleep(0.5)  # the relay's first pass found nothing: it sleeps now
        f = TrajectoryFactory("job-r")
        made = f.group("g1", [1, 0, 0, 1])
        await store_all(runtime.store, made)
        await send_all(runtime.bus, made)

        async def one_update() -> bool:
            return len(updates) == 1

        await wait_for(one_update, within=20.0, what="the policy update, sent by the woken relay")
        assert (updates[0].job_id, updates[0].version) == ("job-r", 1)
    finally:
        await stop(runtime, component)
