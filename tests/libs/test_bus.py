"""The bus contract. Every test runs on the in-process bus and on real Kafka, so the
embedded mode keeps Kafka's semantics."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from temper.bus import Bus, InProcessBus, KafkaBus, Poison, Record
from temper.events import InferenceRequest, Topics


@pytest.fixture(params=["inprocess", pytest.param("kafka", marks=pytest.mark.kafka)])
async def bus(request):
    if request.param == "kafka":
        bootstrap = request.getfixturevalue("kafka_bootstrap")
        b: Bus = KafkaBus(bootstrap=bootstrap, partitions=3, max_retries=2, retry_backoff_s=0.01)
    else:
        b = InProcessBus(partitions=3, max_retries=2, retry_backoff_s=0.01)
    await b.start()
    yield b
    await b.stop()


async def wait_for(predicate, limit_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


async def test_keyed_messages_keep_their_order_within_a_key(bus: Bus, unique: str):
    topic = f"t-order-{unique}"
    await bus.create_topics([topic])
    seen: dict[str, list[int]] = defaultdict(list)
    partitions: dict[str, set[int]] = defaultdict(set)

    async def handle(record: Record) -> None:
        seen[record.key].append(int(record.value))
        partitions[record.key].add(record.partition)

    await bus.subscribe([topic], f"g-{unique}", handle)
    for i in range(20):
        for key in ("episode-a", "episode-b", "episode-c"):
            await bus.send(topic, str(i).encode(), key=key)
    await wait_for(lambda: sum(len(v) for v in seen.values()) == 60)
    for key in ("episode-a", "episode-b", "episode-c"):
        assert seen[key] == list(range(20))
        assert len(partitions[key]) == 1


async def test_group_members_share_partitions_and_each_message_is_handled_once(bus: Bus, unique: str):
    topic = f"t-group-{unique}"
    await bus.create_topics([topic])
    handled: dict[str, list[int]] = {"a": [], "b": []}

    def handler(name: str):
        async def handle(record: Record) -> None:
            handled[name].append(int(record.value))

        return handle

    a = await bus.subscribe([topic], f"g-{unique}", handler("a"))
    b = await bus.subscribe([topic], f"g-{unique}", handler("b"))
    await asyncio.sleep(3 if isinstance(bus, KafkaBus) else 0)  # let the group settle
    for i in range(60):
        await bus.send(topic, str(i).encode(), key=f"k{i}")
    await wait_for(lambda: len(handled["a"]) + len(handled["b"]) >= 60)
    await asyncio.sleep(0.5)
    everything = sorted(handled["a"] + handled["b"])
    assert everything == list(range(60))
    assert handled["a"] and handled["b"], "both members got partitions"
    await a.stop()
    await b.stop()


async def test_a_member_that_dies_before_committing_has_its_messages_redelivered(bus: Bus, unique: str):
    topic = f"t-crash-{unique}"
    group = f"g-{unique}"
    await bus.create_topics([topic], partitions=1)
    started = asyncio.Event()

    async def dies_mid_handling(record: Record) -> None:
        started.set()
        await asyncio.sleep(3600)  # the process "dies" here: it never returns, never commits

    survivor_got: list[bytes] = []

    async def survivor(record: Record) -> None:
        survivor_got.append(record.value)

    doomed = await bus.subscribe([topic], group, dies_mid_handling)
    await bus.send(topic, b"work-1", key="e1")
    await asyncio.wait_for(started.wait(), 30)
    other = await bus.subscribe([topic], group, survivor)
    await doomed.stop()
    await wait_for(lambda: survivor_got == [b"work-1"], limit_s=45)
    await bus.send(topic, b"work-2", key="e1")
    await wait_for(lambda: survivor_got == [b"work-1", b"work-2"])
    await other.stop()


async def test_poison_messages_go_to_the_dead_letter_topic_after_the_retry_bound(bus: Bus, unique: str):
    topic = f"t-poison-{unique}"
    await bus.create_topics([topic])
    attempts: dict[bytes, int] = defaultdict(int)
    good: list[bytes] = []

    async def handle(record: Record) -> None:
        attempts[record.value] += 1
        if record.value == b"bad":
            raise RuntimeError("cannot handle this")
        if record.value == b"never":
            raise Poison("malformed beyond repair")
        good.append(record.value)

    dead: list[Record] = []

    async def collect(record: Record) -> None:
        dead.append(record)

    await bus.subscribe([topic], f"g-{unique}", handle)
    await bus.subscribe([Topics.dead_letter(topic)], f"dlq-{unique}", collect)
    for value in (b"bad", b"ok-1", b"never", b"ok-2"):
        await bus.send(topic, value, key="same-key")
    await wait_for(lambda: len(dead) == 2 and len(good) == 2)
    assert attempts[b"bad"] == bus.max_retries + 1
    assert attempts[b"never"] == 1, "a Poison is not retried"
    assert good == [b"ok-1", b"ok-2"], "the partition keeps flowing past a poison message"
    by_value = {r.value: r for r in dead}
    assert "cannot handle this" in by_value[b"bad"].headers["temper.dlq.error"]
    assert by_value[b"bad"].headers["temper.dlq.source"].startswith(f"{topic}/")
    assert by_value[b"never"].headers["temper.dlq.attempts"] == str(bus.max_retries + 1)


async def test_pause_stops_delivery_and_resume_restarts_it(bus: Bus, unique: str):
    topic = f"t-pause-{unique}"
    await bus.create_topics([topic])
    got: list[bytes] = []

    async def handle(record: Record) -> None:
        got.append(record.value)

    consumer = await bus.subscribe([topic], f"g-{unique}", handle)
    await bus.send(topic, b"before", key="k")
    await wait_for(lambda: got == [b"before"])
    consumer.pause()
    assert consumer.paused
    await bus.send(topic, b"while-paused", key="k")
    await asyncio.sleep(1.5)
    assert got == [b"before"]
    consumer.resume()
    await wait_for(lambda: got == [b"before", b"while-paused"])


async def test_a_group_started_at_the_end_reads_only_what_is_sent_after_and_an_old_group_keeps_its_place(
    bus: Bus, unique: str
):
    topic = f"t-end-{unique}"
    await bus.create_topics([topic])
    for i in range(6):
        await bus.send(topic, f"old-{i}".encode(), key=f"k{i}")
    # a group that read part of the topic before, and stopped
    seen_old: list[str] = []

    async def old_reader(record: Record) -> None:
        seen_old.append(record.value.decode())

    first = await bus.subscribe([topic], f"g-old-{unique}", old_reader)
    await wait_for(lambda: len(seen_old) == 6)
    await first.stop()
    for i in range(3):
        await bus.send(topic, f"between-{i}".encode(), key=f"k{i}")

    await bus.start_group_at_end(f"g-new-{unique}", [topic])
    await bus.start_group_at_end(f"g-old-{unique}", [topic])  # has offsets: left where it was
    seen_new: list[str] = []
    seen_again: list[str] = []

    async def new_reader(record: Record) -> None:
        seen_new.append(record.value.decode())

    async def old_again(record: Record) -> None:
        seen_again.append(record.value.decode())

    new = await bus.subscribe([topic], f"g-new-{unique}", new_reader)
    again = await bus.subscribe([topic], f"g-old-{unique}", old_again)
    for i in range(4):
        await bus.send(topic, f"new-{i}".encode(), key=f"k{i}")
    await wait_for(lambda: len(seen_new) >= 4 and len(seen_again) >= 7)
    await asyncio.sleep(0.3)
    assert sorted(seen_new) == [f"new-{i}" for i in range(4)]
    assert sorted(seen_again) == sorted([f"between-{i}" for i in range(3)] + [f"new-{i}" for i in range(4)])
    await new.stop()
    await again.stop()


async def test_messages_round_trip_as_typed_events(bus: Bus, unique: str):
    from temper.events import decode

    topic = f"t-typed-{unique}"
    await bus.create_topics([topic])
    got = []

    async def handle(record: Record) -> None:
        got.append((record.key, decode(record.value)))

    await bus.subscribe([topic], f"g-{unique}", handle)
    msg = InferenceRequest(
        job_id="j1", episode_id="e1", turn=2, attempt=1, model="tiny", prompt_ids=[1, 2, 3]
    )
    await bus.send_message(topic, msg)
    await wait_for(lambda: len(got) == 1)
    key, decoded = got[0]
    assert key == "e1"
    assert decoded == msg


async def test_sending_to_a_missing_topic_fails_on_the_in_process_bus():
    bus = InProcessBus()
    with pytest.raises(KeyError, match="does not exist"):
        await bus.send("nope", b"x")


async def test_an_unreachable_broker_gives_an_error_naming_the_setting():
    from temper.bus import BusUnavailable

    bus = KafkaBus(bootstrap="127.0.0.1:1", connect_timeout_s=2)
    with pytest.raises(BusUnavailable, match="TEMPER_BUS__BOOTSTRAP='127.0.0.1:1'"):
        await bus.start()


@pytest.mark.kafka
async def test_kafka_handles_other_keys_of_a_batch_while_one_key_waits_and_keeps_each_key_in_order(
    kafka_bootstrap, unique: str
):
    # Kafka-only: the in-process bus handles a partition's records one at a time, a
    # stronger order than the contract asks for.
    bus = KafkaBus(bootstrap=kafka_bootstrap, partitions=1)
    await bus.start()
    topic = f"t-keys-{unique}"
    await bus.create_topics([topic], partitions=1)  # every key on one partition
    release = asyncio.Event()
    seen: list[tuple[str, int]] = []

    async def handle(record: Record) -> None:
        if (record.key, record.value) == ("slow", b"0"):
            await release.wait()
        seen.append((record.key or "", int(record.value)))

    try:
        # Sent before the group joins, so the first fetch brings them as one batch.
        await bus.send(topic, b"0", key="slow")
        for i in range(5):
            await bus.send(topic, str(i).encode(), key="fast")
        await bus.send(topic, b"1", key="slow")
        await bus.subscribe([topic], f"g-{unique}", handle, concurrency=4)
        await wait_for(lambda: [v for k, v in seen if k == "fast"] == list(range(5)))
        assert ("slow", 1) not in seen, "a key's next record waits for the one before it"
        release.set()
        await wait_for(lambda: len(seen) == 7)
        assert [v for k, v in seen if k == "slow"] == [0, 1]
    finally:
        release.set()
        await bus.stop()


@pytest.mark.kafka
@pytest.mark.parametrize("batch_fails", [False, True])
async def test_kafka_offers_a_batch_the_first_record_of_each_key_and_the_rest_go_one_by_one_in_order(
    kafka_bootstrap, unique: str, batch_fails: bool
):
    bus = KafkaBus(bootstrap=kafka_bootstrap, partitions=1)
    await bus.start()
    topic = f"t-batch-{unique}"
    await bus.create_topics([topic], partitions=1)
    one: list[tuple[str, int]] = []
    batches: list[list[tuple[str, int]]] = []

    async def handle(record: Record) -> None:
        one.append((record.key or "", int(record.value)))

    async def handle_batch(records: list[Record]) -> bool:
        batch = [(r.key or "", int(r.value)) for r in records]
        if batch_fails:
            raise RuntimeError("the batch's transaction failed")
        batches.append(batch)
        return True

    try:
        # Sent before the group joins, so the first fetch brings them as one batch.
        for key, value in [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1)]:
            await bus.send(topic, str(value).encode(), key=key)
        await bus.subscribe([topic], f"g-{unique}", handle, concurrency=4, batch_handler=handle_batch)
        if batch_fails:  # nothing was taken: every record alone, each key in order
            await wait_for(lambda: len(one) == 5)
            assert sorted(one) == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0)]
            assert [v for k, v in one if k == "a"] == [0, 1] and [v for k, v in one if k == "b"] == [0, 1]
        else:
            await wait_for(lambda: len(one) == 2)
            assert batches == [[("a", 0), ("b", 0), ("c", 0)]]
            assert sorted(one) == [("a", 1), ("b", 1)], "each record once: the batch's, then the rest"
    finally:
        await bus.stop()


@pytest.mark.kafka
async def test_kafka_workers_go_on_while_a_commit_is_in_flight_and_a_member_hands_over_what_it_handled(
    kafka_bootstrap, unique: str
):
    """One committer commits every partition's handled offsets in one request; no worker
    waits for it. A member that loses partitions commits what it handled before they go."""
    bus = KafkaBus(bootstrap=kafka_bootstrap, partitions=3)
    await bus.start()
    topic, group = f"t-commit-{unique}", f"g-{unique}"
    await bus.create_topics([topic], partitions=3)
    first: list[tuple[int, bytes]] = []
    second: list[tuple[int, bytes]] = []

    async def handle_first(record: Record) -> None:
        first.append((record.partition, record.value))

    async def handle_second(record: Record) -> None:
        second.append((record.partition, record.value))

    try:
        member = await bus.subscribe([topic], group, handle_first)
        inner = member._consumer  # type: ignore[attr-defined]
        real_commit = inner.commit
        gate = asyncio.Event()
        requests: list[dict[int, int]] = []

        async def commit(offsets) -> None:  # noqa: ANN001 - aiokafka's offsets
            requests.append({tp.partition: meta.offset for tp, meta in offsets.items()})
            if len(requests) == 1:
                await gate.wait()  # the broker is slow to answer the first commit
            await real_commit(offsets)

        inner.commit = commit
        await bus.send(topic, b"first", key="k-first")
        await wait_for(lambda: len(requests) == 1)
        for i in range(30):
            await bus.send(topic, str(i).encode(), key=f"k{i}")
        await wait_for(lambda: len(first) == 31)  # handled while the first commit waits
        assert len(requests) == 1, "no worker commits on its own"
        ends = {p: sum(1 for q, _ in first if q == p) for p in {q for q, _ in first}}
        assert len(ends) == 3, "the keys cover the three partitions"

        # A second member joins: the first loses partitions, with the first commit still stuck.
        await bus.subscribe([topic], group, handle_second)
        await asyncio.sleep(1)
        gate.set()
        await wait_for(lambda: requests[-1] == ends)
        assert len(requests) == 2, "the next commit took every partition's batches in one request"
        for i in range(30, 60):
            await bus.send(topic, str(i).encode(), key=f"k{i}")
        await wait_for(lambda: len(first) + len(second) == 61)
        await asyncio.sleep(0.5)
        assert second, "the second member got partitions"
        values = sorted(int(v) for _, v in first + second if v != b"first")
        assert values == list(range(60)), "every message handled once: none again after the handover"
    finally:
        await bus.stop()


@pytest.mark.kafka
async def test_kafka_namespaces_keep_deployments_on_one_cluster_apart(kafka_bootstrap, unique: str):
    staging = KafkaBus(
        bootstrap=kafka_bootstrap,
        partitions=1,
        max_retries=0,
        retry_backoff_s=0.01,
        namespace=f"staging-{unique}.",
    )
    prod = KafkaBus(
        bootstrap=kafka_bootstrap,
        partitions=1,
        max_retries=0,
        retry_backoff_s=0.01,
        namespace=f"prod-{unique}.",
    )
    seen: dict[str, list[tuple[str, bytes]]] = {"staging": [], "prod": []}

    def handler(name: str):
        async def handle(record: Record) -> None:
            if record.value == b"poison":
                raise Poison("never succeeds")
            seen[name].append((record.topic, record.value))

        return handle

    try:
        for name, bus in (("staging", staging), ("prod", prod)):
            await bus.start()
            await bus.create_topics(["work"])
            # The same plain topic and group names in both deployments.
            await bus.subscribe(["work"], "workers", handler(name))
        await staging.send("work", b"for staging", key="k")
        await staging.send("work", b"poison", key="k")
        await prod.send("work", b"for prod", key="k")
        await wait_for(lambda: seen["staging"] and seen["prod"])
        assert seen == {"staging": [("work", b"for staging")], "prod": [("work", b"for prod")]}, (
            "handlers see plain topic names, and only their own deployment's messages"
        )
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            on_broker = {t for t in await admin.list_topics() if unique in t}
            groups = {g[0] for g in await admin.list_consumer_groups() if unique in g[0]}
        finally:
            await admin.close()
        assert on_broker == {f"{ns}-{unique}.{t}" for ns in ("staging", "prod") for t in ("work", "work.dlq")}
        assert groups == {f"staging-{unique}.workers", f"prod-{unique}.workers"}
        # The poison message went to staging's own dead-letter topic.
        dead: list[bytes] = []

        async def collect(record: Record) -> None:
            dead.append(record.value)

        await staging.subscribe(["work.dlq"], "dlq-reader", collect)
        await wait_for(lambda: dead == [b"poison"])
    finally:
        await staging.stop()
        await prod.stop()


async def test_a_dependency_outage_is_waited_out_and_never_dead_letters(bus: Bus, unique: str):
    """A handler that fails because the database is unreachable is retried (with backoff)
    for as long as the outage lasts, far past the retry bound, and the record is handled
    once the dependency is back; a failure of the message's own goes to the DLQ as before."""
    from sqlalchemy.exc import OperationalError

    topic = f"t-outage-{unique}"
    await bus.create_topics([topic])
    outage_attempts = bus.max_retries + 4
    attempts: dict[bytes, int] = defaultdict(int)
    handled: list[bytes] = []
    dead: list[Record] = []

    async def handle(record: Record) -> None:
        attempts[record.value] += 1
        if record.value == b"during-outage" and attempts[record.value] <= outage_attempts:
            raise OperationalError("SELECT 1", {}, ConnectionRefusedError(111, "Connection refused"))
        if record.value == b"broken":
            raise ValueError("this message is wrong")
        handled.append(record.value)

    async def collect(record: Record) -> None:
        dead.append(record)

    await bus.subscribe([topic], f"g-{unique}", handle)
    await bus.subscribe([Topics.dead_letter(topic)], f"dlq-{unique}", collect)
    for value in (b"during-outage", b"after", b"broken"):
        await bus.send(topic, value, key="one-key")
    await wait_for(lambda: handled == [b"during-outage", b"after"] and len(dead) == 1)
    assert attempts[b"during-outage"] == outage_attempts + 1, "retried past the bound, not dead-lettered"
    assert [r.value for r in dead] == [b"broken"]
    assert attempts[b"broken"] == bus.max_retries + 1


