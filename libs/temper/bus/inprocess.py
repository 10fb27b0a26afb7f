from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from aiokafka.partitioner import DefaultPartitioner

from temper import metrics
from temper.bus.base import BatchHandler, Bus, Consumer, Delivery, DependencyWait, Handler, Record
from temper.events import Message, Topics

TopicPartition = tuple[str, int]


@dataclass
class _Group:
    name: str
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    members: list[InProcessConsumer] = field(default_factory=list)
    generation: int = 0


class InProcessBus(Bus):
    """Topics, partitions, consumer groups and committed offsets kept in memory."""

    def __init__(self, *, partitions: int = 6, max_retries: int = 3, retry_backoff_s: float = 0.05) -> None:
        super().__init__(partitions=partitions, max_retries=max_retries, retry_backoff_s=retry_backoff_s)
        self.topics: dict[str, list[list[Record]]] = {}
        self._groups: dict[str, _Group] = {}
        self._changed = asyncio.Condition()
        self._partitioner = DefaultPartitioner()
        self._round_robin = itertools.count()

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
                g.committed[(topic, partition)] = len(log)

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
        async with self._changed:
            self._changed.notify_all()

    async def subscribe(
        self,
        topics: Iterable[str],
        group: str,
        handler: Handler,
        *,
        concurrency: int = 1,
        batch_handler: BatchHandler | None = None,  # records are handled one at a time here
    ) -> Consumer:
        topics = tuple(topics)
        missing = [t for t in topics if t not in self.topics]
        if missing:
            raise KeyError(f"topics {missing} do not exist; create them with create_topics()")
        g = self._groups.setdefault(group, _Group(group))
        member = InProcessConsumer(self, g, topics, handler, concurrency)
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
        async with self._changed:
            self._changed.notify_all()

    def lag(self, topic: str, group: str) -> int:
        committed = self._groups[group].committed if group in self._groups else {}
        return sum(
            len(log) - committed.get((topic, p), 0) for p, log in enumerate(self.topics.get(topic, []))
        )


class InProcessConsumer(Consumer):
    def __init__(
        self, bus: InProcessBus, group: _Group, topics: tuple[str, ...], handler: Handler, concurrency: int
    ) -> None:
        self.bus = bus
        self._group = group
        self.group = group.name
        self.topics = topics
        self.delivery = Delivery(bus, group.name, handler, self.topics)
        self.concurrency = max(1, concurrency)
        self.assigned: set[TopicPartition] = set()
        self.positions: dict[TopicPartition, int] = {}
        self._paused = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"consumer-{self.group}")

    def pause(self) -> None:
        self._paused = True
        for t in self.topics:
            metrics.BUS_PAUSED.labels(t, self.group).set(1)

    def resume(self) -> None:
        self._paused = False
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
        if self._paused:
            return []
        return [tp for tp in sorted(self.assigned) if self.positions[tp] < len(self.bus.topics[tp[0]][tp[1]])]

    async def _run(self) -> None:
        while True:
            async with self.bus._changed:
                await self.bus._changed.wait_for(lambda: bool(self._ready()))
            ready = self._ready()
            for i in range(0, len(ready), self.concurrency):
                await asyncio.gather(*(self._drain(tp) for tp in ready[i : i + self.concurrency]))

    async def _drain(self, tp: TopicPartition) -> None:
        generation = self._group.generation
        log = self.bus.topics[tp[0]][tp[1]]
        while not self._paused and tp in self.assigned and self.positions[tp] < len(log):
            record = log[self.positions[tp]]
            try:
                await self.delivery.run(record, keep_trying=lambda: tp in self.assigned)
            except DependencyWait:
                return  # revoked while waiting for a dependency: the next owner takes the record
            if self._group.generation != generation and tp not in self.assigned:
                return  # revoked while handling: like Kafka, the commit is refused and the record redelivered
            self.positions[tp] = record.offset + 1
            self._group.committed[tp] = record.offset + 1
            metrics.BUS_CONSUMER_LAG.labels(tp[0], self.group).set(self.bus.lag(tp[0], self.group))

    async def stop(self) -> None:
        """Leave the group; a record being handled now is not committed and goes to another member."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self in self._group.members:
            self._group.members.remove(self)
            await self.bus._rebalance(self._group)
