"""Exactly once from Kafka into the lake: the Delta log holds each partition's offset; event ids are de-duplicated.

The lake is the source of truth, as in kafka-delta-ingest: the events table (a Delta table,
`flywheel.lake`) carries, for every Kafka (topic, partition) ingest has written, an application
transaction `ingest:<topic>/<partition>` whose version is the last offset committed with it.
`PartitionLedger` keeps, per partition this worker owns:

- `committed`: the offset the table held when this worker took the partition, then the offsets of
  its own commits: what it expects the table to hold;
- the event ids of the partition's rows received within the window (`window_s`), to drop a later
  record that carries an id already written (a client's retry: `duplicates`);
- for a record that itself arrived (`received_at`) before the window (a replayed dead letter, which keeps its
  arrival; an import of history), a check against the table: such a record's earlier copies carry the same old
  arrival, so memory, which holds the window's, cannot know them, and the lake is asked (`_in_lake`).

Why every record is in the table exactly once (at-least-once from Kafka):

1. A batch and its offsets go in one Delta commit: the rows, and for each partition the batch's
   last offset as that partition's transaction version. The commit is atomic (a rename on a disk,
   a conditional put on S3), so the table holds a batch's rows exactly when it holds its offsets.
2. On every assignment (`Consumer.assignment_epoch` changes) the ledger reloads the table and the
   worker seeks each partition to its stored offset + 1 (a partition the table has never seen
   starts at the consumer group's offset). The group's committed offsets are only a hint for lag:
   a crash anywhere loses at most uncommitted work, which is read again from the stored offset.
3. A record at or below the stored offset is dropped before the write (`already_in_lake`), so a
   batch polled from an older position never writes a row twice.
4. The check and the commit happen on one `DeltaTable` snapshot (`Table.commit`): for each
   partition in the batch, the table's offset must be the one this worker expects, and the new
   one must be higher. A stale worker (frozen past its session timeout, or not yet told its
   partitions moved) either sees the new owner's offset on its snapshot and is refused
   (`CommitRefused`), or holds a snapshot from before the new owner's commit, and then Delta's
   conflict check fails its commit (`CommitFailedError`: a concurrent transaction for the same
   application id). Measured here with deltalake 1.6.6: checking on one snapshot and writing
   through another let 90 of 150 racing rounds commit twice; one snapshot, 0 of 150. A worker
   whose partitions were revoked drops its ledger on the new assignment, so it cannot commit for
   them from memory either.
5. A failed commit is never retried blindly: the worker reloads the table, re-reads the offsets,
   drops what is now committed and seeks to stored + 1 (`ingest.worker.loop`).
6. Duplicates by event id are recognised among records of the same partition, whatever their age, within
   this bound: a record that arrived within the window is checked against the ids of the window (memory),
   one that arrived before it against the whole table (one scan of the partition's ids per batch holding
   such records: replays and imports only). Not recognised: a copy that arrives afresh (a new `received_at`)
   more than the window after an earlier copy was written, say a client retrying an event after 7 days.
   The collector keys
   every event by its `generation_id`, part of the event, so a client's retry of an event lands in
   the partition of the first copy; records produced with other keys that repeat an event id
   across partitions are not de-duplicated.

The dead-letter table is kept exactly the same way, with transactions of its own
(`dead_letters:<topic>/<partition>`), committed before the events: a batch replayed after a crash
between the two skips the letters already in the table.

Memory: about 100 bytes an event id, for one to two windows of a partition's events; start-up reads the ids of
one window. Nothing older is held: the table answers for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import polars as pl
from deltalake import DeltaTable

from flywheel.lake.tables import DEFAULT_LOG_RETENTION_DAYS, EVENTS, CommitRefused, Table

Partition = tuple[str, int]


def app_id(prefix: str, key: Partition) -> str:
    """The application transaction of one Kafka partition in a table."""
    return f"{prefix}:{key[0]}/{key[1]}"


@dataclass(slots=True)
class _PartitionState:
    ids: set[str]
    older_ids: set[str] = field(default_factory=set)  # the previous window, still checked
    rotated_at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class Selection:
    keep: pl.DataFrame  # the rows to write, in input order
    duplicates: int
    already_in_lake: int


class PartitionLedger:
    """The offsets a table holds per Kafka partition and, for events, the recent event ids (module doc)."""

    def __init__(
        self,
        table: Table,
        location: str,
        prefix: str,
        window_s: float = 7 * 24 * 3600,
        log_retention_days: int = DEFAULT_LOG_RETENTION_DAYS,
    ) -> None:
        self.table = table
        self.location = location
        self.prefix = prefix
        self._log_retention_days = log_retention_days  # for a table this ledger creates
        self._window_s = window_s
        self._snapshot: DeltaTable | None = None
        self.committed: dict[Partition, int | None] = {}
        self._ids: dict[Partition, _PartitionState] = {}

    def snapshot(self) -> DeltaTable:
        if self._snapshot is None:
            self._snapshot = self.table.create(self.location, log_retention_days=self._log_retention_days)
        return self._snapshot

    def reload(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]:
        """Forget everything and read the table's offsets of `partitions` (the new assignment) from one fresh
        snapshot; returns them (None: never written)."""
        self._snapshot = None
        self._ids.clear()
        snapshot = self.snapshot()
        self.committed = {key: snapshot.transaction_version(app_id(self.prefix, key)) for key in partitions}
        return dict(self.committed)

    def owns(self, key: Partition) -> bool:
        return key in self.committed

    def select(self, rows: pl.DataFrame, dedup_ids: bool = True) -> Selection:
        """Which of `rows` (with `kafka_topic`, `kafka_partition`, `kafka_offset`, `event_id`) to write: none at
        or below its partition's committed offset and, with `dedup_ids`, none whose event id was written."""
        now = time.time()
        keep: list[pl.Series] = []
        duplicates = in_lake = 0
        cutoff = datetime.now(UTC) - timedelta(seconds=self._window_s)
        arrival = (pl.col("received_at") < cutoff) if "received_at" in rows.columns else pl.lit(False)
        keys = rows.select(
            "kafka_topic", "kafka_partition", "kafka_offset", "event_id", arrival.alias("_before_window")
        ).with_row_index("_row")
        for (topic, partition), part in keys.partition_by("kafka_topic", "kafka_partition", as_dict=True).items():
            key = (str(topic), int(partition))
            committed = self.committed.get(key)
            if committed is not None:
                fresh = part.filter(pl.col("kafka_offset") > committed)
                in_lake += part.height - fresh.height
                part = fresh
            if not dedup_ids:
                keep.append(part["_row"])
                continue
            state = self._ids.get(key)
            if state is None:
                state = self._ids[key] = self._load_ids(key)
            elif now - state.rotated_at > self._window_s:
                state.older_ids, state.ids, state.rotated_at = state.ids, set(), now
            event_ids: list[str] = part["event_id"].to_list()
            batch_ids = set(event_ids)
            old = part.filter(pl.col("_before_window"))["event_id"]
            lake_ids = self._in_lake(key, set(old.to_list())) if old.len() else set()
            if not lake_ids and len(batch_ids) == len(event_ids) and batch_ids.isdisjoint(
                state.ids
            ) and batch_ids.isdisjoint(state.older_ids):  # the usual case: nothing seen before, set operations in C
                state.ids |= batch_ids
                keep.append(part["_row"])
                continue
            kept: list[int] = []
            for row, event_id in zip(part["_row"].to_list(), event_ids, strict=True):
                if event_id in state.ids or event_id in state.older_ids or event_id in lake_ids:
                    duplicates += 1
                else:
                    state.ids.add(event_id)
                    kept.append(row)
            keep.append(pl.Series(kept, dtype=pl.UInt32))
        if sum(map(len, keep)) == rows.height:
            return Selection(rows, duplicates, in_lake)
        chosen = pl.concat(keep).sort() if keep else pl.Series(dtype=pl.UInt32)
        return Selection(rows[chosen], duplicates, in_lake)

    def commit(self, rows: pl.DataFrame, ends: dict[Partition, int]) -> int:
        """Append `rows` with each partition's new offset `ends[key]` in one commit on the ledger's snapshot
        (`Table.commit`: refused unless the table holds what this ledger expects and every offset moves forward).
        Returns the table version; raises `CommitRefused` for a partition this ledger does not own."""
        foreign = [key for key in ends if not self.owns(key)]
        if foreign:
            raise CommitRefused(f"{self.table.name}: not assigned {foreign}: their new owner commits for them")
        transactions = {app_id(self.prefix, key): end for key, end in ends.items()}
        expected = {app_id(self.prefix, key): self.committed[key] for key in ends}
        version = self.table.commit(self.snapshot(), rows, transactions, expected)
        self.committed.update(ends)
        return version

    def _in_lake(self, key: Partition, ids: set[str]) -> set[str]:
        """Which of `ids` the table holds in partition `key` (for records that arrived before the window)."""
        lf = self.table.scan_table(self.snapshot())
        mine = (pl.col("kafka_topic") == key[0]) & (pl.col("kafka_partition") == key[1])
        found = lf.filter(mine & pl.col("event_id").is_in(sorted(ids))).select("event_id").collect()["event_id"]
        return set(found.to_list())

    def _load_ids(self, key: Partition) -> _PartitionState:
        lf = self.table.scan_table(self.snapshot())
        cutoff = datetime.now(UTC) - timedelta(seconds=self._window_s)
        mine = (pl.col("kafka_topic") == key[0]) & (pl.col("kafka_partition") == key[1])
        ids = lf.filter(mine & (pl.col("received_at") >= cutoff)).select("event_id").collect()["event_id"]
        return _PartitionState(set(ids.to_list()))


def events_ledger(location: str, window_s: float = 7 * 24 * 3600) -> PartitionLedger:
    return PartitionLedger(EVENTS, location, "ingest", window_s)
