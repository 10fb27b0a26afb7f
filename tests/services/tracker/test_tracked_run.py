"""``temper run`` of a small real job (real sandboxes, generation and gradient steps) with
``tracking.mlflow``: the job's MLflow run on a real server holds its params, tags, state and
every metric point, with the values the run's database holds when it ends."""

from __future__ import annotations

import asyncio
import json
import math
import sqlite3
from typing import Any

import pytest
import yaml

from services.cli import main
from temper import __version__
from temper.tracking import MlflowClient, flatten
from temper.tracking.mlflow import JOB_TAG
from tests.services.embedded.test_temper_run import small_spec
from tests.services.tracker.mlflow_server import MlflowServer

NUMBERS = ("loss", "kl", "entropy", "grad_norm", "clip_fraction", "learning_rate", "tokens")


async def read_run(
    uri: str, experiment: str, job_id: str
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    client = MlflowClient(uri)
    try:
        run_id = await client.find_run(await client.experiment_id(experiment), JOB_TAG, job_id)
        assert run_id is not None, "the job has no run"
        run = await client.get_run(run_id)
        keys = {m["key"] for m in run["data"]["metrics"]}
        return run, {k: await client.metric_history(run_id, k) for k in keys}
    finally:
        await client.aclose()


@pytest.mark.mlflow
@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_temper_run_logs_the_job_to_mlflow(tmp_path, capsys, mlflow_server: MlflowServer):
    path = small_spec(tmp_path)
    spec = yaml.safe_load(path.read_text())
    # a weak model can score every group flat: train on those too, so versions are published
    spec["algorithm"]["skip_zero_variance"] = False
    spec["tracking"] = {"mlflow": {"uri": mlflow_server.uri, "experiment": "temper-run"}}
    path.write_text(yaml.safe_dump(spec))
    code = main(["run", str(path), "--runs-dir", str(tmp_path / "runs"), "--run-id", "tracked"])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert "tracking: not every event" not in err

    with sqlite3.connect(tmp_path / "runs" / "tracked" / "temper.db") as conn:
        job_id, tenant, name, stored, state = conn.execute(
            "SELECT id, tenant_id, name, spec, state FROM jobs"
        ).fetchone()
        versions = conn.execute("SELECT version, metrics FROM policy_versions ORDER BY version").fetchall()
        rewards = conn.execute(
            "SELECT iteration, reward FROM episodes WHERE state IN ('scored', 'trained') AND reward IS NOT NULL"
        ).fetchall()
    assert state == "completed" and len(versions) >= 2, versions
    run, history = asyncio.run(read_run(mlflow_server.uri, "temper-run", job_id))

    assert run["info"]["status"] == "FINISHED"
    assert {p["key"]: p["value"] for p in run["data"]["params"]} == flatten(json.loads(stored))
    tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
    assert (tags["temper.tenant"], tags[JOB_TAG], tags["temper.job_name"], tags["temper.version"], tags["temper.state"]) == (
        tenant, job_id, name, __version__, "completed",
    )  # fmt: skip
    for key in NUMBERS:
        got = sorted((int(m["step"]), m["value"]) for m in history[f"train/{key}"])
        assert got == [(v, float(json.loads(m)[key])) for v, m in versions], key
    for it in sorted({i for i, _ in rewards}):
        values = [r for i, r in rewards if i == it]
        mean = sum(values) / len(values)
        std = math.sqrt(max(0.0, sum(r * r for r in values) / len(values) - mean * mean))
        for key, want in (
            ("rollout/reward_mean", mean),
            ("rollout/reward_std", std),
            ("rollout/episodes", len(values)),
        ):
            final = max((m for m in history[key] if int(m["step"]) == it), key=lambda m: m["timestamp"])
            assert final["value"] == pytest.approx(want, rel=1e-9, abs=1e-12), (key, it)
