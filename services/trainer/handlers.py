"""Typed bus handlers of the trainer, one per topic it consumes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from services.trainer.training import JobTrainer
from temper.events import Topics, TrajectoryReady


def topics(training: JobTrainer) -> dict[str, Callable[[Any], Awaitable[None]]]:
    async def on_trajectory(message: TrajectoryReady) -> None:
        # buffer it durably (a ledger row) and wake the training loop; a redelivery is a no-op
        await training.receive(message)

    return {Topics.TRAJECTORIES: on_trajectory}
