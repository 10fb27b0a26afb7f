"""Group commit: calls that arrive while a transaction runs wait and go through the next
one together.

A service handing over work one call at a time (a bus handler per record) pays a
transaction's fixed cost (begin, the reads, one write per table, commit) for each call.
:class:`GroupCommit` lets the calls that arrive while a transaction runs queue up and go
through the next one together, up to ``max_batch`` items, with at most as many
transactions at a time as its ``slots`` allow.

What each caller sees is what it would see alone: its call returns once the transaction
that took its items committed. If a merged transaction fails, each caller's items run
again on their own, so an item that makes a transaction fail fails only its own call,
and an outage reaches every caller as the outage it is. Items of one key (an episode)
never meet in one transaction: a call whose key is already in the batch waits for the
next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Call(Generic[T]):
    items: list[T]
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class GroupCommit(Generic[T]):
    """``handle`` takes a list of items in one transaction, all or nothing; ``key`` says
    which items may not share one. ``slots`` (shared between instances that write the same
    tables, or ``parallel`` of its own) bounds the transactions running at once."""

    def __init__(
        self,
        handle: Callable[[list[T]], Awaitable[None]],
        *,
        key: Callable[[T], Hashable],
        max_batch: int = 256,
        slots: asyncio.Semaphore | None = None,
        parallel: int = 2,
    ) -> None:
        self.handle = handle
        self.key = key
        self.max_batch = max_batch
        self._slots = slots or asyncio.Semaphore(parallel)
        self._queue: list[_Call[T]] = []
        self._draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def take(self, items: Sequence[T]) -> None:
        """Take ``items`` (of distinct keys) with whatever else is waiting; returns once
        they are committed, or raises what handling them alone raised."""
        if not items:
            return
        call: _Call[T] = _Call(list(items))
        self._queue.append(call)
        if not self._draining:
            self._draining = True
            self._spawn(self._drain())
        await call.done

    async def close(self) -> None:
        """Wait for the transactions under way (the callers have stopped handing over)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        queue = self._queue
        try:
            while queue:
                await self._slots.acquire()
                batch: list[_Call[T]] = []
                keys: set[Hashable] = set()
                size = 0
                rest: list[_Call[T]] = []
                for call in queue:
                    ids = {self.key(item) for item in call.items}
                    if batch and (ids & keys or size + len(call.items) > self.max_batch):
                        rest.append(call)
                        continue
                    batch.append(call)
                    keys |= ids
                    size += len(call.items)
                queue[:] = rest
                self._spawn(self._run(batch))
        finally:
            self._draining = False

    async def _run(self, batch: list[_Call[T]]) -> None:
        try:
            try:
                await self.handle([item for call in batch for item in call.items])
            except Exception:  # noqa: BLE001 - each call again on its own, below
                if len(batch) == 1:
                    raise
                for call in batch:
                    await self._alone(call)
            else:
                for call in batch:
                    if not call.done.done():
                        call.done.set_result(None)
        except BaseException as exc:
            for call in batch:
                if not call.done.done():
                    call.done.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._slots.release()

    async def _alone(self, call: _Call[T]) -> None:
        # a caller cancelled while it waited (a consumer stopping) has a done future: its
        # items still run (taking them is idempotent), the future is left alone
        try:
            await self.handle(call.items)
        except Exception as exc:  # noqa: BLE001 - the caller's own error, raised in its call
            if not call.done.done():
                call.done.set_exception(exc)
        else:
            if not call.done.done():
                call.done.set_result(None)
