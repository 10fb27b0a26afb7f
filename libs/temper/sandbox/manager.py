"""Sessions and the warm pool.

A session is a sandbox that lives across actions (create → act, act, … → destroy) and
is destroyed after ``idle_expiry_s`` without use, never before the time its caller asked
it be kept (:meth:`SandboxManager.keep`: an episode's session until the episode's deadline). The pool keeps ``pool_size`` sandboxes
started (namespaces set up, agent ready) with the default limits, so acquiring one costs
a pop and a few cgroup writes. A sandbox is never handed out twice: once released it is
destroyed and the pool refilled in the background.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import shutil
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

from temper import metrics
from temper.limits import KillReason, SandboxLimits
from temper.sandbox import snapshot
from temper.sandbox.admission import limit_errors, timeout_error
from temper.sandbox.backends import Backend, make_backend
from temper.sandbox.cgroups import CgroupManager, detect
from temper.sandbox.compile_cache import SANDBOX_CACHE, CompileCaches
from temper.sandbox.images import Image, ImageCache
from temper.sandbox.languages import Language, LanguageName, registry
from temper.sandbox.models import Action, ExecResult
from temper.sandbox.sandbox import LimitsNotSet, Sandbox, SandboxError, refuse_files
from temper.sandbox.spawner import Spawner
from temper.sandbox.zygote import ZygotePool, ZygoteUnsupported
from temper.settings.sandbox import IsolationPiece, SandboxSettings

log = logging.getLogger(__name__)

REFILL_DELAY_S = 0.02
REFILL_MAX_WAIT_S = 2.0


def _sweep_dead_workspaces(parent: Path) -> None:
    """Unmount and remove workspaces left by a worker that died (``w<pid>-*`` whose pid is gone)."""
    if not parent.is_dir():
        return
    for d in parent.glob("w*-*"):
        try:
            pid = int(d.name[1:].split("-", 1)[0])
            os.kill(pid, 0)
            continue  # alive
        except ValueError:
            continue
        except PermissionError:
            continue
        except ProcessLookupError:
            pass
        for ws in d.iterdir():
            _umount(ws)
        _umount(d)  # the root's own tmpfs (a root worker's)
        shutil.rmtree(d, ignore_errors=True)


def _umount(path: Path) -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).umount2(str(path).encode(), 2)  # MNT_DETACH; EINVAL if not a mount


def _mount_tmpfs(path: Path, options: str) -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", 0x2 | 0x4, options.encode()) == 0:  # nosuid, nodev
        return True
    log.warning(
        "cannot mount a tmpfs on %s (errno %d): sandboxes see its host path", path, ctypes.get_errno()
    )
    return False


class SessionNotFound(KeyError):
    pass


class SessionExists(SandboxError):
    """A session with this id is already held by this worker."""


class RequestRefused(SandboxError):
    """A request this worker will not run, for a reason in one of its fields (``field``,
    dotted: ``limits.memory_mb``, ``key``, ``files``): the caller's error, not the worker's."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _refuse_limits(limits: SandboxLimits, settings: SandboxSettings) -> None:
    refused = limit_errors(limits, settings)
    if refused:
        raise RequestRefused(f"limits.{refused[0][0]}", "; ".join(message for _field, message in refused))


RECYCLE_REASONS = ("limits", "runs", "memory", "broken")


def init_metrics() -> None:
    """Kills by every reason, fresh runs by either path and zygote recycles by every reason
    export 0 from the start (metrics.zero says why)."""
    metrics.zero(metrics.SANDBOX_KILLS, *KillReason)
    metrics.zero(metrics.SANDBOX_FRESH_RUNS, "zygote", "sandbox")
    metrics.zero(metrics.SANDBOX_ZYGOTE_RECYCLES, *RECYCLE_REASONS)


