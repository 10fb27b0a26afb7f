"""The bare-bwrap floor both sandbox benchmarks start: its workspace and the preexec_fn
that drops a forked child to the sandbox uid (as the sandboxes run)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

SANDBOX_UID = 65534  # nobody


def floor_workspace(root: Path) -> tuple[Path, int | None]:
    """``root/floor``, owned by the sandbox uid when this runs as root (else no uid drop)."""
    ws = root / "floor"
    ws.mkdir(parents=True, exist_ok=True)
    uid = SANDBOX_UID if os.geteuid() == 0 else None
    if uid is not None:
        os.chown(ws, uid, uid)
    return ws, uid


def as_sandbox_user(uid: int | None) -> Callable[[], None]:
    """A preexec_fn: a new session, then the sandbox uid and gid (if ``uid``)."""

    def pre() -> None:
        os.setsid()
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return pre
