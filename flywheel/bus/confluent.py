"""confluent-kafka (librdkafka) behind the `Producer` / `Consumer` interface of `flywheel.bus`.

Chosen with `FLYWHEEL_KAFKA_CLIENT=confluent`. Configuration keyword arguments may use
librdkafka names (`"queue.buffering.max.ms"`, or with underscores) or the few
kafka-python names the components pass (`max_block_ms`, `max_request_size`, ...).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

from flywheel.bus.types import BrokerUnavailable, MessageTooLarge, Outgoing, Record, RecordBatch

log = logging.getLogger(__name__)

# kafka-python names used by callers -> librdkafka names (None: no librdkafka equivalent, ignored).
_KAFKA_PYTHON_NAMES: dict[str, str | None] = {
    "max_block_ms": "message.timeout.ms",
    "max_request_size": "message.max.bytes",
    "bootstrap_timeout_ms": None,
    "session_timeout_ms": "session.timeout.ms",
    "heartbeat_interval_ms": "heartbeat.interval.ms",
    "max_poll_records": None,
    "linger_ms": "linger.ms",
    "sasl_plain_username": "sasl.username",
    "sasl_plain_password": "sasl.password",
    "ssl_cafile": "ssl.ca.location",
}


def _librdkafka_config(config: dict[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in config.items():
        if key in _KAFKA_PYTHON_NAMES:
            name = _KAFKA_PYTHON_NAMES[key]
            if name is not None:
                out[name] = value
        else:
            out[key.replace("_", ".")] = value
    return out


class ConfluentProducer:
    def __init__(self, bootstrap: str, **config: object) -> None:
        from confluent_kafka import Producer as RdProducer

        self._p = RdProducer(
            {
                "bootstrap.servers": bootstrap,
                "acks": "all",
                "enable.idempotence": False,  # the embedded broker does not hand out producer ids
                "linger.ms": 5,
                "message.timeout.ms": 10_000,
                # Kafka's default key partitioning (the Java client's and kafka-python's), not librdkafka's CRC32:
                # a generation's events land in one partition whichever client wrote them
                "partitioner": "murmur2_random",
                **_librdkafka_config(config),
            }
        )

    def send_all(self, messages: Sequence[Outgoing], timeout_s: float = 10.0) -> None:
        from confluent_kafka import KafkaError, KafkaException

        errors: list[str] = []
        too_large: list[str] = []

        def delivered(err: object, _msg: object) -> None:
            if err is not None:
                is_size = isinstance(err, KafkaError) and err.code() == KafkaError.MSG_SIZE_TOO_LARGE
                (too_large if is_size else errors).append(str(err))

        for m in messages:
            while True:
                try:
                    self._p.produce(
                        m.topic,
                        value=m.value,
                        key=m.key,
                        headers=list(m.headers) or None,
                        on_delivery=delivered,
                    )
                    break
                except BufferError:  # local queue full: let deliveries drain it
                    self._p.poll(0.05)
                except KafkaException as exc:
                    err = exc.args[0] if exc.args else None
                    if isinstance(err, KafkaError) and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                        self._p.flush(timeout_s)  # what was queued before it goes out; the caller reports none
                        raise MessageTooLarge(f"a message is too large for Kafka: {err}") from exc
                    raise BrokerUnavailable(f"Kafka refused a message: {exc}") from exc
        remaining = self._p.flush(timeout_s)
        if too_large:
            raise MessageTooLarge(f"a message is too large for Kafka: {too_large[0]}")
        if remaining:
            raise BrokerUnavailable(f"Kafka did not acknowledge {remaining} message(s) within {timeout_s}s")
        if errors:
            raise BrokerUnavailable(f"Kafka did not acknowledge: {errors[0]}")

    def close(self) -> None:
        self._p.flush(5)


def _log_commit_failure(err: object, _partitions: object) -> None:
    if err is not None:
        log.warning("offset commit failed (the records are read again after a restart): %s", err)


class ConfluentConsumer:
    def __init__(self, bootstrap: str, topics: Sequence[str], group_id: str, **config: object) -> None:
        from confluent_kafka import Consumer as RdConsumer

        self._c = RdConsumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": group_id,
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 1000,
                # With the default (1000 ms), a partition whose prefetch queue was full waits a whole second
                # before its next fetch, and a consumer that drains fast stalls: measured 210k events/s
                # sustained from the embedded broker with it, against the queue's ~1M/s.
                "fetch.queue.backoff.ms": 10,
                "on_commit": _log_commit_failure,
                **_librdkafka_config(config),
            }
        )
        self._epoch = 0
        # librdkafka applies the assignment itself after the callback; the callback only counts.
        self._c.subscribe(list(topics), on_assign=self._assigned)

    def _assigned(self, _consumer: object, _partitions: object) -> None:
        self._epoch += 1

    def assignment_epoch(self) -> int:
        return self._epoch

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        out: list[Record] = []
        for m in self._c.consume(num_messages=max_records, timeout=timeout_s):
            if m.error():
                # Partition EOF and transient broker errors are reported in-band; librdkafka retries itself.
                log.debug("consumer event: %s", m.error())
                continue
            # A message without an error always has topic, partition, offset and value.
            out.append(Record(cast(str, m.topic()), cast(int, m.partition()), cast(int, m.offset()), m.key(),
                              cast(bytes, m.value()), m.timestamp()[1]))
        return out

    def poll_columns(self, max_records: int = 500, timeout_s: float = 1.0) -> RecordBatch:
        msgs = self._c.consume(num_messages=max_records, timeout=timeout_s)
        # One method call a message per column, no object per record: this is most of what a bare consume costs.
        if any([m.error() is not None for m in msgs]):
            for m in msgs:
                if m.error() is not None:
                    log.debug("consumer event: %s", m.error())
            msgs = [m for m in msgs if m.error() is None]
        # Messages without an error always have topic, partition, offset and value.
        return RecordBatch(
            cast(list[str], [m.topic() for m in msgs]), cast(list[int], [m.partition() for m in msgs]),
            cast(list[int], [m.offset() for m in msgs]), cast(list[bytes], [m.value() for m in msgs]),
        )

    def commit(self, next_offsets: dict[tuple[str, int], int], *, wait: bool = True) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        if not next_offsets:
            return
        try:
            offsets = [TopicPartition(t, p, o) for (t, p), o in next_offsets.items()]
            if wait:
                self._c.commit(offsets=offsets, asynchronous=False)
            else:
                self._c.commit(offsets=offsets, asynchronous=True)
        except KafkaException as exc:
            raise BrokerUnavailable(f"commit failed: {exc}") from exc

    def assignment(self) -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in self._c.assignment()}

    def seek(self, topic: str, partition: int, offset: int) -> None:
        from confluent_kafka import TopicPartition

        self._c.seek(TopicPartition(topic, partition, offset))

    def lag(self) -> dict[tuple[str, int], int]:
        parts = self._c.assignment()
        if not parts:
            return {}
        positions = {(tp.topic, tp.partition): tp.offset for tp in self._c.position(parts)}
        # Nothing fetched yet on a partition: the group starts from its commit.
        unknown = [tp for tp in parts if positions[(tp.topic, tp.partition)] < 0]
        if unknown:
            for tp in self._c.committed(unknown, timeout=5):
                positions[(tp.topic, tp.partition)] = tp.offset
        out: dict[tuple[str, int], int] = {}
        for tp in parts:
            low, high = self._c.get_watermark_offsets(tp, timeout=5, cached=False)
            position = positions[(tp.topic, tp.partition)]
            # No commit either: auto.offset.reset is earliest. Clamped: the embedded Tansu's end may trail.
            out[(tp.topic, tp.partition)] = max(0, high - (position if position >= 0 else low))
        return out

    def known_backlog(self) -> int:
        parts = self._c.assignment()
        total = 0
        for tp in self._c.position(parts) if parts else []:
            if tp.offset < 0:  # nothing consumed yet
                continue
            # cached: the high watermark of the last fetch response (negative when none came yet)
            marks = self._c.get_watermark_offsets(tp, cached=True)
            if marks is not None and marks[1] >= 0:
                total += max(0, marks[1] - tp.offset)
        return total

    def close(self) -> None:
        self._c.close()


class ConfluentTopicReader:
    """Every partition of one topic, assigned by hand from the beginning: no group joined, nothing committed."""

    def __init__(self, bootstrap: str, topic: str, **config: object) -> None:
        import uuid

        from confluent_kafka import OFFSET_BEGINNING, TopicPartition
        from confluent_kafka import Consumer as RdConsumer

        self._c = RdConsumer(
            {
                "bootstrap.servers": bootstrap,
                # librdkafka wants a group id even for a manual assignment; it is never joined nor committed to.
                "group.id": f"flywheel-reader-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                **_librdkafka_config(config),
            }
        )
        meta = self._c.list_topics(topic, timeout=10).topics.get(topic)
        found = sorted(meta.partitions) if meta is not None and meta.error is None else []
        self._parts = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in found]
        if self._parts:
            self._c.assign(self._parts)

    def poll(self, max_records: int = 5000, timeout_s: float = 0.3) -> list[Record]:
        if not self._parts:
            return []
        out: list[Record] = []
        for m in self._c.consume(num_messages=max_records, timeout=timeout_s):
            if m.error():
                log.debug("reader event: %s", m.error())
                continue
            out.append(Record(cast(str, m.topic()), cast(int, m.partition()), cast(int, m.offset()), m.key(),
                              cast(bytes, m.value()), m.timestamp()[1]))
        return out

    def caught_up(self) -> bool:
        for tp in self._parts:
            low, high = self._c.get_watermark_offsets(tp, timeout=5, cached=False)
            (position,) = self._c.position([tp])
            # Nothing fetched yet on the partition: the reader stands at its beginning.
            if (position.offset if position.offset >= 0 else low) < high:
                return False
        return True

    def close(self) -> None:
        self._c.close()
