"""The fork server's own program, and the steps every sandbox process takes before exec.

This file runs as a script (``python3 -S fork_server.py FD``, started by
:class:`temper.sandbox.spawner.Spawner`), so it imports nothing but the standard library
and starts in a few milliseconds. The worker imports :func:`enter_sandbox` from it for
the path without a fork server (``preexec_fn``), so the cgroup join and the uid drop are
written once.

The protocol: the worker sends a ``marshal``-ed request over a SOCK_SEQPACKET socket with
the child's stdin, stdout and stderr, and any further fds the child gets as 3, 4, …, as
``SCM_RIGHTS``; ``{"op": "spawn", argv, env, cwd, join, uid, gid}`` answers ``{"pid": N}``
with a pidfd, ``{"op": "ping"}`` answers
``{"ok": 1}``. When the socket closes (the worker is gone) every child's process group is
killed and the server exits.
"""

from __future__ import annotations

import _signal as signal  # not ``signal``: its enum wrappers cost startup time here
import array
import marshal
import os
import select
import socket
import sys

children: set[int] = set()


def enter_sandbox(join: list[str], uid: int | None, gid: int | None) -> None:
    """In a forked child, before exec: join the sandbox's cgroups (while still
    privileged), start a new session, then drop to the sandbox's uid and gid."""
    for path in join:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    os.setsid()
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)


def _child(req: dict, fds: list[int]) -> None:
    try:
        # The fds received are numbered above every fd this server opened itself (3-5),
        # so duplicating them down to 0, 1, 2, 3… clobbers none not yet duplicated.
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        os.closerange(len(fds), 65536)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        enter_sandbox(req["join"], req["uid"], req["gid"])
        os.chdir(req["cwd"])
        os.execve(req["argv"][0], req["argv"], req["env"])
    except BaseException as e:
        try:
            os.write(2, f"spawner: {e!r}\n".encode())
        finally:
            os._exit(127)


def _shutdown() -> None:
    for pid in list(children):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)


def _receive(sock: socket.socket) -> tuple[bytes, array.array]:
    msg, anc, _flags, _addr = sock.recvmsg(1 << 20, socket.CMSG_SPACE(8 * 4), socket.MSG_CMSG_CLOEXEC)
    fds = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, fds


def _handle(req: dict, fds: list[int]) -> tuple[dict, list[int]]:
    if req.get("op") != "spawn":
        return {"ok": 1}, []
    try:
        pid = os.fork()
    except OSError as e:
        return {"error": f"fork failed: {e!r}"}, []
    if pid == 0:
        _child(req, fds)
    children.add(pid)
    pidfd = os.pidfd_open(pid)  # before any reaping: the pid is still ours
    return {"pid": pid}, [pidfd]


def main(sock_fd: int) -> None:
    sock = socket.socket(fileno=sock_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *a: _shutdown())
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for fd, _ev in poller.poll():
            if fd == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                _reap()
                continue
            try:
                msg, fds = _receive(sock)
            except InterruptedError:
                continue
            except OSError:
                _shutdown()
            if not msg:
                _shutdown()  # the worker is gone
            reply, send = _handle(marshal.loads(msg), list(fds))
            for passed in fds:
                os.close(passed)
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", send))] if send else []
            sock.sendmsg([marshal.dumps(reply)], anc)
            for sent in send:
                os.close(sent)


if __name__ == "__main__":
    main(int(sys.argv[1]))
