"""One sandbox, seen from the worker: a workspace, a cgroup, and the agent process
that the backend started inside its namespaces.

The worker is the trusted side. It enforces the wall-clock backstop, CPU time summed
over all of an action's processes, workspace size and memory/pids (through the cgroup),
and it decides the kill reason from the kernel's counters, not from what runs inside.
The agent (``agent.py``) forks each action, drains and caps its output and kills the
action's whole process tree when it ends.
"""

from __future__ import annotations

import asyncio
import base64
import ctypes
import logging
import math
import os
import shutil
import signal
import struct
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from temper.limits import KillReason, NetworkPolicy, SandboxLimits, ServiceSpec
from temper.sandbox.backends import Backend, shm_mb
from temper.sandbox.cgroups import Cgroup, CgroupError, CgroupManager, CgroupStats
from temper.sandbox.fork_server import enter_sandbox
from temper.sandbox.models import Action, ExecResult, FileInfo
from temper.sandbox.proxy import FORWARD_PORT, EgressProxy
from temper.settings.sandbox import IsolationPiece

if TYPE_CHECKING:
    from temper.sandbox.images import Image
    from temper.sandbox.spawner import SpawnedProcess, Spawner

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MS_REMOUNT = 0x2, 0x4, 0x20
MNT_DETACH = 0x2
GRACE_S = 1.0  # the agent enforces wall_s itself; the worker steps in this much later
FULL_BYTES = 64 << 10  # a workspace with less free space than this counts as full


class SandboxError(RuntimeError):
    """The sandbox machinery failed (not the code inside it)."""


class LimitsNotSet(SandboxError):
    """The kernel refused a sandbox's limits (a memory limit below what its group already
    holds): it must not run anything under the limits it had before."""


