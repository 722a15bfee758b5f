"""The Parquet lake: files become visible only when complete.

Layout: `<lake>/<table>/date=YYYY-MM-DD/hour=HH/<name>.parquet`. A file is written
under a hidden temporary name and renamed into place (atomic on one filesystem),
so readers never see a half-written file.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import polars as pl


def write_atomic(df: pl.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    df.write_parquet(tmp, compression="zstd")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def write_partitioned(df: pl.DataFrame, table_dir: Path, name: str, ts_column: str = "ts") -> list[Path]:
    """Write `df` split by the date and hour of `ts_column`, one file per partition named `name`."""
    if df.is_empty():
        return []
    keyed = df.with_columns(
        pl.col(ts_column).dt.strftime("%Y-%m-%d").alias("_date"),
        pl.col(ts_column).dt.strftime("%H").alias("_hour"),
    )
    written = []
    for (date, hour), part in keyed.group_by(["_date", "_hour"], maintain_order=True):
        path = table_dir / f"date={date}" / f"hour={hour}" / f"{name}.parquet"
        written.append(write_atomic(part.drop("_date", "_hour"), path))
    return written


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
