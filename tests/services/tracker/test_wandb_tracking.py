"""The tracker writing W&B runs in offline mode with the real wandb SDK (0.31, its wandb-core),
read back from the ``.wandb`` files with wandb's own reader (``wandb leet inspect --json``,
:func:`temper.tracking.read_records`): a seeded job's lifecycle events, shaped as their
producers send them, give a run whose config is the flattened spec, whose tags name tenant and
job, and whose every history row holds the database's numbers: each version's ``train/*``
once, at ``policy_version`` = the version, each iteration's ``rollout/*`` ending at the
database's final number. A tracker that stops mid-job, or starts after the job's events are
gone, completes the same run; a W&B that cannot write fails the event, never the job."""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from services.tracker.component import GROUP, TrackerComponent
from temper import __version__
from temper.bus import InProcessBus
from temper.db import Episode, Evaluation, Job, PolicyVersion, Tenant
from temper.events import LifecycleEvent, Topics
from temper.jobspec import JobSpec
from temper.runtime import Runtime
from temper.settings import DatabaseSettings, LogSettings, Settings, StorageSettings, TrackingSettings
from temper.tracking import Tracker, WandbFailed, WandbSink, flatten_values, read_records
from temper.tracking.tracker import provenance_params
from temper.tracking.wandb_offline import history
from temper.training.learner import StepStats
from tests.services.tracker.test_mlflow_tracking import (
    EVAL_KEYS,
    ITERATIONS,
    JOB,
    PER_ITERATION,
    PROVENANCE,
    TENANT,
    VERSIONS,
    add_in_order,
    eval_values,
    evaluated,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROJECT = "temper-tests"
GRACE_S = 0.3


async def ended(tmp_path: Path, timeout_s: float = 60) -> None:
    """Wait until the job's newest run file holds its exit (the run finished after the grace)."""
    deadline = time.monotonic() + timeout_s
    while True:
        paths = files(tmp_path)
        if paths and any(r["type"] == "exit" for r in await asyncio.to_thread(read_records, paths[-1])):
            return
        assert time.monotonic() < deadline, "the run never finished"
        await asyncio.sleep(0.2)


def spec() -> dict[str, Any]:
    return JobSpec.model_validate({
        "name": "tracked job",
        "tags": ["nightly", "exp:lr-sweep"],
        "policy": {"model": "temper-policy"},
        "tasks": {"taskset": "ts-1", "group_size": 2},
        "algorithm": {"learning_rate": 3e-5, "kl_coef": 0.02},
        "schedule": {"iterations": ITERATIONS, "episodes_per_iteration": PER_ITERATION},
        "tracking": {"wandb": {"project": PROJECT, "mode": "offline"}},
    }).model_dump(mode="json")  # fmt: skip


Step = tuple[list[Any], LifecycleEvent]  # rows its producer wrote, then the event it sent


async def steps(runtime: Runtime) -> list[Step]:
    """The job in the database, and what its run adds, step by step: the rows a producer
    writes, then the event it sends (the shapes of tests/services/tracker/test_mlflow_tracking.py)."""
    assert runtime.db is not None
    rng = random.Random(7)
    async with runtime.db.session() as s:
        s.add(Tenant(id=TENANT, name="Acme"))
    async with runtime.db.session() as s:
        s.add(
            Job(
                id=JOB,
                tenant_id=TENANT,
                name="tracked job",
                spec=spec(),
                state="running",
                provenance=PROVENANCE,
            )
        )
    out: list[Step] = [([], LifecycleEvent(event="job.state", job_id=JOB, tenant=TENANT, state="running"))]
    out.append(evaluated(0, rng))  # version 0, the initial weights
    for it in range(ITERATIONS):
        for n in range(PER_ITERATION):
            reward = round(rng.random(), 6)
            ep = Episode(id=f"ep-{it}-{n}", job_id=JOB, tenant_id=TENANT, task_id=f"t{n // 2}",
                         group_id=f"g-{it}-{n // 2}", iteration=it, state="trained", reward=reward)  # fmt: skip
            failed = [Episode(id=f"ep-{it}-failed", job_id=JOB, tenant_id=TENANT, task_id="t9", group_id=f"g-{it}-9",
                              iteration=it, state="failed", reward=None)] if n == 0 else []  # fmt: skip
            out.append(([ep, *failed], LifecycleEvent(event="episode.reward", job_id=JOB, episode_id=ep.id, tenant=TENANT,
                                                      reward=reward, data={"iteration": it, "task_id": ep.task_id})))  # fmt: skip
        version = it + 1
        stats = StepStats(step=version, version=version, updated=True, loss=rng.uniform(-1, 1),
                          pg_loss=rng.uniform(-1, 1), kl=rng.random() / 10, entropy=rng.uniform(1, 3),
                          clip_fraction=rng.random() / 5, grad_norm=rng.uniform(0, 5),
                          learning_rate=3e-5, tokens=rng.randrange(100, 900), samples=PER_ITERATION,
                          groups=2, seconds=rng.random())  # fmt: skip
        summary = stats.as_dict()
        row = PolicyVersion(
            job_id=JOB, version=version, checkpoint_key=f"k/v{version}", step=version, metrics=summary
        )
        out.append(([row], LifecycleEvent(event="policy.version", job_id=JOB, tenant=TENANT, version=version,
                                          data=summary)))  # fmt: skip
        out.append(evaluated(version, rng))
    out.append(([], LifecycleEvent(event="job.state", job_id=JOB, tenant=TENANT, state="completed")))
    return out


async def play(runtime: Runtime, played: list[Step], *, write: bool = True) -> None:
    """Each step's rows, then its event, handled by the tracker before the next step."""
    assert runtime.db is not None
    for rows, event in played:
        if write and rows:
            async with runtime.db.session() as s:
                await add_in_order(s, rows)
        await send_and_wait(runtime, [event])


async def started(tmp_path: Path, grace_s: float = GRACE_S) -> tuple[Runtime, TrackerComponent]:
    from temper.db.migrate import upgrade

    url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    if not (tmp_path / "temper.db").exists():
        await asyncio.to_thread(upgrade, url)
    settings = Settings(db=DatabaseSettings(url=url), storage=StorageSettings(root=tmp_path / "objects"),
                        log=LogSettings(level="WARNING"), data_dir=tmp_path,
                        tracking=TrackingSettings(wandb_dir=tmp_path / "wandb-runs", wandb_flush_s=0.5,
                                                  wandb_end_grace_s=grace_s))  # fmt: skip
    runtime = Runtime(settings, service="tracker")
    await runtime.start()
    tracker = TrackerComponent(runtime)
    await tracker.start()
    return runtime, tracker


async def send_and_wait(runtime: Runtime, events: list[LifecycleEvent], timeout_s: float = 60) -> None:
    """Send ``events`` and wait until the tracker has handled every one."""
    bus = runtime.bus
    assert isinstance(bus, InProcessBus)
    for event in events:
        await bus.send_message(Topics.EVENTS, event)
    deadline = time.monotonic() + timeout_s
    while bus.lag(Topics.EVENTS, GROUP):
        assert time.monotonic() < deadline, "the tracker did not handle every event"
        await asyncio.sleep(0.05)


def files(tmp_path: Path) -> list[Path]:
    return WandbSink(tmp_path / "wandb-runs").run_files(JOB, TENANT)


async def check_run(
    runtime: Runtime, tmp_path: Path, events: list[LifecycleEvent], *, from_events: bool = True
) -> list[list[dict]]:
    """The job's run files hold everything the database holds, each point once; returns the
    records of each file. ``from_events``: every version's row came from its event (its
    timestamp), none from the database (the version's ``created_at``)."""
    assert runtime.db is not None
    async with runtime.db.session() as s:
        job = await s.get(Job, JOB)
        assert job is not None
        versions = (await s.execute(select(PolicyVersion).where(PolicyVersion.job_id == JOB))).scalars().all()
        episodes = (await s.execute(select(Episode).where(Episode.job_id == JOB))).scalars().all()
        evaluations = (
            (await s.execute(select(Evaluation).where(Evaluation.source_job_id == JOB))).scalars().all()
        )
    paths = files(tmp_path)
    assert paths, "the job has no .wandb file"
    assert all(p.parent.parent == tmp_path / "wandb-runs" / TENANT / "wandb" for p in paths)
    per_file = [await asyncio.to_thread(read_records, p) for p in paths]

    for records in per_file:
        assert records[0]["type"] == "header"
        run = next(r["run"] for r in records if r["type"] == "run")
        assert (run["run_id"], run["project"], run["display_name"]) == (JOB, PROJECT, "tracked job")
        assert run["tags"] == [f"tenant:{TENANT}", f"job:{JOB}", "nightly", "exp:lr-sweep"]
        config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
        assert config == {**flatten_values({**job.spec, **provenance_params(job.provenance)}),
                          "temper.tenant": TENANT, "temper.job_id": JOB,
                          "temper.job_name": "tracked job", "temper.version": __version__}  # fmt: skip
        assert config["algorithm.learning_rate"] == 3e-05 and config["schedule.iterations"] == ITERATIONS
        assert config["tracking.wandb.mode"] == "offline"
        assert config["provenance.model.sha256"] == "a" * 64 and config["provenance.seeds.tasks.seed"] == 0
        metrics = {r["metric"].get("glob_name") or r["metric"]["name"]: r["metric"] for r in records
                   if r["type"] == "metric"}  # fmt: skip
        assert metrics["train/*"]["step_metric"] == "policy_version"
        assert metrics["eval/*"]["step_metric"] == "policy_version"
        assert metrics["rollout/*"]["step_metric"] == "iteration"

    rows = [row for records in per_file for row in history(records)]
    # one _step after the other across every file of the run (a resumed file goes on)
    assert [row["_step"] for row in rows] == sorted({row["_step"] for row in rows})

    numeric = {
        k for k, v in versions[0].metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    assert {"loss", "kl", "entropy", "grad_norm", "clip_fraction", "learning_rate", "tokens"} <= numeric
    sent = {e.version: e for e in events if e.event == "policy.version"}
    train_rows = [row for row in rows if any(k.startswith("train/") for k in row)]
    for v in versions:
        version_rows = [row for row in train_rows if row.get("policy_version") == v.version]
        assert len(version_rows) == 1, (v.version, version_rows)  # each version once, whatever came twice
        row = version_rows[0]
        assert {k: row[k] for k in row if k.startswith("train/")} == {
            f"train/{k}": float(v.metrics[k]) for k in numeric
        }
        stamps = {int(sent[v.version].occurred_at.timestamp() * 1000)}  # ms, as every system gets them
        if not from_events:
            stamps.add(int(v.created_at.timestamp() * 1000))
        assert round(row["_timestamp"] * 1000) in stamps, (v.version, row["_timestamp"], stamps)
    assert len({row["policy_version"] for row in train_rows}) == VERSIONS
    # each evaluation's results once, at policy_version = the version it evaluated (in a row of
    # their own when logged from the event, beside the version's train/* when read from the database)
    eval_rows = [row for row in rows if any(k.startswith("eval/") for k in row)]
    assert sorted(row["policy_version"] for row in eval_rows) == sorted(e.version for e in evaluations)
    assert len(evaluations) == VERSIONS + 1
    for e in evaluations:
        (row,) = [row for row in eval_rows if row["policy_version"] == e.version]
        assert {k: row[k] for k in row if k.startswith("eval/")} == {
            f"eval/{k}": eval_values(e.summary)[k] for k in EVAL_KEYS
        }

    for it in range(ITERATIONS):
        rewards = [e.reward for e in episodes if e.iteration == it and e.reward is not None]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(max(0.0, sum(r * r for r in rewards) / len(rewards) - mean * mean))
        it_rows = [row for row in rows if row.get("iteration") == it]
        assert 1 <= len(it_rows) <= PER_ITERATION + 1
        newest: dict[str, float] = {}
        for row in it_rows:  # no row repeats a value the run already held
            changed = {k: v for k, v in row.items() if k.startswith("rollout/")}
            assert changed and all(newest.get(k) != v for k, v in changed.items()), (it, it_rows)
            newest.update(changed)
        assert newest["rollout/reward_mean"] == pytest.approx(mean, rel=1e-12, abs=1e-12)
        assert newest["rollout/reward_std"] == pytest.approx(std, rel=1e-9, abs=1e-12)
        assert newest["rollout/episodes"] == PER_ITERATION
    assert not [row for row in rows if not ({"policy_version", "iteration"} & row.keys())]

    summary: dict[str, Any] = {}
    for records in per_file:
        for r in records:
            if r["type"] == "summary":
                summary.update(r["summary"]["update"])
    assert (summary["temper.state"], summary["temper.state_reason"]) == ("completed", "")
    last = per_file[-1]
    assert [r["exit"].get("exit_code", 0) for r in last if r["type"] == "exit"] == [0]
    assert not [r for r in last if r["type"] == "preempting"]
    return per_file


async def test_a_tracked_job_lands_in_wandb_with_the_databases_values(tmp_path):
    runtime, tracker = await started(tmp_path)
    try:
        played = await steps(runtime)
        await play(runtime, played)
        events = [event for _, event in played]
        await send_and_wait(runtime, events)  # every event again: a redelivery writes nothing new
        # the job's end closes its run after the grace: the file is complete while the tracker runs
        await ended(tmp_path)
        per_file = await check_run(runtime, tmp_path, events)
        assert len(per_file) == 1
    finally:
        await tracker.stop()
        await runtime.stop()
    assert len(files(tmp_path)) == 1  # stopping the tracker after the end opens nothing


async def test_a_restarted_tracker_resumes_the_run(tmp_path):
    runtime, tracker = await started(tmp_path)
    try:
        played = await steps(runtime)
        half = len(played) // 2
        await play(runtime, played[:half])
        await tracker.stop()  # mid-job: the run is closed as preempting, not as the job's end
        [first] = files(tmp_path)
        records = await asyncio.to_thread(read_records, first)
        assert [r["type"] for r in records if r["type"] in ("preempting", "exit")] == ["preempting", "exit"]

        tracker = TrackerComponent(runtime)
        await tracker.start()
        # the new tracker gets the rest, and some of what the old one logged again
        await play(runtime, played[half - 3 : half], write=False)
        await play(runtime, played[half:])
        await ended(tmp_path)
        per_file = await check_run(runtime, tmp_path, [event for _, event in played], from_events=False)
        assert len(per_file) == 2
        second_run = next(r["run"] for r in per_file[1] if r["type"] == "run")
        assert second_run.get("resume") is True
    finally:
        await tracker.stop()
        await runtime.stop()


@pytest.mark.parametrize("grace_s", [10.0, GRACE_S])
async def test_the_last_version_after_the_end_is_in_the_run(tmp_path, grace_s):
    """The trainer publishes its last version once the job completed, and its evaluation ends
    later still: within the grace they go in the run still open; after it, the run is resumed
    (a second file) and ended again."""
    runtime, tracker = await started(tmp_path, grace_s)
    try:
        played = await steps(runtime)
        *before, last_version, its_evaluation, end = played
        assert last_version[1].event == "policy.version" and end[1].state == "completed"
        assert its_evaluation[1].event == "evaluation"
        await play(runtime, [*before, end])
        if grace_s == GRACE_S:
            await ended(tmp_path)
        await play(runtime, [last_version, its_evaluation])  # and its evaluation, later still
        await ended(tmp_path)
        per_file = await check_run(runtime, tmp_path, [event for _, event in played])
        assert len(per_file) == (1 if grace_s > GRACE_S else 2)
    finally:
        await tracker.stop()
        await runtime.stop()


async def test_a_tracker_that_missed_the_events_completes_the_run_from_the_database(tmp_path):
    """The first sight of a job fills the run from the database: a tracker that lost events
    (on the in-process bus, a process that died; wandb-core that had not flushed) misses nothing."""
    runtime, tracker = await started(tmp_path)
    try:
        played = await steps(runtime)
        assert runtime.db is not None
        async with runtime.db.session() as s:
            await add_in_order(s, [row for rows, _ in played for row in rows])
        await play(runtime, [played[-1]])  # only the job's end
        await ended(tmp_path)
        await check_run(runtime, tmp_path, [event for _, event in played], from_events=False)
    finally:
        await tracker.stop()
        await runtime.stop()


async def test_wandb_failing_fails_the_event_not_the_job(tmp_path):
    runtime, tracker = await started(tmp_path)
    try:
        played = await steps(runtime)
        assert runtime.db is not None
        blocked = tmp_path / "not-a-directory"
        blocked.write_text("")
        broken = Tracker(runtime.db, wandb_dir=blocked)
        try:
            with pytest.raises(WandbFailed):
                await broken.handle(played[0][1])
        finally:
            await broken.aclose()
        async with runtime.db.session() as s:
            job = await s.get(Job, JOB)
            assert job is not None and job.state == "running"
    finally:
        await tracker.stop()
        await runtime.stop()


def test_run_files_are_found_by_the_exact_job_id(tmp_path):
    runs = tmp_path / "acme" / "wandb"
    made = {"offline-run-20260101_000001-job-a-1": "job-a", "offline-run-20260101_000000-job-a": "job-a",
            "offline-run-20260101_000001-job-a": "job-a", "offline-run-20260101_000000-x-job-a": "x-job-a",
            "offline-run-20260101_000002-a": "a"}  # fmt: skip
    for name, job_id in made.items():
        (runs / name).mkdir(parents=True)
        (runs / name / f"run-{job_id}.wandb").write_bytes(b"")
    assert [p.parent.name for p in WandbSink(tmp_path).run_files("job-a", "acme")] == [
        "offline-run-20260101_000000-job-a",
        "offline-run-20260101_000001-job-a",
        "offline-run-20260101_000001-job-a-1",
    ]
