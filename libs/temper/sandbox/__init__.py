"""Isolated sandboxes for agent actions: bubblewrap namespaces, cgroups and rlimits,
a warm pool, stateful sessions and workspace snapshots. See docs/sandbox.md."""

from temper.limits import KillReason, NetworkPolicy, SandboxLimits, ServiceSpec
from temper.sandbox.backends import Backend, BwrapBackend, ProcessBackend, make_backend
from temper.sandbox.manager import RequestRefused, SandboxManager, SessionExists, SessionNotFound
from temper.sandbox.models import Action, ExecResult, FileInfo
from temper.sandbox.sandbox import Sandbox, SandboxError
from temper.sandbox.snapshot import SnapshotError
from temper.settings.sandbox import BackendKind, SandboxSettings

__all__ = [
    "Action",
    "Backend",
    "BackendKind",
    "BwrapBackend",
    "ExecResult",
    "FileInfo",
    "KillReason",
    "NetworkPolicy",
    "ProcessBackend",
    "RequestRefused",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxManager",
    "SandboxSettings",
    "ServiceSpec",
    "SessionExists",
    "SessionNotFound",
    "SnapshotError",
    "make_backend",
]
