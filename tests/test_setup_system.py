"""``make run`` installs only what a job needs: scripts/setup_system.sh's groups."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(30)


def packages(*groups: str) -> list[str]:
    out = subprocess.run(
        ["bash", "scripts/setup_system.sh", "--list", *groups],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def test_each_use_gets_its_own_packages():
    assert packages("run") == ["bubblewrap", "libseccomp2"]
    assert packages("deploy") == ["prometheus"]
    assert packages("images") == ["mmdebstrap"]
    langs = ["gcc", "g++", "libssl-dev", "openjdk-17-jdk-headless", "libjavatuples-java", "golang-go", "rustc",
             "nodejs", "node-typescript"]  # fmt: skip
    assert packages("langs") == langs
    assert set(packages("test")) == {
        "bubblewrap", "libseccomp2", "chromium", "chromium-driver", "prometheus", "mmdebstrap", *langs
    }  # fmt: skip
    assert packages() == packages("all") == packages("test")
    bad = subprocess.run(
        ["bash", "scripts/setup_system.sh", "--list", "bogus"], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "unknown group 'bogus'" in bad.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_run_and_serve_install_only_the_run_group():
    for target in ("run", "serve"):
        plan = subprocess.run(
            ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout
        assert "scripts/setup_system.sh run" in plan and "setup_system.sh all" not in plan
    assert (
        "scripts/setup_system.sh all"
        in subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    )
