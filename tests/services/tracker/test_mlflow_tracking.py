"""The tracker against a real MLflow server: a seeded job's lifecycle events, shaped as their
producers send them (the trainer's ``policy.version`` with the ``policy_versions.metrics``
row, the dispatcher's ``episode.reward``, the job's ``job.state``), go through the bus to the
tracker component, and MLflow is read back over its REST API: every param, tag and metric
point, with the values the database holds. The outage test stops the server mid-job and
restarts the tracker before the server is back: nothing is lost, nothing is doubled, and the
job keeps its one run."""

from __future__ import annotations

import asyncio
import math
import random
import time
from typing import Any

import pytest
from sqlalchemy import select

from services.tracker.component import TrackerComponent
from temper import __version__
from temper.db import Episode, Evaluation, Job, PolicyVersion, Tenant
from temper.db.migrate import upgrade
from temper.events import LifecycleEvent, Topics
from temper.jobspec import JobSpec
from temper.runtime import Runtime
from temper.settings import BusKind, BusSettings, DatabaseSettings, LogSettings, Settings, StorageSettings
from temper.tracking import MlflowClient, flatten
from temper.tracking.mlflow import JOB_TAG
from temper.tracking.tracker import provenance_params
from temper.training.learner import StepStats
from tests.services.tracker.mlflow_server import MlflowServer

pytestmark = [pytest.mark.mlflow, pytest.mark.timeout(240)]

TENANT = "acme"
JOB = "job-tracked"
# as temper.provenance.record leaves it at submission
PROVENANCE = {
    "format": 1,
    "recorded_at": "2026-12-04T10:00:00+00:00",
    "seeds": {"tasks.seed": 0},
    "spec_sha256": "5" * 64,
    "temper": {"version": __version__, "commit": "c" * 40, "dirty": False},
    "model": {"policy_model": "temper-policy", "init": "/models/m", "source": "directory", "sha256": "a" * 64,
              "files": 3},
    "taskset": {"id": "ts-1", "name": "adders", "tasks": 2, "sha256": "b" * 64},
}  # fmt: skip
ITERATIONS, PER_ITERATION, VERSIONS = 3, 4, 3
EVAL_KEYS = ("pass_at_1", "pass_at_4", "reward_mean", "episodes", "tests_passed")


def evaluated(version: int, rng: random.Random) -> tuple[list[Any], LifecycleEvent]:
    """An evaluation of ``version`` as the dispatcher leaves it (its job, its row with the
    results) and the ``evaluation`` event it sends for the evaluated job."""
    from temper.clock import utcnow

    eval_job = f"job-eval-v{version}"
    summary = {"tasks": 4, "tasks_scored": 4, "episodes": 16, "failed_episodes": 0, "passed": 7,
               "pass_at": {"1": round(rng.random(), 6), "4": round(rng.random(), 6)},
               "reward_mean": round(rng.random(), 6), "components": {"tests_passed": round(rng.random(), 6)}}  # fmt: skip
    rows = [
        Job(id=eval_job, tenant_id=TENANT, name=f"tracked job: eval v{version}", spec={}, state="completed"),
        Evaluation(
            job_id=eval_job,
            tenant_id=TENANT,
            source_job_id=JOB,
            version=version,
            label="eval",
            periodic=True,
            taskset_id="ts-1",
            split="held_out",
            samples=4,
            pass_at=[1, 4],
            summary=summary,
            completed_at=utcnow(),
        ),  # fmt: skip
    ]
    event = LifecycleEvent(event="evaluation", job_id=JOB, tenant=TENANT, version=version,
                           data={**summary, "label": "eval", "evaluation_job_id": eval_job})  # fmt: skip
    return rows, event


async def add_in_order(s: Any, rows: list[Any]) -> None:
    """Rows whose foreign keys point at the ones before them (no ORM relationship orders them)."""
    for row in rows:
        s.add(row)
        await s.flush()


