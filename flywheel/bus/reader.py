"""Read a topic from the beginning without joining a consumer group: an operator's read, not a member's.

For listing dead letters, tests, the simulators and benchmarks. Partitions are assigned by hand, so
nothing is committed and no group rebalances; the configured client (`FLYWHEEL_KAFKA_CLIENT`)
does the reading, like every other Kafka use of the loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from flywheel.bus.security import client_security
from flywheel.bus.types import Record
from flywheel.settings import Settings


class TopicReader(Protocol):
    def poll(self, max_records: int = 5000, timeout_s: float = 0.3) -> list[Record]:
        """The next records of any partition (none when nothing arrived within `timeout_s`)."""

    def caught_up(self) -> bool:
        """Whether every partition's position has reached the end the broker reports."""

    def close(self) -> None: ...


@contextmanager
def topic_reader(settings: Settings, topic: str) -> Iterator[TopicReader]:
    """Every partition of `topic`, from its first record on, read with the configured client."""
    reader: TopicReader
    if settings.kafka_client == "confluent":
        from flywheel.bus.confluent import ConfluentTopicReader

        reader = ConfluentTopicReader(settings.kafka_bootstrap_servers, topic, **client_security(settings))
    else:
        from flywheel.bus.kafka_python import KafkaPythonTopicReader

        reader = KafkaPythonTopicReader(settings.kafka_bootstrap_servers, topic, **client_security(settings))
    try:
        yield reader
    finally:
        reader.close()


def read_topic(settings: Settings, topic: str, timeout_s: float = 10.0) -> list[Record]:
    """Every record now in `topic`, in partition/offset order (what arrived within `timeout_s` at most)."""
    out: list[Record] = []
    deadline = time.monotonic() + timeout_s
    with topic_reader(settings, topic) as reader:
        # The embedded broker reports a partition's end as its last batch's base offset + 1, short of the
        # true end: read until that end is passed and then one poll comes back empty.
        while time.monotonic() < deadline:
            polled = reader.poll()
            out.extend(polled)
            if not polled and reader.caught_up():
                break
    return sorted(out, key=lambda r: (r.partition, r.offset))