class SandboxManager:
    def __init__(
        self, settings: SandboxSettings, *, distributed: bool = False, store: object | None = None
    ) -> None:
        init_metrics()
        self.settings = settings
        self.distributed = distributed
        self.store = store  # a temper.storage.ObjectStore, for snapshots
        self.backend: Backend | None = None
        self.cgroups: CgroupManager | None = None
        self.root = Path(settings.workspace_root).absolute() / f"w{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.sessions: dict[str, Sandbox] = {}
        self.kept: dict[str, float] = {}  # session -> monotonic time it is kept until (keep)
        self._pool: deque[Sandbox] = deque()
        self._in_use: set[Sandbox] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._refill_lock = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None
        self.spawner: Spawner | None = None
        self.images = ImageCache(settings.image_cache, store, prefix=settings.image_prefix)
        self.compile_caches = CompileCaches(Path(settings.compile_cache).absolute(), inner=SANDBOX_CACHE)
        self.languages: dict[LanguageName, Language] = {}
        self.leaked = 0
        self.started = False
        self._root_mounted = False
        self.zygotes = ZygotePool(settings.zygotes, self._start_zygote)

    # --- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self.backend = make_backend(self.settings, distributed=self.distributed)
        self.cgroups = await asyncio.to_thread(detect)
        if (
            self.cgroups is None
            and self.backend.isolated
            and self.distributed
            and not self.settings.allow_unsafe
        ):
            raise SandboxError("no usable cgroups: memory and pids limits cannot be enforced")
        await asyncio.to_thread(_sweep_dead_workspaces, self.root.parent)
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0 and self.backend.isolated:
            # A tmpfs of its own: what sandboxes bind from here (the compiled agent, proxy
            # sockets) then shows in their mount table by its path in this tmpfs, not by
            # the host path with this worker's pid in it.
            self._root_mounted = _mount_tmpfs(self.root, "size=16m,mode=0711")
        self.root.chmod(0o711)
        await asyncio.to_thread(self.backend.prepare, self.root)
        caches = self.compile_caches
        if self.backend.isolated:
            self.backend.extra_binds = [f"{caches.root}:{SANDBOX_CACHE}"]
        else:
            caches.inner = str(caches.root)
        await asyncio.to_thread(caches.prepare)
        self.languages = registry(caches.runner_inside)
        if self.backend.isolated:
            self.images.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0 and self.backend.isolated:
            # bwrap runs as the unprivileged sandbox uid: it must be able to reach the workspace
            # and every directory it binds in (else it exits before the agent says a word).
            blocked = _unsearchable_parent(self.root)
            if blocked is not None:
                raise SandboxError(
                    f"{blocked} is not searchable by other users; the sandbox uid cannot reach "
                    f"{self.root} (set TEMPER_SANDBOX__WORKSPACE_ROOT to a path under a mode o+x tree)"
                )
            for entry in [*self.settings.ro_binds, str(self.images.root), str(caches.root)]:
                source = Path(entry.partition(":")[0])
                blocked = _unsearchable_parent(source)
                if blocked is not None:
                    raise SandboxError(
                        f"{blocked} is not searchable by other users; the sandbox uid cannot reach "
                        f"{source}, which sandboxes bind in (put the checkout or the venv under a mode o+x tree)"
                    )
        self.images.store = self.store  # the store may be set after construction
        for digest in [*self.settings.preload_images, *filter(None, [self.settings.default_image])]:
            await self.images.ensure(digest)  # the pool runs on the default one
        if self.settings.spawner:
            spawner = Spawner(self.settings.python)
            try:
                await spawner.start()
                self.spawner = spawner
            except (OSError, SandboxError) as e:
                log.warning("sandbox spawner unavailable (%s): sandboxes are forked from the worker", e)
                await spawner.stop()
            except BaseException:  # cancelled while it started: its process must not outlive us
                await spawner.stop()
                raise
        self.started = True
        try:
            await self.refill()
        except BaseException:  # the caller never gets a manager to close: the spawner and pool go now
            await self.close()
            raise
        self._reaper = asyncio.create_task(self._reap_idle())

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        self.started = False  # refills stop after the sandbox they are starting
        while self._tasks:  # background destroys and refills run to the end: none may leak
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        doomed = [*self.sessions.values(), *self._pool, *self._in_use, *self.zygotes.drain()]
        self.sessions.clear()
        self._pool.clear()
        self._in_use.clear()
        for sb in doomed:
            await self._destroy(sb)
        self._update_gauges()
        if self.spawner is not None:
            await self.spawner.stop()
            self.spawner = None
        if self.cgroups is not None:
            self.cgroups.close()
        for name in ("agent.py", "agent.pyc"):  # what backend.prepare() wrote
            with contextlib.suppress(OSError):
                (self.root / name).unlink()
        if self._root_mounted:
            _umount(self.root)
            self._root_mounted = False
        with contextlib.suppress(OSError):
            self.root.rmdir()
        self.started = False

    def health(self) -> dict[str, str]:
        """Component -> 'ok' or what is wrong."""
        out = {"backend": "ok" if self.backend is not None else "not started"}
        out["cgroups"] = (
            f"v{self.cgroups.version}" if self.cgroups is not None else "unavailable (rlimits only)"
        )
        out["leaked_processes"] = str(self.leaked)
        out["zygotes"] = f"unavailable: {self.zygotes.broken}" if self.zygotes.broken else "ok"
        return out

    # --- sandboxes ------------------------------------------------------------------
    def with_image(self, limits: SandboxLimits) -> SandboxLimits:
        """``limits`` with the worker's default image filled in when they name none."""
        if limits.image is None and self.settings.default_image is not None:
            return limits.model_copy(update={"image": self.settings.default_image})
        return limits

    async def _new(
        self, limits: SandboxLimits, sandbox_id: str | None = None, *, zygote: bool = False
    ) -> Sandbox:
        assert self.backend is not None, "SandboxManager.start() first"
        image: Image | None = None
        if limits.image is not None:
            if not self.backend.isolated:
                raise SandboxError("the process backend cannot run sandboxes on an image")
            image = await self.images.ensure(limits.image)
        run_as = (self.settings.run_as_uid, self.settings.run_as_gid)
        return Sandbox(
            backend=self.backend, cgroups=self.cgroups, limits=limits, workspace_root=self.root,
            run_as=run_as, sandbox_id=sandbox_id, spawner=self.spawner, image=image,
            egress_allow_private=self.settings.egress_allow_private, zygote=zygote,
            egress_private_targets=self.settings.egress_private_targets,
        )  # fmt: skip

    async def _destroy(self, sb: Sandbox) -> None:
        """Tear ``sb`` down. The teardown is a task of its own that ``close()`` waits for, so
        a caller cancelled half-way (the idle reaper, when the manager closes) cannot leave
        a workspace mounted or a process unreaped: it finishes either way."""
        await asyncio.shield(self._spawn(self._teardown(sb)))

    async def _teardown(self, sb: Sandbox) -> None:
        try:
            leaked = await sb.destroy()
        except Exception:
            log.exception("sandbox %s: destroy failed", sb.id)
            leaked = 1
        if leaked:
            self.leaked += leaked
            metrics.SANDBOX_LEAKED_PROCESSES.set(self.leaked)

    def _spawn(self, coro: Coroutine[Any, Any, Any] | asyncio.Future[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def missing_tools(self, language: Language, limits: SandboxLimits) -> list[str]:
        """The files ``language`` needs that a sandbox under ``limits`` would not find: on
        the host's /usr, or on the task image it names."""
        if limits.image is None:
            return language.missing()
        image = await self.images.ensure(limits.image)
        return language.missing(str(image.rootfs))

    def spawn_background(self, work: asyncio.Future[Any]) -> None:
        """Background work (a compile cache being made) that ``close()`` waits for."""
        self._spawn(work)

    async def refill(self) -> None:
        """Bring the pool up to ``pool_size``, one sandbox at a time."""
        async with self._refill_lock:
            while self.started and len(self._pool) < self.settings.pool_size:
                try:
                    sb = await self._new(self.with_image(self.settings.default_limits))
                except Exception:
                    log.exception("warm pool: no image for the pool's sandboxes")
                    return
                try:
                    await sb.start()
                    # One trivial action first, so the first real one finds the agent's
                    # pages faulted in and its code paths warm.
                    await sb.act(Action(kind="run_python", code="pass"))
                except Exception:
                    log.exception("warm pool: could not start a sandbox")
                    return
                self._pool.append(sb)
                self._update_gauges()

    def _update_gauges(self) -> None:
        metrics.SANDBOX_POOL_SIZE.set(len(self._pool))
        metrics.SANDBOX_ACTIVE.set(len(self.sessions) + len(self._in_use))

    async def acquire(self, limits: SandboxLimits | None = None, *, sandbox_id: str | None = None) -> Sandbox:
        """A started sandbox with these limits: from the pool when one fits, else a new one."""
        limits = self.with_image(limits or self.settings.default_limits)
        _refuse_limits(limits, self.settings)
        t0 = time.perf_counter()
        sb: Sandbox | None = None
        # Pooled sandboxes all carry the default network policy, services and image; the
        # rest can change.
        pooled = self.with_image(self.settings.default_limits)
        while self._pool and sb is None and limits.fixed_at_start == pooled.fixed_at_start:
            candidate = self._pool.popleft()
            try:
                if candidate.dead:
                    raise SandboxError("pooled sandbox died")
                await candidate.apply_limits(limits)
                sb = candidate
            except SandboxError:
                self._spawn(self._teardown(candidate))
        if sb is not None:
            metrics.SANDBOX_POOL_HITS.inc()
            if sandbox_id is not None:
                sb.id = sandbox_id
        else:
            metrics.SANDBOX_POOL_MISSES.inc()
            sb = await self._new(limits, sandbox_id)
            await sb.start()
        self._in_use.add(sb)
        self._update_gauges()
        metrics.SANDBOX_ACQUIRE_SECONDS.observe(time.perf_counter() - t0)
        if len(self._pool) < self.settings.pool_size:
            self._spawn(self._refill_later())
        return sb

    async def _refill_later(self) -> None:
        # Off the caller's critical path: starting a sandbox forks this process, which
        # would otherwise delay the action that just acquired one.
        deadline = time.monotonic() + REFILL_MAX_WAIT_S
        await asyncio.sleep(REFILL_DELAY_S)
        while self._busy() and time.monotonic() < deadline:  # noqa: ASYNC110 - polling on purpose
            await asyncio.sleep(REFILL_DELAY_S)  # wait for a gap between actions
        await self.refill()

    def _busy(self) -> bool:
        return any(sb._lock.locked() for sb in (*self._in_use, *self.sessions.values()))

    async def release(self, sb: Sandbox, *, wait: bool = False) -> None:
        """Destroy a sandbox that is no longer needed (in the background unless ``wait``)."""
        self._in_use.discard(sb)
        self._update_gauges()
        if wait:
            await self._destroy(sb)
        else:
            self._spawn(self._teardown(sb))

    @contextlib.asynccontextmanager
    async def sandbox(self, limits: SandboxLimits | None = None) -> AsyncIterator[Sandbox]:
        sb = await self.acquire(limits)
        try:
            yield sb
        finally:
            await self.release(sb)

    async def execute(self, sb: Sandbox, action: Action) -> ExecResult:
        refused = timeout_error(action.timeout_s, self.settings)
        if refused is not None:
            return ExecResult(error=refused)
        t0 = time.perf_counter()
        result = await sb.act(action)
        metrics.SANDBOX_EXEC_SECONDS.observe(time.perf_counter() - t0)
        if result.kill_reason is not None:
            metrics.SANDBOX_KILLS.labels(reason=result.kill_reason.value).inc()
        return result

    # --- one-shot runs ----------------------------------------------------------------
    async def run_fresh(
        self,
        limits: SandboxLimits | None,
        files: dict[str, bytes],
        action: Action,
        fetch: list[str] | tuple[str, ...] = (),
        executable: frozenset[str] = frozenset(),
    ) -> tuple[ExecResult, dict[str, bytes | None]]:
        """Run ``action`` once where no earlier run was: a workspace holding ``files``
        (those named in ``executable`` with mode 0755), then ``fetch`` read back (None:
        missing or too large). On a zygote when the limits fit one (fresh namespaces per
        run, no sandbox start; ``temper.sandbox.zygote``), else in a sandbox of its own
        from the pool, destroyed afterwards."""
        limits = self.with_image(limits or self.settings.default_limits)
        _refuse_limits(limits, self.settings)
        timeout_refused = timeout_error(action.timeout_s, self.settings)
        if timeout_refused is not None:
            return ExecResult(error=timeout_refused), {}
        files_refused = refuse_files(files, limits)
        if files_refused is not None:
            return files_refused, {}
        if self._zygote_fits(limits):
            try:
                zygote = await self.zygotes.take()
            except (SandboxError, OSError) as e:
                if self.zygotes.broken:
                    log.error("zygotes cannot run on this host (%s): one-shot runs start a sandbox each", e)
                else:
                    log.warning("a zygote did not start (%s): this run starts a sandbox of its own", e)
            else:
                return await self._run_on_zygote(zygote, limits, files, action, fetch, executable)
        metrics.SANDBOX_FRESH_RUNS.labels("sandbox").inc()
        async with self.sandbox(limits) as sb:
            for path, data in files.items():
                written = await sb.act(
                    Action(
                        kind="write_file",
                        path=path,
                        content=base64.b64encode(data).decode(),
                        encoding="base64",
                        executable=path in executable,
                    )
                )
                if written.error:
                    return ExecResult(error=f"cannot write {path}: {written.error}"), {}
            result = await self.execute(sb, action)
            return result, await sb.fetch(fetch)

    def _zygote_fits(self, limits: SandboxLimits) -> bool:
        """A zygote runs with the pool's network policy, services and image, and only
        where the backend has namespaces and no earlier zygote failed to start."""
        assert self.backend is not None, "SandboxManager.start() first"
        pooled = self.with_image(self.settings.default_limits)
        return (
            self.settings.zygotes > 0
            and self.backend.pid_namespace
            and self.zygotes.broken is None
            and not pooled.services
            and limits.fixed_at_start == pooled.fixed_at_start
        )

    async def _run_on_zygote(
        self,
        zygote: Sandbox,
        limits: SandboxLimits,
        files: dict[str, bytes],
        action: Action,
        fetch: list[str] | tuple[str, ...],
        executable: frozenset[str],
    ) -> tuple[ExecResult, dict[str, bytes | None]]:
        metrics.SANDBOX_FRESH_RUNS.labels("zygote").inc()
        self._in_use.add(zygote)
        recycle: str | None = "broken"  # unless the run comes back
        try:
            try:
                await zygote.apply_limits(limits)
            except LimitsNotSet as e:
                # Whatever holds its memory, this zygote cannot run under these limits; a
                # fresh one can (and if it cannot either, the run fails: never unlimited).
                log.warning("zygote %s replaced: %s", zygote.id, e)
                self._give_back(zygote, "limits")
                zygote = await self.zygotes.take(fresh=True)
                self._in_use.add(zygote)
                recycle = "limits"  # should the fresh one refuse them too
                await zygote.apply_limits(limits)
                recycle = "broken"
            t0 = time.perf_counter()
            result, fetched = await zygote.run_fresh(action, files, fetch, executable)
            metrics.SANDBOX_EXEC_SECONDS.observe(time.perf_counter() - t0)
            if result.kill_reason is not None:
                metrics.SANDBOX_KILLS.labels(reason=result.kill_reason.value).inc()
            recycle = self._recycle_reason(zygote)
            return result, fetched
        finally:
            self._give_back(zygote, recycle)

    def _recycle_reason(self, zygote: Sandbox) -> str | None:
        """Why ``zygote`` must not serve another run, or None."""
        if zygote.dead or zygote.destroyed:
            return "broken"
        assert self.backend is not None
        if not self.backend.piece_on(IsolationPiece.recycle):
            return None
        if zygote.runs >= self.settings.zygote_max_runs:
            return "runs"
        if zygote.cgroup is not None and zygote.baseline_bytes is not None:
            resident = zygote.cgroup.resident_bytes()
            if resident > zygote.baseline_bytes + (self.settings.zygote_memory_margin_mb << 20):
                log.warning(
                    "zygote %s replaced: %d MiB resident after a run, idle baseline %d MiB (margin %d MiB)",
                    zygote.id, resident >> 20, zygote.baseline_bytes >> 20, self.settings.zygote_memory_margin_mb,
                )  # fmt: skip
                return "memory"
        return None

    def _give_back(self, zygote: Sandbox, recycle: str | None) -> None:
        """Return ``zygote`` to the pool after a run, or destroy it (``recycle`` says why)
        and start its replacement in the background."""
        self._in_use.discard(zygote)
        doomed = self.zygotes.give_back(zygote, recycle=recycle is not None)
        if doomed is not None:
            self._spawn(self._teardown(doomed))
        if recycle is not None:
            metrics.SANDBOX_ZYGOTE_RECYCLES.labels(recycle).inc()
            if self.started:
                self._spawn(self._replenish_zygotes())
        metrics.SANDBOX_ZYGOTES.set(self.zygotes.started)

    async def _replenish_zygotes(self) -> None:
        try:
            doomed = await self.zygotes.replenish()
        except (SandboxError, OSError) as e:
            log.warning("a replacement zygote did not start (%s): the next run starts one", e)
            return
        if doomed is not None:
            await self._teardown(doomed)
        metrics.SANDBOX_ZYGOTES.set(self.zygotes.started)

    async def _start_zygote(self) -> Sandbox:
        """A started zygote that has run one empty program (its code paths warm, and the
        proof that this host lets it make namespaces)."""
        zygote = await self._new(self.with_image(self.settings.default_limits), zygote=True)
        try:
            await zygote.start()
            probe, _ = await zygote.run_fresh(Action(kind="run_python", code="pass"), {})
            if probe.exit_code != 0:
                raise SandboxError(probe.stderr.strip() or str(probe))
            zygote.runs = 0  # the probe is not a run
            if zygote.cgroup is not None:
                zygote.baseline_bytes = zygote.cgroup.resident_bytes()
        except SandboxError as e:
            await self._destroy(zygote)
            if "TimeoutError" in str(e):  # a slow start under load says nothing of the host
                raise
            raise ZygoteUnsupported(f"a zygote cannot make namespaces here: {e}") from e
        return zygote

    # --- sessions -------------------------------------------------------------------
    async def create_session(
        self, limits: SandboxLimits | None = None, *, session_id: str | None = None
    ) -> str:
        if session_id is not None and session_id in self.sessions:
            raise SessionExists(f"session {session_id} exists")
        if len(self.sessions) >= self.settings.max_sessions:
            await self._expire(force_oldest=True)
        sid = session_id or uuid.uuid4().hex
        sb = await self.acquire(limits)
        self._in_use.discard(sb)
        self.sessions[sid] = sb
        self._update_gauges()
        return sid

    def keep(self, session_id: str, seconds: float) -> None:
        """Keep the session at least ``seconds`` from now, idle or not (the longest of every
        call's; a later idle expiry still applies)."""
        until = time.monotonic() + seconds
        if session_id in self.sessions and until > self.kept.get(session_id, 0.0):
            self.kept[session_id] = until

    def get(self, session_id: str) -> Sandbox:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionNotFound(session_id) from None

    async def act(self, session_id: str, action: Action) -> ExecResult:
        return await self.execute(self.get(session_id), action)

    async def destroy_session(self, session_id: str, *, wait: bool = True) -> None:
        """End a session; with ``wait=False`` the teardown (kill, cgroup, unmount) runs in
        the background and the caller goes on (``close()`` still waits for it)."""
        sb = self.sessions.pop(session_id, None)
        self.kept.pop(session_id, None)
        if sb is None:
            raise SessionNotFound(session_id)
        self._update_gauges()
        if wait:
            await self._destroy(sb)
        else:
            self._spawn(self._teardown(sb))

    async def snapshot(self, session_id: str, key: str | None = None) -> str:
        """Put a tar.gz of the session's workspace to object storage; returns its key."""
        if self.store is None:
            raise SandboxError("no object store configured for snapshots")
        sb = self.get(session_id)
        key = key or f"{self.settings.snapshot_prefix}/{session_id}/{time.time_ns()}.tar.gz"
        async with sb._lock:  # no action may write while the workspace is read
            data = await asyncio.to_thread(snapshot.pack, sb.workspace.path)
        await self.store.put(key, data, snapshot.SNAPSHOT_CONTENT_TYPE)  # type: ignore[attr-defined]
        return key

    async def restore(
        self, key: str, limits: SandboxLimits | None = None, *, session_id: str | None = None
    ) -> str:
        """A new session whose workspace is the snapshot at ``key`` (under the worker's
        ``snapshot_prefix``: a restore cannot unpack any other object of the store)."""
        if self.store is None:
            raise SandboxError("no object store configured for snapshots")
        from temper.storage.base import check_key  # lazily: storage's clients are heavy

        prefix = self.settings.snapshot_prefix + "/"
        try:
            check_key(key)
        except ValueError as e:
            raise RequestRefused("key", str(e)) from None
        if not key.startswith(prefix):
            raise RequestRefused("key", f"invalid snapshot key {key!r}: snapshots live under {prefix}")
        if session_id is not None and session_id in self.sessions:
            raise SessionExists(f"session {session_id} exists")
        data = await self.store.get(key)  # type: ignore[attr-defined]
        sid = await self.create_session(limits, session_id=session_id)
        sb = self.sessions[sid]
        owner = sb.run_as
        try:
            await asyncio.to_thread(
                snapshot.unpack, data, sb.workspace.path, max_bytes=sb.limits.workspace_mb << 20, owner=owner
            )
        except BaseException:
            await self.destroy_session(sid)
            raise
        return sid

    async def _expire(self, *, force_oldest: bool = False) -> None:
        """Destroy the sessions idle past ``idle_expiry_s`` and not kept (:meth:`keep`).
        ``force_oldest`` (a new session and ``max_sessions`` held): if none is idle, the
        least recently used one not kept, else the least recently used of all (counted in
        ``temper_sandbox_kept_sessions_evicted_total``; its episode's next step restores its
        workspace from the step's snapshot)."""
        now = time.monotonic()
        free = [sid for sid in self.sessions if self.kept.get(sid, 0.0) <= now]
        idle = [sid for sid in free if now - self.sessions[sid].last_used > self.settings.idle_expiry_s]
        if force_oldest and not idle and self.sessions:
            pool = free or list(self.sessions)
            idle = [min(pool, key=lambda s: self.sessions[s].last_used)]
            if not free:
                metrics.SANDBOX_KEPT_EVICTED.inc()
                log.warning("sandbox session %s evicted while kept: all %d sessions are kept", idle[0],
                            len(self.sessions))  # fmt: skip
        for sid in idle:
            sb = self.sessions.get(sid)
            if sb is None or sb._lock.locked():
                continue
            log.info("sandbox session %s expired", sid)
            self.sessions.pop(sid, None)
            self.kept.pop(sid, None)
            await self._destroy(sb)
        self._update_gauges()

    async def _reap_idle(self) -> None:
        interval = max(0.05, min(self.settings.idle_expiry_s / 4, 30.0))
        while True:
            await asyncio.sleep(interval)
            try:
                await self._expire()
            except Exception:
                log.exception("sandbox session reaper failed")


def _unsearchable_parent(path: Path) -> Path | None:
    """The first directory on the way to ``path`` that other users cannot enter, if any
    (none for a path that does not exist: bwrap's ``--ro-bind-try`` skips those)."""
    if not path.exists():
        return None
    for parent in reversed([path, *path.parents] if path.is_dir() else list(path.parents)):
        if not parent.stat().st_mode & 0o001:
            return parent
    return None