class Workspace:
    """The sandbox's writable directory on the host. When the worker may mount (root),
    it is a tmpfs of exactly ``workspace_mb``: the kernel enforces the size, and files
    survive a restart of the agent. Otherwise a plain directory whose size is checked
    after each action."""

    def __init__(self, path: Path, *, size_mb: int, uid: int | None, gid: int | None) -> None:
        self.path = path
        self.size_mb = size_mb
        self.uid, self.gid = uid, gid
        self.mounted = False

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=False)
        if os.geteuid() == 0:
            opts = f"size={self.size_mb}m,mode=0755"
            if self.uid is not None:
                opts += f",uid={self.uid},gid={self.gid}"
            rc = _libc.mount(b"tmpfs", str(self.path).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode())
            if rc == 0:
                self.mounted = True
                return
            log.warning(
                "workspace tmpfs mount failed (errno %d): size is checked, not enforced", ctypes.get_errno()
            )
        if self.uid is not None:
            os.chown(self.path, self.uid, self.gid or self.uid)

    def resize(self, size_mb: int) -> None:
        if self.mounted and size_mb != self.size_mb:
            opts = f"size={size_mb}m".encode()
            if (
                _libc.mount(
                    b"tmpfs", str(self.path).encode(), b"tmpfs", MS_REMOUNT | MS_NOSUID | MS_NODEV, opts
                )
                != 0
            ):
                raise SandboxError(f"cannot resize workspace (errno {ctypes.get_errno()})")
        self.size_mb = size_mb

    def used_bytes(self) -> int:
        if self.mounted:
            st = os.statvfs(self.path)
            return (st.f_blocks - st.f_bfree) * st.f_frsize
        total = 0
        for root, _dirs, files in os.walk(self.path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
        return total

    def full(self) -> bool:
        if self.mounted:
            st = os.statvfs(self.path)
            return st.f_bavail * st.f_frsize < FULL_BYTES
        return self.used_bytes() >= self.size_mb * (1 << 20)

    def remove(self) -> None:
        if self.mounted:
            if _libc.umount2(str(self.path).encode(), MNT_DETACH) != 0:
                log.error("workspace %s: umount failed (errno %d)", self.path, ctypes.get_errno())
            self.mounted = False
        shutil.rmtree(self.path, ignore_errors=True)


def _parse_head(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in raw.decode("ascii", "replace").split(";"):
        key, _, value = part.partition("=")
        out[key] = value
    return out


class Reply:
    __slots__ = ("head", "out", "err", "data")

    def __init__(self, head: dict[str, str], out: bytes, err: bytes, data: bytes) -> None:
        self.head, self.out, self.err, self.data = head, out, err, data

    def int(self, key: str) -> int | None:
        v = self.head.get(key)
        return int(v) if v not in (None, "") else None


class Sandbox:
    def __init__(
        self,
        *,
        backend: Backend,
        cgroups: CgroupManager | None,
        limits: SandboxLimits,
        workspace_root: Path,
        run_as: tuple[int, int] | None,
        sandbox_id: str | None = None,
        spawner: Spawner | None = None,
        image: Image | None = None,
        egress_allow_private: bool = False,
        zygote: bool = False,
        egress_private_targets: Sequence[str] = (),
    ) -> None:
        self.id = sandbox_id or uuid.uuid4().hex[:16]
        # A zygote runs each action in namespaces of its own on a fresh workspace (run_fresh);
        # its own workspace stays empty, so it gets the smallest one.
        self.zygote = zygote
        self.workspace_root = workspace_root
        self.egress_allow_private = egress_allow_private
        self.egress_private_targets = list(egress_private_targets)
        self.proxy: EgressProxy | None = None
        # Sessions (ids inside the sandbox's pid namespace) of the services and the proxy
        # forwarder: their processes survive the end of an action.
        self.kept_sessions: set[int] = set()
        self.image = image  # the unpacked root filesystem it runs on (None: the host's /usr)
        self.backend = backend
        self.cgroups = cgroups
        self.limits = limits
        self.run_as = run_as if os.geteuid() == 0 else None
        uid, gid = self.run_as or (None, None)
        ws_mb = 1 if zygote else limits.workspace_mb
        self.workspace = Workspace(workspace_root / self.id, size_mb=ws_mb, uid=uid, gid=gid)
        self.cgroup: Cgroup | None = None
        self.spawner = spawner
        self.proc: asyncio.subprocess.Process | SpawnedProcess | None = None
        self.keep: set[int] = set()
        self.dead = True
        self.destroyed = False
        self.created_at = time.monotonic()
        self.last_used = self.created_at
        self.runs = 0  # fresh runs served (a zygote's)
        # A zygote's resident memory when idle (CgroupManager.resident_bytes after its probe
        # run): what it must come back to after each run.
        self.baseline_bytes: int | None = None
        self._lock = asyncio.Lock()

    # --- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self.workspace.create()
        try:
            if self.cgroups is not None:
                self.cgroup = self.cgroups.create(f"sb-{self.id}")
                self._set_limits(self.limits)
            if self.limits.network is NetworkPolicy.allowlist:
                self.proxy = EgressProxy(
                    self.workspace_root / f"{self.id}.proxy", self.limits.allow,
                    sandbox_id=self.id, allow_private=self.egress_allow_private,
                    private_targets=self.egress_private_targets,
                )  # fmt: skip
                await self.proxy.start()
            await self._spawn()
        except BaseException:
            await self.destroy()
            raise

    def _preexec(self) -> Any:
        join = self.cgroup.join_paths() if self.cgroup else []
        uid, gid = self.run_as if self.run_as is not None else (None, None)
        return lambda: enter_sandbox(join, uid, gid)

    def _seccomp_pipe(self) -> int | None:
        """The read end of a pipe holding the system-call filter, for bwrap to read once."""
        program = self.backend.seccomp_program
        if program is None:
            return None
        read, write = os.pipe()
        try:
            os.write(write, program)  # a few hundred bytes: far below a pipe's buffer
        finally:
            os.close(write)
        return read

    async def _spawn(self) -> None:
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        proxy = self.proxy.path if self.proxy else None
        filter_fd = self._seccomp_pipe()
        spawner = self.spawner if self.spawner is not None and self.spawner.running else None
        try:
            argv = self.backend.agent_argv(
                self.workspace.path, self.limits, self.image, proxy, zygote=self.zygote,
                # The spawner's child gets it as its fd 3; a child of this process, as it is.
                seccomp_fd=None if filter_fd is None else 3 if spawner is not None else filter_fd,
            )  # fmt: skip
            extra = [] if filter_fd is None else [filter_fd]
            if spawner is not None:
                # Forked by the small spawner process, not by this (large) one.
                self.proc = await spawner.spawn(
                    argv,
                    env=env,
                    cwd=str(self.workspace.path),
                    join=self.cgroup.join_paths() if self.cgroup else [],
                    run_as=self.run_as,
                    pass_fds=extra,
                )
            else:
                self.proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.DEVNULL,
                    env=env,
                    cwd=str(self.workspace.path),
                    preexec_fn=self._preexec(),
                    pass_fds=extra,
                )
        finally:
            if filter_fd is not None:
                os.close(filter_fd)
        try:
            ready = await asyncio.wait_for(self._read_reply(), timeout=10)
        except (TimeoutError, asyncio.IncompleteReadError) as e:
            self._hard_kill()
            raise SandboxError(f"sandbox agent did not start ({type(e).__name__})") from e
        # At this instant the group holds only the backend's wrapper and the agent:
        # those are spared when an action's processes are killed.
        self.keep = {self.proc.pid, *(self.cgroup.procs() if self.cgroup else [])}
        self.agent_pid = ready.int("pid")
        forwarder = ready.int("fwd")
        self.kept_sessions = {forwarder} if forwarder is not None else set()
        self.dead = False
        for service in self.limits.services:
            await self._start_service(service)

    def _spare(self, pid: int) -> bool:
        """A process of a kept session (a service, the proxy forwarder), found by its
        session id inside the sandbox's pid namespace (the last ``NSsid`` entry)."""
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("NSsid:"):
                        return int(line.split()[-1]) in self.kept_sessions
        except (OSError, ValueError):
            pass
        return False

    def _kill_rest(self) -> None:
        """Kill what an action left in the cgroup: all but the agent and kept sessions."""
        if self.cgroup is not None:
            self.cgroup.kill_except(self.keep, self._spare if self.kept_sessions else None)

    def _proxy_env(self) -> dict[str, str]:
        if self.proxy is None:
            return {}
        url = f"http://127.0.0.1:{FORWARD_PORT}"
        env = {"HTTP_PROXY": url, "HTTPS_PROXY": url, "NO_PROXY": "localhost,127.0.0.1"}
        return {**env, **{k.lower(): v for k, v in env.items()}}

    async def _start_service(self, service: ServiceSpec) -> None:
        """Start one service in a kept session and wait until its readiness check passes."""
        log_path = f"/tmp/temper-service-{service.name}.log"
        lim = self.limits
        rlimits = {k: v for k, v in self._rlimits(lim.cpu_s).items() if k != "RLIMIT_CPU"}
        env = {**self.backend.base_env(self.workspace.path), **self._proxy_env(), **service.env}
        self._send(
            {"op": "service", "command": service.command, "env": env, "rlimits": rlimits,
             "log": log_path, "cwd": self.backend.inner_workspace(self.workspace.path)}
        )  # fmt: skip
        reply = await asyncio.wait_for(self._read_reply(), timeout=10)
        pid = reply.int("pid")
        if reply.head.get("ok") != "1" or pid is None:
            raise SandboxError(f"service {service.name}: {reply.data.decode('utf-8', 'replace')}")
        self.kept_sessions.add(pid)
        if service.ready_port is not None:
            check = Action(
                kind="run_python",
                code=(
                    "import socket, time\n"
                    "while True:\n"
                    "    try:\n"
                    f"        socket.create_connection(('127.0.0.1', {service.ready_port}), 1).close()\n"
                    "        break\n"
                    "    except OSError:\n"
                    "        time.sleep(0.05)\n"
                ),
                timeout_s=service.ready_timeout_s,
            )
        else:
            check = Action(
                kind="run_command",
                command=f"until (\n{service.ready_command}\n) >/dev/null 2>&1; do sleep 0.1; done",
                timeout_s=service.ready_timeout_s,
            )
        result, _ = await self._exec(check, cpu_s=service.ready_timeout_s)
        if not result.ok:
            log = await self._file_op(Action(kind="read_file", path=log_path))
            tail = (log.content or "")[-2000:]
            raise SandboxError(
                f"service {service.name} was not ready within {service.ready_timeout_s:g} s "
                f"({'port ' + str(service.ready_port) if service.ready_port else 'ready_command'}); "
                f"its output: {tail!r}"
            )

    async def _respawn(self) -> None:
        self._hard_kill()
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=5)
            except TimeoutError:
                pass
            self._release_proc()
        if self.cgroup is not None:
            self.cgroup.kill_except(set())
        await self._spawn()

    def _hard_kill(self, *, cgroup: bool = True) -> None:
        """Kill the whole sandbox, agent included (``cgroup=False``: the caller has
        already killed the cgroup's processes)."""
        self.dead = True
        if cgroup and self.cgroup is not None:
            self.cgroup.kill_except(set())
        if self.proc is not None and self.proc.returncode is None:
            try:
                if isinstance(self.proc, asyncio.subprocess.Process):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
            except (ProcessLookupError, PermissionError):
                pass

    def _release_proc(self) -> None:
        close = getattr(self.proc, "close", None)  # a SpawnedProcess holds a pidfd and pipes
        if close is not None:
            close()

    async def destroy(self) -> int:
        """Destroy the sandbox; returns how many of its processes could not be killed."""
        if self.destroyed:
            return 0
        self.destroyed = True
        if self.cgroup is not None:
            # In a thread: freezing, killing and waiting for the group to thaw sleeps, and
            # would hold up every other sandbox's actions on this event loop.
            await asyncio.to_thread(self.cgroup.kill_except, set())
        self._hard_kill(cgroup=False)
        if self.proc is not None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                await asyncio.wait_for(self.proc.wait(), timeout=5)
            except TimeoutError:
                log.error("sandbox %s: agent did not exit", self.id)
            self._release_proc()
        if self.proxy is not None:
            await self.proxy.close()
        leaked = 0
        if self.cgroup is not None:
            leaked = await asyncio.to_thread(self.cgroup.destroy)
        await asyncio.to_thread(self.workspace.remove)
        return leaked

    async def apply_limits(self, limits: SandboxLimits) -> None:
        """Change a (pooled) sandbox's limits; the network policy and services cannot change."""
        if (limits.network, limits.allow) != (self.limits.network, self.limits.allow):
            raise SandboxError("network access cannot change after a sandbox starts")
        if limits.services != self.limits.services:
            raise SandboxError("services cannot change after a sandbox starts")
        if limits.image != self.limits.image:
            raise SandboxError("the image cannot change after a sandbox starts")
        if self.cgroup is not None and (limits.memory_mb, limits.pids) != (
            self.limits.memory_mb,
            self.limits.pids,
        ):
            self._set_limits(limits)
        if not self.zygote:  # a zygote's runs mount their own workspace of the limits' size
            self.workspace.resize(limits.workspace_mb)
        self.limits = limits

    def _set_limits(self, limits: SandboxLimits) -> None:
        assert self.cgroup is not None
        try:
            self.cgroup.set_limits(memory_bytes=limits.memory_mb << 20, pids=limits.pids)
        except CgroupError as e:
            raise LimitsNotSet(
                f"sandbox {self.id}: memory_mb={limits.memory_mb}, pids={limits.pids}: {e}"
            ) from e

    # --- protocol -------------------------------------------------------------------
    def _max_frame(self) -> int:
        return 2 * self.limits.output_bytes + (self.limits.file_size_mb << 20) + (1 << 20)

    async def _read_reply(self) -> Reply:
        assert self.proc is not None and self.proc.stdout is not None
        stdout = self.proc.stdout
        (n,) = struct.unpack("<I", await stdout.readexactly(4))
        if n > self._max_frame():
            raise SandboxError(f"oversized reply from sandbox agent ({n} bytes)")
        body = await stdout.readexactly(n)
        (hlen,) = struct.unpack_from("<I", body)
        head = _parse_head(body[4 : 4 + hlen])
        pos = 4 + hlen
        sizes = [int(head.get(k) or 0) for k in ("out", "err", "data")]
        parts = []
        for size in sizes:
            parts.append(body[pos : pos + size])
            pos += size
        return Reply(head, *parts)

    def _send(self, req: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        import marshal

        payload = marshal.dumps(req)
        self.proc.stdin.write(struct.pack("<I", len(payload)) + payload)

    # --- actions --------------------------------------------------------------------
    async def act(self, action: Action) -> ExecResult:
        if self.destroyed:
            raise SandboxError(f"sandbox {self.id} is destroyed")
        if self.zygote:
            raise SandboxError("a zygote only runs fresh actions (run_fresh)")
        async with self._lock:
            try:
                if self.dead:
                    await self._respawn()
                if action.kind in ("run_command", "run_python"):
                    return (await self._exec(action))[0]
                return await self._file_op(action)
            finally:
                self.last_used = time.monotonic()

    async def run_fresh(
        self,
        action: Action,
        files: dict[str, bytes],
        fetch: list[str] | tuple[str, ...] = (),
        executable: frozenset[str] = frozenset(),
    ) -> tuple[ExecResult, dict[str, bytes | None]]:
        """On a zygote: run ``action`` in pid, mount and IPC namespaces of its own, on a
        fresh workspace (of the limits' size) holding ``files`` (those in ``executable``
        with mode 0755, the rest 0644) and a fresh ``/tmp``; then read back ``fetch`` (a
        missing file, one outside the workspace or past ``file_size_mb`` in all: None).
        Nothing of one run is visible to the next: its processes die with its pid
        namespace and its files with its mounts."""
        if not self.zygote:
            raise SandboxError("run_fresh needs a zygote")
        if self.destroyed:
            raise SandboxError(f"sandbox {self.id} is destroyed")
        if action.kind not in ("run_command", "run_python"):
            return ExecResult(error=f"a fresh run takes a command or a program, not {action.kind}"), {}
        refused = refuse_files(files, self.limits)
        if refused is not None:
            return refused, {}
        budget = self.limits.file_size_mb << 20
        fresh = {
            "files": files, "fetch": list(fetch), "ws_mb": self.limits.workspace_mb, "fetch_max": budget,
            "shm_mb": shm_mb(self.limits) if self.backend.piece_on(IsolationPiece.dev) else 0,
            "kill": self.backend.piece_on(IsolationPiece.fetch),
            "modes": {path: 0o755 for path in executable if path in files},
        }  # fmt: skip
        async with self._lock:
            try:
                if self.dead:
                    await self._respawn()
                self.runs += 1
                result, reply = await self._exec(action, fresh=fresh)
            finally:
                self.last_used = time.monotonic()
        if reply is not None and reply.head.get("ok") != "1":
            raise SandboxError(f"zygote: {reply.data.decode('utf-8', 'replace')}")
        return result, _parse_fetched(reply.data) if reply is not None else {}

    async def fetch(self, paths: list[str] | tuple[str, ...]) -> dict[str, bytes | None]:
        """Read ``paths`` back from a sandbox's workspace as a zygote run's are: regular
        files inside the workspace reached without a link, at most ``file_size_mb`` in
        all (None for the rest)."""
        if not paths:
            return {}
        async with self._lock:
            if self.dead:
                await self._respawn()
            self._send({"op": "fetch", "paths": list(paths), "max": self.limits.file_size_mb << 20})
            try:
                reply = await asyncio.wait_for(self._read_reply(), timeout=max(5.0, self.limits.wall_s))
            except (TimeoutError, asyncio.IncompleteReadError, SandboxError) as e:
                self._hard_kill()
                raise SandboxError(f"sandbox agent failed to fetch files: {type(e).__name__}") from e
        if reply.head.get("ok") != "1":
            raise SandboxError(f"fetch: {reply.data.decode('utf-8', 'replace')}")
        return _parse_fetched(reply.data)

    def _rlimits(self, cpu_s: float, address_space_mb: int | None = None) -> dict[str, tuple[int, int]]:
        lim = self.limits
        cpu = max(1, math.ceil(cpu_s))
        rl = {
            "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_FSIZE": (lim.file_size_mb << 20, lim.file_size_mb << 20),
            "RLIMIT_NOFILE": (lim.open_files, lim.open_files),
            "RLIMIT_CORE": (0, 0),
        }
        if self.cgroup is None:
            rl["RLIMIT_AS"] = (lim.memory_mb << 20, lim.memory_mb << 20)
        if address_space_mb is not None:
            space = min(address_space_mb, lim.memory_mb) << 20
            rl["RLIMIT_AS"] = (space, space)
        return rl

    async def _exec(
        self, action: Action, cpu_s: float | None = None, fresh: dict[str, Any] | None = None
    ) -> tuple[ExecResult, Reply | None]:
        """Run one command or program; with ``fresh`` (a zygote's run), in namespaces of
        its own. The result, and the agent's reply (None when the agent died)."""
        lim = self.limits
        wall = action.timeout_s or lim.wall_s
        cpu_s = cpu_s or lim.cpu_s
        inner_ws = self.backend.inner_workspace(self.workspace.path)
        env = {**self.backend.base_env(self.workspace.path), **self._proxy_env(), **action.env}
        req: dict[str, Any] = {
            "op": "exec",
            "wall": wall,
            "out_cap": lim.output_bytes,
            "rlimits": self._rlimits(cpu_s, action.address_space_mb),
            "env": env,
            "cwd": os.path.join(inner_ws, action.cwd) if action.cwd else inner_ws,
            "stdin": (action.stdin or "").encode(),
        }
        if action.kind == "run_python":
            req["code"] = action.code or ""
            if action.path:
                req["file"] = action.path
        else:
            cmd = action.command or ""
            req["argv"] = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
            if not req["argv"]:
                return ExecResult(error="empty command"), None
        if fresh is not None:
            req["fresh"] = fresh
        cg = self.cgroup
        if cg is not None:
            cg.reset_peak()
        before = cg.stats() if cg is not None else CgroupStats()
        was_full = fresh is None and self.workspace.full()  # a fresh run's workspace starts empty
        t0 = time.monotonic()
        self._send(req)
        reply, host_reason = await self._await_reply(wall, cpu_s, before, was_full)
        elapsed = time.monotonic() - t0
        after = cg.stats() if cg is not None else CgroupStats()
        if cg is not None and not self.dead:
            # Belt and braces: nothing of the action may outlive it.
            self._kill_rest()
        result = ExecResult(
            wall_s=round(elapsed, 6),
            cpu_s=round(max(0, after.cpu_ns - before.cpu_ns) / 1e9, 6),
            peak_memory_mb=round(after.peak_bytes / (1 << 20), 3),
        )
        sig: int | None = None
        agent_reason = ""
        if reply is None:
            sig = signal.SIGKILL
            result.stderr = (
                "sandbox: the sandbox's agent died; the sandbox will be restarted on its workspace\n"
            )
        else:
            result.stdout = reply.out.decode("utf-8", "replace")
            result.stderr = reply.err.decode("utf-8", "replace")
            result.stdout_truncated = reply.head.get("otr") == "1"
            result.stderr_truncated = reply.head.get("etr") == "1"
            result.exit_code = reply.int("exit")
            took = reply.head.get("took") or reply.head.get("wall")  # a zygote's init times the action itself
            result.exec_s = round(float(took), 6) if took else None
            sig = reply.int("sig")
            agent_reason = reply.head.get("reason", "")
        result.signal = sig
        # A fresh run's workspace is its own mount, inside: the agent says whether it filled.
        full_now = (reply is not None and reply.head.get("full") == "1") if fresh else self.workspace.full()
        result.kill_reason = self._kill_reason(
            before, after, host_reason, agent_reason, sig, result, was_full, full_now
        )
        if result.kill_reason is not None and result.exit_code is None and sig is None:
            result.signal = signal.SIGKILL
        return result, reply

    def _kill_reason(
        self,
        before: CgroupStats,
        after: CgroupStats,
        host_reason: KillReason | None,
        agent_reason: str,
        sig: int | None,
        result: ExecResult,
        was_full: bool,
        full_now: bool,
    ) -> KillReason | None:
        if after.oom_kills > before.oom_kills:
            return KillReason.memory
        if after.pids_max_events > before.pids_max_events:
            return KillReason.pids
        if host_reason is not None:
            return host_reason
        if agent_reason:
            return KillReason(agent_reason)
        # A shell reports a child killed by a signal as exit status 128 + signal.
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and result.cpu_s >= self.limits.cpu_s):
            return KillReason.cpu
        if result.exit_code == 128 + signal.SIGXCPU:
            return KillReason.cpu
        if sig == signal.SIGXFSZ or result.exit_code == 128 + signal.SIGXFSZ:
            return KillReason.disk
        if full_now and (not was_full or sig is not None or result.exit_code != 0):
            # Filled during this action, or failed against a full workspace.
            return KillReason.disk
        if sig is not None:
            return KillReason.signal
        return None

    async def _await_reply(
        self, wall: float, cpu_s: float, before: CgroupStats, was_full: bool
    ) -> tuple[Reply | None, KillReason | None]:
        """Wait for the agent's reply while watching CPU, disk and the clock."""
        task = asyncio.ensure_future(self._read_reply())
        start = time.monotonic()
        deadline = start + wall + GRACE_S
        host_reason: KillReason | None = None
        poll = 0.02
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll)
                if done:
                    try:
                        return task.result(), host_reason
                    except (asyncio.IncompleteReadError, ConnectionError, SandboxError, struct.error):
                        self._hard_kill()
                        return None, host_reason
                poll = min(poll * 2, 0.1)
                now = time.monotonic()
                if host_reason is None and self.cgroup is not None:
                    if (self.cgroup.stats().cpu_ns - before.cpu_ns) / 1e9 > cpu_s:
                        host_reason = KillReason.cpu
                    elif self.workspace.mounted and not was_full and self.workspace.full():
                        host_reason = KillReason.disk
                    if host_reason is not None:
                        self._kill_rest()
                elif (
                    host_reason is None
                    and not was_full
                    and not self.workspace.mounted
                    and now - start > 1
                    and self.workspace.full()
                ):
                    host_reason = KillReason.disk
                    self._hard_kill()
                if now > deadline:
                    if host_reason is None:
                        host_reason = KillReason.timeout
                        if self.cgroup is not None:
                            self._kill_rest()
                        else:
                            self._hard_kill()
                    if now > deadline + 3 * GRACE_S:
                        log.error("sandbox %s: agent unresponsive after a kill; restarting it", self.id)
                        self._hard_kill()
                        task.cancel()
                        return None, host_reason
        finally:
            if not task.done():
                # Cancelled mid-frame: the stream can no longer be trusted.
                task.cancel()
                self._hard_kill()

    async def _file_op(self, action: Action) -> ExecResult:
        t0 = time.monotonic()
        path = action.path or ""
        if action.kind == "write_file":
            if not path:
                return ExecResult(error="write_file needs a path")
            raw = action.content or ""
            data = base64.b64decode(raw) if action.encoding == "base64" else raw.encode()
            if len(data) > self.limits.file_size_mb << 20:
                return ExecResult(error="file larger than file_size_mb", kill_reason=KillReason.disk)
            self._send(
                {"op": "write", "path": path, "data": data, "mode": 0o755 if action.executable else 0o644}
            )
        elif action.kind == "read_file":
            if not path:
                return ExecResult(error="read_file needs a path")
            self._send({"op": "read", "path": path, "max": self.limits.file_size_mb << 20})
        else:
            self._send({"op": "list", "path": path, "recursive": True})
        try:
            reply = await asyncio.wait_for(self._read_reply(), timeout=max(5.0, self.limits.wall_s))
        except (TimeoutError, asyncio.IncompleteReadError, SandboxError) as e:
            self._hard_kill()
            return ExecResult(error=f"sandbox agent failed: {type(e).__name__}", wall_s=time.monotonic() - t0)
        result = ExecResult(wall_s=round(time.monotonic() - t0, 6))
        if reply.head.get("ok") != "1":
            result.error = reply.data.decode("utf-8", "replace")
            if "No space left" in result.error or "File too large" in result.error:
                result.kill_reason = KillReason.disk
            return result
        if action.kind == "read_file":
            result.encoding = action.encoding
            if action.encoding == "base64":
                result.content = base64.b64encode(reply.data).decode()
            else:
                result.content = reply.data.decode("utf-8", "replace")
            result.stdout_truncated = reply.head.get("dtr") == "1"
        elif action.kind == "list_files":
            files = []
            for entry in reply.data.decode("utf-8", "replace").split("\0") if reply.data else []:
                meta, _, rel = entry.partition("\t")
                files.append(FileInfo(path=rel, size=int(meta[1:] or 0), is_dir=meta[:1] == "d"))
            result.files = files
        return result


