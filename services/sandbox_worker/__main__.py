"""``python -m services.sandbox_worker``: the sandbox worker on port 8002
(``TEMPER_HOST``/``TEMPER_PORT`` choose where it listens)."""

import signal

from temper.runtime import run_service

from services.sandbox_worker.app import create_app


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    # uvicorn handles SIGTERM while serving, then re-raises it to the handler that was
    # installed before it started; with the default one the process dies right there,
    # before the app's lifespan destroys its sandboxes (workspace mounts, cgroups). As
    # SystemExit it unwinds through the lifespan instead, so shutdown runs to the end.
    signal.signal(signal.SIGTERM, _exit)
    run_service(create_app, "sandbox-worker", default_port=8002)
