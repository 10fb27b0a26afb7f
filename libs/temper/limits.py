"""What a sandbox may use and how a run of it can end: its limits, network policy and
services, the kill reasons, and the languages a program may be written in. The vocabulary that job specs, tasks, settings and the
sandbox share, so it sits below all of them (plain pydantic v2, no other import)."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class KillReason(StrEnum):
    timeout = "timeout"  # wall-clock limit
    cpu = "cpu"  # CPU-time limit
    memory = "memory"  # the cgroup's OOM killer fired
    pids = "pids"  # the process-count limit was hit
    output = "output"  # stdout/stderr went past output_bytes
    disk = "disk"  # workspace full or a file past file_size_mb
    signal = "signal"  # died of a signal not explained by a limit


class LanguageName(StrEnum):
    """The languages a program, and a task's hidden tests, may be written in: SandboxFusion's
    names (``c`` is Temper's addition). ``temper.sandbox.languages`` runs them."""

    python = "python"
    bash = "bash"
    c = "c"
    cpp = "cpp"
    java = "java"
    go = "go"
    rust = "rust"
    nodejs = "nodejs"
    typescript = "typescript"


class NetworkPolicy(StrEnum):
    none = "none"  # a private network namespace: nothing outside the sandbox is reachable
    loopback = "loopback"  # the same namespace; the sandbox's own services listen on its loopback
    allowlist = "allowlist"  # the same, plus egress to listed host:port through the worker's proxy
    host = "host"  # the host's network namespace: refused unless the operator allows it


_HOST_PORT = re.compile(
    r"^(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[A-Za-z0-9.-]{1,253})):(?P<port>[0-9]{1,5})$"
)


def split_host_port(entry: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (lower-case host, port); ValueError otherwise."""
    m = _HOST_PORT.match(entry.strip())
    port = int(m.group("port")) if m else 0
    if m is None or not 0 < port < 65536:
        raise ValueError(f"{entry!r} is not host:port (a name or address and a port 1-65535)")
    return (m.group("v6") or m.group("host")).lower().rstrip("."), port


class ServiceSpec(BaseModel):
    """A long-lived process the sandbox starts before its first action (a database, a
    web server): it survives the end of every action, listens on the sandbox's own
    loopback, counts in the sandbox's cgroup and dies with the sandbox."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    command: str = Field(min_length=1, max_length=8192, description="a shell command, run by /bin/sh -c")
    ready_port: int | None = Field(None, ge=1, le=65535, description="ready once 127.0.0.1:<port> accepts")
    ready_command: str | None = Field(None, max_length=8192, description="ready once this exits 0")
    ready_timeout_s: float = Field(30.0, gt=0, le=600)
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_check(self) -> ServiceSpec:
        if (self.ready_port is None) == (self.ready_command is None):
            raise ValueError(f"service {self.name}: give exactly one of ready_port and ready_command")
        return self


class SandboxLimits(BaseModel):
    """Per-sandbox limits. Memory, pids and workspace size hold for the sandbox as a whole;
    wall, CPU, output, file size and open files hold for each action."""

    model_config = ConfigDict(allow_inf_nan=False)  # NaN and infinity are refused by name

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
    network: NetworkPolicy = Field(
        NetworkPolicy.none,
        description="none (default) | loopback | allowlist (egress to `allow` through the worker's proxy) "
        "| host (refused unless TEMPER_SANDBOX__ALLOW_HOST_NETWORK); the old booleans read as none / host",
    )
    allow: list[str] = Field(
        default_factory=list, max_length=256, description="allowlist: host:port entries egress may reach"
    )
    services: list[ServiceSpec] = Field(
        default_factory=list, max_length=16, description="processes started before the first action"
    )
    image: str | None = Field(
        None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="the root filesystem to run on (a published image's digest); none: the host's /usr",
    )

    @field_validator("network", mode="before")
    @classmethod
    def _old_boolean(cls, v: Any) -> Any:
        # Task files and stored specs from before the policies say ``network: false``
        # (what model_dump wrote) or ``true`` (the host's network): map them explicitly.
        if isinstance(v, bool):
            return NetworkPolicy.host if v else NetworkPolicy.none
        return v

    @field_validator("allow")
    @classmethod
    def _host_ports(cls, allow: list[str]) -> list[str]:
        return [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in map(split_host_port, allow)]

    @model_validator(mode="after")
    def _consistent(self) -> SandboxLimits:
        if self.allow and self.network is not NetworkPolicy.allowlist:
            raise ValueError("allow is only for network: allowlist")
        if self.network is NetworkPolicy.allowlist and not self.allow:
            raise ValueError("network: allowlist needs at least one host:port in allow")
        if self.services and self.network in (NetworkPolicy.none, NetworkPolicy.host):
            raise ValueError(
                "services need network: loopback (or allowlist): they listen on the sandbox's loopback"
            )
        names = [s.name for s in self.services]
        if len(set(names)) != len(names):
            raise ValueError("services: names must be unique")
        return self

    @property
    def fixed_at_start(self) -> tuple[object, ...]:
        """What a started sandbox cannot change: a pooled one fits only when these match."""
        return (
            self.network,
            tuple(self.allow),
            tuple(s.model_dump_json() for s in self.services),
            self.image,
        )
