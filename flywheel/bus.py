"""One small Kafka interface with both clients behind it.

kafka-python is the default (the user's choice); confluent-kafka (librdkafka) is
chosen with `FLYWHEEL_KAFKA_CLIENT=confluent`. Components only ever see
`Producer`, `Consumer` and `Record` (or `RecordBatch`, the same records column-wise, for
consumers that handle whole batches and cannot afford one object per record).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from flywheel.settings import Settings

log = logging.getLogger(__name__)


class BrokerUnavailable(RuntimeError):
    """Kafka did not acknowledge in time: the caller must not report success."""


@dataclass(frozen=True, slots=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class RecordBatch:
    """Polled records column-wise: element i of every list belongs to the same record."""

    topics: list[str]
    partitions: list[int]
    offsets: list[int]
    values: list[bytes]

    def __len__(self) -> int:
        return len(self.offsets)

    @classmethod
    def from_records(cls, records: Sequence[Record]) -> RecordBatch:
        return cls(
            [r.topic for r in records], [r.partition for r in records], [r.offset for r in records],
            [r.value for r in records],
        )

    def offset_range(self) -> dict[tuple[str, int], tuple[int, int]]:
        """Per (topic, partition): the batch's first offset, and the offset to commit after it (last + 1)."""
        if not self.offsets:
            return {}
        import polars as pl

        frame = pl.DataFrame(
            {"topic": self.topics, "partition": self.partitions, "offset": self.offsets},
            schema={"topic": pl.String, "partition": pl.Int64, "offset": pl.Int64},
        )
        ranges = frame.group_by("topic", "partition").agg(
            pl.col("offset").min().alias("first"), (pl.col("offset").max() + 1).alias("end")
        )
        return {(topic, partition): (first, end) for topic, partition, first, end in ranges.iter_rows()}

    def next_offsets(self) -> dict[tuple[str, int], int]:
        """The offsets to commit after processing the batch (last offset + 1 per partition)."""
        return {key: end for key, (_, end) in self.offset_range().items()}

    def first_offsets(self) -> dict[tuple[str, int], int]:
        return {key: first for key, (first, _) in self.offset_range().items()}


@dataclass(frozen=True, slots=True)
class Outgoing:
    topic: str
    value: bytes
    key: bytes | None = None
    headers: tuple[tuple[str, bytes], ...] = ()


class Producer(Protocol):
    def send_all(self, messages: Sequence[Outgoing], timeout_s: float = 10.0) -> None:
        """Send and wait until the broker acknowledged every message; raise `BrokerUnavailable` if not."""

    def close(self) -> None: ...


class Consumer(Protocol):
    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]: ...

    def poll_columns(self, max_records: int = 500, timeout_s: float = 1.0) -> RecordBatch:
        """Like `poll_batch`, column-wise and without keys or timestamps (no object per record)."""

    def assignment_epoch(self) -> int:
        """A number that changes whenever the group hands this consumer partitions: state kept per partition
        since the last change may be stale (another member may have owned the partition meanwhile)."""

    def commit(self, next_offsets: dict[tuple[str, int], int], *, wait: bool = True) -> None:
        """Commit, per (topic, partition), the offset of the next record to read. `wait=False` sends the commit
        and returns: it lands during later polls, or is lost with the process (a failed one is logged)."""

    def assignment(self) -> set[tuple[str, int]]: ...

    def seek(self, topic: str, partition: int, offset: int) -> None: ...

    def lag(self) -> dict[tuple[str, int], int]:
        """Per assigned (topic, partition): records between this consumer's position and the partition end
        (never negative). Asks the broker: call it every few seconds, not per batch."""

    def close(self) -> None: ...


def next_offsets(records: Sequence[Record]) -> dict[tuple[str, int], int]:
    """The offsets to commit after processing `records` (last offset + 1 per partition)."""
    return RecordBatch.from_records(records).next_offsets()


# ---------------------------------------------------------------- kafka-python


