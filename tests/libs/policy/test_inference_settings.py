"""``TEMPER_INFERENCE__BACKENDS``: a bare URL, a comma-separated list, or JSON; anything
else stops the gateway with one line naming the setting and exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from temper.runtime import StartupError, load_settings

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("http://gateway-engine:8010", [("b0", "http://gateway-engine:8010", "cpu_server")]),
        ("http://a:1, vllm+http://b:2/", [("b0", "http://a:1", "cpu_server"), ("b1", "http://b:2", "vllm")]),
        ('[{"name": "e0", "url": "http://x:8010"}]', [("e0", "http://x:8010", "cpu_server")]),
        ('{"name": "l", "kind": "local"}', [("l", "", "local")]),
        ("", []),
    ],
)
def test_backends_are_read_from_urls_or_json(monkeypatch, value, expected):
    monkeypatch.setenv("TEMPER_INFERENCE__BACKENDS", value)
    got = [(b.name, b.url, b.kind.value) for b in load_settings().inference.backends]
    assert got == expected


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("gpu1:8000", "is not an http(s) URL"),
        ("[{oops", "not valid JSON"),
        ('[{"name": "v", "kind": "vllm"}]', "needs a url"),
    ],
)
def test_unreadable_backends_name_the_setting(monkeypatch, value, error):
    monkeypatch.setenv("TEMPER_INFERENCE__BACKENDS", value)
    with pytest.raises(StartupError, match="TEMPER_INFERENCE__BACKENDS") as info:
        load_settings()
    assert error in str(info.value)


def test_the_gateway_exits_2_with_one_line_per_bad_setting():
    env = {**os.environ, "TEMPER_INFERENCE__BACKENDS": "gpu1:8000", "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT}"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.inference_gateway"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "TEMPER_INFERENCE__BACKENDS" in line]
    assert len(lines) == 1 and "is not an http(s) URL" in lines[0]
