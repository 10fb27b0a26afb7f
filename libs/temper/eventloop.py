"""The event loop Temper's long-running processes run on.

Services (``python -m services.<name>``), ``temper run``, ``temper serve`` and the trainer's
follower run on uvloop, libuv's loop: the loop uvicorn itself picks when it is installed.
A dispatcher turn costs less CPU on it than on the standard library's selector loop
(`make bench-dispatch`, 4.45 -> 3.82 ms measured). ``TEMPER_EVENT_LOOP=asyncio`` runs the standard
library's loop instead (for a debugger or a profiler that expects it); any other value
is refused (:class:`UnknownEventLoop`, which the entry points print as one line).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

CHOICES = ("uvloop", "asyncio")


class UnknownEventLoop(ValueError):
    """``TEMPER_EVENT_LOOP`` names no loop Temper runs on."""


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the loop ``TEMPER_EVENT_LOOP`` names (default uvloop); None for the
    standard library's."""
    choice = os.environ.get("TEMPER_EVENT_LOOP", "uvloop")
    if choice not in CHOICES:
        raise UnknownEventLoop(f"TEMPER_EVENT_LOOP={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the chosen loop."""
    try:
        factory = loop_factory()
    except UnknownEventLoop:
        main.close()  # never started: no "was never awaited" warning after the one-line error
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