def refuse_files(files: dict[str, bytes], limits: SandboxLimits) -> ExecResult | None:
    """The error result for files a one-shot run cannot start with (a path that is not
    relative and inside the workspace, or a file past ``file_size_mb``), or None."""
    for path, data in files.items():
        norm = os.path.normpath(path)
        if not path or os.path.isabs(path) or norm == "." or norm.startswith(".."):
            return ExecResult(error=f"{path!r}: a file path must be relative and inside the workspace")
        if len(data) > limits.file_size_mb << 20:
            return ExecResult(error=f"{path!r}: larger than file_size_mb", kill_reason=KillReason.disk)
    return None


def _parse_fetched(data: bytes) -> dict[str, bytes | None]:
    """The agent's fetched-files records (``u32 name length, name, i32 size, bytes``; a
    negative size: missing, outside the workspace or over the budget)."""
    fetched: dict[str, bytes | None] = {}
    pos = 0
    try:
        while pos < len(data):
            (n,) = struct.unpack_from("<I", data, pos)
            name = data[pos + 4 : pos + 4 + n].decode("utf-8", "surrogateescape")
            (size,) = struct.unpack_from("<i", data, pos + 4 + n)
            pos += 8 + n
            if pos + max(size, 0) > len(data):
                raise struct.error("record past the end")
            fetched[name] = data[pos : pos + size] if size >= 0 else None
            pos += max(size, 0)
    except struct.error as e:
        raise SandboxError(f"malformed fetched files from the sandbox agent: {e}") from e
    return fetched
