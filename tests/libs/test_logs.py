from __future__ import annotations

import json
import logging
import os

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


def _capture(logger_name: str, filters: list[logging.Filter] = ()) -> tuple[logging.Logger, list[dict]]:
    logger = logging.getLogger(logger_name)
    lines: list[dict] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(self.format(record)))

    handler = Keep()
    handler.setFormatter(JsonFormatter("svc"))
    for f in filters:
        handler.addFilter(f)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger, lines


def test_a_dependency_outage_is_logged_once_then_at_a_bounded_rate(monkeypatch):
    from temper import logs, metrics

    logger, lines = _capture("temper.test.outage")
    clock = [1000.0]
    monkeypatch.setattr(logs.time, "monotonic", lambda: clock[0])
    dependency = "database-test-outage"
    errors_before = metrics.DEPENDENCY_ERRORS.labels(dependency)._value.get()
    for _ in range(5000):  # a retry loop during a 20 s outage
        logs.dependency_failed(logger, dependency, ConnectionRefusedError(111, "refused"), group="g")
        clock[0] += 0.004
    assert [line["msg"] for line in lines] == ["dependency unreachable"]
    assert metrics.DEPENDENCY_DOWN.labels(dependency)._value.get() == 1
    assert metrics.DEPENDENCY_ERRORS.labels(dependency)._value.get() - errors_before == 5000
    clock[0] += logs.OUTAGE_EVERY_S
    logs.dependency_failed(logger, dependency, ConnectionRefusedError(111, "refused"))
    assert lines[-1]["msg"] == "dependency still unreachable"
    assert lines[-1]["failures_not_logged"] == 4999 and lines[-1]["down_s"] >= 50
    logs.dependency_recovered(logger, dependency)
    logs.dependency_recovered(logger, dependency)  # said once
    assert [line["msg"] for line in lines[2:]] == ["dependency reachable again"]
    assert metrics.DEPENDENCY_DOWN.labels(dependency)._value.get() == 0


def test_a_client_library_repeating_a_line_is_rate_limited_and_temper_lines_are_not():
    from temper.logs import RepeatFilter

    noisy, noisy_lines = _capture("aiokafka.test-noisy", [RepeatFilter(window_s=60, burst=3)])
    for _ in range(2000):
        noisy.error("Unable connect to node with id %s: %s", 1, "refused")
    assert len(noisy_lines) == 3
    ours, our_lines = _capture("temper.test-not-limited", [RepeatFilter(window_s=60, burst=3)])
    for i in range(10):
        log_event(ours, "message dead-lettered", logging.ERROR, offset=i)
    assert len(our_lines) == 10


def test_a_service_writes_no_hugging_face_progress_bars(tmp_path):
    """``Loading weights: 100%|…`` on stderr is the console of temper serve and every
    service's log stream: configured logging turns the bars off, also for a library
    imported before it."""
    import subprocess
    import sys

    from temper.policy.build import build_model_dir, train_tokenizer

    model = build_model_dir(tmp_path / "m", "qwen2", train_tokenizer(["hello world"] * 10, vocab_size=300))
    load = (
        f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(model)!r})"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    runs = {
        "without": load,
        "before": f"from temper.logs import configure_logging; configure_logging('x'); {load}",
        "after": f"import transformers; from temper.logs import configure_logging; configure_logging('x'); {load}",
    }
    stderr = {
        name: subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        ).stderr
        for name, code in runs.items()
    }
    assert "Loading weights" in stderr["without"], "the check can fail: transformers draws the bar"
    assert "Loading weights" not in stderr["before"] and "Loading weights" not in stderr["after"], stderr
