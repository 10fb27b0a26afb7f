"""Typed bus handlers of the trainer, one per topic it consumes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from temper.events import Topics

if TYPE_CHECKING:
    from services.trainer.component import Trainer


def topics(trainer: Trainer) -> dict[str, Callable[[Any], Awaitable[None]]]:
    # Trainer.handle(message: TrajectoryReady): buffer it durably (a ledger row), wake the loop.
    return {Topics.TRAJECTORIES: trainer.handle}
