"""Lake maintenance: compaction (`optimize`), vacuum, history, and migration from the former format.

Writers commit one set of small files per batch, and every reader pays for each file it opens.
`compact` rewrites them into few large files with delta-rs's `optimize.compact`: one commit that
removes the small files from the newest version and adds the merged ones (no data change, so
concurrent appends never conflict with it). Readers of an older version still read the small files
(a `DeltaTable` pins its version), so no reader ever sees a row twice or misses one.

Replaced files stay on storage until `vacuum` deletes the ones no version within the retention
needs. The retention must outlast every reader and every version someone means to read again:

- `retention_hours` (default Delta's 7 days, never under `MIN_RETENTION_HOURS`): longer than any
  read, so a running reader's version keeps its files;
- `keep_versions`: the versions registered candidates trained on (their lineage names them,
  `flywheel.contract.DataWindow.lake_versions`): their files are kept whatever their age, so any
  model can be traced to, and retrained on, the exact rows it learnt from.

Data files are not all a version needs: its commit log must be there too. `set_log_retention` sets how long a
table keeps it (`delta.logRetentionDuration`, `flywheel.lake.tables.DEFAULT_LOG_RETENTION_DAYS`); a candidate
pinned for longer than that can no longer be read back by its version.

`vacuum(full=True)` also deletes files no version ever referenced: the Parquet files of a writer
that lost its commit race (or was killed before committing), which a plain vacuum cannot see.

`migrate` turns a lake of the former format (`flywheel.lake.legacy`) into Delta tables, checking that
every row is present once; it is safe to run again after a crash (one commit, named).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import polars as pl

from flywheel.lake import is_remote, legacy
from flywheel.lake.tables import LOG_RETENTION, Table, log_retention

log = logging.getLogger(__name__)

DEFAULT_RETENTION_HOURS = 7 * 24
# A reader pins its version for as long as it reads: no read takes an hour, so no retention may be shorter.
MIN_RETENTION_HOURS = 1


@dataclass(frozen=True, slots=True)
class Compaction:
    table: str
    files_before: int
    files_after: int
    seconds: float
    version: int | None  # the version the compaction made (None: nothing to do)


def compact(table: Table, location: str, *, target_size: int | None = None) -> Compaction:
    """Merge the small files of every partition of the table at `location` (module doc)."""
    started = time.perf_counter()
    delta = table.open(location)
    if delta is None:
        return Compaction(table.name, 0, 0, 0.0, None)
    before = len(delta.file_uris())
    version = delta.version()
    delta.optimize.compact(target_size=target_size)
    after = len(delta.file_uris())
    made = delta.version() if delta.version() != version else None
    return Compaction(table.name, before, after, time.perf_counter() - started, made)


def set_log_retention(table: Table, location: str, days: int) -> bool:
    """Make the table at `location` keep its commit log `days` (`delta.logRetentionDuration`); True when this
    changed it (one metadata commit: a writer whose snapshot predates it loses one commit race and retries)."""
    value = log_retention(days)
    delta = table.open(location)
    if delta is None or delta.metadata().configuration.get(LOG_RETENTION) == value:
        return False
    delta.alter.set_table_properties({LOG_RETENTION: value})
    log.info("%s: commit log kept %s", table.name, value.removeprefix("interval "))
    return True


def vacuum(
    table: Table,
    location: str,
    *,
    retention_hours: float = DEFAULT_RETENTION_HOURS,
    keep_versions: Sequence[int] = (),
    full: bool = False,
    dry_run: bool = False,
) -> list[str]:
    """Delete the files of the table at `location` that no version within `retention_hours` nor any of
    `keep_versions` needs (and, `full`, files no version ever named); returns them."""
    if retention_hours < MIN_RETENTION_HOURS:
        raise ValueError(
            f"a vacuum retention of {retention_hours} h could delete files a running reader still reads: "
            f"use at least {MIN_RETENTION_HOURS} h"
        )
    if full and not is_remote(location) and former_files(Path(location)):
        raise MigrationError(
            f"{location} still holds files of the former lake format, which a full vacuum would delete: "
            "run `flywheel lake migrate` first"
        )
    delta = table.open(location)
    if delta is None:
        return []
    keep = sorted({v for v in keep_versions if 0 <= v <= delta.version()})
    return delta.vacuum(
        retention_hours=int(retention_hours),
        dry_run=dry_run,
        enforce_retention_duration=False,  # ours is checked above; Delta's own minimum is its 7-day default
        full=full,
        keep_versions=keep or None,
    )


def history(table: Table, location: str, limit: int | None = None) -> list[dict[str, object]]:
    """The table's commits, newest first: version, time, operation and its metrics."""
    delta = table.open(location)
    if delta is None:
        return []
    return [
        {
            "version": entry.get("version"),
            "at": datetime.fromtimestamp(int(entry["timestamp"]) / 1000, UTC).isoformat(timespec="seconds"),
            "operation": entry.get("operation"),
            "metrics": entry.get("operationMetrics", {}),
        }
        for entry in delta.history(limit)
    ]


