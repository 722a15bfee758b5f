"""Every table of the lake, defined once: its name, columns, place under the lake root and rules.

The lake is a contract between components that never import each other: ingest writes `events`,
signals reads it and writes `rewards`, the trainer and the deploy gate read both. Each `Table` here
says, for everyone:

- `schema`: the columns, in order, with their polars types. Writers go through `Table.write`, which
  refuses a frame with a missing or unknown column and casts the rest to the declared types, so
  no file disagrees with another (compaction refuses to merge files whose types clash);
- `path`: where it lives, relative to the lake root (`Settings.lake_dir`): `Table.at(root)`;
- `partition_column`: files are split by the date and hour of this column
  (`<table>/date=YYYY-MM-DD/hour=HH/<name>.parquet`, `flywheel.lake.write_partitioned`);
- `key`: the columns a row is unique by. Readers that may see a row twice (a replay, a
  duplicate event) keep one per key;
- `current_key` and `order_by` (rewards only): a row may be revised; the current one of each
  `current_key` is the last in `order_by` order (`Table.latest`).

Readers take a table's location (`Table.at(settings.lake_dir)`) and scan it with `Table.scan`,
which reads through `flywheel.lake.parquet_files` (complete, not compacted-away files) with the
declared schema: a column a file lacks (written before the column existed) reads as null.

The frames of the contract's records live here too (`events_frame`, `rewards_frame`), so every
writer that starts from an `Event` or a `RewardRecord` spells the rows the same way.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import polars as pl

from flywheel.contract import Event, RewardRecord
from flywheel.lake import parquet_files, write_partitioned

_UTC_US = pl.Datetime("us", "UTC")

Frame = TypeVar("Frame", pl.DataFrame, pl.LazyFrame)


class LakeSchemaError(ValueError):
    """A frame does not have a table's columns: writing it would break the contract for every reader."""


@dataclass(frozen=True, slots=True)
class Table:
    """One table of the lake (the module's doc says what each field promises)."""

    name: str
    path: str  # relative to the lake root
    schema: pl.Schema
    partition_column: str  # a UTC Datetime column: files are split by its date and hour
    key: tuple[str, ...]  # a row is unique by these
    current_key: tuple[str, ...] = ()  # revised tables: the current row of each of these ...
    order_by: tuple[str, ...] = ()  # ... is the last in this order

    def at(self, lake_root: Path) -> Path:
        """This table's directory in the lake rooted at `lake_root`."""
        return lake_root / self.path

    def empty(self) -> pl.DataFrame:
        return pl.DataFrame(schema=self.schema)

    def conform(self, df: pl.DataFrame) -> pl.DataFrame:
        """`df` with exactly this table's columns, in order and of the declared types; else `LakeSchemaError`."""
        missing = [c for c in self.schema if c not in df.columns]
        unknown = [c for c in df.columns if c not in self.schema]
        if missing or unknown:
            problems = [f"lacks {missing}"] if missing else []
            problems += [f"has columns the table does not: {unknown}"] if unknown else []
            raise LakeSchemaError(f"a frame for the {self.name} table {'; '.join(problems)}")
        if df.schema == self.schema:
            return df
        return df.select(self.schema.names()).cast(self.schema)

    def write(self, location: Path, df: pl.DataFrame, name: str) -> list[Path]:
        """Write `df` under `location`, one file `name` per date/hour of `partition_column`, each visible only
        when complete. The same `name` for the same rows replaces them (idempotent rewrites)."""
        return write_partitioned(self.conform(df), location, name, ts_column=self.partition_column)

    def scan(self, location: Path) -> pl.LazyFrame | None:
        """A lazy scan of the table at `location` with the declared schema, or None when it holds no file."""
        files = list(parquet_files(location))
        return self.scan_files(files) if files else None

    def scan_files(self, files: Sequence[Path]) -> pl.LazyFrame:
        """Some of the table's files (from `flywheel.lake.parquet_files`), read with the declared schema."""
        return pl.scan_parquet(
            list(files), schema=self.schema, hive_partitioning=False, missing_columns="insert", extra_columns="ignore"
        )

    def read(self, location: Path) -> pl.DataFrame:
        """The whole table (tests and tools; components scan lazily and select what they need)."""
        lf = self.scan(location)
        return self.empty() if lf is None else lf.collect()

    def latest(self, frame: Frame) -> Frame:
        """The current row of each `current_key`: the last in `order_by` order (of equal ones, the last read).
        Deterministic: rows come out in `order_by` order."""
        if not self.current_key:
            raise TypeError(f"the {self.name} table has no revisions")
        # Sort then unique(keep="last"): on a collected frame, the fastest form bench/gate_metrics.py measured.
        return frame.sort(list(self.order_by), maintain_order=True).unique(
            list(self.current_key), keep="last", maintain_order=True
        )


