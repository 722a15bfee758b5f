"""The `events` lake table: rows from events, and which Kafka positions it holds.

Files are written by event date and hour, each file renamed into place only when complete
(`flywheel.lake.write_atomic`). Every row carries its Kafka topic, partition and offset, so
after a crash the lake itself says which records are in. `write_batch`, the worker's writer,
never fails over a row: a row that cannot be partitioned or written is handed back with the
reason (for the dead-letter topic) and the others are written; only I/O errors raise.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from flywheel.contract import EARLIEST_TIME, LATEST_TIME
from flywheel.lake import parquet_files, write_atomic, write_partitioned

log = logging.getLogger(__name__)

EVENTS_SCHEMA = pl.Schema(
    {
        "event_id": pl.String(),
        "type": pl.String(),
        "schema_version": pl.Int32(),
        "generation_id": pl.String(),
        "user_id": pl.String(),
        "session_id": pl.String(),
        "ts": pl.Datetime("us", "UTC"),
        "received_at": pl.Datetime("us", "UTC"),
        "source": pl.String(),
        "properties": pl.String(),
        "kafka_topic": pl.String(),
        "kafka_partition": pl.Int32(),
        "kafka_offset": pl.Int64(),
    }
)


def events_table(lake_dir: Path) -> Path:
    return lake_dir / "events"


def rows_frame(rows: Sequence[tuple[object, ...]]) -> pl.DataFrame:
    """Lake rows (`ingest.fast_validate.LakeRow`, in `EVENTS_SCHEMA` order) as a frame, built column-wise."""
    if not rows:
        return pl.DataFrame(schema=EVENTS_SCHEMA)
    # zip(*rows) transposes in C; polars then converts each column in one go.
    columns = dict(zip(EVENTS_SCHEMA, (list(c) for c in zip(*rows, strict=True)), strict=True))
    # Times arrive as microseconds since the epoch: an Int64 column cast to Datetime costs nothing.
    schema = pl.Schema({k: pl.Int64() if v == pl.Datetime("us", "UTC") else v for k, v in EVENTS_SCHEMA.items()})
    return pl.DataFrame(columns, schema=schema).cast(EVENTS_SCHEMA)


def write_events(table_dir: Path, df: pl.DataFrame) -> list[Path]:
    """One file per event date/hour, each visible only when complete."""
    name = f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
    return write_partitioned(df, table_dir, name, ts_column="ts")


def read_events(lake_dir: Path) -> pl.DataFrame:
    """The whole events table (tests and tools; components should scan lazily)."""
    files = list(parquet_files(events_table(lake_dir)))
    if not files:
        return pl.DataFrame(schema=EVENTS_SCHEMA)
    return pl.read_parquet(files)


def write_batch(table_dir: Path, rows: pl.DataFrame) -> tuple[list[Path], list[tuple[int, str]]]:
    """Write `rows` (`EVENTS_SCHEMA` plus `_i`, the record's index in its batch) one file per event date/hour.

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
        directory = table_dir / f"date={start:%Y-%m-%d}" / f"hour={start:%H}"
        written += _write_part(part.drop("_hour"), directory, name, refused)
    return written, refused


def _write_part(part: pl.DataFrame, directory: Path, name: str, refused: list[tuple[int, str]]) -> list[Path]:
    try:
        return [write_atomic(part.drop("_i"), directory / f"{name}.parquet")]
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - a row the Parquet writer cannot take must not stop ingest
        if part.height == 1:
            log.warning("row %s cannot be written to the lake: %s", part["_i"][0], exc)
            refused.append((int(part["_i"][0]), f"cannot be written to the lake: {type(exc).__name__}: {exc}"))
            return []
    half = part.height // 2
    return _write_part(part.head(half), directory, f"{name}-a", refused) + _write_part(
        part.tail(part.height - half), directory, f"{name}-b", refused
    )
