"""The dispatcher's episode state machine as one component: consumers of the result topics and of
``policy.updates``, the outbox relay, the scheduler loop and the lease reaper.

``app.py`` builds it on the service's :class:`temper.runtime.Runtime`::

    dispatcher = Dispatcher(runtime)
    await runtime.start(); await dispatcher.start()
    ...
    await dispatcher.stop(); await runtime.stop()

Several replicas may run at once: results are partitioned by episode id, each job's
scheduler has one leader (``leader.py``), and the reaper's row locks keep
two replicas from retrying the same step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from services.dispatcher import handlers
from services.dispatcher.batches import ResultBatches
from services.dispatcher.episodes import EpisodeMachine
from services.dispatcher.leader import Leadership
from services.dispatcher.scheduler import Scheduler
from temper.bus import Consumer
from temper.episode_steps import archive_finished
from temper.logs import log_event
from temper.outbox import OutboxRelay
from temper.runtime import Runtime
from temper.settings import DispatcherSettings
from temper.tenants import ensure_bootstrap_key

log = logging.getLogger("temper.dispatcher")
WAKE_GATHER_S = 0.02
# How long stop() lets each loop finish its pass before cancelling it. Cancelling a pass in
# the middle of an asyncpg query could leave the task waiting on the query's cancellation
# for minutes (seen: the scheduler's tick, 1 stop in 20 in tests/services/dispatcher/test_fair_share.py).
STOP_GRACE_S = 30.0


class BootstrapKey:
    """Stores ``TEMPER_API__BOOTSTRAP_KEY`` (when set) as an admin key of tenant 'default'."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def start(self) -> None:
        key = self.runtime.settings.api.bootstrap_key
        if key is None:
            return
        assert self.runtime.db is not None, "the bootstrap key needs the database"
        async with self.runtime.db.session() as session:
            if await ensure_bootstrap_key(session, key.get_secret_value()):
                log_event(log, "bootstrap admin key stored for tenant 'default'")

    async def stop(self) -> None:
        pass


