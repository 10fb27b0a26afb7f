"""Backpressure: the request consumer is paused while no backend has room, so the backlog
stays in Kafka, and resumed as soon as a slot frees (or a backend comes back up)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from temper.bus import Consumer


class RequestFlow:
    """Pauses and resumes ``consumer`` (set once it is subscribed) by ``has_capacity``."""

    def __init__(self, has_capacity: Callable[[], bool], *, interval_s: float = 0.02) -> None:
        self.has_capacity = has_capacity
        self.interval_s = interval_s
        self.consumer: Consumer | None = None
        self.changed = asyncio.Event()  # set when a request finished: room may have freed
        self.pauses = 0

    @property
    def paused(self) -> bool:
        return bool(self.consumer and self.consumer.paused)

    def sync(self) -> None:
        """Pause the request consumer while no backend has room; resume when one has."""
        c = self.consumer
        if c is None:
            return
        has = self.has_capacity()
        if not has and not c.paused:
            c.pause()
            self.pauses += 1
        elif has and c.paused:
            c.resume()

    async def run(self) -> None:
        # Resume on a finished request at once; poll too, for backends that come back up.
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), self.interval_s)
            self.changed.clear()
            self.sync()
