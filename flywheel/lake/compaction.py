"""Lake compaction: the many small files of a closed hour become one, without a reader ever seeing a row twice.

Writers add one file per batch and hour (`flywheel.lake.write_partitioned`), so a quiet hour
holds thousands of small files, and every reader pays for each file it opens. `compact_table`
merges, in every hour directory that closed at least `settle_s` ago, the files of the table into
one (streamed by polars: memory stays bounded however big the hour):

1. the merged rows are written to a temporary file, synced, and renamed to `compacted-<id>.parquet`,
   which readers ignore while no manifest names it;
2. the manifest `_compaction-<id>.json` (`{"output", "replaces", "at"}`) is written the same way:
   its rename is the switch, after which readers see the merged file instead of the ones it replaces;
3. the replaced files are deleted only `grace_s` after the switch, by a later run, so a reader that
   listed the directory just before it can still read them.

A late event that lands in a compacted hour makes a new small file; the next run merges it with
the compacted file. One compaction at a time per directory: a `.compact.lock` made with O_EXCL
(a lock older than `STALE_TEMP_S`, left by a killed run, is taken over). A run killed before its
manifest leaves a compacted file no reader sees; a later run deletes it once it is stale.
The merged file keeps the newest modification time of its inputs, so readers that go by file age
(the ingest de-duplication window) see the rows as old as they were.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl

from flywheel.lake import COMPACTED_PREFIX, STALE_TEMP_S, Manifest, manifests, visible_files

log = logging.getLogger(__name__)

LOCK_NAME = ".compact.lock"
_HOUR_DIR = re.compile(r"date=(\d{4}-\d{2}-\d{2})/hour=(\d{2})$")


@dataclass
class CompactionResult:
    directories: int = 0  # hour directories merged in this run
    files_merged: int = 0
    rows: int = 0
    files_deleted: int = 0  # replaced files (and stale leftovers) deleted after their grace period
    skipped_locked: list[str] = field(default_factory=list)


def hour_of(directory: Path) -> datetime | None:
    """The start of the hour a `date=YYYY-MM-DD/hour=HH` directory holds, or None for any other directory."""
    m = _HOUR_DIR.search(directory.as_posix())
    return datetime.fromisoformat(f"{m[1]}T{m[2]}:00:00+00:00") if m else None


def compact_table(
    table_dir: Path,
    *,
    settle_s: float = 2 * 3600,
    grace_s: float = STALE_TEMP_S,
    now: datetime | None = None,
    on_directory: Callable[[Path], None] | None = None,
) -> CompactionResult:
    """Compact every hour directory of `table_dir` whose hour ended at least `settle_s` ago (module doc)."""
    result = CompactionResult()
    if not table_dir.exists():
        return result
    cutoff = (now or datetime.now(UTC)) - timedelta(seconds=settle_s)
    directories = sorted({p.parent for p in table_dir.rglob("*.parquet")})
    for directory in directories:
        hour = hour_of(directory)
        if hour is None or hour + timedelta(hours=1) > cutoff:
            continue
        if on_directory is not None:
            on_directory(directory)
        compact_directory(directory, grace_s=grace_s, result=result)
    return result


def compact_directory(
    directory: Path, *, grace_s: float = STALE_TEMP_S, result: CompactionResult | None = None
) -> CompactionResult:
    """Delete what earlier compactions left past their grace, then merge the directory's files if several."""
    result = result if result is not None else CompactionResult()
    if not _take_lock(directory):
        result.skipped_locked.append(str(directory))
        return result
    try:
        result.files_deleted += _collect_garbage(directory, grace_s)
        names = [p.name for p in directory.glob("*.parquet")]
        files = visible_files(directory, names, manifests(directory))
        if len(files) < 2:
            return result
        merged = _merge(directory, files)
        result.directories += 1
        result.files_merged += len(files)
        result.rows += merged
    finally:
        (directory / LOCK_NAME).unlink(missing_ok=True)
    return result


def _take_lock(directory: Path) -> bool:
    lock = directory / LOCK_NAME
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            try:
                if time.time() - lock.stat().st_mtime < STALE_TEMP_S:
                    return False
                log.warning("taking over %s, left by a compaction that did not finish", lock)
                lock.unlink(missing_ok=True)
            except FileNotFoundError:  # released meanwhile: try again
                continue
    return False


def _union_schema(files: list[Path]) -> pl.Schema:
    """Every column of every file (a table whose schema grew keeps its new columns); a type clash is an error."""
    schema: dict[str, pl.DataType] = {}
    for f in files:
        for name, dtype in pl.read_parquet_schema(f).items():
            if schema.setdefault(name, dtype) != dtype:
                raise ValueError(f"{f}: column {name!r} is {dtype} here and {schema[name]} in another file")
    return pl.Schema(schema)


def _merge(directory: Path, files: list[Path]) -> int:
    stamp = f"{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
    output = directory / f"{COMPACTED_PREFIX}{stamp}.parquet"
    tmp = directory / f".{output.name}.{uuid.uuid4().hex}.tmp"
    lf = pl.scan_parquet(files, schema=_union_schema(files), missing_columns="insert", hive_partitioning=False)
    lf.sink_parquet(tmp, compression="zstd", compression_level=1, sync_on_close="all")
    rows = pl.scan_parquet(tmp).select(pl.len()).collect().item()
    newest = max(f.stat().st_mtime for f in files)
    os.utime(tmp, (newest, newest))
    os.replace(tmp, output)  # not part of the table yet: no manifest names it

    manifest = directory / f"_compaction-{stamp}.json"
    doc = {"output": output.name, "replaces": [f.name for f in files], "at": time.time()}
    tmp = directory / f".{manifest.name}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, manifest)  # the switch
    log.info("compacted %d files of %s into %s (%d rows)", len(files), directory, output.name, rows)
    return int(rows)


def _collect_garbage(directory: Path, grace_s: float) -> int:
    """Delete files replaced more than `grace_s` ago, manifests with nothing left to name, and compacted
    files of runs killed before their manifest (once stale). Returns how many data files went."""
    deleted = 0
    now = time.time()
    found: list[Manifest] = manifests(directory)
    named = {m.output for m in found}
    for m in found:
        if now - m.at < grace_s:
            continue
        for name in m.replaces:
            path = directory / name
            if path.exists():
                path.unlink()
                deleted += 1
    # A manifest may go once its output is itself replaced and gone, and everything it replaced is gone.
    for m in found:
        if not (directory / m.output).exists() and not any((directory / n).exists() for n in m.replaces):
            m.path.unlink(missing_ok=True)
    for orphan in directory.glob(f"{COMPACTED_PREFIX}*.parquet"):
        if orphan.name not in named and now - orphan.stat().st_ctime > STALE_TEMP_S:
            orphan.unlink()
            deleted += 1
    return deleted
