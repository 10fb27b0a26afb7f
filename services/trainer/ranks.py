"""The trainer's ranks under ``torchrun``: rank 0 is the service (Kafka, the ledger,
publishing), the other ranks follow it (:mod:`services.trainer.follower`).

Rank 0 opens every collective operation with a command broadcast to all ranks
(``broadcast_object_list``: the command's name and its arguments, e.g. the batch of
trajectories of a step); then every rank runs the same learner call, whose collectives
(FSDP's gathers, the gradient reduce, DCP's save) meet in the same order. Commands go
one at a time (:meth:`Ranks.turn`). With one process (no ``torchrun``, or
``--nproc-per-node 1``) nothing is broadcast and the trainer is the single-process one.

A rank that dies fails the collective on the others; the trainer then exits instead of
carrying on (a half-done step must not be recorded), and ``torchrun --max-restarts``
starts every rank again from the last published version. The buffered ledger rows are
trained again, once in the surviving history.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import torch

from temper.logs import log_event
from temper.training.distributed import world_from_env

log = logging.getLogger("temper.trainer")

KEEPALIVE_S = 60.0  # an idle rank 0 pings the others, well inside the collectives' timeout
COLLECTIVE_TIMEOUT_S = 600.0


class Ranks:
    """This process's rank and the world size; on rank 0, the sender of commands."""

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world
        self._lock = asyncio.Lock()
        self._last_sent = time.monotonic()

    @classmethod
    def from_env(cls) -> Ranks:
        rank, world, _ = world_from_env()
        return cls(rank, world)

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def init(self, device: torch.device) -> torch.device:
        """Join the process group (blocks until every rank has); this rank's device."""
        from temper.training.distributed import init

        return init(device, timeout_s=COLLECTIVE_TIMEOUT_S)

    # --- rank 0 -------------------------------------------------------------------------

    @asynccontextmanager
    async def turn(self, op: str, args: dict[str, Any]) -> AsyncIterator[None]:
        """Send command ``op`` to every rank, then run the body (this rank's share of it),
        alone. A failed collective (a rank died) ends this process."""
        async with self._lock:
            try:
                await asyncio.to_thread(self._broadcast, [op, args])
                yield
            except Exception as exc:
                if collective_failed(exc):
                    self.abort(exc)
                raise

    async def keepalive(self) -> None:
        """Ping the other ranks when no command has gone for a while (their wait for the
        next command is a collective, with a timeout)."""
        if self.sharded and time.monotonic() - self._last_sent > KEEPALIVE_S:
            async with self.turn("ping", {}):
                pass

    def stop(self, wait_s: float = 5.0) -> None:
        """Tell the other ranks to exit (they may be gone already: do not wait long)."""
        if not self.sharded:
            return

        def send() -> None:
            try:
                self._broadcast(["stop", {}])
            except Exception as exc:  # noqa: BLE001 - torchrun is stopping them all anyway
                log_event(log, "the other ranks are gone", rank=self.rank, error=repr(exc)[:200])

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        sender.join(wait_s)

    def _broadcast(self, command: list[Any]) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list(command, src=0)
        self._last_sent = time.monotonic()

    def abort(self, exc: BaseException) -> None:
        log_event(log, "a rank failed; exiting for torchrun to restart every rank", logging.ERROR,
                  rank=self.rank, world=self.world, error=repr(exc)[:300])  # fmt: skip
        logging.shutdown()
        os._exit(3)

    # --- the other ranks ----------------------------------------------------------------

    def receive(self) -> tuple[str, dict[str, Any]]:
        """The next command from rank 0 (blocks)."""
        import torch.distributed as dist

        command: list[Any] = [None, None]
        dist.broadcast_object_list(command, src=0)
        return command[0], command[1]


def collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (a peer gone, a timeout), not a bad batch."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    # gloo raises plain RuntimeErrors whose message names its sources (…/gloo/transport/…);
    # an object store's or database's timeout must stay a retried publish, not an exit
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in ("gloo", "nccl"))
