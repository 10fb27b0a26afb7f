"""``python -m services.inference_gateway``: the gateway's HTTP server on 8001.

Backends, timeouts and limits come from ``TEMPER_INFERENCE__*`` (see temper.policy.config).
The Kafka consumers (``inference.requests``, ``policy.updates``) attach to the same
:class:`InferenceService` through ``handle``/``has_capacity``/``apply_update``.
"""

from __future__ import annotations

import argparse

import uvicorn
from temper.settings import get_settings
from temper.storage import make_store

from services.inference_gateway.app import create_app
from services.inference_gateway.service import InferenceService


def main(argv: list[str] | None = None) -> None:
    settings = get_settings()
    cfg = settings.inference
    ap = argparse.ArgumentParser(prog="python -m services.inference_gateway")
    ap.add_argument("--host", default=cfg.host)
    ap.add_argument("--port", type=int, default=cfg.port)
    args = ap.parse_args(argv)
    service = InferenceService(cfg, store=make_store(settings))
    uvicorn.run(create_app(service), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
