"""The Kafka interface's batch helpers, and the client set-up that its throughput depends on."""

from __future__ import annotations

import time

import pytest

from flywheel.bus import Outgoing, RecordBatch, ensure_topics, make_consumer, make_producer
from flywheel.settings import Settings


def test_offset_range_per_partition_whatever_the_order():
    batch = RecordBatch(
        topics=["a", "a", "b", "a", "b"], partitions=[0, 1, 0, 0, 0], offsets=[7, 3, 10, 5, 11], values=[b""] * 5
    )
    assert batch.offset_range() == {("a", 0): (5, 8), ("a", 1): (3, 4), ("b", 0): (10, 12)}
    assert batch.first_offsets() == {("a", 0): 5, ("a", 1): 3, ("b", 0): 10}
    assert batch.next_offsets() == {("a", 0): 8, ("a", 1): 4, ("b", 0): 12}
    assert RecordBatch([], [], [], []).offset_range() == {}


def test_kafka_python_checks_batch_crcs_in_c():
    """Without the `crc32c` package kafka-python computes every fetched batch's CRC in pure Python,
    five times slower to consume (bench/README.md)."""
    import crc32c
    from kafka.record import util

    assert util._crc32c is crc32c.crc32c  # kafka-python picks the C implementation when it imports


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_known_backlog_is_what_the_last_fetch_left_past_the_position(settings: Settings, client: str) -> None:
    """The signals worker polls again while the broker already holds more (`Consumer.known_backlog`, asked of no
    broker): more than 0 while a poll has taken part of what was fetched, 0 once it has taken all."""
    settings = settings.model_copy(update={"kafka_client": client})
    ensure_topics(settings)
    producer = make_producer(settings)
    producer.send_all([Outgoing(settings.events_topic, b"%d" % i, key=b"one partition") for i in range(50)])
    producer.close()
    consumer = make_consumer(settings, [settings.events_topic], f"g-backlog-{client}")
    try:
        taken, deadline = 0, time.monotonic() + 30
        while not taken and time.monotonic() < deadline:
            taken = len(consumer.poll_columns(10, 0.5))
        assert taken == 10 and consumer.known_backlog() == 40
        while taken < 50 and time.monotonic() < deadline:
            taken += len(consumer.poll_columns(100, 0.5))
        assert taken == 50 and consumer.known_backlog() == 0
    finally:
        consumer.close()


def test_a_kafka_python_consumer_that_works_between_polls_joins_its_group(settings: Settings) -> None:
    """kafka-python ends a group join only inside a poll, and the coordinator answers a join after its rebalance
    delay (3 s): a worker that polls for a second and then works for a second had every answer land between
    polls, and rejoined for as long as it ran (before: not assigned after 60 s). Now a poll of a consumer with no
    partitions goes on until the join ends."""
    ensure_topics(settings)
    consumer = make_consumer(settings, [settings.events_topic], "g-gaps")
    try:
        started, polls = time.monotonic(), 0
        while not consumer.assignment() and polls < 3:
            consumer.poll_columns(100, 1.0)
            polls += 1
            time.sleep(1.0)  # the worker's own work between polls
        assert consumer.assignment(), f"not assigned after {polls} polls, {time.monotonic() - started:.0f} s"
    finally:
        consumer.close()


def test_batch_murmur2_is_kafkas_key_hash_at_every_length():
    """`flywheel.bus.murmur2` hashes a batch of keys with numpy; kafka-python's pure-Python murmur2 (the Java
    client's) is the reference, for keys of every length up to 40 bytes and every byte value."""
    import random

    from kafka.partitioner.default import murmur2 as reference

    from flywheel.bus.murmur2 import key_partitions, murmur2

    rng = random.Random(7)
    keys = [bytes(rng.randrange(256) for _ in range(n % 41)) for n in range(2000)]
    assert murmur2(keys).tolist() == [reference(k) & 0xFFFFFFFF for k in keys]
    assert key_partitions(keys, [5, 3, 4]) == [[3, 4, 5][(reference(k) & 0x7FFFFFFF) % 3] for k in keys]
    assert murmur2([]).tolist() == []


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_each_client_puts_each_key_where_kafkas_default_partitioner_does(settings: Settings, client: str) -> None:
    """Both clients partition keys as Kafka's default (Java) partitioner does, kafka-python's producer with its own
    batch of numpy (`flywheel.bus.murmur2`), librdkafka set to `murmur2_random`: a generation's events land in one
    partition whichever client wrote them. Keyless records still go somewhere."""
    from kafka.partitioner.default import murmur2 as reference

    settings = settings.model_copy(update={"kafka_client": client})
    ensure_topics(settings)
    keys = [f"gen-{i:05d}".encode() for i in range(200)] + [b"", b"x" * 37]
    producer = make_producer(settings)
    try:
        messages = [Outgoing(settings.events_topic, k, key=k) for k in keys]
        producer.send_all([*messages, Outgoing(settings.events_topic, b"no key")])
    finally:
        producer.close()
    consumer = make_consumer(settings, [settings.events_topic], f"g-partitions-{client}")
    landed: dict[bytes, int] = {}
    try:
        deadline = time.monotonic() + 30
        while len(landed) < len(keys) + 1 and time.monotonic() < deadline:
            batch = consumer.poll_columns(500, 0.5)
            landed.update(zip(batch.values, batch.partitions, strict=True))
    finally:
        consumer.close()
    n = settings.topic_partitions
    assert {k: landed[k] for k in keys} == {k: (reference(k) & 0x7FFFFFFF) % n for k in keys}
    assert b"no key" in landed
