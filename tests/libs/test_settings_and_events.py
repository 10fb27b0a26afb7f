from __future__ import annotations

import json
from pathlib import Path

import pytest

from temper.events import BadMessage, InferenceResult, LifecycleEvent, decode, write_schemas
from temper.runtime import StartupError, load_settings
from temper.settings import BusKind, Settings, StorageKind

ROOT = Path(__file__).resolve().parents[2]


def test_embedded_is_the_default_and_picks_local_parts(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("TEMPER_")]:  # a shell that sourced .stack/env
        monkeypatch.delenv(name)
    s = Settings()
    assert (s.bus.kind, s.storage.kind) == (BusKind.inprocess, StorageKind.local)
    assert s.db.is_sqlite


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("TEMPER_API__SECRET", "TEMPER_API__SECRET is no longer a setting (removed: nothing read it"),
        ("TEMPER_API__PORT", "TEMPER_API__PORT is no longer a setting (moved: use TEMPER_PORT"),
        (
            "TEMPER_ALLOW_UNSAFE",
            "TEMPER_ALLOW_UNSAFE is no longer a setting (moved: use TEMPER_SANDBOX__ALLOW_UNSAFE)",
        ),
        (
            "temper_sandbox__pool_sise",
            "TEMPER_SANDBOX__POOL_SISE names no setting ('pool_sise' is not one of:",
        ),
        (
            "TEMPER_SANDBOX__MAX_LIMITS__WALL",
            "TEMPER_SANDBOX__MAX_LIMITS__WALL names no setting ('wall' is not",
        ),
        ("TEMPER_DB__URL__HOST", "TEMPER_DB__URL__HOST names no setting ('url' is a value, not a section)"),
        ("TEMPER_SANBOX__POOL_SIZE", "TEMPER_SANBOX__POOL_SIZE names no setting ('sanbox' is not one of:"),
    ],
)
def test_a_setting_the_code_does_not_have_stops_startup_naming_it(monkeypatch, name, expected):
    monkeypatch.setenv(name, "1")
    with pytest.raises(StartupError) as caught:
        load_settings()
    assert expected in str(caught.value)


def test_names_that_are_settings_or_not_settings_at_all_pass(monkeypatch):
    # nested paths that exist, a dict-valued field, and the client's and scripts' own variables
    for name, value in {
        "TEMPER_SANDBOX__MAX_LIMITS__WALL_S": "60",
        "TEMPER_SANDBOX__DEFAULT_LIMITS__MEMORY_MB": "256",
        "TEMPER_PORT": "8123",
        "TEMPER_URL": "http://x",
        "TEMPER_API_KEY": "k",
        "TEMPER_CACHE_DIR": "/tmp/c",
    }.items():
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert settings.port == 8123 and settings.sandbox.max_limits.wall_s == 60
    assert settings.sandbox.default_limits.memory_mb == 256


def test_distributed_mode_refuses_unsafe_settings(monkeypatch):
    monkeypatch.setenv("TEMPER_MODE", "distributed")
    monkeypatch.setenv("TEMPER_DB__URL", "postgresql+asyncpg://u:p@h/db")
    monkeypatch.setenv("TEMPER_BUS__KIND", "inprocess")
    with pytest.raises(StartupError, match="TEMPER_BUS__KIND=inprocess cannot be used"):
        load_settings()
    monkeypatch.delenv("TEMPER_BUS__KIND")
    s = load_settings()
    assert (s.bus.kind, s.storage.kind) == (BusKind.kafka, StorageKind.s3)


def test_a_bad_value_names_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TEMPER_BUS__PARTITIONS", "zero")
    with pytest.raises(StartupError) as info:
        load_settings()
    assert "TEMPER_BUS__PARTITIONS" in str(info.value)


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (b"not json", "not JSON"),
        (b'{"type": "\xff"}', "not JSON"),  # not UTF-8
        (b'{"type": "inference.result", "logprobs": [NaN]}', "not JSON"),  # NaN is not JSON
        (b"[1, 2]", "not a JSON object"),
        (b'{"type": "mystery"}', "unknown message type 'mystery'"),
        (b'{"type": "inference.result", "schema_version": 99}', "newer than this reader"),
        (b'{"type": "inference.result", "policy_version": "x"}', "field policy_version"),
    ],
)
def test_malformed_messages_are_refused_with_the_reason(raw, match):
    with pytest.raises(BadMessage, match=match):
        decode(raw)


def test_messages_round_trip_with_envelope_and_ids():
    msg = InferenceResult(
        job_id="j", episode_id="e", turn=1, attempt=2, token_ids=[1], logprobs=[-0.5], policy_version=3
    )
    back = decode(msg.to_bytes())
    assert back == msg and back.key() == "e"
    assert LifecycleEvent(event="job.state", job_id="j").key() == "j"


def test_published_event_schemas_are_up_to_date(tmp_path):
    written = write_schemas(tmp_path)
    for path in written:
        checked_in = ROOT / "docs" / "events" / path.name
        assert checked_in.exists(), f"{checked_in} is missing: run `make schemas`"
        assert json.loads(checked_in.read_text()) == json.loads(path.read_text()), (
            f"{path.name} is stale: run `make schemas`"
        )
