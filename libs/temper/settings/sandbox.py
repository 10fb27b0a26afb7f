"""Settings of the sandbox subsystem (``TEMPER_SANDBOX__*``)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, Field

from temper.limits import SandboxLimits


class BackendKind(StrEnum):
    bwrap = "bwrap"  # namespaces + cgroups + rlimits (the default)
    process = "process"  # no isolation at all: for hosts without user namespaces


class IsolationPiece(StrEnum):
    """Parts of a sandbox's isolation that a benchmark may switch off to measure what each
    costs (``bench_pieces_off``); every one is on in a real deployment."""

    dev = "dev"  # /dev read-only; each zygote run mounts its own /dev/shm and /dev/pts
    seccomp = "seccomp"  # the system-call filter (temper.sandbox.seccomp)
    fetch = "fetch"  # a zygote run's processes killed before its files are read, read without links
    recycle = "recycle"  # a zygote's memory checked after each run, recycled past a margin or max_runs


class LimitMaxima(BaseModel):
    """The most a task or job may ask for (``TEMPER_SANDBOX__MAX_LIMITS__*``): a request
    above one is refused at job submission and by the worker, never clamped."""

    wall_s: float = Field(3600.0, gt=0, description="wall_s and an action's timeout_s")
    cpu_s: float = Field(3600.0, gt=0)
    memory_mb: int = Field(16384, ge=16)
    pids: int = Field(4096, ge=4)
    workspace_mb: int = Field(16384, ge=1, description="the workspace (the sandbox's disk)")
    file_size_mb: int = Field(16384, ge=1)


class CompileLimits(BaseModel):
    """What a program's compile step may use (``TEMPER_SANDBOX__COMPILE_LIMITS__*``): its own
    memory and processes, not the run's; its clock is the request's ``compile_timeout``."""

    memory_mb: int = Field(
        1024, ge=64, description="memory of a compile (cgroup); javac's heap is sized from it"
    )
    pids: int = Field(
        256, ge=16, description="processes and threads of a compile (go build and rustc run several)"
    )


class SandboxSettings(BaseModel):
    backend: BackendKind = BackendKind.bwrap
    allow_unsafe: bool = Field(False, description="allow the process backend in distributed mode")
    pool_size: int = Field(4, ge=0, le=256, description="warm sandboxes kept ready")
    zygotes: int = Field(
        8,
        ge=0,
        le=256,
        description="zygotes for one-shot runs (run_code, scoring): each gives a run fresh namespaces "
        "without a sandbox start and serves one run at a time; 0: a sandbox per run",
    )
    zygote_max_runs: int = Field(
        1000, ge=1, description="runs one zygote serves before it is replaced by a fresh one"
    )
    zygote_memory_margin_mb: int = Field(
        16,
        ge=1,
        description="a zygote whose resident memory (anonymous + shared, memory.stat) after a run "
        "is this much above its idle baseline is replaced",
    )
    bench_pieces_off: list[IsolationPiece] = Field(
        default_factory=list,
        description="benchmarks only: isolation pieces switched off to measure their cost "
        "(refused in distributed mode unless allow_unsafe)",
    )
    max_sessions: int = Field(64, ge=1, description="sessions held at once by one worker")
    idle_expiry_s: float = Field(900.0, gt=0, description="a session idle this long is destroyed")
    concurrency: int = Field(8, ge=1, description="actions running at once in one worker")
    group: str = Field("sandbox-worker", description="the worker's consumer group on sandbox.requests")
    default_limits: SandboxLimits = SandboxLimits()
    workspace_root: Path = Path(".temper/sandboxes")
    python: str = "/usr/bin/python3"  # the interpreter inside the sandbox (host path, bound read-only)
    bwrap: str = "bwrap"
    spawner: bool = Field(
        True, description="start sandboxes through a small fork server instead of forking the worker"
    )
    run_as_uid: int = Field(65534, description="host uid the sandbox runs as when the worker is root")
    run_as_gid: int = 65534
    ro_binds: list[str] = Field(
        default_factory=lambda: [
            "/usr",
            "/etc/alternatives",
            "/etc/ld.so.cache",
            "/etc/localtime",
            "/etc/ssl",
            "/etc/java-17-openjdk",  # the JDK's conf/ (java.security, ...) is a link into it on Debian
        ],
        description="host paths bound read-only at the same place, or HOST:SANDBOX to bind elsewhere "
        "(missing ones are skipped)",
    )
    max_limits: LimitMaxima = LimitMaxima()
    allow_host_network: bool = Field(
        False, description="let a task ask for network: host (the host's network namespace)"
    )
    egress_allow_private: bool = Field(
        False,
        description="let the allowlist proxy connect to loopback, private and link-local addresses "
        "(off: a listed name that resolves to one is refused)",
    )
    egress_private_targets: list[str] = Field(
        default_factory=list,
        description="host:port entries the allowlist proxy connects to even where they resolve to private "
        "addresses, when a sandbox lists them: the platform's own services (the sandbox worker adds "
        "TEMPER_AGENT__URL's gateway)",
    )
    snapshot_prefix: str = "sandbox-snapshots"
    image_cache: Path = Field(
        Path(".temper/images"),
        description="where this worker unpacks images (by digest); sandboxes bind them read-only, "
        "so the sandbox uid must be able to reach it",
    )
    image_prefix: str = Field("sandbox-images", description="where images live in object storage")
    compile_limits: CompileLimits = CompileLimits()
    compile_cache: Path = Field(
        Path(".temper/langs"),
        description="where this worker makes its compile caches (precompiled C++ headers, javac's CDS "
        "archive, a Go build cache, TypeScript code caches), bound read-only into sandboxes; the sandbox "
        "uid must be able to reach it",
    )
    preload_images: list[str] = Field(
        default_factory=list,
        description="images this worker pulls at start, so no episode's first turn waits for a pull",
    )
    default_image: str | None = Field(
        None,
        pattern=r"^sha256:[0-9a-f]{64}$",
        description="the image of sandboxes whose limits name none (the pool's too); none: the host's /usr",
    )
