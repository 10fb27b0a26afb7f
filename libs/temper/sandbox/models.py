"""Schemas of the sandbox: limits, actions and results. Plain pydantic v2 models, so
they travel inside bus events and HTTP bodies as JSON unchanged."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, Field


class KillReason(StrEnum):
    timeout = "timeout"  # wall-clock limit
    cpu = "cpu"  # CPU-time limit
    memory = "memory"  # the cgroup's OOM killer fired
    pids = "pids"  # the process-count limit was hit
    output = "output"  # stdout/stderr went past output_bytes
    disk = "disk"  # workspace full or a file past file_size_mb
    signal = "signal"  # died of a signal not explained by a limit


class SandboxLimits(BaseModel):
    """Per-sandbox limits. Memory, pids and workspace size hold for the sandbox as a whole;
    wall, CPU, output, file size and open files hold for each action."""

    wall_s: float = Field(10.0, gt=0, le=3600, description="wall-clock limit of one action")
    cpu_s: float = Field(10.0, gt=0, le=3600, description="CPU-time limit of one action (all its processes)")
    memory_mb: int = Field(512, ge=16, le=65536, description="memory of the whole sandbox (cgroup)")
    pids: int = Field(128, ge=4, le=32768, description="processes and threads in the sandbox")
    output_bytes: int = Field(
        1 << 20, ge=1024, le=64 << 20, description="kept bytes per stream (stdout, stderr)"
    )
    file_size_mb: int = Field(64, ge=1, le=16384, description="largest file an action may write")
    open_files: int = Field(256, ge=16, le=65536)
    workspace_mb: int = Field(256, ge=1, le=65536, description="size of the writable workspace")
    network: bool = Field(False, description="share the host network (off unless the task asks)")
    image: str | None = Field(
        None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="the root filesystem to run on (a published image's digest); none: the host's /usr",
    )


ActionKind = Literal["run_command", "run_python", "write_file", "read_file", "list_files"]


class Action(BaseModel):
    """One step in a session. Which fields matter depends on ``kind``:
    run_command: ``command`` (a shell string, or an argv list run without a shell), ``stdin``;
    run_python: ``code``, ``stdin``; write_file: ``path``, ``content``, ``encoding``;
    read_file: ``path``, ``encoding``; list_files: ``path`` (default the workspace root)."""

    kind: ActionKind
    command: str | list[str] | None = None
    code: str | None = None
    path: str | None = None
    content: str | None = None
    encoding: Literal["utf-8", "base64"] = "utf-8"
    stdin: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, description="relative to the workspace")
    timeout_s: float | None = Field(
        None, gt=0, le=3600, description="overrides limits.wall_s for this action"
    )


class FileInfo(BaseModel):
    path: str
    size: int
    is_dir: bool = False


class ExecResult(BaseModel):
    """What an action did. A kill is an observation, never an error of the worker."""

    exit_code: int | None = None  # None when the action was not a process or never exited on its own
    signal: int | None = None  # the signal that ended the main process, if any
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    kill_reason: KillReason | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    peak_memory_mb: float = 0.0
    error: str | None = None  # a file action that failed (missing file, bad path)
    content: str | None = None  # read_file
    encoding: Literal["utf-8", "base64"] = "utf-8"
    files: list[FileInfo] | None = None  # list_files

    @property
    def ok(self) -> bool:
        """Exited 0, was not killed, and nothing was cut."""
        return (
            self.exit_code == 0
            and self.kill_reason is None
            and self.error is None
            and not (self.stdout_truncated or self.stderr_truncated)
        )
