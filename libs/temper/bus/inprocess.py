from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka.partitioner import DefaultPartitioner

from temper import metrics
from temper.bus.base import BatchHandler, Bus, Consumer, Delivery, Handler, Record, handle_records
from temper.events import Message, Topics

TopicPartition = tuple[str, int]


@dataclass
class _Group:
    name: str
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    committed_total: dict[str, int] = field(default_factory=dict)  # each topic's, summed over partitions
    members: list[InProcessConsumer] = field(default_factory=list)
    generation: int = 0

    def commit(self, tp: TopicPartition, offset: int) -> None:
        """Move ``tp``'s committed offset forward to ``offset`` (never back)."""
        before = self.committed.get(tp, 0)
        if offset > before:
            self.committed[tp] = offset
            self.committed_total[tp[0]] = self.committed_total.get(tp[0], 0) + offset - before


class InProcessBus(Bus):
    """Topics, partitions, consumer groups and committed offsets kept in memory."""

    def __init__(self, *, partitions: int = 6, max_retries: int = 3, retry_backoff_s: float = 0.05) -> None:
        super().__init__(partitions=partitions, max_retries=max_retries, retry_backoff_s=retry_backoff_s)
        self.topics: dict[str, list[list[Record]]] = {}
        self._groups: dict[str, _Group] = {}
        self._changed = asyncio.Condition()
        self._partitioner = DefaultPartitioner()
        self._round_robin = itertools.count()
        self._produced: dict[str, int] = {}  # records sent to each topic

    async def stop(self) -> None:
        for group in list(self._groups.values()):
            for member in list(group.members):
                await member.stop()

    async def create_topics(self, topics: Iterable[str], partitions: int | None = None) -> None:
        for topic in topics:
            for name in (topic, Topics.dead_letter(topic)):
                self.topics.setdefault(name, [[] for _ in range(partitions or self.partitions)])

    async def start_group_at_end(self, group: str, topics: Iterable[str]) -> None:
        g = self._groups.setdefault(group, _Group(group))
        if g.committed:
            return
        for topic in topics:
            for partition, log in enumerate(self.topics[topic]):
                g.commit((topic, partition), len(log))

    def _partition_for(self, topic: str, key: str | None) -> int:
        count = len(self.topics[topic])
        if key is None:
            return next(self._round_robin) % count
        ids = list(range(count))
        return self._partitioner(key.encode(), ids, ids)

    async def send(
        self,
        topic: str,
        value: bytes | Message,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if isinstance(value, Message):
            key = key or value.key()
            value = value.to_bytes()
        if topic not in self.topics:
            # Kafka here runs with auto-creation off; the same mistake must fail the same way.
            raise KeyError(f"topic {topic!r} does not exist; create it with create_topics()")
        partition = self._partition_for(topic, key)
        log = self.topics[topic][partition]
        log.append(Record(topic, partition, len(log), key, value, dict(headers or {})))
        metrics.BUS_PRODUCED.labels(topic).inc()
        self._produced[topic] = self._produced.get(topic, 0) + 1
        for group in self._groups.values():
            for member in group.members:
                if (topic, partition) in member.assigned:
                    member.pending.add((topic, partition))
        async with self._changed:
            self._changed.notify_all()

    async def subscribe(
        self,
        topics: Iterable[str],
        group: str,
        handler: Handler,
        *,
        concurrency: int = 1,
        batch_handler: BatchHandler | None = None,
    ) -> Consumer:
        topics = tuple(topics)
        missing = [t for t in topics if t not in self.topics]
        if missing:
            raise KeyError(f"topics {missing} do not exist; create them with create_topics()")
        g = self._groups.setdefault(group, _Group(group))
        member = InProcessConsumer(self, g, topics, handler, concurrency, batch_handler)
        g.members.append(member)
        await self._rebalance(g)
        member.start()
        return member

    async def check(self) -> None:
        return None

    async def _rebalance(self, group: _Group) -> None:
        group.generation += 1
        partitions = sorted(
            {(t, p) for m in group.members for t in m.topics for p in range(len(self.topics[t]))}
        )
        for m in group.members:
            m.assigned = set()
        for i, tp in enumerate(partitions):
            if group.members:
                member = group.members[i % len(group.members)]
                if tp[0] in member.topics:
                    member.assigned.add(tp)
        for m in group.members:
            m.positions = {tp: group.committed.get(tp, 0) for tp in m.assigned}
            m.pending = set(m.assigned)
        async with self._changed:
            self._changed.notify_all()

    def lag(self, topic: str, group: str) -> int:
        """Records of ``topic`` that ``group`` has not committed, over every partition."""
        g = self._groups.get(group)
        return self._produced.get(topic, 0) - (g.committed_total.get(topic, 0) if g else 0)


class InProcessConsumer(Consumer):
    """A group member that handles each assigned partition in a task of its own, as
    :class:`temper.bus.kafka.KafkaConsumer` does: a partition's records waiting now are its
    next batch, handled by :func:`handle_records` (records of one key in order, of
    different keys side by side up to ``concurrency``, the batch handler first), then
    committed. A slow record holds back its own partition's next batch and nothing else."""

    MAX_BATCH = 100  # records a partition's batch takes at most (Kafka's fetch takes as many)

    def __init__(
        self,
        bus: InProcessBus,
        group: _Group,
        topics: tuple[str, ...],
        handler: Handler,
        concurrency: int,
        batch_handler: BatchHandler | None = None,
    ) -> None:
        self.bus = bus
        self._group = group
        self.group = group.name
        self.topics = topics
        self.delivery = Delivery(bus, group.name, handler, self.topics)
        self.batch_handler = batch_handler
        self.concurrency = max(1, concurrency)
        self._slots = asyncio.Semaphore(self.concurrency)
        self.assigned: set[TopicPartition] = set()
        self.positions: dict[TopicPartition, int] = {}  # where each partition's next batch starts
        # partitions that may have records no task handles: sent to since, or all of them
        # after a rebalance or a resume (so a send costs a set insert, not a scan of them all)
        self.pending: set[TopicPartition] = set()
        self._paused = False
        self._task: asyncio.Task[None] | None = None
        self._workers: dict[TopicPartition, asyncio.Task[None]] = {}

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"consumer-{self.group}")

    def pause(self) -> None:
        self._paused = True
        for t in self.topics:
            metrics.BUS_PAUSED.labels(t, self.group).set(1)

    def resume(self) -> None:
        self._paused = False
        self.pending |= self.assigned
        for t in self.topics:
            metrics.BUS_PAUSED.labels(t, self.group).set(0)
        asyncio.get_running_loop().create_task(self._wake())

    @property
    def paused(self) -> bool:
        return self._paused

    async def _wake(self) -> None:
        async with self.bus._changed:
            self.bus._changed.notify_all()

    def _ready(self) -> list[TopicPartition]:
        """Assigned partitions with records waiting and no task handling them (a running
        task goes on to the records sent while it runs)."""
        if self._paused:
            return []
        ready = []
        for tp in self.pending:
            worker = self._workers.get(tp)
            if (
                tp in self.assigned
                and (worker is None or worker.done())
                and self.positions[tp] < len(self.bus.topics[tp[0]][tp[1]])
            ):
                ready.append(tp)
        if not ready:
            self.pending.clear()
        return sorted(ready)

    async def _run(self) -> None:
        while True:
            async with self.bus._changed:
                await self.bus._changed.wait_for(lambda: bool(self._ready()))
            for tp in self._ready():
                self.pending.discard(tp)
                self._workers[tp] = asyncio.create_task(
                    self._drain(tp), name=f"consumer-{self.group}-{tp[0]}-{tp[1]}"
                )

    async def _drain(self, tp: TopicPartition) -> None:
        """Handle ``tp``'s batches until it is caught up, paused or moved to another member."""
        generation = self._group.generation
        log = self.bus.topics[tp[0]][tp[1]]

        def mine() -> bool:
            return tp in self.assigned

        while not self._paused and mine() and self.positions[tp] < len(log):
            start = self.positions[tp]
            records = log[start : start + self.MAX_BATCH]
            self.positions[tp] = records[-1].offset + 1
            handled, failed = await handle_records(
                records,
                self.delivery,
                self._slots,
                by_key=self.concurrency > 1,
                batch_handler=self.batch_handler,
                go_on=lambda: mine() and not self._paused,
                keep_trying=mine,
            )
            if self._group.generation != generation and not mine():
                return  # revoked while handling: like Kafka, the commit is refused and the records redelivered
            unhandled = next((rec.offset for rec in records if rec.offset not in handled), None)
            done = records[-1].offset + 1 if unhandled is None else unhandled
            if unhandled is not None:  # paused or failed: the next batch starts there
                self.positions[tp] = unhandled
            self._group.commit(tp, done)
            metrics.BUS_CONSUMER_LAG.labels(tp[0], self.group).set(self.bus.lag(tp[0], self.group))
            if failed:
                await asyncio.sleep(1)

    async def stop(self) -> None:
        """Leave the group; a record being handled now is not committed and goes to another member."""
        tasks = [t for t in (self._task, *self._workers.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        self._workers.clear()
        if self in self._group.members:
            self._group.members.remove(self)
            await self.bus._rebalance(self._group)
