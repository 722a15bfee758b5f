"""The bus's records and the two roles every Kafka client implements (`Producer`, `Consumer`)."""


from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class BrokerUnavailable(RuntimeError):
    """Kafka did not acknowledge in time: the caller must not report success."""


class MessageTooLarge(ValueError):
    """A message is larger than the client's or the broker's limit. The sender's fault, not an outage: the
    broker is as up as it was, and sending the same message again fails the same way. Nothing of the send may be
    reported as acknowledged (its other messages may or may not have been written)."""


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

    @classmethod
    def concat(cls, parts: Sequence[RecordBatch]) -> RecordBatch:
        """The records of `parts`, in order (several polls gathered into one batch)."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            [t for p in parts for t in p.topics], [n for p in parts for n in p.partitions],
            [o for p in parts for o in p.offsets], [v for p in parts for v in p.values],
        )  # fmt: skip

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
        """Send and wait until the broker acknowledged every message; raise `BrokerUnavailable` if not, or
        `MessageTooLarge` when one of them is past the client's or the broker's message limit."""

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

    def known_backlog(self) -> int:
        """Records past this consumer's position on its assigned partitions, as the last fetch responses told
        (their high watermarks): no request, so cheap enough for every poll; a partition not fetched yet counts 0.
        More than 0: the broker already holds records a poll would get without waiting for new ones."""

    def close(self) -> None: ...


def next_offsets(records: Sequence[Record]) -> dict[tuple[str, int], int]:
    """The offsets to commit after processing `records` (last offset + 1 per partition)."""
    return RecordBatch.from_records(records).next_offsets()
