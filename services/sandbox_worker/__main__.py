"""``python -m services.sandbox_worker``: the sandbox worker on port 8002
(``TEMPER_HOST``/``TEMPER_PORT`` choose where it listens)."""

from services.sandbox_worker.app import create_app
from temper.runtime import run_service

if __name__ == "__main__":
    run_service(create_app, "sandbox-worker", default_port=8002)
