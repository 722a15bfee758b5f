"""Ingest's rows for the `events` lake table (`flywheel.lake.tables.EVENTS`).

Every row carries its Kafka topic, partition and offset. The worker commits a batch's rows with
its partitions' offsets in one Delta commit (`ingest.worker.dedup`); this module makes the rows and
makes sure the lake can store each of them: `storable` never fails over a row. A row that cannot
be partitioned or stored is handed back with the reason (for the dead letters) and the others
are kept; only I/O errors raise.
"""

from __future__ import annotations

import logging
import time
import uuid

import polars as pl
import pyarrow as pa

from flywheel.contract import EARLIEST_TIME, LATEST_TIME
from flywheel.lake.tables import EVENTS

log = logging.getLogger(__name__)


def write_events(location: str, df: pl.DataFrame) -> int | None:
    """Append `df` to the events table at `location` in one commit (tools and simulators: no Kafka offsets)."""
    return EVENTS.write(location, df, f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}")


def to_arrow(rows: pl.DataFrame) -> pa.Table:
    """The rows as the table stores them (partition columns added), in Arrow: where a row would fail to store."""
    return EVENTS.stored(rows).to_arrow()


def storable(rows: pl.DataFrame) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """Of `rows` (`EVENTS.schema` plus `_i`, the record's index in its batch), those the lake can store, and
    (`_i`, why) for each other. A part that fails to convert for another reason than I/O is split in halves
    until the row that fails it is alone. `OSError` raises: the lake's fault, not the row's."""
    in_range = pl.col("ts").is_between(EARLIEST_TIME, LATEST_TIME) & pl.col("ts").is_not_null()
    refused = [
        (i, f"ts: outside the times the lake can partition ({EARLIEST_TIME} .. {LATEST_TIME})")
        for i in rows.filter(~in_range)["_i"].to_list()
    ]
    rows = rows.filter(in_range)
    if rows.is_empty():
        return rows, refused
    kept = _storable(rows, refused)
    return (pl.concat(kept) if len(kept) > 1 else kept[0] if kept else rows.clear()), refused


def _storable(part: pl.DataFrame, refused: list[tuple[int, str]]) -> list[pl.DataFrame]:
    try:
        to_arrow(part.drop("_i"))
        return [part]
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - a row the lake cannot take must not stop ingest
        if part.height == 1:
            log.warning("a row cannot be stored in the lake", extra={"row": part["_i"][0], "error": str(exc)})
            refused.append((int(part["_i"][0]), f"cannot be written to the lake: {type(exc).__name__}: {exc}"))
            return []
    half = part.height // 2
    return _storable(part.head(half), refused) + _storable(part.tail(part.height - half), refused)
