"""The lake's file handling and the ingest worker's in-memory de-duplication, on real Parquet files."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime

import polars as pl

from flywheel.lake import TempFileSweeper, parquet_files, sweep_temp_files, write_partitioned
from ingest.dedup import LakeDedup


def _rows(ids: list[str], offsets: list[int], partition: int = 0, hour: int = 10) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "event_id": ids,
            "ts": [datetime(2026, 11, 23, hour, 5, tzinfo=UTC)] * len(ids),
            "kafka_topic": ["events"] * len(ids),
            "kafka_partition": pl.Series([partition] * len(ids), dtype=pl.Int32),
            "kafka_offset": pl.Series(offsets, dtype=pl.Int64),
        }
    )


def test_write_partitioned_splits_by_event_hour(tmp_path):
    df = pl.concat([_rows(["a", "b"], [0, 1], hour=10), _rows(["c"], [2], hour=11)])
    written = write_partitioned(df, tmp_path, "part-1")
    assert [p.relative_to(tmp_path).as_posix() for p in written] == [
        "date=2026-11-23/hour=10/part-1.parquet",
        "date=2026-11-23/hour=11/part-1.parquet",
    ]
    assert pl.read_parquet(written[0])["event_id"].to_list() == ["a", "b"]
    assert pl.read_parquet(written[1])["event_id"].to_list() == ["c"]


def test_sweep_removes_only_old_temporary_files(tmp_path):
    write_partitioned(_rows(["a"], [0]), tmp_path, "part-1")
    hour_dir = tmp_path / "date=2026-11-23" / "hour=10"
    old, fresh = hour_dir / ".part-0.parquet.dead.tmp", hour_dir / ".part-2.parquet.live.tmp"
    old.write_bytes(b"half a file")
    fresh.write_bytes(b"being written")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))

    assert sweep_temp_files(tmp_path) == 1
    assert not old.exists() and fresh.exists()
    assert [p.name for p in parquet_files(tmp_path)] == ["part-1.parquet"]


def _old_temp_file(directory, name: str):
    tmp = directory / f".{name}.parquet.x.tmp"
    tmp.write_bytes(b"half a file")
    two_hours_ago = time.time() - 7200
    os.utime(tmp, (two_hours_ago, two_hours_ago))
    return tmp


def test_workers_sweep_on_start_then_at_most_every_period(tmp_path):
    first = _old_temp_file(tmp_path, "a")
    sweeper = TempFileSweeper(tmp_path, every_s=3600)
    sweeper.maybe()
    assert not first.exists()
    second = _old_temp_file(tmp_path, "b")
    sweeper.maybe()  # within the period: left for the next sweep
    assert second.exists()
    sweeper.every_s = 0
    sweeper.maybe()
    assert not second.exists()


def test_dedup_drops_repeated_ids_within_and_across_batches(tmp_path):
    dedup = LakeDedup(tmp_path)
    first = dedup.select(_rows(["a", "b", "a"], [0, 1, 2]), {("events", 0): 0})
    assert first.keep["event_id"].to_list() == ["a", "b"] and first.duplicates == 1
    second = dedup.select(_rows(["c", "b"], [3, 4]), {("events", 0): 3})
    assert second.keep["event_id"].to_list() == ["c"] and second.duplicates == 1
    # Another partition has its own ids (the collector keys retries to the partition of the first copy).
    other = dedup.select(_rows(["a"], [0], partition=1), {("events", 1): 0})
    assert other.keep["event_id"].to_list() == ["a"]


def test_dedup_skips_positions_already_in_the_lake_after_a_crash(tmp_path):
    # A worker wrote offsets 5..7 and died before committing; the commit is still 5.
    write_partitioned(_rows(["e5", "e6", "e7"], [5, 6, 7]), tmp_path, "unfinished")
    dedup = LakeDedup(tmp_path)
    replay = dedup.select(_rows(["e5", "e6", "e7", "e8"], [5, 6, 7, 8]), {("events", 0): 5})
    assert replay.keep["event_id"].to_list() == ["e8"] and replay.already_in_lake == 3
    # Past the unfinished batch, the same position check no longer applies, and ids still do.
    later = dedup.select(_rows(["e9", "e6"], [9, 10]), {("events", 0): 9})
    assert later.keep["event_id"].to_list() == ["e9"] and later.duplicates == 1 and later.already_in_lake == 0
