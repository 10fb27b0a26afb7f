from __future__ import annotations

import json
import logging

from temper.logs import JsonFormatter, log_context, log_event, redact


def render(record_fn) -> dict:
    logger = logging.getLogger("temper.test.logs")
    captured: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(self.format(record))  # formatted when emitted, as a stream handler does

    handler = Keep()
    handler.setFormatter(JsonFormatter("svc"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        record_fn(logger)
    finally:
        logger.removeHandler(handler)
    return json.loads(captured[-1])


def test_lines_carry_the_ids_of_the_work_in_progress():
    def emit(logger):
        with log_context(job_id="j1", episode_id="e1"), log_context(turn=3):
            log_event(logger, "turn done", kind="sandbox")

    line = render(emit)
    assert line["msg"] == "turn done"
    assert (line["job_id"], line["episode_id"], line["turn"], line["kind"]) == ("j1", "e1", 3, "sandbox")
    assert line["service"] == "svc" and line["level"] == "info"


def test_secrets_never_reach_the_log():
    def emit(logger):
        log_event(
            logger,
            "connecting to postgresql://temper:hunter2@db/temper with Authorization: Bearer sk-live-123",
            api_key="k-123",
            secret_key="s3cr3t",
            tokens=42,
        )

    line = render(emit)
    text = json.dumps(line)
    for secret in ("hunter2", "sk-live-123", "k-123", "s3cr3t"):
        assert secret not in text
    assert line["tokens"] == 42, "token counts are not secrets"


def test_redact_masks_assignments_in_free_text():
    assert redact("password=abc token: xyz") == "password=*** token: ***"
