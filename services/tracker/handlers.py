"""Typed bus handlers of the tracker, one per topic it consumes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temper.events import LifecycleEvent, Topics
from temper.tracking import Tracker


def topics(tracker: Tracker) -> dict[str, Callable[[Any], Awaitable[None]]]:
    async def on_event(message: LifecycleEvent) -> None:
        # raises TrackingUnavailable while a tracking server is down: the bus keeps the
        # record uncommitted and retries it with backoff, so nothing queued is lost
        await tracker.handle(message)

    return {Topics.EVENTS: on_event}
