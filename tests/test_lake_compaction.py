"""Lake compaction merges a closed hour's small files into one; readers see every row exactly once throughout.

Real Parquet files written by the ingest sink (`write_events`) in a temporary lake; the CLI is
driven through Typer's runner.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from flywheel import lake
from flywheel.lake import compaction, parquet_files, scan
from flywheel.lake.compaction import LOCK_NAME, compact_table
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings, get_settings
from ingest.dedup import LakeDedup
from ingest.lake_sink import rows_frame, write_events
from launcher.cli import app as flywheel_cli
from launcher.embedded import settings_env

OLD_HOUR = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(days=2)
NOW = datetime.now(UTC)


def _us(t: datetime) -> int:
    return int(t.timestamp() * 1_000_000)


def write_batch(table: Path, first_offset: int, n: int, at: datetime) -> None:
    """`n` events of partition 0 from `first_offset` on, at `at`: one small file, as one ingest batch writes."""
    rows = [
        (f"e{o}", "accepted", 1, f"g{o}", "u", "", _us(at), _us(at), "native", "{}", "events", 0, o)
        for o in range(first_offset, first_offset + n)
    ]
    write_events(table, rows_frame(rows))


def table_rows(table: Path) -> list[int]:
    lf = scan(table)
    return [] if lf is None else sorted(lf.select("kafka_offset").collect()["kafka_offset"].to_list())


def files_in(table: Path, hour: datetime) -> list[Path]:
    return [f for f in parquet_files(table) if f"date={hour:%Y-%m-%d}/hour={hour:%H}" in f.as_posix()]


def test_a_closed_hour_becomes_one_file_and_readers_see_each_row_once(tmp_path: Path) -> None:
    table = EVENTS.at(tmp_path)
    for i in range(5):
        write_batch(table, i * 3, 3, OLD_HOUR + timedelta(minutes=i))
    write_batch(table, 100, 2, NOW)  # the current hour: still open, left alone
    listed_before = list(parquet_files(table))
    newest_input = max(f.stat().st_mtime for f in files_in(table, OLD_HOUR))

    result = compact_table(table)
    assert (result.directories, result.files_merged, result.rows, result.files_deleted) == (1, 5, 15, 0)
    (merged,) = files_in(table, OLD_HOUR)
    assert merged.name.startswith("compacted-") and merged.stat().st_mtime == newest_input
    assert table_rows(table) == [*range(15), 100, 101]
    # Within the grace period the replaced files are still there for a reader that listed before the switch.
    assert sorted(pl.read_parquet(listed_before)["kafka_offset"].to_list()) == [*range(15), 100, 101]

    # The ingest de-duplication still finds every Kafka position in the lake.
    replay = pl.read_parquet(merged)
    assert LakeDedup(table).select(replay, {("events", 0): 0}).already_in_lake == 15

    # A later run past the grace period deletes the replaced files; nothing else changes.
    again = compact_table(table, grace_s=0)
    assert (again.directories, again.files_deleted) == (0, 5)
    assert [p.name for p in merged.parent.glob("*.parquet")] == [merged.name]
    assert table_rows(table) == [*range(15), 100, 101]


def test_a_late_event_in_a_compacted_hour_is_merged_by_the_next_run(tmp_path: Path) -> None:
    table = EVENTS.at(tmp_path)
    for i in range(3):
        write_batch(table, i * 2, 2, OLD_HOUR)
    compact_table(table, grace_s=0)
    write_batch(table, 50, 1, OLD_HOUR + timedelta(minutes=59))  # late
    assert table_rows(table) == [0, 1, 2, 3, 4, 5, 50] and len(files_in(table, OLD_HOUR)) == 2

    second = compact_table(table, grace_s=0)
    assert (second.directories, second.files_merged, second.rows) == (1, 2, 7)
    assert table_rows(table) == [0, 1, 2, 3, 4, 5, 50] and len(files_in(table, OLD_HOUR)) == 1
    compact_table(table, grace_s=0)  # deletes the first compacted file, then its manifest, which names nothing left
    directory = files_in(table, OLD_HOUR)[0].parent
    assert len(list(directory.glob("*.parquet"))) == 1 and len(list(directory.glob("_compaction-*.json"))) == 1
    assert table_rows(table) == [0, 1, 2, 3, 4, 5, 50]


def test_a_run_killed_before_its_manifest_shows_nothing_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = EVENTS.at(tmp_path)
    write_batch(table, 0, 2, OLD_HOUR)
    write_batch(table, 2, 2, OLD_HOUR)
    directory = files_in(table, OLD_HOUR)[0].parent
    # What a run killed between its two renames leaves: a merged file that no manifest names.
    orphan = directory / "compacted-1-killed.parquet"
    pl.read_parquet(list(parquet_files(table))).write_parquet(orphan)
    assert table_rows(table) == [0, 1, 2, 3]

    monkeypatch.setattr(compaction, "STALE_TEMP_S", -1.0)  # the orphan counts as stale at once
    result = compact_table(table, grace_s=0)
    assert not orphan.exists() and result.files_merged == 2
    assert table_rows(table) == [0, 1, 2, 3]


def test_an_hour_locked_by_another_run_is_skipped_until_the_lock_is_stale(tmp_path: Path) -> None:
    table = EVENTS.at(tmp_path)
    write_batch(table, 0, 1, OLD_HOUR)
    write_batch(table, 1, 1, OLD_HOUR)
    lock = files_in(table, OLD_HOUR)[0].parent / LOCK_NAME
    lock.touch()
    held = compact_table(table)
    assert held.files_merged == 0 and held.skipped_locked == [str(lock.parent)] and lock.exists()

    old = time.time() - 2 * compaction.STALE_TEMP_S
    os.utime(lock, (old, old))  # left by a killed run
    taken = compact_table(table)
    assert taken.files_merged == 2 and not lock.exists()
    assert table_rows(table) == [0, 1]


def test_columns_a_later_file_added_are_kept(tmp_path: Path) -> None:
    table = tmp_path / "grown"
    hour_dir = table / f"date={OLD_HOUR:%Y-%m-%d}" / f"hour={OLD_HOUR:%H}"
    hour_dir.mkdir(parents=True)
    pl.DataFrame({"id": [1], "reward": [0.5]}).write_parquet(hour_dir / "part-1.parquet")
    pl.DataFrame({"id": [2], "reward": [1.0], "label_source": ["explicit"]}).write_parquet(hour_dir / "part-2.parquet")

    assert compact_table(table).files_merged == 2
    merged = pl.read_parquet(list(parquet_files(table))).sort("id")
    assert merged.to_dicts() == [
        {"id": 1, "reward": 0.5, "label_source": None},
        {"id": 2, "reward": 1.0, "label_source": "explicit"},
    ]


def test_cli_compacts_the_tables_of_the_configured_lake(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = EVENTS.at(settings.lake_dir)
    for i in range(4):
        write_batch(table, i, 1, OLD_HOUR)
    for name, value in settings_env(settings).items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        out = CliRunner().invoke(flywheel_cli, ["lake", "compact"])
    finally:
        get_settings.cache_clear()
    assert out.exit_code == 0, out.output
    assert "events: merged 4 file(s) into 1 (4 rows)" in out.output
    assert "rewards: merged 0 file(s)" in out.output
    assert len(files_in(table, OLD_HOUR)) == 1 and table_rows(table) == [0, 1, 2, 3]


def test_readers_racing_compactions_and_writers_never_see_a_row_twice_or_miss_one(tmp_path: Path) -> None:
    """A writer keeps adding late files to a closed hour while compactions run back to back; every read in
    between holds each row once and at least every row whose file was complete before the read began."""
    table = EVENTS.at(tmp_path)
    written = 0
    stop = threading.Event()
    errors: list[BaseException] = []

    def keep(loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                while not stop.is_set():
                    loop()
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                stop.set()
        return run

    def write() -> None:
        nonlocal written
        write_batch(table, written, 5, OLD_HOUR + timedelta(minutes=written % 60))
        written += 5

    threads = [threading.Thread(target=keep(write)), threading.Thread(target=keep(lambda: compact_table(table)))]
    for t in threads:
        t.start()
    reads = 0
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not stop.is_set():
            complete = written
            seen = table_rows(table)
            assert len(seen) == len(set(seen)), "a row seen twice"
            assert set(range(complete)) <= set(seen), "a row written before the read is missing"
            reads += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert reads > 10 and table_rows(table) == list(range(written))
    assert len(list(lake.manifests(files_in(table, OLD_HOUR)[0].parent))) > 1  # compactions did happen