EVENTS = Table(
    name="events",
    path="events",
    schema=pl.Schema(
        {
            "event_id": pl.String(),
            "type": pl.String(),
            "schema_version": pl.Int32(),
            "generation_id": pl.String(),
            "user_id": pl.String(),
            "session_id": pl.String(),
            "ts": _UTC_US,
            "received_at": _UTC_US,
            "source": pl.String(),
            # The event's properties as compact JSON: `json.dumps(properties, separators=(",", ":"))`.
            "properties": pl.String(),
            # Where the event was read from: the lake itself says which Kafka positions it holds.
            "kafka_topic": pl.String(),
            "kafka_partition": pl.Int32(),
            "kafka_offset": pl.Int64(),
        }
    ),
    partition_column="ts",
    key=("event_id",),
)

REWARDS = Table(
    name="rewards",
    path="rewards",
    schema=pl.Schema(
        {
            "generation_id": pl.String(),
            "reward_version": pl.String(),
            "revision": pl.Int64(),
            "reward": pl.Float64(),
            "confidence": pl.Float64(),
            "label_source": pl.String(),
            "signals": pl.String(),  # JSON object, keys sorted
            "user_id": pl.String(),
            "model_version": pl.String(),
            "arm": pl.String(),
            "experiment": pl.String(),
            "window_start": _UTC_US,
            "window_end": _UTC_US,
            "late_events": pl.Int64(),
            "emitted_at": _UTC_US,
        }
    ),
    partition_column="emitted_at",
    key=("generation_id", "reward_version", "revision"),
    current_key=("generation_id", "reward_version"),
    order_by=("revision", "emitted_at"),
)

TABLES: dict[str, Table] = {t.name: t for t in (EVENTS, REWARDS)}

# Not a table: the reward definitions signals keeps beside the lake, one `<version>.json` each.
REWARD_DEFINITIONS_PATH = "reward_definitions"


def events_frame(located: Iterable[tuple[Event, str, int, int]]) -> pl.DataFrame:
    """Rows of the events table from (event, Kafka topic, partition, offset), as ingest writes them."""
    rows = [
        (
            e.event_id, e.type.value, e.schema_version, e.generation_id, e.user_id, e.session_id, e.ts,
            e.received_at, e.source, json.dumps(e.properties, separators=(",", ":")), topic, partition, offset,
        )
        for e, topic, partition, offset in located
    ]  # fmt: skip
    if not rows:
        return EVENTS.empty()
    return pl.DataFrame(rows, schema=EVENTS.schema, orient="row")


def rewards_frame(records: Sequence[RewardRecord]) -> pl.DataFrame:
    """Rows of the rewards table, one per record (`signals` as JSON with sorted keys)."""
    rows = [{**r.model_dump(), "signals": json.dumps(r.signals, sort_keys=True)} for r in records]
    if not rows:
        return REWARDS.empty()
    return pl.DataFrame(rows, schema=REWARDS.schema)


def generation_events(location: Path, generation_ids: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
    """generation id -> every (properties JSON, user id) its `generation` events logged in the events table at
    `location`, in lake order (a forgery may share an id with serving's record: readers pick what they trust)."""
    events = EVENTS.scan(location)
    if events is None or not generation_ids:
        return {}
    frame = (
        events.filter((pl.col("type") == "generation") & pl.col("generation_id").is_in(list(generation_ids)))
        .select("generation_id", "properties", "user_id")
        .collect()
    )
    out: dict[str, list[tuple[str, str]]] = {}
    for gid, properties, user in frame.iter_rows():
        out.setdefault(gid, []).append((properties, user))
    return out