class KafkaPythonProducer:
    def __init__(self, bootstrap: str, **config: object) -> None:
        from kafka import KafkaProducer

        max_block_ms = config.pop("max_block_ms", 10_000)
        self._p = KafkaProducer(
            bootstrap_servers=bootstrap.split(","),
            acks="all",
            linger_ms=5,
            retries=5,
            max_block_ms=max_block_ms,
            # kafka-python's own default blocks the constructor 30 s when no broker answers, whatever max_block_ms.
            bootstrap_timeout_ms=config.pop("bootstrap_timeout_ms", max_block_ms),
            **config,
        )

    def send_all(self, messages: Sequence[Outgoing], timeout_s: float = 10.0) -> None:
        from kafka.errors import KafkaError

        try:
            futures = [
                self._p.send(m.topic, value=m.value, key=m.key, headers=list(m.headers) or None) for m in messages
            ]
            self._p.flush(timeout=timeout_s)
            for f in futures:
                f.get(timeout=timeout_s)
        except KafkaError as exc:
            raise BrokerUnavailable(f"Kafka did not acknowledge: {exc}") from exc

    def close(self) -> None:
        self._p.close(timeout=5)


class KafkaPythonConsumer:
    def __init__(self, bootstrap: str, topics: Sequence[str], group_id: str, **config: object) -> None:
        from kafka import ConsumerRebalanceListener, KafkaConsumer

        self._epoch = 0
        consumer = self

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked: object) -> None:
                pass

            def on_partitions_assigned(self, assigned: object) -> None:
                consumer._epoch += 1

        self._c = KafkaConsumer(
            bootstrap_servers=bootstrap.split(","),
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # The embedded broker takes about half the session timeout to complete a join.
            session_timeout_ms=config.pop("session_timeout_ms", 6000),
            heartbeat_interval_ms=config.pop("heartbeat_interval_ms", 1000),
            max_poll_records=config.pop("max_poll_records", 2000),
            **config,
        )
        self._c.subscribe(list(topics), listener=_Listener())

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        polled = self._c.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out: list[Record] = []
        for msgs in polled.values():
            for m in msgs:
                out.append(Record(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp))
        return out

    def poll_columns(self, max_records: int = 500, timeout_s: float = 1.0) -> RecordBatch:
        polled = self._c.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        msgs = [m for batch in polled.values() for m in batch]
        return RecordBatch(
            [m.topic for m in msgs], [m.partition for m in msgs], [m.offset for m in msgs], [m.value for m in msgs]
        )

    def assignment_epoch(self) -> int:
        return self._epoch

    def commit(self, next_offsets: dict[tuple[str, int], int], *, wait: bool = True) -> None:
        from kafka.structs import OffsetAndMetadata, TopicPartition

        if not next_offsets:
            return
        offsets = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in next_offsets.items()}
        if wait:
            self._c.commit(offsets)
        else:
            self._c.commit_async(offsets, callback=_log_commit_failure)

    def assignment(self) -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in self._c.assignment()}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        from kafka.structs import TopicPartition

        self._c.seek(TopicPartition(topic, partition), offset)

    def lag(self) -> dict[tuple[str, int], int]:
        parts = list(self._c.assignment())
        if not parts:
            return {}
        ends = self._c.end_offsets(parts, timeout_ms=5000)
        # Clamped: a broker whose end offset trails the true end (the embedded Tansu may) must not read negative.
        return {
            (tp.topic, tp.partition): max(0, ends[tp] - self._c.position(tp, timeout_ms=5000)) for tp in parts
        }

    def close(self) -> None:
        self._c.close(autocommit=False)


def _log_commit_failure(offsets: object, response: object) -> None:
    if isinstance(response, Exception):
        log.warning("offset commit failed (the records are read again after a restart): %s", response)


# ---------------------------------------------------------------- factories


def make_producer(settings: Settings, **config: object) -> Producer:
    if settings.kafka_client == "confluent":
        from flywheel.bus_confluent import ConfluentProducer

        return ConfluentProducer(settings.kafka_bootstrap_servers, **config)
    return KafkaPythonProducer(settings.kafka_bootstrap_servers, **config)


def make_consumer(settings: Settings, topics: Sequence[str], group_id: str, **config: object) -> Consumer:
    if settings.kafka_client == "confluent":
        from flywheel.bus_confluent import ConfluentConsumer

        return ConfluentConsumer(settings.kafka_bootstrap_servers, topics, group_id, **config)
    return KafkaPythonConsumer(settings.kafka_bootstrap_servers, topics, group_id, **config)


def ensure_topics(settings: Settings, names: Sequence[str] | None = None) -> None:
    """Create the loop's topics (idempotent) with the configured partition count."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    names = list(names or (settings.events_topic, settings.rewards_topic, settings.dead_letter_topic))
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers.split(","))
    try:
        existing = set(admin.list_topics())
        missing = [n for n in names if n not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics([NewTopic(n, settings.topic_partitions, 1) for n in missing])
            log.info("created topics %s with %d partitions", missing, settings.topic_partitions)
    finally:
        admin.close()
