"""``temper tasksets import`` and ``temper tasksets validate`` against a dispatcher served
by uvicorn (embedded mode: validation runs in the API's process, on real sandboxes)."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import uvicorn

from services.dispatcher.app import create_app
from temper import cli
from tests.libs.tasks.fixtures import MBPP, harbor_task, write_parquet
from tests.services.dispatcher.test_dispatcher_cli import free_port

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]


@pytest.fixture
def server(env):
    settings, seeded = env
    # under /tmp (mode 1777): the sandbox uid must reach the workspaces
    root = Path("/tmp") / f"temper-cli-{uuid.uuid4().hex[:8]}"
    settings = settings.model_copy(
        update={"sandbox": settings.sandbox.model_copy(update={"workspace_root": root, "pool_size": 1})}
    )
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
    yield ["--url", f"http://127.0.0.1:{port}", "--key", seeded.key]
    srv.should_exit = True
    thread.join(10)
    shutil.rmtree(root, ignore_errors=True)


def test_import_validate_and_show_the_oracle_table(server, tmp_path, capsys):
    bad = harbor_task(tmp_path / "bad", "wrong-oracle")
    (bad / "solution" / "solve.sh").write_text("echo 'Hello, moon!' > /app/hello.txt\n")
    src = write_parquet(tmp_path / "mbpp.parquet", MBPP)
    assert cli.main([*server, "tasksets", "import", "mbpp", str(src), "--name", "mbpp-2", "--wait"]) == 0
    out = capsys.readouterr()
    ts_id = out.out.splitlines()[0]
    assert ts_id.startswith("ts-") and f"imported 2 mbpp tasks as {ts_id}" in out.err
    table = out.out.splitlines()[1:]
    assert table[0].split() == ["task", "status", "oracle", "do-nothing", "reasons"]
    assert [line.split() for line in table[1:3]] == [
        ["mbpp/2", "valid", "1", "pass", "0", "fail"], ["mbpp/3", "valid", "1", "pass", "0", "fail"]]  # fmt: skip
    assert table[3] == "2 valid, 0 invalid of 2"

    assert cli.main([*server, "tasksets", "import", "harbor", str(tmp_path / "bad"), "--no-validate"]) == 0
    bad_id = capsys.readouterr().out.strip()
    assert cli.main([*server, "tasksets", "validate", bad_id, "--interval", "0.2"]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:6] == ["wrong-oracle", "invalid", "0.5", "fail", "0", "fail"]
    assert "the oracle solution scores 0.5 of 1" in lines[1]
    assert cli.main([*server, "tasksets", "list"]) == 0
    listed = capsys.readouterr().out
    assert "mbpp-2" in listed and "bad " in listed


def test_upload_says_in_words_what_happened_to_validation(server, tmp_path, capsys):
    src = tmp_path / "two.jsonl"
    src.write_text(
        '{"id": "a", "kind": "math", "prompt": "1 + 1?", "answer": "2"}\n'
        '{"id": "b", "kind": "math", "prompt": "2 + 2?", "answer": "4"}\n'
    )
    assert cli.main([*server, "tasksets", "upload", str(src), "--no-validate"]) == 0
    err = capsys.readouterr().err
    assert "uploaded 2 tasks as ts-" in err and "not validated (--no-validate)" in err, err
    assert cli.main([*server, "tasksets", "upload", str(src), "--name", "again"]) == 0
    err = capsys.readouterr().err
    assert "validation started" in err, err
    assert "{" not in err and "celery" not in err.lower(), "no Python dict, no Celery in temper serve"
