from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from aiokafka import (
    AIOKafkaConsumer,
    AIOKafkaProducer,
    ConsumerRebalanceListener,
    ConsumerRecord,
    TopicPartition,
)
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import CommitFailedError, KafkaError, TopicAlreadyExistsError
from aiokafka.structs import OffsetAndMetadata

from temper import metrics
from temper.bus.base import (
    BatchHandler,
    Bus,
    BusUnavailable,
    Consumer,
    Delivery,
    Handler,
    Record,
    handle_records,
)
from temper.bus.errors import KAFKA
from temper.events import Message, Topics
from temper.logs import dependency_down, dependency_failed, dependency_recovered, log_event

log = logging.getLogger("temper.bus.kafka")


class KafkaBus(Bus):
    """Apache Kafka through aiokafka: keyed sends with acks=all and an idempotent
    producer; consumer groups that commit an offset only after its handler succeeded.

    ``namespace`` is put in front of every topic and consumer group on the broker, so
    deployments can share a cluster; callers and handlers only ever see the plain names."""

    def __init__(
        self,
        *,
        bootstrap: str,
        partitions: int = 6,
        max_retries: int = 3,
        retry_backoff_s: float = 0.2,
        connect_timeout_s: float = 15.0,
        client_id: str = "temper",
        namespace: str = "",
    ) -> None:
        super().__init__(partitions=partitions, max_retries=max_retries, retry_backoff_s=retry_backoff_s)
        self.bootstrap = bootstrap
        self.namespace = namespace
        self.connect_timeout_s = connect_timeout_s
        self.client_id = client_id
        self._producer: AIOKafkaProducer | None = None
        self._consumers: list[KafkaConsumer] = []

    def broker_name(self, name: str) -> str:
        """A topic's or group's name on the broker."""
        return self.namespace + name

    def plain_name(self, broker_name: str) -> str:
        return broker_name.removeprefix(self.namespace)

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
            linger_ms=0,  # a linger of even 1 ms adds more than 1 ms to every hop; batches still form under load
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

    async def start_group_at_end(self, group: str, topics: Iterable[str]) -> None:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.broker_name(group),
            enable_auto_commit=False,
            request_timeout_ms=int(self.connect_timeout_s * 1000) + 1000,
        )
        try:
            await consumer.start()
        except (KafkaError, OSError, TimeoutError) as exc:
            raise self._unavailable(exc) from exc
        try:
            await consumer._client.force_metadata_update()
            tps = [
                TopicPartition(self.broker_name(t), p)
                for t in topics
                for p in sorted(consumer.partitions_for_topic(self.broker_name(t)) or ())
            ]
            consumer.assign(tps)
            committed = [await consumer.committed(tp) for tp in tps]
            if any(offset is not None for offset in committed):
                return  # the group has read these before: it goes on where it stopped
            ends = await consumer.end_offsets(tps)
            await consumer.commit({tp: OffsetAndMetadata(offset, "") for tp, offset in ends.items()})
        finally:
            await consumer.stop()

    async def create_topics(self, topics: Iterable[str], partitions: int | None = None) -> None:
        names = [self.broker_name(n) for t in topics for n in (t, Topics.dead_letter(t))]
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
        self,
        topic: str,
        value: bytes | Message,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if self._producer is None:
            raise RuntimeError("KafkaBus.send before start()")
        if isinstance(value, Message):
            key = key or value.key()
            value = value.to_bytes()
        await self._producer.send_and_wait(
            self.broker_name(topic),
            value,
            key=key.encode() if key is not None else None,
            headers=[(k, v.encode()) for k, v in (headers or {}).items()],
        )
        metrics.BUS_PRODUCED.labels(topic).inc()

    async def subscribe(
        self,
        topics: Iterable[str],
        group: str,
        handler: Handler,
        *,
        concurrency: int = 1,
        batch_handler: BatchHandler | None = None,
    ) -> Consumer:
        consumer = KafkaConsumer(self, tuple(topics), group, handler, concurrency, batch_handler)
        await consumer.start()
        self._consumers.append(consumer)
        return consumer

    async def check(self) -> None:
        admin = await self._admin()
        await admin.close()


