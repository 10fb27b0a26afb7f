"""``python -m services.sandbox_worker``: the sandbox worker's HTTP server on port 8002."""

from __future__ import annotations

import os

import uvicorn
from temper.logs import configure_logging
from temper.settings import get_settings

from services.sandbox_worker.app import create_app


def main() -> None:
    settings = get_settings()
    configure_logging("sandbox-worker", settings.log.level, settings.log.json_lines)
    host = os.environ.get("TEMPER_SANDBOX_WORKER_HOST", "127.0.0.1")
    port = int(os.environ.get("TEMPER_SANDBOX_WORKER_PORT", "8002"))
    uvicorn.run(create_app(settings), host=host, port=port, log_config=None)


if __name__ == "__main__":
    main()
