"""The services as components of one process (``temper run``, ``temper serve``): the one
list of what runs, in the order it starts (the executors before the dispatcher that feeds
them), and the settings every service needs when they share a process. Start and stop them
with :func:`temper.runtime.started` (or the dispatcher app's lifespan), which stops what
started, in reverse, when anything fails."""

from __future__ import annotations

from services.dispatcher.component import Dispatcher
from services.inference_gateway.component import Gateway
from services.reward_scorer.component import RewardScorer
from services.sandbox_worker.component import SandboxWorkerComponent
from services.tracker.component import TrackerComponent
from services.trainer.component import Trainer
from temper.runtime import Component, Runtime
from temper.settings import Settings


def executors(runtime: Runtime) -> list[Component]:
    """The services beside the dispatcher, in the order they start (before it): those it feeds,
    and the tracker, which logs the jobs that ask for it from the ``events`` topic."""
    return [
        SandboxWorkerComponent(runtime),
        Gateway(runtime),
        RewardScorer(runtime),
        Trainer(runtime),
        TrackerComponent(runtime),
    ]


def components(runtime: Runtime) -> list[Component]:
    """Every service, the dispatcher last."""
    return [*executors(runtime), Dispatcher(runtime)]


def in_one_process(
    settings: Settings, *, scheduler_interval_s: float, reaper_interval_s: float | None = None
) -> Settings:
    """``settings`` for all services in one process: one outbox relay, the dispatcher's (a
    second relay on the same SQLite table would publish rows twice), and the scheduler (and
    the lease reaper) ticking at least this often (one machine's jobs: tick quickly rather
    than save queries)."""
    dispatcher = settings.dispatcher
    ticks = {"scheduler_interval_s": min(dispatcher.scheduler_interval_s, scheduler_interval_s)}
    if reaper_interval_s is not None:
        ticks["reaper_interval_s"] = min(dispatcher.reaper_interval_s, reaper_interval_s)
    return settings.model_copy(
        update={
            "trainer": settings.trainer.model_copy(update={"run_relay": False}),
            "dispatcher": dispatcher.model_copy(update=ticks),
        }
    )
