"""``temper episodes|metrics|logs|export|checkpoints|compare`` against a dispatcher on a
free port, seeded with a finished job."""

from __future__ import annotations

import json

import pytest

from services.dispatcher.api.export import parquet_records, trajectory_of
from temper import cli
from tests.services.dispatcher.conftest import KILLED_EPISODE
from tests.services.dispatcher.test_dispatcher_cli import run_cli, server  # noqa: F401

pytestmark = pytest.mark.timeout(60)


def test_episodes_and_metrics(server, capsys):  # noqa: F811
    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    code, out, _ = run_cli([*base, "episodes", seeded.job_id, "--limit", "5"], capsys)
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == [
        "episode",
        "iteration",
        "task",
        "state",
        "turns",
        "reward",
        "policy",
    ]
    assert len(lines) == 1 + 5 + 1 and lines[-1] == "(5 of 12; --all for every one)"
    code, out, _ = run_cli([*base, "episodes", seeded.job_id, "--all", "--limit", "5"], capsys)
    assert code == 0 and len(out.splitlines()) == 13
    row = next(ln for ln in out.splitlines() if ln.startswith(KILLED_EPISODE)).split()
    # iteration 0 is the first; the seeded row is at turn index 2, so it took 3 turns
    assert row[1] == "1" and row[4] == "3"
    code, out, _ = run_cli([*base, "episodes", seeded.job_id, "--iteration", "3", "--json"], capsys)
    assert code == 0 and {e["iteration"] for e in json.loads(out)} == {2}
    code, out, _ = run_cli([*base, "metrics", seeded.job_id], capsys)
    assert (
        code == 0 and "iteration 3/3" in out and "reward per iteration" in out and "pass rate per task" in out
    )
    curve = out[out.index("reward per iteration") :].splitlines()[2:5]
    assert [ln.split()[0] for ln in curve] == ["1", "2", "3"]


def test_export_round_trips_through_the_cli(server, tmp_path, capsys):  # noqa: F811
    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    out_file = tmp_path / "t.jsonl"
    code, _, err = run_cli([*base, "export", seeded.job_id, "-o", str(out_file)], capsys)
    assert code == 0 and "12 trajectories" in err
    jsonl = {r["episode_id"]: trajectory_of(r) for r in map(json.loads, out_file.read_text().splitlines())}
    pq_file = tmp_path / "t.parquet"
    code, _, err = run_cli(
        [*base, "export", seeded.job_id, "--format", "parquet", "-o", str(pq_file)], capsys
    )
    assert code == 0
    parquet = {r["episode_id"]: trajectory_of(r) for r in parquet_records(pq_file.read_bytes())}
    assert jsonl == parquet and len(jsonl) == 12
    code, _, err = run_cli([*base, "export", seeded.job_id, "--limit", "5", "-o", str(out_file)], capsys)
    assert code == 0 and "5 trajectories" in err and "--after " in err
    code, _, err = run_cli([*base, "export", "job-nope", "-o", str(out_file)], capsys)
    assert code == 1 and "404" in err


def test_compare_logs_and_checkpoints(server, capsys):  # noqa: F811
    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    code, out, _ = run_cli([*base, "compare", seeded.job_id, seeded.running_job_id], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["job", "name", "state", "iterations"]
    assert lines[1].startswith(seeded.job_id) and "completed" in lines[1]
    assert "mean reward per iteration" in out
    code, out, _ = run_cli([*base, "checkpoints", seeded.job_id], capsys)
    assert code == 0 and "no policy version" in out
    code, _, err = run_cli([*base, "logs", "ep-nope"], capsys)
    assert code == 1 and "404" in err


def test_the_commands_are_listed():
    parser = cli.build_parser()
    text = parser.format_help()
    for command in ("episodes", "metrics", "logs", "export", "checkpoints", "compare"):
        assert command in text
