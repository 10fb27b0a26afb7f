from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from temper import metrics
from temper.bus.errors import unavailable_dependency
from temper.events import BadMessage, Message, Topics
from temper.logs import dependency_failed, dependency_recovered, log_event

log = logging.getLogger("temper.bus")


class BusUnavailable(RuntimeError):
    """The bus cannot be reached; the message names the setting to check."""


class Poison(Exception):
    """Raised by a handler for a message that can never succeed: it goes straight to
    the dead-letter topic instead of being retried."""


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Record], Awaitable[None]]
# Handles several records of one partition at once, all or nothing: True once every
# record's effect is committed; False (declined) or an exception having committed none,
# and then each record goes through the handler alone, with the usual retries. See
# Bus.subscribe.
BatchHandler = Callable[[list[Record]], Awaitable[bool]]


class Consumer(ABC):
    """A member of a consumer group. ``pause``/``resume`` stop and restart fetching
    (backpressure); ``stop`` leaves the group after the work in hand is committed."""

    topics: tuple[str, ...]
    group: str

    @abstractmethod
    def pause(self) -> None: ...

    @abstractmethod
    def resume(self) -> None: ...

    @property
    @abstractmethod
    def paused(self) -> bool: ...

    @abstractmethod
    async def stop(self) -> None: ...


