"""A fork server for sandbox starts.

Starting a sandbox means fork + exec of ``bwrap``. Forked from the worker (a Python
process of 50+ MB with a ``preexec_fn``, so no ``vfork``) that fork alone costs several
milliseconds of page-table copying and copy-on-write faults, in the worker, beside the
actions it is running. The spawner is a small ``python3 -S`` process started once per
sandbox manager: the worker sends it a request (argv, environment, working directory,
cgroups to join, uid/gid) with the child's stdin/stdout pipe ends over a Unix socket
(``SCM_RIGHTS``); it forks (cheap: it is small), the child joins the cgroups, starts a new
session, drops to the sandbox uid and execs; the spawner answers with the pid and a
pidfd for it. The worker watches the process through the pidfd (exit, and ``kill``
without the risk of a recycled pid); the spawner reaps it.

If the worker dies, the spawner sees the socket close, kills every process it started
and exits; if the spawner dies, ``bwrap --die-with-parent`` takes the sandboxes with it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import marshal
import os
import select
import signal
import socket
from pathlib import Path
from typing import Any

from temper.sandbox.sandbox import SandboxError

log = logging.getLogger(__name__)

# Run as a script with the standard library only; see its docstring for the protocol.
FORK_SERVER = Path(__file__).with_name("fork_server.py")


async def _readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class SpawnedProcess:
    """What :class:`temper.sandbox.sandbox.Sandbox` needs of a process it did not fork:
    ``pid``, ``stdin``/``stdout`` streams, ``returncode`` (-1 once it has exited: the
    spawner reaps it, so the status itself is not known here), ``wait()``, ``kill()``."""

    def __init__(
        self,
        pid: int,
        pidfd: int,
        stdin: asyncio.StreamWriter,
        stdout: asyncio.StreamReader,
        out_transport: Any,
    ) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.stdin = stdin
        self.stdout = stdout
        self._out_transport = out_transport
        self._returncode: int | None = None
        self._exited: asyncio.Future[None] | None = None

    @property
    def returncode(self) -> int | None:
        if self._returncode is None and self.pidfd >= 0:
            p = select.poll()
            p.register(self.pidfd, select.POLLIN)
            if p.poll(0):
                self._returncode = -1
        return self._returncode

    async def wait(self) -> int:
        if self.returncode is not None:
            return self._returncode  # type: ignore[return-value]
        loop = asyncio.get_running_loop()
        if self._exited is None:
            fut: asyncio.Future[None] = loop.create_future()
            self._exited = fut

            def exited() -> None:
                loop.remove_reader(self.pidfd)
                if not fut.done():
                    fut.set_result(None)

            loop.add_reader(self.pidfd, exited)
        await asyncio.shield(self._exited)
        self._returncode = -1
        return -1

    def kill(self) -> None:
        """SIGKILL through the pidfd: never a recycled pid."""
        if self.pidfd < 0:
            return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)

    def close(self) -> None:
        """Release the pipes and the pidfd (after the process is gone)."""
        with contextlib.suppress(Exception):
            self.stdin.close()
        with contextlib.suppress(Exception):
            self._out_transport.close()
        if self.pidfd >= 0:
            if self._exited is not None and not self._exited.done():
                asyncio.get_running_loop().remove_reader(self.pidfd)
                self._exited.cancel()
            os.close(self.pidfd)
            self.pidfd = -1


class Spawner:
    """The worker's end of the fork server."""

    def __init__(self, python: str) -> None:
        self.python = python
        self._proc: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._lock = asyncio.Lock()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                self.python, "-S", str(FORK_SERVER), str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
            )  # fmt: skip
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        reply, _ = await self._call({"op": "ping"}, [])
        if reply.get("ok") != 1:
            raise SandboxError(f"sandbox spawner did not answer: {reply}")

    async def stop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                await asyncio.wait_for(self._proc.wait(), 5)
            except TimeoutError:
                self._proc.kill()
                try:  # bounded: a worker that cannot stop says so rather than hanging
                    await asyncio.wait_for(self._proc.wait(), 5)
                except TimeoutError:
                    log.error("sandbox spawner pid %d survived SIGKILL for 5 s", self._proc.pid)
            self._proc = None

    async def _call(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        sock = self._sock
        if sock is None or not self.running:
            raise SandboxError("the sandbox spawner is not running")
        loop = asyncio.get_running_loop()
        async with self._lock:
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
            sock.sendmsg([marshal.dumps(request)], anc)
            while True:
                try:
                    msg, anc_in, _flags, _addr = sock.recvmsg(
                        65536, socket.CMSG_SPACE(4 * 4), socket.MSG_CMSG_CLOEXEC
                    )
                    break
                except BlockingIOError:
                    await _readable(loop, sock.fileno())
        received = array.array("i")
        for level, kind, data in anc_in:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received.frombytes(data[: len(data) - len(data) % received.itemsize])
        if not msg:
            for fd in received:
                os.close(fd)
            raise SandboxError("the sandbox spawner exited")
        return marshal.loads(msg), list(received)

    async def spawn(
        self,
        argv: list[str],
        *,
        env: dict[str, str],
        cwd: str,
        join: list[str],
        run_as: tuple[int, int] | None,
        pass_fds: list[int] | tuple[int, ...] = (),
    ) -> SpawnedProcess:
        """Start ``argv`` with a pipe on its stdin and stdout (stderr to /dev/null) and
        ``pass_fds`` as its fds 3, 4, … (the caller still owns and closes them)."""
        if len(pass_fds) > 5:
            raise ValueError("the spawner passes at most 8 fds")
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        null = os.open(os.devnull, os.O_RDWR)
        request = {
            "op": "spawn", "argv": argv, "env": env, "cwd": cwd, "join": join,
            "uid": run_as[0] if run_as else None, "gid": run_as[1] if run_as else None,
        }  # fmt: skip
        try:
            reply, fds = await self._call(request, [in_r, out_w, null, *pass_fds])
        except BaseException:
            os.close(in_w)
            os.close(out_r)
            raise
        finally:
            for fd in (in_r, out_w, null):
                os.close(fd)
        if "pid" not in reply or not fds:
            os.close(in_w)
            os.close(out_r)
            for fd in fds:
                os.close(fd)
            raise SandboxError(f"sandbox spawner: {reply.get('error', 'no pid')}")
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=2**16, loop=loop)
        out_transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(out_r, "rb", buffering=0)
        )
        in_transport, in_protocol = await loop.connect_write_pipe(
            asyncio.streams.FlowControlMixin, os.fdopen(in_w, "wb", buffering=0)
        )
        writer = asyncio.StreamWriter(in_transport, in_protocol, None, loop)
        return SpawnedProcess(reply["pid"], fds[0], writer, reader, out_transport)
