"""The kafka-python client behind the bus interface (the default: `FLYWHEEL_KAFKA_CLIENT=kafka-python`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, cast

from flywheel.bus.murmur2 import key_partitions
from flywheel.bus.types import BrokerUnavailable, MessageTooLarge, Outgoing, Record, RecordBatch

log = logging.getLogger(__name__)


# How long a poll goes on while a consumer has no partitions: past a coordinator's rebalance delay (3 s by default).
_JOIN_POLL_S = 5.0


class KafkaPythonProducer:
    def __init__(self, bootstrap: str, **config: object) -> None:
        from kafka import KafkaProducer

        max_block_ms = config.pop("max_block_ms", 10_000)
        # kafka-python's own default; a message past it is refused by `send` (checked first: `send_all`)
        self._max_request_size = int(cast(int, config.get("max_request_size", 1024 * 1024)))
        # keys are partitioned a batch at a time (`flywheel.bus.murmur2`) unless a partitioner of one's own is set
        self._own_partitioner = "partitioner" in config
        self._p = KafkaProducer(
            bootstrap_servers=bootstrap.split(","),
            acks="all",
            # `send_all` flushes what it sent, so no record waits out the linger; a long one keeps the sender thread
            # from waking up for batches that are not full while `send_all` still appends (a few % of a record's
            # CPU).
            linger_ms=config.pop("linger_ms", 1000),
            # `send_all` flushes what it sent, so a batch is a call's records per partition, not 16 KiB of them:
            # kafka-python's default closes a batch every ~40 records of 400 bytes, and each new batch wakes its
            # sender thread, which then drains (and fights `send` for the GIL); 256 KiB halved the cost of a
            # record (bench/signals_stream_throughput.py). Below Kafka's default 1 MiB message limit.
            batch_size=config.pop("batch_size", 256 * 1024),
            retries=5,
            max_block_ms=max_block_ms,
            # kafka-python's own default blocks the constructor 30 s when no broker answers, whatever max_block_ms.
            bootstrap_timeout_ms=config.pop("bootstrap_timeout_ms", max_block_ms),
            **config,
        )

    def send_all(self, messages: Sequence[Outgoing], timeout_s: float = 10.0) -> None:
        from kafka.errors import KafkaError, MessageSizeTooLargeError, RecordListTooLargeError

        # The client's own limit, checked before anything is sent, so a refusal for size leaves none of the call's
        # messages written (the broker's own, lower, limit can still refuse some after others were written).
        for m in messages:
            size = len(m.value or b"") + len(m.key or b"") + sum(len(k) + len(v) for k, v in m.headers) + 128
            if size > self._max_request_size:
                raise MessageTooLarge(
                    f"a message of about {size} bytes; the producer's limit is {self._max_request_size}"
                )
        try:
            partitions = self._partitions(messages)
            futures = [
                self._p.send(m.topic, value=m.value, key=m.key, headers=list(m.headers) or None, partition=p)
                for m, p in zip(messages, partitions, strict=True)
            ]
            self._p.flush(timeout=timeout_s)
            for f in futures:
                f.get(timeout=timeout_s)
        except (MessageSizeTooLargeError, RecordListTooLargeError) as exc:  # from `send` (the client's limit) or
            # the broker's answer: the message's fault, not the broker's
            raise MessageTooLarge(f"a message is too large for Kafka: {exc}") from exc
        except KafkaError as exc:
            raise BrokerUnavailable(f"Kafka did not acknowledge: {exc}") from exc

    def _partitions(self, messages: Sequence[Outgoing]) -> list[int | None]:
        """Each keyed message's partition, as the default partitioner would pick it, found for the whole batch at
        once; None (the client picks) for a message without a key, or for all with a partitioner of one's own."""
        chosen: list[int | None] = [None] * len(messages)
        if self._own_partitioner:
            return chosen
        by_topic: dict[str, list[int]] = {}
        for i, m in enumerate(messages):
            if m.key is not None:
                by_topic.setdefault(m.topic, []).append(i)
        for topic, rows in by_topic.items():
            # waits for the topic's metadata, as `send` would
            parts = key_partitions([messages[i].key or b"" for i in rows], sorted(self._p.partitions_for(topic)))
            for i, part in zip(rows, parts, strict=True):
                chosen[i] = part
        return chosen

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

    def _poll(self, max_records: int, timeout_s: float) -> dict[Any, list[Any]]:
        """One poll of `timeout_s`; while nothing is assigned, polls back to back until the group join ends.

        kafka-python completes a join only inside a poll: a JoinGroup answer that arrives between polls (the
        caller at work, or asleep) is taken by its heartbeat thread, and the next poll starts the join over. The
        coordinator holds that answer for its rebalance delay (3 s by default, the embedded broker's too), so a
        caller polling 0.2 s at a time between other work could rejoin again and again: a worker's start took
        25 s, or never ended when its polls and gaps kept time with the delay (tests/test_bus.py). Until
        partitions are assigned there is nothing to read, so the polls go on, for `_JOIN_POLL_S` at most."""
        timeout_ms = int(timeout_s * 1000)
        if self._c.assignment():
            return self._c.poll(timeout_ms=timeout_ms, max_records=max_records)
        deadline = time.monotonic() + max(timeout_s, _JOIN_POLL_S)
        while True:
            polled = self._c.poll(timeout_ms=max(timeout_ms, 100), max_records=max_records)
            if polled or self._c.assignment() or time.monotonic() >= deadline:
                return polled

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        polled = self._poll(max_records, timeout_s)
        out: list[Record] = []
        for msgs in polled.values():
            for m in msgs:
                out.append(Record(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp))
        return out

    def poll_columns(self, max_records: int = 500, timeout_s: float = 1.0) -> RecordBatch:
        polled = self._poll(max_records, timeout_s)
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
        return {(tp.topic, tp.partition): max(0, ends[tp] - self._c.position(tp, timeout_ms=5000)) for tp in parts}

    def known_backlog(self) -> int:
        total = 0
        for tp in self._c.assignment():
            high = self._c.highwater(tp)
            if high is not None:  # fetched, so its position is known: `position` asks nobody
                total += max(0, high - self._c.position(tp))
        return total

    def close(self) -> None:
        self._c.close(autocommit=False)


class KafkaPythonTopicReader:
    """Every partition of one topic, assigned by hand from the beginning: no group, nothing committed."""

    def __init__(self, bootstrap: str, topic: str, **config: object) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self._c = KafkaConsumer(
            bootstrap_servers=bootstrap.split(","), group_id=None, enable_auto_commit=False, **config
        )
        self._parts = [TopicPartition(topic, p) for p in sorted(self._c.partitions_for_topic(topic) or ())]
        if self._parts:
            self._c.assign(self._parts)
            self._c.seek_to_beginning(*self._parts)

    def poll(self, max_records: int = 5000, timeout_s: float = 0.3) -> list[Record]:
        if not self._parts:
            return []
        polled = self._c.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        return [
            Record(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp)
            for msgs in polled.values()
            for m in msgs
        ]

    def caught_up(self) -> bool:
        if not self._parts:
            return True
        ends = self._c.end_offsets(self._parts)
        return all(self._c.position(tp) >= ends[tp] for tp in self._parts)

    def close(self) -> None:
        self._c.close(autocommit=False)


def _log_commit_failure(offsets: object, response: object) -> None:
    if isinstance(response, Exception):
        log.warning("offset commit failed (the records are read again after a restart): %s", response)
