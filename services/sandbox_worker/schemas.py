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
from temper.sandbox.languages import LanguageName


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
    """Run ``code`` followed by ``tests`` (e.g. a solution and its asserts) as one program
    of ``language`` in a fresh sandbox, compiled first where the language is. Passed means:
    it compiled, exited 0, and nothing was killed or cut."""

    model_config = ConfigDict(allow_inf_nan=False)

    code: str
    tests: str = ""
    language: LanguageName = LanguageName.python
    compile_timeout: float = Field(10, gt=0, description="seconds for the compile step, where there is one")
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
    result: ExecResult = Field(description="the run, or the compile when it failed (nothing ran)")
    compile: ExecResult | None = Field(None, description="the compile step, where the language has one")


# SandboxFusion's /run_code shapes, plus Temper's explicit truncation fields.
class RunCodeRequest(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)  # a NaN timeout is a 422 naming it

    code: str
    language: LanguageName = Field(
        description="SandboxFusion's name of a language this worker runs (c is Temper's addition); "
        "any other is a 422, as SandboxFusion answers"
    )
    compile_timeout: float = Field(10, gt=0)
    run_timeout: float = Field(10, gt=0)
    memory_limit_MB: int = -1
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CommandRunResult(BaseModel):
    """SandboxFusion's meanings: ``Finished`` the process ended (any exit status; one
    killed by a signal, the memory limit's included, has ``return_code`` -signal, as
    Python's subprocess reports it), ``TimeLimitExceeded`` it ran past its time (no
    return code), ``Error`` the sandbox failed to run it."""

    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = Field(None, description="seconds from the process's start to its exit")
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
