"""Structured logs: one JSON object per line, carrying the job/episode/turn ids of the
work in progress (set with :func:`log_context`) and never a secret."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import sys
import threading
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
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    for previous in root.handlers:
        previous.close()  # a file handler of an earlier configuration would leak its file
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiokafka", "kafka", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    quiet_progress_bars()


def quiet_progress_bars() -> None:
    """No Hugging Face progress bars (``Loading weights: 100%|…``) on a service's stderr,
    which is ``temper serve``'s console and every service's log stream: the environment
    variable for libraries not imported yet, their switches for those already imported."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def log_event(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log ``msg`` with structured fields (redacted by key)."""
    logger.log(level, msg, extra={"fields": fields})


# --- dependency outages ---------------------------------------------------------------------
# While Kafka or Postgres is down, every client retry used to log a line: thousands in
# seconds. An outage is now logged when it starts, then at most every OUTAGE_EVERY_S with
# how many failures were not logged, and once when it ends; temper_dependency_down and
# temper_dependency_errors_total count it.

OUTAGE_EVERY_S = 30.0


class _Outage:
    def __init__(self, started: float) -> None:
        self.started = started
        self.last_logged = started
        self.unlogged = 0


_outages: dict[str, _Outage] = {}
_outage_lock = threading.Lock()


def dependency_failed(
    logger: logging.Logger, dependency: str, error: BaseException | str, **fields: Any
) -> None:
    """Report a failure caused by ``dependency`` being unreachable (rate-limited)."""
    from temper import metrics

    metrics.DEPENDENCY_ERRORS.labels(dependency).inc()
    now = time.monotonic()
    with _outage_lock:
        outage = _outages.get(dependency)
        if outage is None:
            _outages[dependency] = _Outage(now)
            metrics.DEPENDENCY_DOWN.labels(dependency).set(1)
            message, extra = "dependency unreachable", {}
        elif now - outage.last_logged >= OUTAGE_EVERY_S:
            message = "dependency still unreachable"
            extra = {"down_s": round(now - outage.started, 1), "failures_not_logged": outage.unlogged}
            outage.last_logged, outage.unlogged = now, 0
        else:
            outage.unlogged += 1
            return
    log_event(logger, message, logging.WARNING, dependency=dependency, error=_short(error), **extra, **fields)


def dependency_recovered(logger: logging.Logger, dependency: str) -> None:
    """Report that ``dependency`` answered again (logs only if an outage was reported)."""
    from temper import metrics

    with _outage_lock:
        outage = _outages.pop(dependency, None)
    if outage is None:
        return
    metrics.DEPENDENCY_DOWN.labels(dependency).set(0)
    log_event(
        logger,
        "dependency reachable again",
        dependency=dependency,
        down_s=round(time.monotonic() - outage.started, 1),
    )


def dependency_down(dependency: str) -> bool:
    with _outage_lock:
        return dependency in _outages


def _short(error: BaseException | str) -> str:
    return (error if isinstance(error, str) else repr(error))[:500]


class RepeatFilter(logging.Filter):
    """Rate-limits client libraries' warnings and errors that repeat with the same logger
    and message template (aiokafka logs one per reconnect attempt during an outage): the
    first ``burst`` in a window pass, the rest are counted and dropped, and the first
    line after the window says how many were dropped. Temper's own lines are left alone:
    its outages go through :func:`dependency_failed`."""

    def __init__(self, window_s: float = OUTAGE_EVERY_S, burst: int = 3) -> None:
        super().__init__()
        self.window_s = window_s
        self.burst = burst
        self._seen: dict[tuple[str, int, str], list[float]] = {}  # key -> [window start, count, dropped]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.name.startswith(("temper", "services")):
            return True
        key = (record.name, record.levelno, str(record.msg)[:200])
        now = time.monotonic()
        with self._lock:
            state = self._seen.get(key)
            if state is None or now - state[0] >= self.window_s:
                dropped = int(state[2]) if state else 0
                self._seen[key] = [now, 1, 0]
                if len(self._seen) > 10_000:
                    self._seen.clear()
                if dropped:
                    fields = dict(getattr(record, "fields", None) or {})
                    fields["similar_lines_dropped"] = dropped
                    record.fields = fields
                return True
            state[1] += 1
            if state[1] <= self.burst:
                return True
            state[2] += 1
        from temper import metrics

        metrics.LOG_LINES_SUPPRESSED.labels(record.name).inc()
        return False
