"""Schemas of the sandbox: actions and their results (its limits are :mod:`temper.limits`).
Plain pydantic v2 models, so they travel inside bus events and HTTP bodies as JSON unchanged."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from temper.limits import KillReason

ActionKind = Literal["run_command", "run_python", "write_file", "read_file", "list_files"]


class Action(BaseModel):
    """One step in a session. Which fields matter depends on ``kind``:
    run_command: ``command`` (a shell string, or an argv list run without a shell), ``stdin``;
    run_python: ``code``, ``stdin``, ``path`` (optional: the file the program runs as, for
    ``__file__``, ``sys.argv[0]`` and its tracebacks; write it first to show its lines);
    write_file: ``path``, ``content``, ``encoding``, ``executable``; read_file: ``path``,
    ``encoding``; list_files: ``path`` (default the workspace root)."""

    model_config = ConfigDict(allow_inf_nan=False)  # NaN and infinity are refused by name

    kind: ActionKind
    command: str | list[str] | None = None
    code: str | None = None
    path: str | None = None
    content: str | None = None
    encoding: Literal["utf-8", "base64"] = "utf-8"
    executable: bool = Field(False, description="write_file: mode 0755 instead of 0644")
    stdin: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = Field(None, description="relative to the workspace")
    timeout_s: float | None = Field(
        None, gt=0, le=3600, description="overrides limits.wall_s for this action"
    )
    address_space_mb: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="RLIMIT_AS of the action's processes: an allocation past it fails inside the "
        "program (Python raises MemoryError), as SandboxFusion limits memory; the sandbox's "
        "memory limit still holds",
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
    exec_s: float | None = Field(
        None,
        description="the program's own run time, from its start to its exit (what SandboxFusion "
        "reports as execution_time); wall_s also counts the sandbox's work around it",
    )
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
