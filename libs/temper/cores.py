"""The machine's cores, shared by the torch compute loops of one process.

In embedded mode one process both generates (the CPU engine's decoding thread) and trains
(the trainer's steps, in a worker thread). Two busy torch thread pools on the same cores
slow each other down several times, so each loop used half the cores for the whole run,
and whenever one waited on the other (the staleness gate, scoring between an iteration's
generation and its training) half the machine sat idle.

:class:`CoreShare` gives each loop all the cores while it computes alone and an equal
share while several do. A loop marks itself busy while it has work under way
(:meth:`CoreShare.busy`) and calls :func:`fit` before each unit of work (a decoded token,
a micro-batch): torch's intra-op thread count is per OS thread under OpenMP, so ``fit``
sets the calling thread's own count and nobody else's. A loop that starts while another
holds every core shares them from the other's next unit on.

Off (``fit`` does nothing) unless :func:`share` was called: the distributed services run
one loop per process and keep ``torch.set_num_threads`` as their settings give it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


def half() -> int:
    """Half the machine's cores (at least one): what each of two busy loops gets."""
    return max(1, (os.cpu_count() or 2) // 2)


class CoreShare:
    def __init__(self, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"a core share needs at least one core, got {cores}")
        self.cores = cores
        self._busy: dict[str, int] = {}  # role -> nested busy marks
        self._lock = threading.Lock()
        self._mine = threading.local()  # the thread count this thread last set

    def threads(self) -> int:
        """The threads a busy loop gets now: every core alone, an equal share (at least one) with others."""
        with self._lock:
            loops = sum(1 for n in self._busy.values() if n > 0)
        return max(1, self.cores // max(1, loops))

    def set_busy(self, role: str, busy: bool) -> None:
        """Mark ``role`` busy or idle (a loop whose work spans calls: the engine's batch)."""
        with self._lock:
            self._busy[role] = 1 if busy else 0

    @contextmanager
    def busy(self, role: str) -> Iterator[None]:
        """``role`` busy for the block, and the calling thread fitted to its share."""
        with self._lock:
            self._busy[role] = self._busy.get(role, 0) + 1
        try:
            self.fit()
            yield
        finally:
            with self._lock:
                self._busy[role] -= 1

    def fit(self) -> int:
        """Set the calling thread's torch threads to the share now; returns it."""
        n = self.threads()
        if getattr(self._mine, "threads", None) != n:
            import torch

            torch.set_num_threads(n)
            self._mine.threads = n
        return n


_SHARE: CoreShare | None = None


def share(cores: int) -> CoreShare:
    """Share ``cores`` among this process's compute loops from now on."""
    global _SHARE  # noqa: PLW0603 - one share per process, set up by the embedded runner
    _SHARE = CoreShare(cores)
    return _SHARE


def unshare() -> None:
    global _SHARE  # noqa: PLW0603
    _SHARE = None


def fit() -> None:
    """Before a unit of work: this thread's torch threads to its share (nothing when off)."""
    if _SHARE is not None:
        _SHARE.fit()


def set_busy(role: str, busy: bool) -> None:
    if _SHARE is not None:
        _SHARE.set_busy(role, busy)


def run_busy(role: str, call: Callable[..., T], *args: object) -> T:
    """``call(*args)`` with ``role`` busy (for :func:`asyncio.to_thread`: in the worker thread)."""
    if _SHARE is None:
        return call(*args)
    with _SHARE.busy(role):
        return call(*args)
