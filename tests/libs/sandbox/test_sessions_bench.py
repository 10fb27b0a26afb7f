"""bench/sessions.py (make bench-sessions) on a few real sessions: it opens them, each
keeps its sandbox's processes while it waits, and it leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[3]


def test_the_session_memory_bench_measures_real_sessions(tmp_path):
    out = tmp_path / "sessions.json"
    mounts = _bench_mounts()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sessions.py"), "--sessions", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["sessions"] == 4
    # each waiting session keeps its sandbox (bwrap and the sandbox's init) alive
    assert figures["processes_per_session"] >= 1
    assert figures["sandbox_pss_kb_per_session"] > 100
    assert 0 < figures["open_ms"] <= figures["open_ms_p99"]
    assert "sandbox_pss_kb_per_session" in proc.stdout
    assert _bench_mounts() == mounts, "a session's workspace stayed mounted"


def _bench_mounts() -> set[str]:
    return {
        line for line in Path("/proc/mounts").read_text().splitlines() if "temper-bench-sessions-" in line
    }
