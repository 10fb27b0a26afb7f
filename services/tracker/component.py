"""The tracker as a component on the shared :class:`temper.runtime.Runtime`: the
:class:`temper.tracking.Tracker` and its consumer of the ``events`` topic, in a consumer
group of its own (``tracker``), so its offsets move only past what it logged and a
tracking server that is down holds back nothing but the tracker."""

from __future__ import annotations

from services.tracker import handlers
from temper.bus import Consumer
from temper.runtime import Runtime
from temper.tracking import Tracker

GROUP = "tracker"


class TrackerComponent:
    """After ``start()``, ``tracker`` is the :class:`Tracker`."""

    def __init__(self, runtime: Runtime, *, group: str = GROUP) -> None:
        self.runtime = runtime
        self.group = group
        self._tracker: Tracker | None = None
        self.consumer: Consumer | None = None

    @property
    def tracker(self) -> Tracker:
        assert self._tracker is not None, "the tracker is not started"
        return self._tracker

    async def start(self) -> None:
        rt = self.runtime
        if rt.db is None or rt.bus is None:
            raise RuntimeError("TrackerComponent needs a started Runtime with a database and a bus")
        tracking = rt.settings.tracking
        self._tracker = Tracker(
            rt.db,
            wandb_dir=tracking.wandb_dir or rt.settings.data_dir / "wandb",
            wandb_flush_s=tracking.wandb_flush_s,
            wandb_end_grace_s=tracking.wandb_end_grace_s,
        )
        self.consumer = await rt.consume_handlers(handlers.topics(self._tracker), group=self.group)

    async def stop(self) -> None:
        if self.consumer is not None:
            await self.consumer.stop()
            self.consumer = None
        if self._tracker is not None:
            await self._tracker.aclose()
