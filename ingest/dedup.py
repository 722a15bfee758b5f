"""De-duplication by `event_id` and skipping of replayed records, per Kafka partition, in memory.

The lake is the source of truth; this module only remembers, per (topic, partition)
this worker owns, what the lake holds for it:

- the event ids of its rows written within the window (`window_s`, by write time:
  file modification time on load, batch time after), to drop a later record that
  carries an id already written from this partition (`duplicates`);
- the offsets, with their event ids, of its rows at or after the offset this worker
  started reading the partition from, to skip a record whose very position is already
  in the lake (`already_in_lake`).

The state of a partition is loaded from the lake the first time a batch holds it after
`reset()`; the worker resets on every new assignment (`Consumer.assignment_epoch`) and
after a failed batch, so the state is never older than the last time someone else could
have written the partition.

Why this is exactly once in the lake (at-least-once from Kafka):

1. Offsets are committed only after the lake write, so everything below the committed
   offset of a partition is in the lake (or dead-lettered, or a duplicate), and a
   record at or above it may or may not be: a previous owner may have written part of a
   batch (one file per date/hour, each atomic) and died before committing, or written
   whole batches whose commits (sent without waiting) never landed.
2. A consumer that gets a partition starts reading at the committed offset `c`, so the
   rows the lake holds at offsets >= `c` (loaded by position, whatever their age) are
   exactly the records written since that commit: they are skipped by (offset,
   event_id), each written once. Matching the event id too means a topic recreated
   from offset 0 is never mistaken for a replay.
3. The group hands a partition to one member at a time: with the eager protocol a member
   gives up its partitions only inside its own poll, i.e. between batches, so no batch
   of the old owner is in flight when the new owner loads the lake (a member that stops
   heartbeating for the session timeout is dead or frozen; a frozen one that wakes up
   fails its commit, and may have written a batch the new owner also writes: the one
   case not covered, as with any Kafka consumer that has no fencing token).
4. Duplicates by event id are recognised among records of the same partition. The
   collector keys every event by its `generation_id`, part of the event, so a client's
   retry of an event lands in the partition of the first copy; records produced with
   other keys that repeat an event id across partitions are not de-duplicated.

Memory: about 100 bytes an event id, for one to two windows of a partition's events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from flywheel.lake import parquet_files
from flywheel.lake.tables import EVENTS


@dataclass(slots=True)
class _PartitionState:
    ids: set[str]
    older_ids: set[str] = field(default_factory=set)  # the previous window, still checked
    rotated_at: float = field(default_factory=time.time)
    in_lake: dict[int, str] = field(default_factory=dict)  # offset -> event_id, from `start` on


@dataclass(frozen=True, slots=True)
class Selection:
    keep: pl.DataFrame  # the rows to write, in input order
    duplicates: int
    already_in_lake: int


class LakeDedup:
    """`select(rows, first_offsets) -> Selection`, in memory after a load per partition."""

    def __init__(self, table_dir: Path, window_s: float = 7 * 24 * 3600) -> None:
        self._table = table_dir
        self._window_s = window_s
        self._states: dict[tuple[str, int], _PartitionState] = {}

    def reset(self) -> None:
        """Forget everything: the next batch of each partition reloads it from the lake."""
        self._states.clear()

    def select(self, rows: pl.DataFrame, first_offsets: dict[tuple[str, int], int]) -> Selection:
        """Which of `rows` (with `kafka_topic`, `kafka_partition`, `kafka_offset`, `event_id`) to write.
        `first_offsets`: per partition, the first offset of the whole polled batch (where reading resumed),
        which bounds the positions that may already be in the lake."""
        now = time.time()
        keep: list[pl.Series] = []
        duplicates = in_lake = 0
        # Split only the columns needed here: the rows themselves are picked at the end, once.
        keys = rows.select("kafka_topic", "kafka_partition", "kafka_offset", "event_id").with_row_index("_row")
        for (topic, partition), part in keys.partition_by("kafka_topic", "kafka_partition", as_dict=True).items():
            key = (str(topic), int(partition))
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = self._load(key, first_offsets[key])
            elif now - state.rotated_at > self._window_s:
                state.older_ids, state.ids, state.rotated_at = state.ids, set(), now
            event_ids: list[str] = part["event_id"].to_list()
            batch_ids = set(event_ids)
            if (
                not state.in_lake
                and len(batch_ids) == len(event_ids)
                and batch_ids.isdisjoint(state.ids)
                and batch_ids.isdisjoint(state.older_ids)
            ):  # the usual case: nothing seen before, set operations in C
                state.ids |= batch_ids
                keep.append(part["_row"])
                continue
            kept: list[int] = []
            offsets: list[int] = part["kafka_offset"].to_list()
            for row, offset, event_id in zip(part["_row"].to_list(), offsets, event_ids, strict=True):
                if state.in_lake and state.in_lake.get(offset) == event_id:
                    in_lake += 1
                elif event_id in state.ids or event_id in state.older_ids:
                    duplicates += 1
                else:
                    state.ids.add(event_id)
                    kept.append(row)
            keep.append(pl.Series(kept, dtype=pl.UInt32))
            # Positions written after the last commit lie between it and their end: once read past, done.
            if state.in_lake and max(offsets) >= max(state.in_lake):
                state.in_lake = {}
        if sum(map(len, keep)) == rows.height:
            return Selection(rows, duplicates, in_lake)
        chosen = pl.concat(keep).sort() if keep else pl.Series(dtype=pl.UInt32)
        return Selection(rows[chosen], duplicates, in_lake)

    def _load(self, key: tuple[str, int], start: int) -> _PartitionState:
        topic, partition = key
        files = list(parquet_files(self._table))
        if not files:
            return _PartitionState(set())
        mine = (pl.col("kafka_topic") == topic) & (pl.col("kafka_partition") == partition)
        # Positions: every file (row-group statistics on kafka_offset skip most of them), whatever its age.
        positions = (
            EVENTS.scan_files(files)
            .filter(mine & (pl.col("kafka_offset") >= start))
            .select("kafka_offset", "event_id")
            .collect()
        )
        cutoff = time.time() - self._window_s
        recent = [f for f in files if f.stat().st_mtime >= cutoff]
        ids: set[str] = set()
        if recent:
            ids = set(EVENTS.scan_files(recent).filter(mine).select("event_id").collect()["event_id"].to_list())
        return _PartitionState(ids, in_lake=dict(positions.iter_rows()))
