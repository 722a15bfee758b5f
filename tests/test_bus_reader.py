"""Reading a whole topic without a consumer group, through each Kafka client, on the embedded broker."""

from __future__ import annotations

import pytest

from flywheel.bus import Outgoing, ensure_topics, make_producer
from flywheel.bus.reader import read_topic, topic_reader
from flywheel.settings import Settings


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_read_topic_returns_every_record_in_partition_order_with_either_client(settings: Settings, client: str) -> None:
    s = settings.model_copy(update={"kafka_client": client})
    ensure_topics(s)
    sent = [Outgoing(s.events_topic, f"v{i}".encode(), f"k{i % 5}".encode(), (("h", b"1"),)) for i in range(40)]
    producer = make_producer(s)
    try:
        producer.send_all(sent[:25])
        producer.send_all(sent[25:])  # two produce batches: the embedded broker's end offset trails the first
    finally:
        producer.close()

    records = read_topic(s, s.events_topic)

    assert sorted(r.value for r in records) == sorted(m.value for m in sent)
    assert [(r.partition, r.offset) for r in records] == sorted((r.partition, r.offset) for r in records)
    assert {r.partition for r in records} == {0, 1}  # keys spread over both partitions
    by_value = {r.value: r.key for r in records}
    assert all(by_value[m.value] == m.key for m in sent)
    for p in (0, 1):  # offsets of a partition run from 0 without a gap
        offsets = [r.offset for r in records if r.partition == p]
        assert offsets == list(range(len(offsets)))
    # Reading again gives the same: nothing was committed, no group moved on.
    assert read_topic(s, s.events_topic) == records


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_a_topic_that_does_not_exist_reads_empty(settings: Settings, client: str) -> None:
    s = settings.model_copy(update={"kafka_client": client})
    with topic_reader(s, f"{s.events_topic}-absent") as reader:
        assert reader.poll(timeout_s=0.2) == [] and reader.caught_up()
