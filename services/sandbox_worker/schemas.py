"""The sandbox worker's HTTP request and response bodies (sessions, one-shot runs,
SandboxFusion's ``/run_code``)."""

from __future__ import annotations

import base64
import binascii
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from temper.sandbox import (
    ExecResult,
    KillReason,
    SandboxLimits,
)


class CreateSession(BaseModel):
    limits: SandboxLimits | None = None
    session_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,128}$")


class SessionCreated(BaseModel):
    session_id: str


class RestoreSession(CreateSession):
    key: str


class SnapshotTaken(BaseModel):
    key: str


class RunTests(BaseModel):
    """Run ``code`` followed by ``tests`` (e.g. a solution and its check function) as one
    Python program in a fresh sandbox. Passed means: exit 0, nothing killed or cut."""

    code: str
    tests: str = ""
    files: dict[str, str] = Field(default_factory=dict, description="path -> base64 content, written first")
    stdin: str | None = None
    limits: SandboxLimits | None = None

    @field_validator("files")
    @classmethod
    def _base64(cls, files: dict[str, str]) -> dict[str, str]:
        for path, content in files.items():
            try:
                base64.b64decode(content, validate=True)
            except binascii.Error as e:
                raise ValueError(f"{path!r}: not base64 ({e})") from None
        return files


class RunTestsResult(BaseModel):
    passed: bool
    result: ExecResult


# SandboxFusion's /run_code shapes, plus Temper's explicit truncation fields.
class RunCodeRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)  # a NaN timeout is a 422 naming it

    code: str
    language: str = "python"
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    # Temper additions (SandboxFusion clients ignore unknown fields):
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    kill_reason: KillReason | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