class Dispatcher:
    """The episode state machine of one dispatcher replica. Its knobs are
    ``runtime.settings.dispatcher`` (``TEMPER_DISPATCHER__*``); ``settings`` replaces them
    (tests, the embedded runner)."""

    def __init__(self, runtime: Runtime, *, settings: DispatcherSettings | None = None) -> None:
        self.runtime = runtime
        self.settings = settings or runtime.settings.dispatcher
        self.machine: EpisodeMachine | None = None
        self.batches: ResultBatches | None = None
        self.scheduler: Scheduler | None = None
        self.relay: OutboxRelay | None = None
        self.leadership: Leadership | None = None
        self._consumers: list[Consumer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()  # set by stop(): the loops end after their pass
        self._wake: asyncio.Event | None = None

    async def start(self) -> None:
        rt = self.runtime
        if rt.db is None or rt.bus is None or rt.store is None:
            raise RuntimeError(
                "Dispatcher needs a started Runtime with a database, a bus and an object store"
            )
        s = self.settings
        self._stopping.clear()
        self.relay = OutboxRelay(rt.db, rt.bus, keep_published_s=rt.settings.db.outbox_keep_published_s)
        rt.outbox_relays.append(self.relay.notify)
        self.machine = EpisodeMachine(
            rt.db,
            rt.store,
            s,
            transaction=self.relay.transaction,
            core=self.relay.core,
            agent_url=rt.settings.agent.url,
        )
        self.batches = ResultBatches(self.machine)
        self.leadership = Leadership(rt.db)
        self.scheduler = Scheduler(
            self.machine,
            self.leadership,
            trainer_attached=s.trainer_attached,
            wait_for_training=s.wait_for_training,
            fleet_max_episodes=s.fleet_max_episodes,
        )
        # Loops on the runtime (a crash shows in /health); stop() cancels them before the
        # final outbox flush, so the relay is not sending while the flush does.
        self._tasks.append(rt.spawn(self.relay.run(until=self._stopping), "dispatcher-outbox-relay"))
        self._consumers.append(
            await rt.consume_handlers(
                handlers.result_topics(self.batches),
                group=s.results_group,
                concurrency=s.result_concurrency,
                batch_handlers=handlers.result_batches(self.batches),
            )
        )
        self._consumers.append(
            await rt.consume_handlers(handlers.policy_topics(self.scheduler), group=s.policy_group)
        )
        # The scheduler runs when an episode of this replica finished (its slot is free), when
        # a gateway in this process serves a new version, and otherwise every
        # scheduler_interval_s (new jobs, other replicas' episodes).
        wake = self._wake = asyncio.Event()
        self.machine.on_finished = wake.set
        rt.version_served.append(wake.set)
        self._tasks.append(
            rt.spawn(
                self._every(s.scheduler_interval_s, self.scheduler.tick, "scheduler", wake=wake),
                "dispatcher-scheduler",
            )
        )
        self._tasks.append(
            rt.spawn(
                self._every(s.reaper_interval_s, self.machine.reap_expired, "lease reaper"),
                "dispatcher-reaper",
            )
        )
        if s.archive_after_s is not None:
            db, store, after_s = rt.db, rt.store, s.archive_after_s
            self._tasks.append(
                rt.spawn(
                    self._every(
                        s.archive_interval_s,
                        lambda: archive_finished(db, store, after_s=after_s),
                        "steps archive",
                    ),
                    "dispatcher-steps-archive",
                )
            )
        rt.checks["dispatcher"] = self._check
        log_event(
            log,
            "dispatcher started",
            lease_s=s.lease_s,
            max_step_attempts=s.max_step_attempts,
            trainer_attached=s.trainer_attached,
        )

    async def _every(
        self,
        interval_s: float,
        fn: Callable[[], Awaitable[Any]],
        name: str,
        *,
        wake: asyncio.Event | None = None,
    ) -> None:
        """Run ``fn`` every ``interval_s``, or as soon as ``wake`` is set, until stop()."""
        while not self._stopping.is_set():
            if wake is not None:
                wake.clear()
            try:
                await fn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a db blip must not stop the loop
                log_event(log, f"{name} pass failed", logging.WARNING, error=repr(exc))
            try:
                await asyncio.wait_for((wake or self._stopping).wait(), interval_s)
            except TimeoutError:
                continue
            if wake is not None and not self._stopping.is_set():
                # the episodes finishing in the next moment go in the same pass
                await asyncio.sleep(min(WAKE_GATHER_S, interval_s))

    async def _check(self) -> None:
        for task in self._tasks:
            if task.done():
                raise RuntimeError(f"{task.get_name()} stopped")

    async def stop(self) -> None:
        for consumer in self._consumers:
            await consumer.stop()
        self._consumers.clear()
        if self.batches is not None:
            await self.batches.close()
        # the loops end after their current pass; one still running after the grace is cancelled
        self._stopping.set()
        if self._wake is not None:
            if self._wake.set in self.runtime.version_served:
                self.runtime.version_served.remove(self._wake.set)
            self._wake.set()
        if self.relay is not None:
            self.relay.notify()
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=STOP_GRACE_S)
            for task in late:
                log_event(log, "loop still running at stop: cancelled", logging.WARNING, task=task.get_name())
                task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping
                pass
        self._tasks.clear()
        if self.relay is not None:
            if self.relay.notify in self.runtime.outbox_relays:
                self.runtime.outbox_relays.remove(self.relay.notify)
            # What was committed but not yet sent goes out now rather than at the next start.
            try:
                while await self.relay.publish_pending():
                    pass
            except Exception as exc:  # noqa: BLE001 - the next start publishes it
                log_event(log, "final outbox flush failed", logging.WARNING, error=repr(exc))
        if self.leadership is not None:
            await self.leadership.close()
        self.runtime.checks.pop("dispatcher", None)
