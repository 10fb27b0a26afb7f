"""ModelRunner servers for the gateway tests: in-process (a uvicorn thread) or real subprocesses."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from services.inference_gateway.cpu_server.app import create_app
from services.inference_gateway.cpu_server.batching import BatchScheduler
from services.inference_gateway.cpu_server.runner import ModelRunner
from temper.policy import create_model, default_tokenizer
from tests.services.inference_gateway.vllm_server import VLLM_VERSION, VLLMServer

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server at {url} did not become healthy")


@dataclass
class ThreadServer:
    url: str
    server: uvicorn.Server
    thread: threading.Thread
    runner: ModelRunner

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve_app(app, port: int | None = None) -> tuple[str, uvicorn.Server, threading.Thread]:  # noqa: ANN001
    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return url, server, thread


def start_cpu_server_thread(
    seed: int = 0, *, max_batch: int = 16, window_ms: float = 3.0, store=None
) -> ThreadServer:  # noqa: ANN001
    runner = ModelRunner(create_model(seed=seed), default_tokenizer())
    app = create_app(BatchScheduler(runner, max_batch=max_batch, window_ms=window_ms), store=store)
    url, server, thread = serve_app(app)
    return ThreadServer(url, server, thread, runner)


@pytest.fixture
def cpu_server() -> Iterator[ThreadServer]:
    srv = start_cpu_server_thread()
    yield srv
    srv.stop()


@pytest.fixture
def cpu_servers() -> Iterator[list[ThreadServer]]:
    """Two in-process cpu_servers with the same weights (seed 0)."""
    servers = [start_cpu_server_thread(0), start_cpu_server_thread(0)]
    yield servers
    for s in servers:
        s.stop()


@dataclass
class ProcServer:
    url: str
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_cpu_server_process(seed: int = 0) -> ProcServer:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "libs")])}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.inference_gateway.cpu_server",
            "--preset",
            "tiny",
            "--seed",
            str(seed),
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=90, proc=proc)
    except Exception:
        proc.kill()
        proc.wait()
        raise
    return ProcServer(url, proc)


@pytest.fixture
def two_cpu_server_processes() -> Iterator[list[ProcServer]]:
    servers = [start_cpu_server_process(0), start_cpu_server_process(0)]
    yield servers
    for s in servers:
        s.kill()


# --- the real vLLM server (tests marked vllm) --------------------------------------------
@dataclass(frozen=True)
class VLLMModels:
    """The model the server starts with (tied embeddings) and a second version of its weights."""

    base: Path
    v1: Path  # the same architecture and tokenizer, other seeded weights


@pytest.fixture(scope="session")
def vllm_models(tmp_path_factory: pytest.TempPathFactory) -> VLLMModels:
    from temper.policy import ChatTokenizer
    from tests.services.inference_gateway.vllm_server import build_model

    root = tmp_path_factory.mktemp("vllm-models")
    base = build_model(root / "base", seed=0)
    v1 = build_model(root / "v1", seed=1, tokenizer=ChatTokenizer.load(base))
    return VLLMModels(base=base, v1=v1)


@pytest.fixture(scope="session")
def vllm_server(vllm_models: VLLMModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One vLLM server for every test marked vllm, warmed up, stopped at the end of the session.
    Tests that change its weights put the base weights back before they end. A missing vLLM
    environment is a failure naming the install step, never a skip."""
    from tests.services.inference_gateway.vllm_server import VLLMMissing, start_server

    log_path = tmp_path_factory.mktemp("vllm-server") / "vllm.log"
    try:
        server = start_server(vllm_models.base, log_path)
    except VLLMMissing as exc:
        pytest.fail(str(exc))
    VLLM_TIMINGS.update(start_s=server.started_s, warm_up_s=server.warmed_s)
    yield server
    server.stop()


VLLM_TIMINGS: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    if VLLM_TIMINGS:
        terminalreporter.write_line(
            "vLLM server ({}): ready in {start_s:.1f}s, warmed up in {warm_up_s:.1f}s".format(
                VLLM_VERSION, **VLLM_TIMINGS
            )
        )
