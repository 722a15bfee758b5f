"""Ingest's writes to the `events` lake table (`flywheel.lake.tables.EVENTS`).

Files are written by event date and hour, each renamed into place only when complete.
Every row carries its Kafka topic, partition and offset, so after a crash the lake itself
says which records are in (`ingest.dedup`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from flywheel.lake.tables import EVENTS

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
