"""Read a whole topic from the beginning without joining a group (for listing and tests).

Uses kafka-python's manual assignment directly, like `flywheel.bus.ensure_topics`
uses its admin client: this is an operator's read, not a consumer-group member.
"""

from __future__ import annotations

import time

from flywheel.bus import Record
from flywheel.settings import Settings


def read_topic(settings: Settings, topic: str, timeout_s: float = 10.0) -> list[Record]:
    """Every record now in `topic`, in partition/offset order."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap_servers.split(","), enable_auto_commit=False, group_id=None
    )
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not tps:
            return []
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        # The embedded broker answers ListOffsets with the last batch's base offset + 1, not the end:
        # read until the reported end is passed and then one poll comes back empty.
        end = consumer.end_offsets(tps)
        out: list[Record] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            polled = consumer.poll(timeout_ms=300, max_records=5000)
            for msgs in polled.values():
                out.extend(Record(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp) for m in msgs)
            if not polled and all(consumer.position(tp) >= end[tp] for tp in tps):
                break
        return sorted(out, key=lambda r: (r.partition, r.offset))
    finally:
        consumer.close()
