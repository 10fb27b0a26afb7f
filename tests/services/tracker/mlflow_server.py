"""A real MLflow tracking server for the tests marked ``mlflow``: mlflow 3.18.0 from the
environment ``scripts/stack/mlflow/install.sh`` makes (``make stack-up`` runs it); nothing
is installed here. Each server has its own port, SQLite store and artifact directory, so a
test can stop it and start it again on the same data (an outage in the middle of a job)."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]
INSTALLER = ROOT / "scripts" / "stack" / "mlflow"
START_TIMEOUT_S = 120.0


class MlflowMissing(RuntimeError):
    """The environment of install.sh is not there (or not complete)."""


def mlflow_python() -> Path:
    """The python of install.sh's environment for this checkout's requirements.txt, found
    where install.sh puts it: ``$TEMPER_CACHE_DIR/mlflow/env-<hash>`` (the Makefile's default
    cache is ~/.cache/temper, a script run on its own uses <repo>/.cache)."""
    key = hashlib.sha256((INSTALLER / "requirements.txt").read_bytes()).hexdigest()[:16]
    roots = [os.environ["TEMPER_CACHE_DIR"]] if os.environ.get("TEMPER_CACHE_DIR") else []
    roots += [str(Path.home() / ".cache" / "temper"), str(ROOT / ".cache")]
    for root in roots:
        env = Path(root) / "mlflow" / f"env-{key}"
        stamp = env / ".temper-complete"
        if stamp.is_file() and stamp.read_text().strip() == key:
            return env / "bin" / "python"
    raise MlflowMissing(
        f"no MLflow environment for scripts/stack/mlflow/requirements.txt (env-{key}) under {', '.join(roots)}: "
        "run `make stack-up` (or scripts/stack/mlflow/install.sh)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class MlflowServer:
    data: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        python = mlflow_python()
        self.data.mkdir(parents=True, exist_ok=True)
        log = (self.data / "server.log").open("ab")
        # the server's job runner (huey workers for GenAI jobs) is not needed: 4 fewer processes
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [str(python), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.data / 'mlflow.db'}",
             "--default-artifact-root", str(self.data / "artifacts"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip
        log.close()
        deadline = t0 + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mlflow server not ready in {START_TIMEOUT_S:.0f}s: {self.log_tail()}")
            time.sleep(0.2)
        self.started_s = time.monotonic() - t0

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL if it has not gone in 15 s."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None

    def log_tail(self) -> str:
        path = self.data / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""