def eval_values(summary: dict[str, Any]) -> dict[str, float]:
    """What an evaluation's summary logs, by key (temper.tracking.tracker.eval_points)."""
    return {"pass_at_1": summary["pass_at"]["1"], "pass_at_4": summary["pass_at"]["4"],
            "reward_mean": summary["reward_mean"], "episodes": float(summary["episodes"]),
            "tests_passed": summary["components"]["tests_passed"]}  # fmt: skip


def spec(uri: str, experiment: str) -> dict[str, Any]:
    return JobSpec.model_validate({
        "name": "tracked job",
        "policy": {"model": "temper-policy"},
        "tasks": {"taskset": "ts-1", "group_size": 2},
        "algorithm": {"learning_rate": 3e-5, "kl_coef": 0.02},
        "schedule": {"iterations": ITERATIONS, "episodes_per_iteration": PER_ITERATION},
        "tracking": {"mlflow": {"uri": uri, "experiment": experiment}},
    }).model_dump(mode="json")  # fmt: skip


async def seed(runtime: Runtime, uri: str, experiment: str) -> list[LifecycleEvent]:
    """The job, its episodes and policy versions in the database, and the events their
    producers sent, in the order they would come."""
    assert runtime.db is not None
    rng = random.Random(7)
    events = [LifecycleEvent(event="job.state", job_id=JOB, tenant=TENANT, state="running")]
    async with runtime.db.session() as s:
        s.add(Tenant(id=TENANT, name="Acme"))
    async with runtime.db.session() as s:
        s.add(Job(id=JOB, tenant_id=TENANT, name="tracked job", spec=spec(uri, experiment), state="running",
                  provenance=PROVENANCE))  # fmt: skip
        await s.flush()
        rows, event = evaluated(0, rng)  # version 0, the initial weights
        await add_in_order(s, rows)
        events.append(event)
        for it in range(ITERATIONS):
            for n in range(PER_ITERATION):
                reward = round(rng.random(), 6)
                ep = Episode(id=f"ep-{it}-{n}", job_id=JOB, tenant_id=TENANT, task_id=f"t{n // 2}",
                             group_id=f"g-{it}-{n // 2}", iteration=it, state="trained", reward=reward)  # fmt: skip
                s.add(ep)
                events.append(LifecycleEvent(event="episode.reward", job_id=JOB, episode_id=ep.id, tenant=TENANT,
                                             reward=reward, data={"iteration": it, "task_id": ep.task_id}))  # fmt: skip
            # a failed episode has no reward and is not in the iteration's numbers
            s.add(Episode(id=f"ep-{it}-failed", job_id=JOB, tenant_id=TENANT, task_id="t9", group_id=f"g-{it}-9",
                          iteration=it, state="failed", reward=None))  # fmt: skip
            version = it + 1
            stats = StepStats(step=version, version=version, updated=True, loss=rng.uniform(-1, 1),
                              pg_loss=rng.uniform(-1, 1), kl=rng.random() / 10, entropy=rng.uniform(1, 3),
                              clip_fraction=rng.random() / 5, grad_norm=rng.uniform(0, 5),
                              learning_rate=3e-5, tokens=rng.randrange(100, 900), samples=PER_ITERATION,
                              groups=2, seconds=rng.random())  # fmt: skip
            summary = stats.as_dict()
            s.add(PolicyVersion(job_id=JOB, version=version, checkpoint_key=f"k/v{version}", step=version,
                                metrics=summary))  # fmt: skip
            events.append(LifecycleEvent(event="policy.version", job_id=JOB, tenant=TENANT, version=version,
                                         data=summary))  # fmt: skip
            rows, event = evaluated(version, rng)
            await add_in_order(s, rows)
            events.append(event)
    events.append(LifecycleEvent(event="job.state", job_id=JOB, tenant=TENANT, state="completed"))
    return events


