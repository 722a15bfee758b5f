"""The `events` lake table (interfaces.md): rows from events, and which Kafka positions it holds.

Files are written with `flywheel.lake.write_partitioned` (by event date and hour, each
file renamed into place only when complete). Every row carries its Kafka topic,
partition and offset, so after a crash the lake itself says which records are in.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from flywheel.bus import Record
from flywheel.contract import Event
from flywheel.lake import parquet_files, write_partitioned

EVENTS_SCHEMA = {
    "event_id": pl.String,
    "type": pl.String,
    "schema_version": pl.Int32,
    "generation_id": pl.String,
    "user_id": pl.String,
    "session_id": pl.String,
    "ts": pl.Datetime("us", "UTC"),
    "received_at": pl.Datetime("us", "UTC"),
    "source": pl.String,
    "properties": pl.String,
    "kafka_topic": pl.String,
    "kafka_partition": pl.Int32,
    "kafka_offset": pl.Int64,
}


def events_table(lake_dir: Path) -> Path:
    return lake_dir / "events"


def events_frame(rows: Sequence[tuple[Record, Event]]) -> pl.DataFrame:
    columns: dict[str, list[object]] = {name: [] for name in EVENTS_SCHEMA}
    for record, e in rows:
        columns["event_id"].append(e.event_id)
        columns["type"].append(e.type.value)
        columns["schema_version"].append(e.schema_version)
        columns["generation_id"].append(e.generation_id)
        columns["user_id"].append(e.user_id)
        columns["session_id"].append(e.session_id)
        columns["ts"].append(e.ts)
        columns["received_at"].append(e.received_at)
        columns["source"].append(e.source)
        columns["properties"].append(json.dumps(e.properties, separators=(",", ":")))
        columns["kafka_topic"].append(record.topic)
        columns["kafka_partition"].append(record.partition)
        columns["kafka_offset"].append(record.offset)
    return pl.DataFrame(columns, schema=EVENTS_SCHEMA)


def write_events(table_dir: Path, df: pl.DataFrame) -> list[Path]:
    """One file per event date/hour, each visible only when complete."""
    name = f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}"
    return write_partitioned(df, table_dir, name, ts_column="ts")


def positions_in_lake(table_dir: Path, records: Sequence[Record]) -> set[tuple[str, int, int]]:
    """Which of `records` (by topic, partition, offset) already have a row in the lake."""
    files = list(parquet_files(table_dir))
    if not files or not records:
        return set()
    wanted = pl.DataFrame(
        {
            "kafka_topic": [r.topic for r in records],
            "kafka_partition": [r.partition for r in records],
            "kafka_offset": [r.offset for r in records],
        },
        schema={k: EVENTS_SCHEMA[k] for k in ("kafka_topic", "kafka_partition", "kafka_offset")},
    )
    lo, hi = min(r.offset for r in records), max(r.offset for r in records)
    found = (
        pl.scan_parquet(files)
        .select("kafka_topic", "kafka_partition", "kafka_offset")
        .filter(pl.col("kafka_offset").is_between(lo, hi))  # row-group statistics skip most files
        .join(wanted.lazy(), on=["kafka_topic", "kafka_partition", "kafka_offset"], how="semi")
        .collect()
    )
    return set(found.iter_rows())


def read_events(lake_dir: Path) -> pl.DataFrame:
    """The whole events table (tests and tools; components should scan lazily)."""
    files = list(parquet_files(events_table(lake_dir)))
    if not files:
        return pl.DataFrame(schema=EVENTS_SCHEMA)
    return pl.read_parquet(files)