@dataclass(frozen=True, slots=True)
class Migration:
    table: str
    rows_found: int  # rows of the former format's visible files
    rows_written: int  # rows committed by this run (0 when an earlier run committed them)
    rows_in_table: int  # the Delta table's rows afterwards
    files_removed: int  # former files deleted (only when the table took their place)


MIGRATION = "flywheel-migrate"


def migrate(table: Table, source: Path, location: str) -> Migration:
    """Copy the former-format table at `source` into the Delta table at `location` in one commit, check that every
    row is there once, and, when the Delta table took the same folder, delete the former files.

    Run again after a crash, it finds its commit (an application transaction) and only checks and deletes. Raises
    `MigrationError` when the counts disagree: then nothing former is deleted."""
    files = [f for f in legacy.parquet_files(source) if not _is_delta_file(f)]
    rows = table.empty()
    if files:
        scan = pl.scan_parquet(
            files, schema=table.schema, hive_partitioning=False, missing_columns="insert", extra_columns="ignore"
        )
        rows = table.conform(scan.collect())
    app = f"{MIGRATION}:{source.resolve()}"
    delta = table.create(location)
    written = 0
    if delta.transaction_version(app) is None:
        before = table.scan_table(delta).select(pl.len()).collect().item()
        version = table.commit(delta, rows, {app: 1})
        written = rows.height
        after = table.read(location, version).height
        if after != before + written:
            raise MigrationError(f"{table.name}: the migration's commit holds {after - before} rows, not {written}")
    check = table.read(location)
    missing = rows.join(check, on=list(table.key), how="anti", nulls_equal=True).height
    if missing:
        raise MigrationError(f"{table.name}: {missing} migrated row(s) are not in the Delta table")
    removed = 0
    same_place = not is_remote(location) and Path(location).resolve() == source.resolve()
    if same_place:  # every former file: visible, replaced by a compaction, or a killed writer's temporary one
        former = former_files(source)
        for f in [*former, *source.rglob(legacy.MANIFEST_GLOB), *source.rglob(".*.tmp")]:
            f.unlink(missing_ok=True)
        removed = len(former)
    log.info("migrated %s: %d rows found, %d written, %d former files removed", table.name, rows.height, written,
             removed)  # fmt: skip
    return Migration(table.name, rows.height, written, check.height, removed)


class MigrationError(RuntimeError):
    """The Delta table does not hold every migrated row exactly once: the former files are kept."""


def former_files(folder: Path) -> list[Path]:
    """The former format's data files under `folder` (any Parquet file delta-rs or this lake did not name)."""
    return [f for f in folder.rglob("*.parquet") if not _is_delta_file(f)] if folder.exists() else []


def _is_delta_file(path: Path) -> bool:
    # delta-rs names its data files part-<n>-<uuid>-c000.<codec>.parquet; the former format never did.
    return path.name.endswith(("-c000.snappy.parquet", "-c000.zstd.parquet", "-c000.parquet"))