async def started(tmp_path, bus: BusSettings | None = None) -> tuple[Runtime, TrackerComponent]:
    url = f"sqlite+aiosqlite:///{tmp_path}/temper.db"
    if not (tmp_path / "temper.db").exists():
        await asyncio.to_thread(upgrade, url)
    settings = Settings(db=DatabaseSettings(url=url), storage=StorageSettings(root=tmp_path / "objects"),
                        log=LogSettings(level="WARNING"), bus=bus or BusSettings())  # fmt: skip
    runtime = Runtime(settings, service="tracker")
    await runtime.start()
    tracker = TrackerComponent(runtime)
    await tracker.start()
    return runtime, tracker


async def stopped(runtime: Runtime, tracker: TrackerComponent) -> None:
    await tracker.stop()
    await runtime.stop()


async def send(runtime: Runtime, events: list[LifecycleEvent]) -> None:
    assert runtime.bus is not None
    for event in events:
        await runtime.bus.send_message(Topics.EVENTS, event)


async def the_run(client: MlflowClient, experiment: str) -> dict[str, Any] | None:
    experiment_id = await client.experiment_id(experiment)
    run_id = await client.find_run(experiment_id, JOB_TAG, JOB)
    return None if run_id is None else await client.get_run(run_id)


async def wait_for_state(
    client: MlflowClient, experiment: str, state: str, timeout_s: float = 60
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        run = await the_run(client, experiment)
        tags = {t["key"]: t["value"] for t in (run or {}).get("data", {}).get("tags", [])}
        if run is not None and tags.get("temper.state") == state:
            return run
        assert time.monotonic() < deadline, f"the run never reached temper.state={state}: {run}"
        await asyncio.sleep(0.2)


async def check_run(runtime: Runtime, client: MlflowClient, run: dict[str, Any], experiment: str) -> None:
    """Everything the database holds for the job, in the run: exactly once per point."""
    assert runtime.db is not None
    async with runtime.db.session() as s:
        job = await s.get(Job, JOB)
        assert job is not None
        versions = (await s.execute(select(PolicyVersion).where(PolicyVersion.job_id == JOB))).scalars().all()
        episodes = (await s.execute(select(Episode).where(Episode.job_id == JOB))).scalars().all()
        evaluations = (
            (await s.execute(select(Evaluation).where(Evaluation.source_job_id == JOB))).scalars().all()
        )
    info, data = run["info"], run["data"]
    assert info["status"] == "FINISHED" and info["run_name"] == "tracked job"
    # the one run of the job in its experiment
    experiment_id = await client.experiment_id(experiment)
    assert info["experiment_id"] == experiment_id

    params = {p["key"]: p["value"] for p in data["params"]}
    assert params == flatten({**job.spec, **provenance_params(job.provenance)})
    # the job's provenance beside its spec
    assert params["provenance.model.sha256"] == "a" * 64 and params["provenance.taskset.sha256"] == "b" * 64
    assert params["provenance.temper.commit"] == "c" * 40 and params["provenance.seeds.tasks.seed"] == "0"
    assert "provenance.recorded_at" not in params
    assert params["algorithm.learning_rate"] == "3e-05" and params["algorithm.kl_coef"] == "0.02"
    assert params["tracking.mlflow.experiment"] == experiment and params["schedule.iterations"] == str(
        ITERATIONS
    )

    tags = {t["key"]: t["value"] for t in data["tags"]}
    assert {k: tags[k] for k in ("temper.tenant", JOB_TAG, "temper.job_name", "temper.version", "temper.state")} == {
        "temper.tenant": TENANT, JOB_TAG: JOB, "temper.job_name": "tracked job", "temper.version": __version__,
        "temper.state": "completed",
    }  # fmt: skip

    numeric = {
        k for k, v in versions[0].metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    assert {"loss", "kl", "entropy", "grad_norm", "clip_fraction", "learning_rate", "tokens"} <= numeric
    for key in sorted(numeric):
        history = await client.metric_history(info["run_id"], f"train/{key}")
        got = sorted((int(m["step"]), m["value"]) for m in history)
        assert got == sorted((v.version, float(v.metrics[key])) for v in versions), key

    # each evaluation's results at step = the version it evaluated, once
    assert len(evaluations) == VERSIONS + 1
    for key in EVAL_KEYS:
        history = await client.metric_history(info["run_id"], f"eval/{key}")
        got = sorted((int(m["step"]), m["value"]) for m in history)
        assert got == sorted((e.version, eval_values(e.summary)[key]) for e in evaluations), key

    for it in range(ITERATIONS):
        rewards = [e.reward for e in episodes if e.iteration == it and e.reward is not None]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(max(0.0, sum(r * r for r in rewards) / len(rewards) - mean * mean))
        for key, want in (("rollout/reward_mean", mean), ("rollout/reward_std", std),
                          ("rollout/episodes", float(PER_ITERATION))):  # fmt: skip
            points = [m for m in await client.metric_history(info["run_id"], key) if int(m["step"]) == it]
            # at most one point per event that touched the iteration (its 4 episodes, the job's
            # end; events of one millisecond with one value are one point): a redelivery adds none
            assert (
                1 <= len(points) == len({(m["timestamp"], m["value"]) for m in points}) <= PER_ITERATION + 1
            )
            final = max(points, key=lambda m: m["timestamp"])
            assert final["value"] == pytest.approx(want, rel=1e-9, abs=1e-12), (key, it)


async def test_a_tracked_job_lands_in_mlflow_with_the_databases_values(tmp_path, mlflow_server: MlflowServer):
    experiment = f"exp-{tmp_path.name}"
    runtime, tracker = await started(tmp_path)
    client = MlflowClient(mlflow_server.uri)
    try:
        await send(runtime, await seed(runtime, mlflow_server.uri, experiment))
        run = await wait_for_state(client, experiment, "completed")
        await check_run(runtime, client, run, experiment)
    finally:
        await client.aclose()
        await stopped(runtime, tracker)


@pytest.fixture(params=["inprocess", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus(request, unique) -> BusSettings:
    """The in-process bus, and real Kafka (topics and groups of this test's own namespace)."""
    if request.param == "inprocess":
        return BusSettings()
    bootstrap = request.getfixturevalue("kafka_bootstrap")
    return BusSettings(kind=BusKind.kafka, bootstrap=bootstrap, partitions=2, namespace=f"trk{unique}.")


async def test_mlflow_down_mid_job_loses_nothing_and_keeps_the_run(
    tmp_path, mlflow_server: MlflowServer, bus
):
    experiment = f"exp-{tmp_path.name}"
    runtime, tracker = await started(tmp_path, bus)
    client = MlflowClient(mlflow_server.uri)
    try:
        events = await seed(runtime, mlflow_server.uri, experiment)
        first, rest = events[: len(events) // 2], events[len(events) // 2 :]
        await send(runtime, first)
        await wait_for_state(client, experiment, "running")
        run_id = (await the_run(client, experiment) or {})["info"]["run_id"]
        mlflow_server.stop()
        await send(runtime, rest)
        await asyncio.sleep(2)  # the tracker retries against the stopped server meanwhile
        # the tracker restarts too, before the server is back (on Kafka the whole runtime: a
        # new process): what it had not logged is still on the bus, uncommitted, and the new
        # tracker finds the job's run by its tag
        await tracker.stop()
        if bus.kind is BusKind.kafka:
            await runtime.stop()
            runtime, tracker = await started(tmp_path, bus)
        else:  # the in-process bus lives as long as its runtime
            tracker = TrackerComponent(runtime)
            await tracker.start()
        await asyncio.to_thread(mlflow_server.start)
        run = await wait_for_state(client, experiment, "completed")
        assert run["info"]["run_id"] == run_id
        # the events before the outage were logged once, and those during it once
        await check_run(runtime, client, run, experiment)
    finally:
        await client.aclose()
        await stopped(runtime, tracker)