def test_outage_errors_are_told_apart_from_errors_of_the_message():
    import asyncpg
    import urllib3
    import urllib3.exceptions
    from aiokafka.errors import KafkaConnectionError
    from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError

    from temper.bus.errors import unavailable_dependency

    refused = ConnectionRefusedError(111, "Connection refused")
    assert unavailable_dependency(OperationalError("x", {}, refused)) == "database"
    assert unavailable_dependency(InterfaceError("x", {}, Exception("connection is closed"))) == "database"
    assert unavailable_dependency(asyncpg.exceptions.AdminShutdownError("terminating")) == "database"
    pool = urllib3.HTTPConnectionPool("127.0.0.1", 9)
    assert unavailable_dependency(urllib3.exceptions.MaxRetryError(pool, "/b/k")) == "object_store"
    assert unavailable_dependency(KafkaConnectionError("down")) == "kafka"
    assert unavailable_dependency(refused) == "network"
    try:
        try:
            raise refused
        except OSError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as wrapped:
        assert unavailable_dependency(wrapped) == "network", "found through the cause"
    assert unavailable_dependency(IntegrityError("x", {}, Exception("duplicate key"))) is None
    assert unavailable_dependency(ValueError("bad json")) is None
    assert unavailable_dependency(FileNotFoundError(2, "no such file")) is None


async def test_the_in_process_lag_counts_what_a_group_has_not_committed():
    bus = InProcessBus(partitions=3)
    await bus.create_topics(["t-lag"])
    for i in range(5):
        await bus.send("t-lag", str(i).encode(), key=f"k{i}")
    assert bus.lag("t-lag", "nobody") == 5
    await bus.start_group_at_end("late", ["t-lag"])
    assert bus.lag("t-lag", "late") == 0
    release = asyncio.Event()
    handled: list[int] = []

    async def handle(record: Record) -> None:
        if record.value == b"4":
            await release.wait()
        handled.append(int(record.value))

    consumer = await bus.subscribe(["t-lag"], "g", handle, concurrency=4)
    await wait_for(lambda: len(handled) == 4)
    await asyncio.sleep(0.05)
    # the record still in hand is not committed, nor anything after it in its partition
    assert 1 <= bus.lag("t-lag", "g") <= 2
    release.set()
    await wait_for(lambda: bus.lag("t-lag", "g") == 0)
    await bus.send("t-lag", b"5", key="k5")
    assert bus.lag("t-lag", "late") == 1
    await wait_for(lambda: bus.lag("t-lag", "g") == 0 and 5 in handled)
    await consumer.stop()
