"""Zygotes: long-lived sandboxes that give each one-shot run namespaces of its own.

A fresh bwrap sandbox per run costs a bwrap start, an interpreter start, a cgroup and a
workspace mount (about 15-20 ms of CPU on a 2-core machine), which caps one-shot runs
(``POST /run_code``, scoring) near 50-100 per second. A zygote is a sandbox started once
with ``CAP_SYS_ADMIN`` of its own user namespace (nothing on the host). For each run its
agent forks a child that unshares new pid, mount and IPC namespaces; that namespace's
init mounts a fresh tmpfs workspace, a fresh ``/tmp``, its own ``/proc``, ``/dev/shm``
and ``/dev/pts``, writes the run's files, and forks the action, which drops every
capability (ambient, bounding, effective, permitted, inheritable) and sets
``no_new_privs`` before it runs. When the action exits, the init kills what is left in
its pid namespace, reports the action's status and the fetched files, and exits. So each
run gets a process tree, workspace, ``/tmp``, ``/proc``, shared memory, ptys and SysV/POSIX
IPC that no other run used or can see, for two forks and five mounts.

What runs share: the zygote's read-only root and read-only ``/dev`` (device nodes and
links no run can change), its system-call filter, its network namespace (only a
loopback; one run at a time per zygote, and the sockets of a run close with its
processes) and its cgroup, whose memory and pids limits are set for each run (a limit the
kernel refuses replaces the zygote) and whose peak is reset before it. A zygote serves one
run at a time; the pool holds up to ``zygotes`` of them, and replaces one after
``zygote_max_runs`` runs, when its memory does not come back to its idle baseline, or when
its agent died (``temper_sandbox_zygote_recycles_total{reason}``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from temper.sandbox.sandbox import Sandbox, SandboxError

log = logging.getLogger(__name__)


class ZygoteUnsupported(SandboxError):
    """This host does not let a zygote make namespaces (its probe run failed)."""


class ZygotePool:
    """Up to ``size`` zygotes, each lent to one run at a time; started on first need, and
    in the background to replace one that was recycled."""

    def __init__(self, size: int, start: Callable[[], Awaitable[Sandbox]]) -> None:
        self.size = size
        self._start = start
        self._idle: list[Sandbox] = []
        self._slots = asyncio.Semaphore(size)
        self._all: set[Sandbox] = set()
        self._starting = 0  # replacements being started in the background
        self.broken: str | None = None  # why zygotes cannot run on this host, once known
        self.closed = False

    @property
    def started(self) -> int:
        return len(self._all)

    async def take(self, *, fresh: bool = False) -> Sandbox:
        """An idle zygote (unless ``fresh``), or a new one; waits while ``size`` runs hold
        one each. Raises SandboxError when none could start (ZygoteUnsupported, remembered
        in ``broken``, when this host cannot run zygotes at all)."""
        await self._slots.acquire()
        try:
            while self._idle and not fresh:
                zygote = self._idle.pop()
                if not zygote.destroyed:
                    return zygote
                self._all.discard(zygote)
            zygote = await self._start()
        except BaseException as e:
            self._slots.release()
            if isinstance(e, ZygoteUnsupported):
                self.broken = str(e)
            raise
        self._all.add(zygote)
        return zygote

    def give_back(self, zygote: Sandbox, *, recycle: bool = False) -> Sandbox | None:
        """Return a zygote after its run; returns it when it must be destroyed instead
        (``recycle``, the pool is closed or over its size, or it is already destroyed)."""
        self._slots.release()
        if recycle or self.closed or zygote.destroyed or len(self._all) > self.size:
            self._all.discard(zygote)
            return zygote
        self._idle.append(zygote)
        return None

    async def replenish(self) -> Sandbox | None:
        """Start one zygote ahead of need, if the pool is below its size (after a recycle).
        Returns a zygote the caller must destroy (the pool closed meanwhile), else None."""
        if self.closed or self.broken or len(self._all) + self._starting >= self.size:
            return None
        self._starting += 1
        try:
            zygote = await self._start()
        except ZygoteUnsupported as e:
            self.broken = str(e)
            raise
        finally:
            self._starting -= 1
        if self.closed:
            return zygote
        self._all.add(zygote)
        self._idle.append(zygote)
        return None

    def drain(self) -> list[Sandbox]:
        """Close the pool: every zygote it holds, for the caller to destroy."""
        self.closed = True
        doomed = list(self._all)
        self._all.clear()
        self._idle.clear()
        return doomed
