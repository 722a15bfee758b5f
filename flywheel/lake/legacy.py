"""Today's former lake format, read only by `flywheel lake migrate` (`flywheel.lake.maintenance`).

Before the lake became Delta tables it was plain Parquet files:
`<lake>/<table>/date=YYYY-MM-DD/hour=HH/<name>.parquet`, each written under a hidden temporary name
and renamed into place, plus compaction's `compacted-*.parquet` files, visible only once a manifest
`_compaction-*.json` named them, and then hiding the files that manifest replaces. `parquet_files`
is that visibility rule; `write_partitioned` writes the format (the migration's tests build such a
lake with it). Nothing else reads or writes it any more.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
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
    return [write_atomic(part, partition_dir(table_dir, start) / f"{name}.parquet") for start, part in parts]


def partition_dir(table_dir: Path, hour_start: datetime) -> Path:
    """The folder of `table_dir` that holds the rows of the hour starting at `hour_start`."""
    return table_dir / f"date={hour_start:%Y-%m-%d}" / f"hour={hour_start:%H}"


COMPACTED_PREFIX = "compacted-"
MANIFEST_GLOB = "_compaction-*.json"


@dataclass(frozen=True, slots=True)
class Manifest:
    """One compaction of one directory: `output` took the place of `replaces` (file names) at `at`."""

    path: Path
    output: str
    replaces: tuple[str, ...]
    at: float

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        """The manifest at `path`, or None when it was removed meanwhile (its files are then gone too)."""
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        return cls(path, str(doc["output"]), tuple(doc["replaces"]), float(doc["at"]))


def manifests(directory: Path) -> list[Manifest]:
    return [m for p in sorted(directory.glob(MANIFEST_GLOB)) if (m := Manifest.read(p)) is not None]


def visible_files(directory: Path, names: Iterable[str], found: Iterable[Manifest]) -> list[Path]:
    """Of the Parquet file `names` in `directory`, those that are part of the table (see the module's doc)."""
    replaced: set[str] = set()
    outputs: set[str] = set()
    for m in found:
        replaced.update(m.replaces)
        outputs.add(m.output)
    return [
        directory / n
        for n in sorted(names)
        if not n.startswith(".") and n not in replaced and (not n.startswith(COMPACTED_PREFIX) or n in outputs)
    ]


def parquet_files(table_dir: Path) -> Iterator[Path]:
    """Complete files of a table: temporary files (names starting with a dot), files a compaction replaced
    and compacted files whose manifest is not written yet are skipped."""
    if not table_dir.exists():
        return
    # Manifests before data files: a compaction renames its output before its manifest, so a manifest read
    # here names an output the listing below will find. (The other order could miss both the output and
    # the files it replaced, had the switch fallen between the two.)
    found: dict[Path, list[Manifest]] = defaultdict(list)
    for p in table_dir.rglob(MANIFEST_GLOB):
        if (m := Manifest.read(p)) is not None:
            found[p.parent].append(m)
    by_dir: dict[Path, list[str]] = defaultdict(list)
    for p in table_dir.rglob("*.parquet"):
        by_dir[p.parent].append(p.name)
    for directory in sorted(by_dir):
        yield from visible_files(directory, by_dir[directory], found.get(directory, ()))


def scan(table_dir: Path) -> pl.LazyFrame | None:
    """A lazy scan of a table, or None when it holds no file yet."""
    files = list(parquet_files(table_dir))
    if not files:
        return None
    return pl.scan_parquet(files, hive_partitioning=False, missing_columns="insert", extra_columns="ignore")
