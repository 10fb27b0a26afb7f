"""The ``temper`` CLI and the Python client against a dispatcher served by uvicorn."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
import yaml

from services.dispatcher.app import create_app
from temper import cli
from temper.client import ApiError, TemperClient
from tests.services.dispatcher.conftest import KILLED_EPISODE, SPEC

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(env):
    """The dispatcher (API only) on a free port, in a thread of this process."""
    settings, seeded = env
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, run_episodes=False), host="127.0.0.1", port=port, log_config=None, lifespan="on"
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "dispatcher did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", seeded
    srv.should_exit = True
    thread.join(10)


def run_cli(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_submit_list_cancel_through_the_cli(server, tmp_path, capsys, monkeypatch):
    url, seeded = server
    monkeypatch.setenv("TEMPER_URL", url)
    monkeypatch.setenv("TEMPER_API_KEY", seeded.key)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC | {"name": "cli-job"}))
    code, out, err = run_cli(["submit", str(spec)], capsys)
    assert code == 0, err
    job_id = out.strip()
    assert job_id.startswith("job-") and "cli-job" in err

    code, out, _ = run_cli(["jobs", "--state", "pending"], capsys)
    assert code == 0 and job_id in out and "cli-job" in out and out.splitlines()[0].startswith("JOB")
    code, out, _ = run_cli(["cancel", job_id], capsys)
    assert code == 0 and out.strip() == f"{job_id} cancelled"
    code, _, err = run_cli(["cancel", job_id], capsys)
    assert code == 1 and "409" in err


def test_a_bad_spec_and_a_bad_key_are_reported(server, tmp_path, capsys):
    url, seeded = server
    spec = tmp_path / "bad.yaml"
    spec.write_text(yaml.safe_dump(SPEC | {"schedule": {"iterations": 0}}))
    code, _, err = run_cli(["--url", url, "--key", seeded.key, "submit", str(spec)], capsys)
    assert code == 1 and "schedule.iterations" in err
    code, _, err = run_cli(["--url", url, "--key", "tmp_nope", "jobs"], capsys)
    assert code == 1 and "401" in err
    code, _, err = run_cli(
        ["--url", url, "--key", seeded.key, "submit", str(tmp_path / "missing.yaml")], capsys
    )
    assert code == 1 and "missing.yaml" in err


def test_transcript_and_watch(server, capsys):
    url, seeded = server
    base = ["--url", url, "--key", seeded.key]
    code, out, _ = run_cli([*base, "transcript", KILLED_EPISODE], capsys)
    assert code == 0
    assert (
        "── turn 1" in out
        and "── turn 2" in out
        and "Write a function add(a, b)" in out
        and "killed: timeout" in out
    )
    assert "tests_passed" in out
    code, out, _ = run_cli([*base, "watch", seeded.job_id], capsys)
    assert code == 0  # the job completed
    assert "completed" in out and "iteration 3/3" in out and "100.0%" in out and "mean reward 0.875" in out


def test_watch_redraws_in_place_on_a_terminal(server):
    url, seeded = server

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    with TemperClient(url, seeded.key) as api:
        assert cli.jobs.watch(api, seeded.running_job_id, interval=0.01, stream=stream, max_polls=2) == 0
    text = stream.getvalue()
    assert text.count("\x1b[4A") == 1  # the second frame moved up over the first
    assert "acting 1" in text and "pending 1" in text


def test_client_errors_carry_the_field_paths(server):
    url, seeded = server
    with TemperClient(url, seeded.key) as api:
        with pytest.raises(ApiError) as info:
            api.submit(
                {"name": "x", "policy": {"model": "m"}, "tasks": {"taskset": "ts-acme", "group_size": 0}}
            )
        assert info.value.status == 422 and ("tasks.group_size" in dict(info.value.errors))
        assert api.tenant()["id"] == "acme"
        assert api.metrics(seeded.job_id)["progress"]["finished"] == 12
        assert len(api.episodes(seeded.job_id, task="add-1", limit=100)["items"]) == 6
    with pytest.raises(ApiError) as info, TemperClient("http://127.0.0.1:9", "k") as api:
        api.jobs()
    assert info.value.status == 0 and "cannot reach" in info.value.detail


def test_admin_create_tenant_prints_a_working_key(server, env, capsys, monkeypatch):
    url, _ = server
    settings, _ = env
    monkeypatch.setenv("TEMPER_DB__URL", settings.db.url)
    with pytest.raises(SystemExit):  # argparse refuses a weight that is not positive
        run_cli(["admin", "create-tenant", "Blue Team", "--weight", "0"], capsys)
    assert "must be more than 0" in capsys.readouterr().err
    code, out, err = run_cli(
        ["admin", "create-tenant", "Blue Team", "--max-concurrent-episodes", "5", "--weight", "2",
         "--quota-sandbox-cpu-s", "30", "--quota-trainer-s", "600"],
        capsys,
    )  # fmt: skip
    assert code == 0, err
    key = out.strip()
    assert key.startswith("tmp_") and key not in err
    with TemperClient(url, key) as api:
        me = api.tenant()
    assert me["id"] == "blue-team" and me["max_concurrent_episodes"] == 5
    assert me["weight"] == 2 and me["quota_sandbox_cpu_s"] == 30 and me["quota_inference_tokens"] is None
    assert me["quota_trainer_s"] == 600 and me["quota_sandbox_memory_gb_s"] is None
    code, _, err = run_cli(["admin", "create-tenant", "Blue Team"], capsys)
    assert code == 1 and "already exists" in err


def test_environments_push_list_show_through_the_cli(server, tmp_path, capsys, monkeypatch):
    """``temper environments push DIR`` uploads the example package; a bad manifest is
    reported with its field and line; the other tenant sees nothing."""
    import shutil
    from pathlib import Path

    url, seeded = server
    monkeypatch.setenv("TEMPER_URL", url)
    monkeypatch.setenv("TEMPER_API_KEY", seeded.key)
    example = Path(__file__).resolve().parents[3] / "examples" / "environments" / "wordcount-pkg"
    code, out, err = run_cli(["environments", "push", str(example)], capsys)
    assert code == 0 and out.strip() == "wordcount-pkg 1.0.0", err
    assert "count_words" in err and "2 hidden files" in err
    code, out, _ = run_cli(["environments", "list"], capsys)
    assert code == 0 and out.startswith("wordcount-pkg\t1.0.0\t")
    code, out, _ = run_cli(["environments", "show", "wordcount-pkg", "1.0.0"], capsys)
    assert code == 0 and '"hidden/grade.py"' not in out and '"tools/count.py"' in out

    bad = tmp_path / "bad"
    shutil.copytree(example, bad)
    manifest = (bad / "environment.yaml").read_text()
    (bad / "environment.yaml").write_text(manifest.replace("max_turns: 4", "max_turns: many"))
    code, _, err = run_cli(["environments", "push", str(bad)], capsys)
    line = manifest.splitlines().index("max_turns: 4") + 1
    assert code == 1 and "422" in err and f"max_turns (line {line})" in err, err

    monkeypatch.setenv("TEMPER_API_KEY", seeded.other_key)
    code, _, err = run_cli(["environments", "show", "wordcount-pkg", "1.0.0"], capsys)
    assert code == 1 and "404" in err


def test_the_client_sets_a_tenants_weight_and_quotas(server):
    url, seeded = server
    with TemperClient(url, seeded.admin_key) as api:
        made = api.create_tenant(
            "Green Team", weight=3, quota_inference_tokens=1000, quota_sandbox_memory_gb_s=50
        )["tenant"]
        assert (made["weight"], made["quota_inference_tokens"], made["quota_sandbox_memory_gb_s"]) == (
            3,
            1000,
            50,
        )
        api.update_tenant(
            "green-team", quota_sandbox_cpu_s=60.5, quota_inference_tokens=None, quota_trainer_s=120
        )
        got = api.get_tenant("green-team")
    assert got["quota_sandbox_cpu_s"] == 60.5 and got["quota_inference_tokens"] is None
    assert (got["quota_sandbox_memory_gb_s"], got["quota_trainer_s"]) == (50, 120)  # left out: kept
    assert (got["weight"], got["used_sandbox_cpu_s"], got["used_inference_tokens"]) == (3, 0, 0)
    assert (got["used_sandbox_memory_gb_s"], got["used_trainer_s"]) == (0, 0)
    with pytest.raises(ApiError) as info, TemperClient(url, seeded.key) as api:
        api.update_tenant("green-team", weight=10)  # not an admin key
    assert info.value.status == 403


def test_jobs_counts_iterations_from_1_and_flags_go_before_or_after_the_command(server, capsys):
    url, seeded = server
    # after the subcommand as before it; the finished job is at its last iteration, 3 of 3
    code, out, _ = run_cli(["jobs", "--url", url, "--key", seeded.key], capsys)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert rows[seeded.job_id][4] == "3/3", out  # iteration index 3 of 3: done, shown as 3
    assert rows[seeded.running_job_id][4] == "2/3", out  # index 1: the second iteration
    code, before, _ = run_cli(["--url", url, "--key", seeded.key, "jobs"], capsys)
    assert code == 0 and before == out
    code, out, _ = run_cli(["admin", "plugins", "--json", "--url", url], capsys)
    assert code == 0 and "temper.environments" in json.loads(out)


def test_a_reader_that_goes_away_ends_the_cli_quietly(server, tmp_path):
    url, seeded = server
    err = tmp_path / "err"
    # `true` exits at once: every write the CLI makes goes to a pipe nobody reads
    subprocess.run(
        f"{sys.executable} -m services.cli --url {url} --key {seeded.key} episodes {seeded.job_id} --all "
        f"2>{err} | true",
        shell=True, check=False, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert "Traceback" not in err.read_text() and "BrokenPipe" not in err.read_text(), err.read_text()
