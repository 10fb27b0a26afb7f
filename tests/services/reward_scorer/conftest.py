"""A scoring sandbox manager (real bwrap sandboxes, the coverage package bound in)."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest


@pytest.fixture
async def scoring_manager():
    from temper.rewards.runner import scoring_sandbox_settings
    from temper.sandbox import SandboxManager, SandboxSettings

    # under /tmp (mode 1777): pytest's tmp_path is 0700 and the sandbox uid must reach it
    root = Path("/tmp") / f"temper-score-{uuid.uuid4().hex[:8]}"
    manager = SandboxManager(scoring_sandbox_settings(SandboxSettings(pool_size=2, workspace_root=root)))
    await manager.start()
    yield manager
    await manager.close()
    shutil.rmtree(root, ignore_errors=True)
