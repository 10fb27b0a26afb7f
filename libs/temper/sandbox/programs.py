"""A program in any language of :mod:`temper.sandbox.languages`, run once where no other
run was: its compile step (where its language has one) in a fresh run of its own, under
the compile's limits, then the program in another fresh run, under the run's limits, on a
workspace holding the request's files, the source and what the compile left.

Each step is a :meth:`SandboxManager.run_fresh` (a zygote run: fresh pid, mount and IPC
namespaces, an empty workspace and /tmp), so a compile has its own memory and pids limits,
kill reasons and output caps, and nothing of it but its outputs (the archive it leaves,
read back like any fetched file) reaches the run.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from dataclasses import dataclass, field

from temper.limits import SandboxLimits
from temper.sandbox.languages import BUILD_ARCHIVE, Language, Step
from temper.sandbox.manager import RequestRefused, SandboxManager
from temper.sandbox.models import Action, ExecResult

COMPILE_CPU_FACTOR = 2  # compilers run threads (go, javac, rustc): CPU may outpace the wall clock


@dataclass
class ProgramResult:
    """``compile`` (None: the language has no compile step), ``run`` (None: the compile
    failed, so nothing ran), and the fetched files (None: missing or too large)."""

    compile: ExecResult | None
    run: ExecResult | None
    files: dict[str, bytes | None] = field(default_factory=dict)

    @property
    def compiled(self) -> bool:
        return self.compile is None or (self.compile.ok and self.compile.error is None)


class LanguageUnavailable(RequestRefused):
    """The request's language cannot run here: its toolchain is not on the host (or in
    the task image the run names). The caller's choice, like an unknown language: a 422
    naming ``language``, checked before anything runs."""

    def __init__(self, message: str) -> None:
        super().__init__("language", message)


class BuildError(ValueError):
    """The archive a compile step left is not one a run can take."""


def unpack_build(data: bytes, budget: int) -> tuple[dict[str, bytes], frozenset[str]]:
    """The files of a compile step's archive (path -> bytes) and which are executable.
    Only regular files with relative paths that stay inside are taken, at most ``budget``
    bytes in all; anything else (links, devices, ``..``) refuses the whole archive: it was
    made inside the sandbox, so it is not trusted."""
    files: dict[str, bytes] = {}
    executable: set[str] = set()
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for member in tar:
                name = posixpath.normpath(member.name)
                if member.isdir():
                    continue
                if not member.isreg():
                    raise BuildError(f"{member.name!r} is not a regular file")
                if name.startswith(("/", "..")) or name in (".", ""):
                    raise BuildError(f"{member.name!r} leaves the workspace")
                total += member.size
                if total > budget:
                    raise BuildError("the build's outputs are larger than file_size_mb")
                handle = tar.extractfile(member)
                files[name] = handle.read() if handle is not None else b""
                if member.mode & 0o111:
                    executable.add(name)
    except tarfile.TarError as exc:
        raise BuildError(f"not a tar archive: {exc}") from None
    return files, frozenset(executable)


def compile_limits(limits: SandboxLimits, timeout_s: float, memory_mb: int, pids: int) -> SandboxLimits:
    """A compile's limits: the run's sandbox (network, image, workspace, files) with the
    compile's own clock, memory and processes."""
    return limits.model_copy(
        update={
            "wall_s": timeout_s,
            "cpu_s": timeout_s * COMPILE_CPU_FACTOR,
            "memory_mb": memory_mb,
            "pids": pids,
        }
    )


async def run_program(
    manager: SandboxManager,
    language: Language,
    code: str,
    *,
    files: dict[str, bytes] | None = None,
    stdin: str | None = None,
    limits: SandboxLimits | None = None,
    compile_timeout_s: float | None = None,
    fetch: list[str] | tuple[str, ...] = (),
    sources: tuple[str, ...] = (),
    address_space: bool = False,
) -> ProgramResult:
    """Compile (where ``language`` has a compile step) and run ``code`` with ``files``
    (path -> bytes; the code goes to ``language.source`` after them) and ``stdin``; read
    ``fetch`` back after the run. ``limits`` are the run's (default: the worker's);
    the compile runs under ``TEMPER_SANDBOX__COMPILE_LIMITS`` and ``compile_timeout_s``.
    ``sources``: files among ``files`` that the compile takes with the code (Go's).
    ``address_space``: a language that turns it into its own error (Python's MemoryError)
    runs with an address-space limit of the run's memory, as SandboxFusion limits it."""
    settings = manager.settings
    limits = manager.with_image(limits or settings.default_limits)
    missing = await manager.missing_tools(language, limits)
    if missing:
        where = (
            f"task image {limits.image}" if limits.image else "this worker (scripts/setup_system.sh langs)"
        )
        raise LanguageUnavailable(
            f"language {language.name} is not installed: {', '.join(missing)} missing; "
            f"Debian package {language.package} is needed in {where}"
        )
    base = dict(files or {})
    base[language.source] = code.encode("utf-8", "surrogateescape")
    spawn = manager.spawn_background
    compiled: ExecResult | None = None
    built: dict[str, bytes] = {}
    executable: frozenset[str] = frozenset()
    image = limits.image is not None  # its own toolchains: no caches
    compile_memory = settings.compile_limits.memory_mb
    if language.compile_argv(Step(compile_memory)) is not None:
        cache = (
            None if image else manager.compile_caches.ready(language.cache, spawn, memory_mb=compile_memory)
        )
        step = Step(compile_memory, cache, sources)
        argv = language.compile_argv(step)
        assert argv is not None
        c_limits = compile_limits(
            limits, compile_timeout_s or limits.wall_s, compile_memory, settings.compile_limits.pids
        )
        action = Action(kind="run_command", command=argv, env=language.compile_env(step))
        compiled, out = await manager.run_fresh(c_limits, base, action, (BUILD_ARCHIVE,))
        if compiled.error is not None or not compiled.ok:
            return ProgramResult(compiled, None)
        archive = out.get(BUILD_ARCHIVE)
        if archive is None:
            compiled.error = "the compile step left no build archive"
            return ProgramResult(compiled, None)
        try:
            built, executable = unpack_build(archive, limits.file_size_mb << 20)
        except BuildError as exc:
            compiled.error = f"the compile step's outputs cannot be run: {exc}"
            return ProgramResult(compiled, None)
    cache = None if image else manager.compile_caches.ready(language.cache, spawn, memory_mb=limits.memory_mb)
    step = Step(limits.memory_mb, cache)
    space = limits.memory_mb if address_space and language.address_space_error else None
    if language.in_process:
        action = Action(
            kind="run_python", code=code, path=language.source, stdin=stdin, address_space_mb=space
        )
    else:
        action = Action(
            kind="run_command", command=language.run_argv(step), env=language.run_env(step), stdin=stdin,
            address_space_mb=space,
        )  # fmt: skip
    ran, fetched = await manager.run_fresh(limits, {**base, **built}, action, fetch, executable)
    return ProgramResult(compiled, ran, fetched)
