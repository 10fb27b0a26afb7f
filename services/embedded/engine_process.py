"""The policy's CPU engine in a child process of ``temper run`` (``local.engine: process``).

In one process the engine's decoding shares the interpreter's lock with everything else
the run does (the dispatcher, scoring, the bus, SQLite, the trainer's Python): each
decoded token waits for the event loop, and a batch of 72 answers that takes about 0.9 s
alone took 3-5 s inside a run. As a child it is the CPU model server
(``python -m services.inference_gateway.cpu_server``), which the gateway reaches over
HTTP on the loopback exactly as a distributed gateway reaches one: versions are loaded
from the run's checkpoint cache, every answer names its version.

The child dies with the run: it is stopped when the run ends (terminated, then killed),
and the kernel sends it SIGTERM if the run's process dies first (``PR_SET_PDEATHSIG``).
Its output goes to ``engine.log`` in the run directory. ``scripts/run_processes.sh``
(the services as processes) starts it the same way for ``local.engine: process``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx

from temper.runtime import StartupError

START_TIMEOUT_S = 120.0
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineProcess:
    """``python -m services.inference_gateway.cpu_server`` for one run's policy."""

    def __init__(
        self,
        run_dir: Path,
        model_dir: Path,
        *,
        port: int,
        max_batch: int,
        threads: int,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``env``: the child's settings over this process's environment (where its object
        store is: the gateway hands it each version's local path, the store is the fallback)."""
        self.run_dir = run_dir
        self.env = dict(env or {})
        self.model_dir = model_dir
        self.port = port
        self.max_batch = max_batch
        self.threads = threads
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "engine.log"

    def start(self) -> None:
        """Start the child and wait until it answers ``/health`` (or say why it did not)."""
        cmd = [
            sys.executable, "-m", "services.inference_gateway.cpu_server",
            "--model-dir", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port),
            "--max-batch", str(self.max_batch), "--threads", str(self.threads),
        ]  # fmt: skip
        env = {**os.environ, **self.env}
        root = Path(__file__).resolve().parents[2]  # `services` imports from the checkout
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(  # noqa: S603 - our own module, no shell
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartupError(
                    f"the engine process exited with {self.proc.returncode} before it answered: "
                    f"{self._tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise StartupError(f"the engine process did not answer in {START_TIMEOUT_S:.0f}s: {self._tail()}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _tail(self) -> str:
        """The last line of its log (a traceback's ends with the error), and where the rest is."""
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"{lines[-1].strip() if lines else '(no output)'} (all of it in {self.log_path})"
