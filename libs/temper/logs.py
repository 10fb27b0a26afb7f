"""Structured logs: one JSON object per line, carrying the job/episode/turn ids of the
work in progress (set with :func:`log_context`) and never a secret."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_context: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "temper_log_context", default=None
)

# Values of these keys, and bearer tokens or URL passwords inside messages, are masked.
_SECRET_KEYS = re.compile(
    r"(?:^|_)(secret|secret_key|password|passwd|token|authorization|api_key|access_key|bootstrap_key)$", re.I
)
_SECRET_IN_TEXT = [
    (re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]+", re.I), r"\1***"),
    (re.compile(r"(://[^:/@\s]+:)[^@\s]+(@)"), r"\1***\2"),
    (re.compile(r"((?:secret|password|token|api_key)[\"']?\s*[=:]\s*[\"']?)[^\s\"',}]+", re.I), r"\1***"),
]


def redact(text: str) -> str:
    for pattern, replacement in _SECRET_IN_TEXT:
        text = pattern.sub(replacement, text)
    return text


def _redact_fields(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: ("***" if _SECRET_KEYS.search(k) else v) for k, v in fields.items()}


@contextlib.contextmanager
def log_context(**ids: Any) -> Iterator[None]:
    """Attach ids (job_id, episode_id, turn, ...) to every log line inside the block."""
    token = _context.set({**(_context.get() or {}), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": redact(record.getMessage()),
            **(_context.get() or {}),
        }
        extra = getattr(record, "fields", None)
        if extra:
            entry.update(_redact_fields(extra))
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


def configure_logging(
    service: str, level: str = "INFO", json_lines: bool = True, file: Path | None = None
) -> None:
    handler: logging.Handler
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(file)
    else:
        handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for previous in root.handlers:
        previous.close()  # a file handler of an earlier configuration would leak its file
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "kafka", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def log_event(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``msg`` with structured fields (redacted by key)."""
    logger.log(level, msg, extra={"fields": fields})
