"""The `events` lake table (docs/design.md, "Lake tables"): rows from events, and which Kafka positions it holds.

Files are written with `flywheel.lake.write_partitioned` (by event date and hour, each
file renamed into place only when complete). Every row carries its Kafka topic,
partition and offset, so after a crash the lake itself says which records are in.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from flywheel.lake import parquet_files, write_partitioned

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
