"""The lake's Delta tables: commit rules, the ingest ledger, compaction, vacuum, time travel and migration.

Real Delta tables (delta-rs) in a temporary folder; the CLI is driven through Typer's runner.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
from deltalake.exceptions import CommitFailedError
from typer.testing import CliRunner

from flywheel.contract import RewardRecord
from flywheel.lake import ForkedLakeError, legacy
from flywheel.lake.maintenance import MigrationError, compact, migrate, vacuum
from flywheel.lake.tables import EVENTS, REWARDS, CommitRefused, rewards_frame, rows_frame
from ingest.worker.dedup import PartitionLedger, app_id
from launcher.cli import app as flywheel_cli
from launcher.embedded import settings_env

HOUR = datetime(2026, 11, 23, 10, 5, tzinfo=UTC)
KEY = ("events", 0)


def _us(t: datetime) -> int:
    return int(t.timestamp() * 1_000_000)


def events(offsets: range | list[int], partition: int = 0, at: datetime = HOUR, ids: list[str] | None = None):
    ids = ids or [f"e{partition}-{o}" for o in offsets]
    rows = [
        (i, "accepted", 1, f"g{o}", "u", "", _us(at), _us(at), "native", "{}", "events", partition, o)
        for i, o in zip(ids, offsets, strict=True)
    ]
    return rows_frame(rows)


def reward_record(generation_id: str, reward: float) -> RewardRecord:
    return RewardRecord(generation_id=generation_id, reward_version="rules-v1", reward=reward, confidence=1.0,
                        label_source="explicit", window_start=HOUR, window_end=HOUR, emitted_at=HOUR)  # fmt: skip


def offsets_in(location: str, version: int | None = None) -> list[int]:
    return sorted(EVENTS.read(location, version)["kafka_offset"].to_list())


# ------------------------------------------------------------ commit rules


def test_a_commit_must_move_each_partitions_offset_forward(tmp_path: Path) -> None:
    """Delta itself accepts a transaction version lower than, or equal to, the stored one: the lake refuses it."""
    location = EVENTS.at(tmp_path)
    table = EVENTS.create(location)
    EVENTS.commit(table, events(range(3)), {"ingest:events/0": 2})
    for stale in (2, 1):
        with pytest.raises(CommitRefused, match="not forward"):
            EVENTS.commit(table, events(range(3, 4)), {"ingest:events/0": stale})
    assert offsets_in(location) == [0, 1, 2] and table.transaction_version("ingest:events/0") == 2


def test_a_writer_expecting_another_offset_is_refused(tmp_path: Path) -> None:
    location = EVENTS.at(tmp_path)
    ledger = PartitionLedger(EVENTS, location, "ingest")
    assert ledger.reload([KEY]) == {KEY: None}
    ledger.commit(events(range(5)), {KEY: 4})
    stale = PartitionLedger(EVENTS, location, "ingest")
    stale.committed = {KEY: None}  # what it read before the other writer's commit
    with pytest.raises(CommitRefused, match="someone else committed"):
        stale.commit(events(range(5)), {KEY: 4})
    with pytest.raises(CommitRefused, match="not assigned"):  # a partition it does not own
        ledger.commit(events(range(1), partition=1), {("events", 1): 0})
    assert offsets_in(location) == list(range(5))


def test_a_stale_snapshot_loses_to_a_commit_for_the_same_partition(tmp_path: Path) -> None:
    """The frozen worker's check passes on its old snapshot; Delta's conflict check then fails its commit."""
    location = EVENTS.at(tmp_path)
    frozen, owner = PartitionLedger(EVENTS, location, "ingest"), PartitionLedger(EVENTS, location, "ingest")
    frozen.reload([KEY])
    owner.reload([KEY])
    owner.commit(events(range(10)), {KEY: 9})
    with pytest.raises(CommitFailedError):
        frozen.commit(events(range(6)), {KEY: 5})
    assert offsets_in(location) == list(range(10))
    assert EVENTS.open(location).transaction_version(app_id("ingest", KEY)) == 9  # type: ignore[union-attr]


def test_named_writes_are_committed_once(tmp_path: Path) -> None:
    location = REWARDS.at(tmp_path)
    frame = rewards_frame([reward_record("g1", 1.0), reward_record("g2", -1.0)])
    assert REWARDS.write(location, frame, "signals-0-abc") is not None
    assert REWARDS.write(location, frame, "signals-0-abc") is None  # the outbox entry flushed again
    assert REWARDS.read(location).height == 2


def test_named_parts_are_each_committed_once_whether_written_together_or_apart(tmp_path: Path) -> None:
    """The signals worker flushes several outbox entries in one commit; after a crash before the pop, a new owner
    of one partition flushes that entry alone, and an entry flushed alone may come again with others."""
    location = REWARDS.at(tmp_path)
    a, b, c = (rewards_frame([reward_record(f"g{i}", 1.0)]) for i in range(3))
    assert REWARDS.write_parts(location, [("a", a), ("b", b)]) is not None
    assert REWARDS.write_parts(location, [("b", b)]) is None
    assert REWARDS.write_parts(location, [("a", a), ("b", b), ("c", c)]) is not None  # only c is new
    assert REWARDS.write(location, c, "c") is None
    assert sorted(REWARDS.read(location)["generation_id"].to_list()) == ["g0", "g1", "g2"]


# ------------------------------------------------------------ the ingest ledger


def test_ledger_drops_repeated_ids_within_and_across_batches(tmp_path: Path) -> None:
    ledger = PartitionLedger(EVENTS, EVENTS.at(tmp_path), "ingest")
    ledger.reload([KEY, ("events", 1)])
    first = ledger.select(events([0, 1, 2], ids=["a", "b", "a"]))
    assert first.keep["event_id"].to_list() == ["a", "b"] and first.duplicates == 1
    second = ledger.select(events([3, 4], ids=["c", "b"]))
    assert second.keep["event_id"].to_list() == ["c"] and second.duplicates == 1
    # Another partition has its own ids (the collector keys retries to the partition of the first copy).
    other = ledger.select(events([0], partition=1, ids=["a"]))
    assert other.keep["event_id"].to_list() == ["a"]


def test_ledger_skips_offsets_the_table_holds_and_reloads_ids_from_it(tmp_path: Path) -> None:
    # A worker committed offsets 0..7 to the table and died before committing them to the consumer group.
    location = EVENTS.at(tmp_path)
    PartitionLedger(EVENTS, location, "ingest").reload([KEY])
    writer = PartitionLedger(EVENTS, location, "ingest")
    writer.reload([KEY])
    writer.commit(events(range(8), at=datetime.now(UTC)), {KEY: 7})
    ledger = PartitionLedger(EVENTS, location, "ingest")
    assert ledger.reload([KEY]) == {KEY: 7}  # the worker seeks to 8
    replay = ledger.select(events(range(5, 10), at=datetime.now(UTC)))
    assert replay.keep["kafka_offset"].to_list() == [8, 9] and replay.already_in_lake == 3
    # A client's retry of an event written before the crash, at a new offset: dropped by its id.
    retry = ledger.select(events([10], ids=["e0-3"]))
    assert retry.keep.is_empty() and retry.duplicates == 1


# ------------------------------------------------------------ compaction, vacuum, time travel


def test_compaction_merges_files_and_every_version_reads_each_row_once(tmp_path: Path) -> None:
    location = EVENTS.at(tmp_path)
    ledger = PartitionLedger(EVENTS, location, "ingest")
    ledger.reload([KEY])
    for i in range(6):
        ledger.commit(events(range(i * 3, i * 3 + 3), at=HOUR + timedelta(minutes=i)), {KEY: i * 3 + 2})
    before = EVENTS.version(location)
    assert before is not None
    done = compact(EVENTS, location)
    assert (done.files_before, done.files_after) == (6, 1) and done.version == before + 1
    assert offsets_in(location) == list(range(18)) == offsets_in(location, before)
    # The ledger's offsets survive compaction (it moves files, not transactions).
    assert PartitionLedger(EVENTS, location, "ingest").reload([KEY]) == {KEY: 17}


def test_vacuum_keeps_the_versions_models_trained_on_and_refuses_a_retention_readers_could_outlive(
    tmp_path: Path,
) -> None:
    location = EVENTS.at(tmp_path)
    ledger = PartitionLedger(EVENTS, location, "ingest")
    ledger.reload([KEY])
    for i in range(3):
        ledger.commit(events(range(i * 2, i * 2 + 2)), {KEY: i * 2 + 1})
    trained_on = EVENTS.version(location)
    ledger.commit(events(range(6, 8)), {KEY: 7})
    compact(EVENTS, location)
    with pytest.raises(ValueError, match="at least 1 h"):
        vacuum(EVENTS, location, retention_hours=0)
    table = EVENTS.open(location)
    assert table is not None
    # Delta's own vacuum, with no retention and no kept version, would delete the four small files...
    assert len(table.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=True)) == 4
    # ... ours keeps the ones the trained-on version reads, even past the retention.
    gone = table.vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False, keep_versions=[trained_on])
    assert len(gone) == 1
    assert offsets_in(location, trained_on) == list(range(6)) and offsets_in(location) == list(range(8))


def test_lake_cli_compacts_vacuums_and_shows_history(settings, tmp_path: Path) -> None:
    location = EVENTS.at(settings.lake_root)
    ledger = PartitionLedger(EVENTS, location, "ingest")
    ledger.reload([KEY])
    for i in range(4):
        ledger.commit(events(range(i, i + 1)), {KEY: i})
    env = settings_env(settings)
    runner = CliRunner()
    done = runner.invoke(flywheel_cli, ["lake", "compact", "--table", "events"], env=env)
    assert done.exit_code == 0, done.output
    assert "events: 4 -> 1 file(s)" in done.output and "kept versions []" in done.output
    shown = runner.invoke(flywheel_cli, ["lake", "history", "events", "--limit", "2"], env=env)
    assert shown.exit_code == 0 and "OPTIMIZE" in shown.output.splitlines()[0], shown.output
    assert offsets_in(location) == [0, 1, 2, 3]


def test_a_process_forked_after_the_lake_was_used_is_told_to_spawn(tmp_path: Path) -> None:
    location = EVENTS.at(tmp_path)
    EVENTS.write(location, events(range(2)), "x")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what using the lake does, and leave at once
        try:
            EVENTS.read(location)
            os.write(write_end, b"read")
        except ForkedLakeError as exc:
            os.write(write_end, str(exc).encode()[:200])
        finally:
            os._exit(0)
    os.close(write_end)
    told = os.read(read_end, 200).decode()
    os.waitpid(pid, 0)
    assert "spawn" in told, told
    assert offsets_in(location) == [0, 1]  # the parent goes on


# ------------------------------------------------------------ migration


def test_migrate_turns_a_former_lake_into_delta_tables_with_every_row_once(settings) -> None:
    """A lake written in the former format, with a finished compaction (whose replaced files are still there,
    hidden by its manifest) and a killed writer's temporary file: every visible row lands once."""
    old = Path(EVENTS.at(settings.lake_root))
    legacy.write_partitioned(events(range(0, 4)), old, "part-a")
    legacy.write_partitioned(events(range(4, 6)), old, "part-b")
    hour_dir = legacy.partition_dir(old, HOUR.replace(minute=0))
    merged = pl.concat([pl.read_parquet(hour_dir / "part-a.parquet"), pl.read_parquet(hour_dir / "part-b.parquet")])
    merged.write_parquet(hour_dir / "compacted-1.parquet")
    (hour_dir / "_compaction-1.json").write_text(
        '{"output": "compacted-1.parquet", "replaces": ["part-a.parquet", "part-b.parquet"], "at": 0}'
    )
    legacy.write_partitioned(events(range(6, 9), at=HOUR + timedelta(hours=1)), old, "part-c")
    (hour_dir / ".part-d.parquet.x.tmp").write_bytes(b"half a file")
    rewards = rewards_frame([reward_record("g1", 1.0)])
    legacy.write_partitioned(REWARDS.conform(rewards), Path(REWARDS.at(settings.lake_root)), "r", "emitted_at")

    with pytest.raises(MigrationError, match="migrate` first"):  # a full vacuum would delete the former files
        vacuum(EVENTS, EVENTS.at(settings.lake_root), full=True)
    env = settings_env(settings)
    done = CliRunner().invoke(flywheel_cli, ["lake", "migrate"], env=env)
    assert done.exit_code == 0, done.output
    assert "events: 9 row(s) found, 9 written, 9 in the table" in done.output
    assert "rewards: 1 row(s) found, 1 written" in done.output
    assert offsets_in(EVENTS.at(settings.lake_root)) == list(range(9))
    assert REWARDS.read(REWARDS.at(settings.lake_root)).height == 1
    assert not list(old.rglob("_compaction-*.json")) and not (hour_dir / "part-a.parquet").exists()
    # Run again (as after a crash): nothing is written twice.
    again = migrate(EVENTS, old, EVENTS.at(settings.lake_root))
    assert (again.rows_written, again.rows_in_table) == (0, 9)
