"""The Parquet lake: files become visible only when complete.

Layout: `<lake>/<table>/date=YYYY-MM-DD/hour=HH/<name>.parquet`. A file is written
under a hidden temporary name and renamed into place (atomic on one filesystem),
so readers never see a half-written file. A writer killed before its rename leaves the
temporary file behind: `sweep_temp_files` removes those once they are old.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import polars as pl

log = logging.getLogger(__name__)


def write_atomic(df: pl.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    # zstd level 1: on event rows, as small as the default level here and about a fifth faster to write.
    df.write_parquet(tmp, compression="zstd", compression_level=1)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def write_partitioned(df: pl.DataFrame, table_dir: Path, name: str, ts_column: str = "ts") -> list[Path]:
    """Write `df` split by the date and hour of `ts_column`, one file per partition named `name`."""
    if df.is_empty():
        return []
    hour = pl.col(ts_column).dt.truncate("1h")
    hours: list[datetime] = df.select(hour.unique(maintain_order=True)).to_series().to_list()
    if len(hours) == 1:  # the usual batch: no split needed
        parts = [(hours[0], df)]
    else:
        keyed = df.with_columns(hour.alias("_hour"))
        parts = [(h, part.drop("_hour")) for (h,), part in keyed.group_by("_hour", maintain_order=True)]
    return [
        write_atomic(part, table_dir / f"date={start:%Y-%m-%d}" / f"hour={start:%H}" / f"{name}.parquet")
        for start, part in parts
    ]


# A temporary file older than this cannot belong to a writer still at work (a batch takes well under a second).
STALE_TEMP_S = 3600.0


def sweep_temp_files(table_dir: Path, older_than_s: float = STALE_TEMP_S) -> int:
    """Delete temporary files left by writers killed before their rename; returns how many.

    Only files older than `older_than_s` go: another process may be writing a fresh one right now.
    """
    if not table_dir.exists():
        return 0
    cutoff = time.time() - older_than_s
    removed = 0
    for tmp in table_dir.rglob(".*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
                removed += 1
        except FileNotFoundError:  # renamed or swept by someone else meanwhile
            continue
    return removed


class TempFileSweeper:
    """For a worker's loop: `maybe()` sweeps `table_dir` (`sweep_temp_files`) on the first call and then at most
    every `every_s` seconds, and logs what it removed."""

    def __init__(self, table_dir: Path, every_s: float = STALE_TEMP_S) -> None:
        self.table_dir = table_dir
        self.every_s = every_s
        self._swept_at = float("-inf")

    def maybe(self) -> None:
        if time.monotonic() - self._swept_at < self.every_s:
            return
        self._swept_at = time.monotonic()
        removed = sweep_temp_files(self.table_dir)
        if removed:
            log.info("removed %d temporary file(s) left in %s by killed writers", removed, self.table_dir)


def parquet_files(table_dir: Path) -> Iterator[Path]:
    """Complete files of a table (temporary files start with a dot and are skipped)."""
    if table_dir.exists():
        yield from sorted(p for p in table_dir.rglob("*.parquet") if not p.name.startswith("."))


def scan(table_dir: Path) -> pl.LazyFrame | None:
    """A lazy scan of a table, or None when it holds no file yet."""
    files = list(parquet_files(table_dir))
    if not files:
        return None
    return pl.scan_parquet(files, hive_partitioning=False, missing_columns="insert", extra_columns="ignore")
