"""Fixtures for the sandbox library's tests: a manager on the real bwrap backend with
small limits, checked for leftovers (processes, mounts, cgroups) when it closes."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from temper.sandbox import BackendKind, SandboxLimits, SandboxManager, SandboxSettings

SMALL = SandboxLimits(
    wall_s=3,
    cpu_s=2,
    memory_mb=96,
    pids=48,
    output_bytes=64 << 10,
    file_size_mb=4,
    open_files=64,
    workspace_mb=8,
)


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    # Under /tmp (mode 1777): pytest's own tmp_path is 0700 and the sandbox uid must reach it.
    root = Path("/tmp") / f"temper-sbx-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def make_settings(root: Path, **overrides: object) -> SandboxSettings:
    fields = {"backend": BackendKind.bwrap, "pool_size": 1, "default_limits": SMALL, "workspace_root": root}
    fields.update(overrides)
    return SandboxSettings(**fields)


def cgroup_members(tag: str) -> list[int]:
    """Pids whose cgroup path mentions ``tag``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cgroup") as f:
                if tag in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def sandbox_mounts(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if str(root) in line]


async def assert_clean_close(manager: SandboxManager) -> None:
    cgroups = manager.cgroups
    tag = f"temper-{os.getpid()}/"
    await manager.close()
    assert manager.leaked == 0
    assert sandbox_mounts(manager.root) == [], "workspace mounts left behind"
    if cgroups is not None:
        assert cgroups.leftovers() == [], "sandbox cgroups left behind"
        assert cgroup_members(tag) == [], "processes left in sandbox cgroups"
    assert not manager.root.exists() or not any(manager.root.iterdir())


@pytest.fixture
async def manager(sandbox_root: Path) -> AsyncIterator[SandboxManager]:
    m = SandboxManager(make_settings(sandbox_root))
    await m.start()
    yield m
    await assert_clean_close(m)