class KafkaConsumer(Consumer):
    """A group member with one worker task per assigned partition.

    The fetch loop only hands each partition's records to that partition's worker, so a
    slow record holds back its own partition and nothing else. Within a batch, records
    of one key are handled in order and records of different keys side by side, up to
    ``concurrency`` at once over all partitions (with ``concurrency`` 1, strictly in
    partition order). A worker notes each batch it handled and goes on to the next; one
    committer task commits what the workers noted, every partition in one request (while a
    commit is in flight, later batches wait for the next one), so a busy partition never
    waits on the broker and the broker sees one commit for many batches. A partition whose
    worker falls ``MAX_QUEUED_BATCHES`` behind is paused at the broker until it catches up.

    With a ``batch_handler``, a fetched batch's first record of each key (when there are
    several keys) goes to it in one call first; the records it took are done, the others
    (later records of a key) follow one by one, in order. If it raises, it took none, and
    every record goes to the handler alone, as without it (so too if it declines them).
    """

    MAX_QUEUED_BATCHES = 2

    def __init__(
        self,
        bus: KafkaBus,
        topics: tuple[str, ...],
        group: str,
        handler: Handler,
        concurrency: int,
        batch_handler: BatchHandler | None = None,
    ):
        self.bus = bus
        self.topics = topics
        self.group = group
        self.delivery = Delivery(bus, group, handler, self.topics)
        self.batch_handler = batch_handler
        self.concurrency = max(1, concurrency)
        self._slots = asyncio.Semaphore(self.concurrency)
        self._paused = False
        self._task: asyncio.Task[None] | None = None
        self._workers: dict[TopicPartition, _PartitionWorker] = {}
        self._uncommitted: dict[TopicPartition, int] = {}  # handled up to here, not committed yet
        self._commit_wanted = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self._committer: asyncio.Task[None] | None = None
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bus.bootstrap,
            group_id=bus.broker_name(group),
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
        self._consumer.subscribe([self.bus.broker_name(t) for t in self.topics], listener=_Revoke(self))
        self._task = asyncio.create_task(self._run(), name=f"kafka-consumer-{self.group}")
        self._committer = asyncio.create_task(self._commit_loop(), name=f"kafka-committer-{self.group}")

    def pause(self) -> None:
        self._paused = True
        self._consumer.pause(*self._consumer.assignment())
        for t in self.topics:
            metrics.BUS_PAUSED.labels(t, self.group).set(1)

    def resume(self) -> None:
        self._paused = False
        self._consumer.resume(*[tp for tp in self._consumer.assignment() if not self._backlogged(tp)])
        for t in self.topics:
            metrics.BUS_PAUSED.labels(t, self.group).set(0)

    @property
    def paused(self) -> bool:
        return self._paused

    def _backlogged(self, tp: TopicPartition) -> bool:
        worker = self._workers.get(tp)
        return worker is not None and worker.queue.qsize() >= self.MAX_QUEUED_BATCHES

    async def _run(self) -> None:
        while True:
            if self._paused:
                # Partitions assigned after pause() must be paused too.
                self._consumer.pause(*self._consumer.assignment())
            try:
                batches = await self._consumer.getmany(timeout_ms=200, max_records=100)
            except KafkaError as exc:
                # The client reconnects by itself; keep the loop alive and say so (once per outage).
                dependency_failed(log, KAFKA, exc, group=self.group, waiting="fetching again")
                await asyncio.sleep(1)
                continue
            if dependency_down(KAFKA):
                dependency_recovered(log, KAFKA)
            for tp, records in batches.items():
                worker = self._workers.get(tp)
                if worker is None:
                    worker = self._workers[tp] = _PartitionWorker(self, tp)
                worker.queue.put_nowait(records)
                if self._backlogged(tp):
                    self._consumer.pause(tp)

    async def _handle(self, worker: _PartitionWorker, records: list[ConsumerRecord]) -> None:
        """Handle a partition's batch (:func:`handle_records`), then note it for the
        committer: a crash before the commit redelivers the batch (handlers are idempotent)."""
        tp = worker.tp
        topic = self.bus.plain_name(tp.topic)
        handled, failed = await handle_records(
            [_record(rec, topic) for rec in records],
            self.delivery,
            self._slots,
            by_key=self.concurrency > 1,
            batch_handler=None if worker.finishing or self._paused else self.batch_handler,
            # stop early when the partition moves to another member, or on pause()
            go_on=lambda: not worker.finishing and not self._paused,
            keep_trying=lambda: not worker.finishing and self._task is not None,
        )
        unhandled = next((rec.offset for rec in records if rec.offset not in handled), None)
        if unhandled is not None and not worker.finishing:
            # Paused or failed: fetch the partition again from the first record not handled
            # (records after it that were handled are delivered again: handlers are idempotent).
            self._rewind(worker, unhandled)
            if failed:
                await asyncio.sleep(1)
        done = records[-1].offset + 1 if unhandled is None else unhandled
        if done > records[0].offset:
            self._uncommitted[tp] = max(done, self._uncommitted.get(tp, 0))
            self._commit_wanted.set()
        # Undo a backlog pause (never the pause() of the subscriber).
        if not self._paused and not self._backlogged(tp) and tp in self._consumer.assignment():
            self._consumer.resume(tp)

    async def _commit_loop(self) -> None:
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            try:
                await self._commit()
            except Exception as exc:  # noqa: BLE001 - the committer must outlive one bad commit
                log_event(log, "commit failed", logging.WARNING, group=self.group, error=repr(exc))

    async def _commit(self, partitions: Iterable[TopicPartition] | None = None) -> None:
        """Commit what was handled, of ``partitions`` (default: every partition), in one request."""
        async with self._commit_lock:
            assigned = self._consumer.assignment()
            for tp in [tp for tp in self._uncommitted if tp not in assigned]:
                del self._uncommitted[tp]  # gone without a revocation: its next owner redelivers
            wanted = list(self._uncommitted) if partitions is None else partitions
            offsets = {tp: self._uncommitted[tp] for tp in wanted if tp in self._uncommitted}
            if offsets and await self._commit_offsets(offsets):
                for tp, offset in offsets.items():
                    if self._uncommitted.get(tp) == offset:  # not handled further meanwhile
                        del self._uncommitted[tp]

    async def _commit_offsets(self, offsets: dict[TopicPartition, int]) -> bool:
        """False where the offsets are to be committed again (the broker did not take them)."""
        try:
            await self._consumer.commit({tp: OffsetAndMetadata(offset, "") for tp, offset in offsets.items()})
        except CommitFailedError as exc:
            # The partition moved to another member during a rebalance: it redelivers from
            # the last commit, which is at-least-once.
            log_event(
                log,
                "commit refused after rebalance",
                logging.WARNING,
                topic=self._topic_names(offsets),
                error=str(exc),
            )
            return True
        except KafkaError as exc:
            # Kept: the next commit (of any partition's batch) takes them again.
            log_event(
                log,
                "commit failed",
                logging.WARNING,
                topic=self._topic_names(offsets),
                group=self.group,
                error=repr(exc),
            )
            return False
        for tp, offset in offsets.items():
            self._update_lag(tp, offset)
        return True

    def _topic_names(self, offsets: dict[TopicPartition, int]) -> str:
        return ",".join(sorted({self.bus.plain_name(tp.topic) for tp in offsets}))

    def _rewind(self, worker: _PartitionWorker, offset: int) -> None:
        """Fetch the partition again from ``offset``; what was queued after it is dropped."""
        worker.drop_queued()
        if worker.tp in self._consumer.assignment():
            self._consumer.seek(worker.tp, offset)

    def _update_lag(self, tp: TopicPartition, position: int) -> None:
        high = self._consumer.highwater(tp)
        if high is not None:
            metrics.BUS_CONSUMER_LAG.labels(self.bus.plain_name(tp.topic), self.group).set(
                max(0, high - position)
            )

    async def _stop_workers(self, partitions: Iterable[TopicPartition]) -> None:
        """Let each worker finish the record in hand and commit what they handled (the
        partitions' next owner starts there); drop what is queued."""
        partitions = list(partitions)
        workers = [self._workers.pop(tp) for tp in partitions if tp in self._workers]
        await asyncio.gather(*(w.finish() for w in workers))
        await self._commit(partitions)
        for tp in partitions:  # not committed (the broker refused): the next owner redelivers
            self._uncommitted.pop(tp, None)

    async def stop(self) -> None:
        """Leave the group; a record being handled now is not committed and goes to another
        member (what was handled is committed, if the broker answers within a second)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for worker in list(self._workers.values()):
            await worker.cancel()
        self._workers.clear()
        if self._committer is not None:
            self._committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._committer
            self._committer = None
        with contextlib.suppress(TimeoutError, KafkaError, OSError):
            await asyncio.wait_for(self._commit(), 1.0)
        self._uncommitted.clear()  # the broker did not answer: the next owner redelivers
        await self._consumer.stop()
        if self in self.bus._consumers:
            self.bus._consumers.remove(self)


def _record(rec: ConsumerRecord, topic: str) -> Record:
    return Record(
        topic=topic,
        partition=rec.partition,
        offset=rec.offset,
        key=rec.key.decode() if rec.key is not None else None,
        value=rec.value or b"",
        headers={k: v.decode(errors="replace") for k, v in rec.headers},
    )


class _PartitionWorker:
    """Handles one partition's batches, one after another."""

    def __init__(self, consumer: KafkaConsumer, tp: TopicPartition) -> None:
        self.consumer = consumer
        self.tp = tp
        self.queue: asyncio.Queue[list[ConsumerRecord] | None] = asyncio.Queue()
        self.finishing = False
        self.task = asyncio.create_task(self._run(), name=f"kafka-{consumer.group}-{tp.topic}-{tp.partition}")

    async def _run(self) -> None:
        while not self.finishing:
            records = await self.queue.get()
            if records is None:
                return
            await self.consumer._handle(self, records)

    def drop_queued(self) -> None:
        while not self.queue.empty():
            self.queue.get_nowait()

    async def finish(self) -> None:
        """Stop after the record in hand, committing what was handled; queued batches are
        dropped (the partition's next owner fetches them again from the committed offset)."""
        self.finishing = True
        self.drop_queued()
        self.queue.put_nowait(None)  # wakes an idle worker
        await self.task

    async def cancel(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


class _Revoke(ConsumerRebalanceListener):
    """Before partitions move to another member, finish and commit the work in hand."""

    def __init__(self, consumer: KafkaConsumer) -> None:
        self.consumer = consumer

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self.consumer._stop_workers(revoked)

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        pass


async def start_groups_at_end(
    bootstrap: str, groups: dict[str, list[str]] | dict[str, tuple[str, ...]]
) -> None:
    """Commit the current end offsets for consumer groups that are new, so they skip what
    is already in the topics: a new group otherwise starts at the earliest offset and
    replays the topics' whole history (other runs' and tests' messages included)."""
    for group, topics in groups.items():
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
        await consumer.start()
        try:
            await consumer._client.force_metadata_update()
            tps = [
                TopicPartition(t, p) for t in topics for p in sorted(consumer.partitions_for_topic(t) or ())
            ]
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            await consumer.commit({tp: OffsetAndMetadata(offset, "") for tp, offset in ends.items()})
        finally:
            await consumer.stop()
