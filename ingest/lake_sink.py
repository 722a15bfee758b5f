"""Ingest's writes to the `events` lake table (`flywheel.lake.tables.EVENTS`).

Files are written by event date and hour, each renamed into place only when complete.
Every row carries its Kafka topic, partition and offset, so after a crash the lake itself
says which records are in (`ingest.dedup`). `write_batch`, the worker's writer, never fails over a
row: a row that cannot be partitioned or written is handed back with the reason (for the dead-letter
topic) and the others are written; only I/O errors raise.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from flywheel.contract import EARLIEST_TIME, LATEST_TIME
from flywheel.lake import partition_dir, write_atomic
from flywheel.lake.tables import EVENTS

log = logging.getLogger(__name__)

# The rows' times arrive as microseconds since the epoch: an Int64 column cast to Datetime costs nothing.
_ROWS_SCHEMA = pl.Schema({k: pl.Int64() if v == pl.Datetime("us", "UTC") else v for k, v in EVENTS.schema.items()})


def rows_frame(rows: Sequence[tuple[object, ...]]) -> pl.DataFrame:
    """Lake rows (`ingest.fast_validate.LakeRow`, in `EVENTS.schema` order) as a frame, built column-wise."""
    if not rows:
        return EVENTS.empty()
    # zip(*rows) transposes in C; polars then converts each column in one go.
    columns = dict(zip(EVENTS.schema, (list(c) for c in zip(*rows, strict=True)), strict=True))
    return pl.DataFrame(columns, schema=_ROWS_SCHEMA).cast(EVENTS.schema)


def write_events(table_dir: Path, df: pl.DataFrame) -> list[Path]:
    """One file per event date/hour, each visible only when complete, under a name no other batch has."""
    return EVENTS.write(table_dir, df, f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}")


def write_batch(table_dir: Path, rows: pl.DataFrame) -> tuple[list[Path], list[tuple[int, str]]]:
    """Write `rows` (`EVENTS.schema` plus `_i`, the record's index in its batch) one file per event date/hour.

    Returns the files written and, for each row that could not be, (`_i`, why). Each file is written whole or
    not at all, so a row is never written twice: a file that fails for another reason than I/O is split in
    halves until the row that fails it is alone. `OSError` (a full disk, a lost mount) raises: that is the
    lake's fault, not the row's, and the batch is retried.
    """
    in_range = pl.col("ts").is_between(EARLIEST_TIME, LATEST_TIME) & pl.col("ts").is_not_null()
    refused = [
        (i, f"ts: outside the times the lake can partition ({EARLIEST_TIME} .. {LATEST_TIME})")
        for i in rows.filter(~in_range)["_i"].to_list()
    ]
    rows = rows.filter(in_range)
    if rows.is_empty():
        return [], refused
    name = f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
    keyed = rows.with_columns(pl.col("ts").dt.truncate("1h").alias("_hour"))
    written: list[Path] = []
    for (start,), part in keyed.group_by("_hour", maintain_order=True):
        written += _write_part(part.drop("_hour"), partition_dir(table_dir, start), name, refused)
    return written, refused


def _write_part(part: pl.DataFrame, directory: Path, name: str, refused: list[tuple[int, str]]) -> list[Path]:
    try:
        return [write_atomic(EVENTS.conform(part.drop("_i")), directory / f"{name}.parquet")]
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - a row the Parquet writer cannot take must not stop ingest
        if part.height == 1:
            log.warning("a row cannot be written to the lake", extra={"row": part["_i"][0], "error": str(exc)})
            refused.append((int(part["_i"][0]), f"cannot be written to the lake: {type(exc).__name__}: {exc}"))
            return []
    half = part.height // 2
    return _write_part(part.head(half), directory, f"{name}-a", refused) + _write_part(
        part.tail(part.height - half), directory, f"{name}-b", refused
    )