class Bus(ABC):
    def __init__(self, *, partitions: int, max_retries: int, retry_backoff_s: float) -> None:
        self.partitions = partitions
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Connect; raises :class:`BusUnavailable` naming the setting if it can't."""

    async def stop(self) -> None:  # noqa: B027 - optional hook
        """Flush and disconnect."""

    @abstractmethod
    async def create_topics(self, topics: Iterable[str], partitions: int | None = None) -> None:
        """Create topics and their dead-letter twins; existing ones are left as they are."""

    @abstractmethod
    async def start_group_at_end(self, group: str, topics: Iterable[str]) -> None:
        """Place a group that has no committed offsets at the topics' current ends, so it
        reads only what is sent from now on (a new group otherwise starts at the earliest
        offset and replays the topics' whole history). A group with offsets keeps them."""

    @abstractmethod
    async def send(
        self,
        topic: str,
        value: bytes | Message,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Send and wait until the bus has durably accepted the message."""

    @abstractmethod
    async def subscribe(
        self,
        topics: Iterable[str],
        group: str,
        handler: Handler,
        *,
        concurrency: int = 1,
        batch_handler: BatchHandler | None = None,
    ) -> Consumer:
        """Join ``group`` and run ``handler`` for each record. Records of one key are
        handled in order (with ``concurrency`` 1, all records of a partition are); up to
        ``concurrency`` records are handled at once.

        ``batch_handler``, if given, may be offered several records of one partition, of
        distinct keys, at once (a bus that fetches in batches does: Kafka); if it declines
        (returns False) or raises, each of them goes to ``handler`` alone instead. A bus
        may ignore it."""

    @abstractmethod
    async def check(self) -> None:
        """Raise :class:`BusUnavailable` if the bus does not answer (for /health)."""

    async def send_message(self, topic: str, message: Message) -> None:
        await self.send(topic, message.to_bytes(), key=message.key())


def init_consumer_metrics(topics: Iterable[str], group: str) -> None:
    """A consumer's handled, failed and dead-lettered counts export 0 from its subscription on
    (metrics.zero says why), and its lag from then until the consumer's first measurement."""
    pairs = [(t, group) for t in topics]
    metrics.zero(metrics.BUS_CONSUMED, *pairs)
    metrics.zero(metrics.BUS_HANDLER_FAILURES, *pairs)
    metrics.zero(metrics.BUS_CONSUMER_LAG, *pairs)
    metrics.zero(metrics.BUS_DEAD_LETTERS, *(t for t, _ in pairs))


class DependencyWait(RuntimeError):
    """Raised by :meth:`Delivery.run` when it stops waiting for a dependency because the
    consumer no longer wants the record (stopping, or the partition was revoked): the
    record is not committed and is delivered again."""


class Delivery:
    """Runs a handler on one record with the bus's retry and dead-letter policy.
    Returns when the record may be committed: handled, or parked in the DLQ.

    Two kinds of failure are told apart (:func:`temper.bus.errors.unavailable_dependency`):

    - the message's own: retried ``max_retries`` times with a growing backoff, then
      dead-lettered (a :class:`Poison` or unparsable message at once);
    - a dependency that cannot be reached (database, object store, Kafka): not the
      message's fault, so the record is retried with exponential backoff (up to
      ``dependency_backoff_max_s``) for as long as the outage lasts and never
      dead-lettered. Its partition waits meanwhile (the consumer pauses it once its
      queue is full). ``keep_trying`` (given to :meth:`run`) is asked before each wait;
      when it turns false (the consumer stops, the partition moved) :class:`DependencyWait`
      is raised and the record is left uncommitted."""

    dependency_backoff_max_s = 2.0

    def __init__(self, bus: Bus, group: str, handler: Handler, topics: Iterable[str] = ()) -> None:
        init_consumer_metrics(topics, group)
        self.bus = bus
        self.group = group
        self.handler = handler

    async def run(self, record: Record, keep_trying: Callable[[], bool] | None = None) -> None:
        attempts = self.bus.max_retries + 1
        error: BaseException | None = None
        attempt = 0
        waits = 0
        waiting_for: str | None = None
        while attempt < attempts:
            try:
                await self.handler(record)
                metrics.BUS_CONSUMED.labels(record.topic, self.group).inc()
                if waiting_for is not None:
                    dependency_recovered(log, waiting_for)
                return
            except (Poison, BadMessage) as exc:
                error = exc
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any handler failure is retried, then dead-lettered
                dependency = unavailable_dependency(exc)
                if dependency is not None:
                    waiting_for = dependency
                    waits += 1
                    metrics.BUS_DEPENDENCY_WAITS.labels(record.topic, self.group, dependency).inc()
                    dependency_failed(
                        log,
                        dependency,
                        exc,
                        topic=record.topic,
                        group=self.group,
                        waiting="retrying the record",
                    )
                    if keep_trying is not None and not keep_trying():
                        raise DependencyWait(
                            f"{dependency} unreachable; {record.topic} record left for later"
                        ) from exc
                    await asyncio.sleep(
                        min(self.dependency_backoff_max_s, self.bus.retry_backoff_s * 2 ** min(waits, 10))
                    )
                    continue
                error = exc
                attempt += 1
                metrics.BUS_HANDLER_FAILURES.labels(record.topic, self.group).inc()
                log_event(
                    log,
                    "handler failed",
                    logging.WARNING,
                    topic=record.topic,
                    partition=record.partition,
                    offset=record.offset,
                    group=self.group,
                    attempt=attempt,
                    error=repr(exc),
                )
                if attempt < attempts:
                    await asyncio.sleep(self.bus.retry_backoff_s * attempt)
        await self._dead_letter(record, error, attempts)

    async def _dead_letter(self, record: Record, error: BaseException | None, attempts: int) -> None:
        dlq = Topics.dead_letter(record.topic)
        headers = {
            **record.headers,
            "temper.dlq.error": repr(error)[:2000],
            "temper.dlq.source": f"{record.topic}/{record.partition}/{record.offset}",
            "temper.dlq.group": self.group,
            "temper.dlq.attempts": str(attempts),
        }
        await self.bus.send(dlq, record.value, key=record.key, headers=headers)
        metrics.BUS_DEAD_LETTERS.labels(record.topic).inc()
        log_event(log, "message dead-lettered", logging.ERROR, topic=record.topic, dlq=dlq, error=repr(error))


async def handle_records(
    records: list[Record],
    delivery: Delivery,
    slots: asyncio.Semaphore,
    *,
    by_key: bool,
    batch_handler: BatchHandler | None,
    go_on: Callable[[], bool],
    keep_trying: Callable[[], bool],
) -> tuple[set[int], bool]:
    """Handle records fetched from one partition; returns the offsets handled and whether a
    record failed past the bus's own retries (then the rest of its key was not tried).

    ``by_key``: records of one key in order and records of different keys side by side,
    each holding one of ``slots`` while it runs; otherwise all of them in order. With a
    ``batch_handler``, the first record of each key goes to it in one call first (when
    there are two keys or more); what it takes is handled, and if it declines or raises,
    every record goes through ``delivery`` alone. ``go_on`` is asked before each record
    (a revoked partition or a paused consumer stops early); ``keep_trying`` is given to
    :meth:`Delivery.run`. Both buses hand their batches here, so the embedded mode handles
    a partition's records as Kafka's consumer does."""
    handled: set[int] = set()
    rest = records
    if batch_handler is not None and go_on():
        rest = await _offer_batch(records, delivery.group, slots, batch_handler, handled)
    chains: dict[str | None, list[Record]] = {}
    for rec in rest:
        chains.setdefault(rec.key if by_key else None, []).append(rec)
    failed = False

    async def run_chain(chain: list[Record]) -> None:
        nonlocal failed
        for rec in chain:
            if failed or not go_on():
                return
            try:
                async with slots:
                    await delivery.run(rec, keep_trying=keep_trying)
            except DependencyWait:
                return  # left for the partition's next owner
            except Exception as exc:  # noqa: BLE001 - e.g. the dead-letter send failed: fetch it again later
                log_event(
                    log,
                    "record not handled; fetching it again",
                    logging.WARNING,
                    topic=rec.topic,
                    partition=rec.partition,
                    offset=rec.offset,
                    group=delivery.group,
                    error=repr(exc),
                )
                failed = True
                return
            handled.add(rec.offset)

    await asyncio.gather(*(run_chain(chain) for chain in chains.values()))
    return handled, failed


async def _offer_batch(
    records: list[Record],
    group: str,
    slots: asyncio.Semaphore,
    batch_handler: BatchHandler,
    handled: set[int],
) -> list[Record]:
    """Offer the first record of each key to ``batch_handler`` in one call (when there are
    two keys or more); adds what it took to ``handled`` and returns the records left for
    the handler, in order: all of them if it declined or raised."""
    first: list[Record] = []
    rest: list[Record] = []
    keys: set[str] = set()
    for rec in records:
        if rec.key is None or rec.key in keys:
            rest.append(rec)
        else:
            keys.add(rec.key)
            first.append(rec)
    if len(first) < 2:
        return records
    try:
        async with slots:
            if not await batch_handler(first):
                return records
    except Exception as exc:  # noqa: BLE001 - nothing was taken: one by one, with the usual retries
        log_event(
            log,
            "batch not handled; handling its records one by one",
            logging.INFO,
            topic=first[0].topic,
            partition=first[0].partition,
            records=len(first),
            group=group,
            error=repr(exc),
        )
        return records
    metrics.BUS_CONSUMED.labels(first[0].topic, group).inc(len(first))
    handled.update(rec.offset for rec in first)
    return rest
