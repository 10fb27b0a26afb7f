"""A scoring sandbox manager (real bwrap sandboxes, the coverage package bound in)."""

from __future__ import annotations

import pytest


@pytest.fixture
async def scoring_manager(tmp_path):
    from temper.rewards.runner import scoring_sandbox_settings
    from temper.sandbox import SandboxManager, SandboxSettings

    manager = SandboxManager(scoring_sandbox_settings(SandboxSettings(pool_size=2, workspace_root=tmp_path / "sbx")))
    await manager.start()
    yield manager
    await manager.close()
