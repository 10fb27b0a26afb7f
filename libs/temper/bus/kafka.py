from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import CommitFailedError, KafkaError, TopicAlreadyExistsError
from aiokafka.structs import OffsetAndMetadata

from temper import metrics
from temper.bus.base import Bus, BusUnavailable, Consumer, Delivery, Handler, Record
from temper.events import Message, Topics
from temper.logs import log_event

log = logging.getLogger("temper.bus.kafka")


class KafkaBus(Bus):
    """Apache Kafka through aiokafka: keyed sends with acks=all and an idempotent
    producer; consumer groups that commit an offset only after its handler succeeded."""

    def __init__(
        self,
        *,
        bootstrap: str,
        partitions: int = 6,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        connect_timeout_s: float = 15.0,
        client_id: str = "temper",
    ) -> None:
        super().__init__(partitions=partitions, max_retries=max_retries, retry_backoff_s=retry_backoff_s)
        self.bootstrap = bootstrap
        self.connect_timeout_s = connect_timeout_s
        self.client_id = client_id
        self._producer: AIOKafkaProducer | None = None
        self._consumers: list[KafkaConsumer] = []

    def _unavailable(self, exc: BaseException) -> BusUnavailable:
        return BusUnavailable(
            f"cannot reach Kafka at TEMPER_BUS__BOOTSTRAP={self.bootstrap!r} "
            f"within {self.connect_timeout_s:g}s: {exc.__class__.__name__}: {exc}"
        )

    async def start(self) -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            client_id=self.client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=1,
            request_timeout_ms=int(self.connect_timeout_s * 1000),
        )
        try:
            await asyncio.wait_for(producer.start(), self.connect_timeout_s)
        except (KafkaError, OSError, TimeoutError) as exc:
            await producer.stop()
            raise self._unavailable(exc) from None
        self._producer = producer

    async def stop(self) -> None:
        for consumer in list(self._consumers):
            await consumer.stop()
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    async def _admin(self) -> AIOKafkaAdminClient:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, client_id=f"{self.client_id}-admin")
        try:
            await asyncio.wait_for(admin.start(), self.connect_timeout_s)
        except (KafkaError, OSError, TimeoutError) as exc:
            await admin.close()
            raise self._unavailable(exc) from None
        return admin

    async def create_topics(self, topics: Iterable[str], partitions: int | None = None) -> None:
        names = [n for t in topics for n in (t, Topics.dead_letter(t))]
        admin = await self._admin()
        try:
            existing = set(await admin.list_topics())
            new = [
                NewTopic(name=n, num_partitions=partitions or self.partitions, replication_factor=1)
                for n in dict.fromkeys(names)
                if n not in existing
            ]
            if new:
                try:
                    await admin.create_topics(new)
                except TopicAlreadyExistsError:
                    pass  # another process created them first
        finally:
            await admin.close()
        # Wait until the producer's metadata knows them, so the first send doesn't race creation.
        if self._producer is not None:
            for n in names:
                for _ in range(50):
                    if await self._producer.partitions_for(n):
                        break
                    await asyncio.sleep(0.1)

    async def send(
        self, topic: str, value: bytes | Message, key: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        if self._producer is None:
            raise RuntimeError("KafkaBus.send before start()")
        if isinstance(value, Message):
            key = key or value.key()
            value = value.to_bytes()
        await self._producer.send_and_wait(
            topic,
            value,
            key=key.encode() if key is not None else None,
            headers=[(k, v.encode()) for k, v in (headers or {}).items()],
        )
        metrics.BUS_PRODUCED.labels(topic).inc()

    async def subscribe(
        self, topics: Iterable[str], group: str, handler: Handler, *, concurrency: int = 1
    ) -> Consumer:
        consumer = KafkaConsumer(self, tuple(topics), group, handler, concurrency)
        await consumer.start()
        self._consumers.append(consumer)
        return consumer

    async def check(self) -> None:
        admin = await self._admin()
        await admin.close()


class KafkaConsumer(Consumer):
    def __init__(self, bus: KafkaBus, topics: tuple[str, ...], group: str, handler: Handler, concurrency: int):
        self.bus = bus
        self.topics = topics
        self.group = group
        self.delivery = Delivery(bus, group, handler)
        self.concurrency = max(1, concurrency)
        self._paused = False
        self._task: asyncio.Task[None] | None = None
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bus.bootstrap,
            group_id=group,
            client_id=f"{bus.client_id}-{group}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=10000,
            heartbeat_interval_ms=1000,
            max_poll_interval_ms=300000,
            fetch_max_wait_ms=50,  # an idle partition must not hold back a busy one
        )

    async def start(self) -> None:
        try:
            await asyncio.wait_for(self._consumer.start(), self.bus.connect_timeout_s)
        except (KafkaError, OSError, TimeoutError) as exc:
            await self._consumer.stop()
            raise self.bus._unavailable(exc) from None
        self._consumer.subscribe(list(self.topics))
        self._task = asyncio.create_task(self._run(), name=f"kafka-consumer-{self.group}")

    def pause(self) -> None:
        self._paused = True
        self._consumer.pause(*self._consumer.assignment())
        for t in self.topics:
            metrics.BUS_PAUSED.labels(t, self.group).set(1)

    def resume(self) -> None:
        self._paused = False
        self._consumer.resume(*self._consumer.assignment())
        for t in self.topics:
            metrics.BUS_PAUSED.labels(t, self.group).set(0)

    @property
    def paused(self) -> bool:
        return self._paused

    async def _run(self) -> None:
        while True:
            if self._paused:
                # Partitions assigned after pause() must be paused too.
                self._consumer.pause(*self._consumer.assignment())
            try:
                batches = await self._consumer.getmany(timeout_ms=200, max_records=100)
            except KafkaError as exc:
                # The client reconnects by itself; keep the loop alive and say so.
                log_event(log, "fetch failed", logging.WARNING, group=self.group, error=repr(exc))
                await asyncio.sleep(1)
                continue
            items = list(batches.items())
            for i in range(0, len(items), self.concurrency):
                await asyncio.gather(*(self._drain(tp, recs) for tp, recs in items[i : i + self.concurrency]))

    async def _drain(self, tp: TopicPartition, records: list[ConsumerRecord]) -> None:
        """Handle a partition's batch in order, then commit once: a crash before the commit
        redelivers the batch (handlers are idempotent), and one commit per batch instead
        of per record keeps a busy partition from waiting on the broker."""
        done: int | None = None
        for rec in records:
            if self._paused:
                # Don't start more work; rewind so the rest is fetched again after resume().
                self._consumer.seek(tp, rec.offset)
                break
            record = Record(
                topic=rec.topic,
                partition=rec.partition,
                offset=rec.offset,
                key=rec.key.decode() if rec.key is not None else None,
                value=rec.value or b"",
                headers={k: v.decode(errors="replace") for k, v in rec.headers},
            )
            await self.delivery.run(record)
            done = rec.offset + 1
        if done is None:
            return
        try:
            await self._consumer.commit({tp: OffsetAndMetadata(done, "")})
        except CommitFailedError as exc:
            # The partition moved to another member during a rebalance: it redelivers from
            # the last commit, which is at-least-once.
            log_event(log, "commit refused after rebalance", logging.WARNING, topic=tp.topic, error=str(exc))
            return
        self._update_lag(tp, done)

    def _update_lag(self, tp: TopicPartition, position: int) -> None:
        high = self._consumer.highwater(tp)
        if high is not None:
            metrics.BUS_CONSUMER_LAG.labels(tp.topic, self.group).set(max(0, high - position))

    async def stop(self) -> None:
        """Leave the group; a record being handled now is not committed and goes to another member."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self._consumer.stop()
        if self in self.bus._consumers:
            self.bus._consumers.remove(self)


async def start_groups_at_end(bootstrap: str, groups: dict[str, list[str]] | dict[str, tuple[str, ...]]) -> None:
    """Commit the current end offsets for consumer groups that are new, so they skip what
    is already in the topics: a new group otherwise starts at the earliest offset and
    replays the topics' whole history (other runs' and tests' messages included)."""
    for group, topics in groups.items():
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
        await consumer.start()
        try:
            await consumer._client.force_metadata_update()
            tps = [TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or ())]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            await consumer.commit({tp: OffsetAndMetadata(offset, "") for tp, offset in ends.items()})
        finally:
            await consumer.stop()
