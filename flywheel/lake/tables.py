"""Every table of the lake, defined once: its name, columns, place under the lake root and rules.

The lake is a contract between components that never import each other: ingest writes `events`
and `dead_letters`, signals reads events and writes `rewards`, the trainer and the deploy gate read
them. Each `Table` is a Delta table (`flywheel.lake`) and says, for everyone:

- `schema`: the columns, in order, with their polars types. Writers go through `Table.write`,
  `Table.write_parts` or `Table.commit`, which refuse a frame with a missing or unknown column and cast the rest to the
  declared types, so no commit disagrees with another;
- `path`: where it lives under the lake root (a local path or an `s3://` URI): `Table.at(root)`;
- `partition_column`: the table is partitioned by the UTC date and hour of this column, stored as
  two more columns, `date` and `hour` (`<table>/date=YYYY-MM-DD/hour=H/part-*.parquet`), which
  readers do not see;
- `key`: the columns a row is unique by. Readers that may see a row twice (a duplicate event
  sent with a fresh id) keep one per key;
- `current_key` and `order_by` (rewards only): a row may be revised; the current one of each
  `current_key` is the last in `order_by` order (`Table.latest`).

Readers scan a table with `Table.scan(location, version=...)`: one table version (the newest by
default), with the declared schema (a column the table does not have yet reads as null). A version
is what a training run records in its lineage, so it can be read again, row for row.

The frames of the contract's records live here too (`events_frame`, `rewards_frame`), so every
writer that starts from an `Event` or a `RewardRecord` spells the rows the same way.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import polars as pl
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction

from flywheel.contract import Event, RewardRecord
from flywheel.lake import guard_fork, is_remote, join

log = logging.getLogger(__name__)

_UTC_US = pl.Datetime("us", "UTC")
# The partition columns every table stores beside its own (the date and hour of `partition_column`).
PARTITION_COLUMNS = pl.Schema({"date": pl.Date(), "hour": pl.Int32()})
# How long a table keeps its commit log (`delta.logRetentionDuration`). At each checkpoint (every 100 commits)
# delta-rs deletes log files older than this, and a version whose log is gone can no longer be opened, though a
# vacuum kept its data files (`maintenance.vacuum(keep_versions=...)`): a model trained on it could no longer be
# traced to its rows. Delta's default is 30 days; ours a year (`Settings.lake_log_retention_days`), never less
# than Delta's. `flywheel lake compact` sets the deployment's value on tables created before it.
DEFAULT_LOG_RETENTION_DAYS = 365
MIN_LOG_RETENTION_DAYS = 30
LOG_RETENTION = "delta.logRetentionDuration"


def log_retention(days: int) -> str:
    """`days` as the table property's value ("interval N days"); refuses fewer than Delta's default."""
    if days < MIN_LOG_RETENTION_DAYS:
        raise ValueError(f"a log retention of {days} days is shorter than Delta's {MIN_LOG_RETENTION_DAYS}-day default")
    return f"interval {int(days)} days"


# Table properties set at creation. A named write's transaction (`Table.write(name=...)`, `write_parts`) carries
# its time and is forgotten this long after it (a signals outbox entry is flushed within seconds); a Kafka
# partition's carries none and is kept for good. The log retention is `Table.create`'s argument.
TABLE_CONFIGURATION: dict[str, str | None] = {"delta.setTransactionRetentionDuration": "interval 7 days"}

Frame = TypeVar("Frame", pl.DataFrame, pl.LazyFrame)


def _below(stored: int | None, version: int) -> bool:
    return stored is None or stored < version


class LakeSchemaError(ValueError):
    """A frame does not have a table's columns: writing it would break the contract for every reader."""


class VersionGone(LookupError):
    """A version of a table that exists can no longer be opened: its commit log was cleaned up (older than the
    table's log retention) or it was never made. Never read as an empty table: a re-run would train on nothing."""


class CommitRefused(RuntimeError):
    """A commit's application transactions do not follow the table's: the writer is stale or replaying.

    Delta accepts any transaction version, lower or equal to the stored one included; the lake refuses
    one that does not move forward, and one whose writer expected another stored version (someone else
    committed for that application id since the writer last looked)."""


@dataclass(frozen=True, slots=True)
class Table:
    """One table of the lake (the module's doc says what each field promises)."""

    name: str
    path: str  # relative to the lake root
    schema: pl.Schema
    partition_column: str  # a UTC Datetime column: partitioned by its date and hour
    key: tuple[str, ...]  # a row is unique by these
    current_key: tuple[str, ...] = ()  # revised tables: the current row of each of these ...
    order_by: tuple[str, ...] = ()  # ... is the last in this order

    def at(self, lake_root: str | Path) -> str:
        """The URI of this table in the lake rooted at `lake_root` (a local path or an object-store URI)."""
        return join(lake_root, self.path)

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

    def stored(self, df: pl.DataFrame) -> pl.DataFrame:
        """`df`, conformed, with the partition columns the table stores."""
        at = pl.col(self.partition_column)
        return self.conform(df).with_columns(at.dt.date().alias("date"), at.dt.hour().cast(pl.Int32).alias("hour"))

    # ------------------------------------------------------------ opening

    def open(self, location: str, version: int | None = None) -> DeltaTable | None:
        """The table at `location` (at `version`, default the newest), or None when it does not exist yet.

        Raises `VersionGone` when the table exists but `version` cannot be opened (its log was cleaned up)."""
        guard_fork()
        if version is None:
            try:
                return DeltaTable(location)
            except TableNotFoundError:
                return None
        try:
            return DeltaTable(location, version=version)
        except DeltaError as exc:  # TableNotFoundError too: delta-rs says so when the version's log is gone
            newest = self.open(location)
            if newest is None:
                return None
            kept = newest.metadata().configuration.get(LOG_RETENTION) or "interval 30 days (Delta's default)"
            raise VersionGone(
                f"{self.name}: version {version} of {location} cannot be opened (the newest is {newest.version()}; "
                f"the table keeps its log for {kept.removeprefix('interval ')}): {exc}"
            ) from exc

    def create(self, location: str, *, log_retention_days: int = DEFAULT_LOG_RETENTION_DAYS) -> DeltaTable:
        """The table at `location`, created empty (partitioned, with the declared schema, keeping its log
        `log_retention_days`) if it does not exist."""
        table = self.open(location)
        if table is not None:
            return table
        schema = pl.DataFrame(schema={**self.schema, **PARTITION_COLUMNS}).to_arrow().schema
        configuration = {**TABLE_CONFIGURATION, LOG_RETENTION: log_retention(log_retention_days)}
        try:
            return DeltaTable.create(
                location, schema=schema, partition_by=list(PARTITION_COLUMNS), mode="ignore",
                configuration=configuration,
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - another writer created it first: its version 0 stands
            table = self.open(location)
            if table is None:
                raise
            return table

    def version(self, location: str) -> int | None:
        """The newest version of the table at `location`, or None when it does not exist."""
        table = self.open(location)
        return None if table is None else table.version()

    # ------------------------------------------------------------ writing

    def commit(
        self,
        snapshot: DeltaTable,
        df: pl.DataFrame,
        transactions: Mapping[str, int] | None = None,
        expected: Mapping[str, int | None] | None = None,
        expiring: bool = False,
    ) -> int:
        """Append `df` with `transactions` (application id -> version) in one commit on `snapshot`; returns the
        table version it made, and `snapshot` is then at that version.

        Checked on `snapshot`, the very table object that commits, so the check and the commit see one table
        version; a commit landing after that version for one of the same application ids makes this one fail
        with `CommitFailedError` (Delta's conflict check), never commit twice. Raises `CommitRefused` when an
        application id's stored version is not `expected[app_id]` (where given) or not below the new one.
        `expiring` transactions are dated, so the table forgets them after its retention (`TABLE_CONFIGURATION`).
        """
        transactions = dict(transactions or {})
        for app_id, new in transactions.items():
            stored = snapshot.transaction_version(app_id)
            if expected is not None and app_id in expected and stored != expected[app_id]:
                raise CommitRefused(f"{self.name}: {app_id} is at {stored} in the table, this writer expected "
                                    f"{expected[app_id]}: someone else committed for it")
            if stored is not None and new <= stored:
                raise CommitRefused(f"{self.name}: {app_id} would go from {stored} to {new}, not forward")
        at = int(time.time() * 1000) if expiring else None
        properties = CommitProperties(app_transactions=[Transaction(a, v, at) for a, v in transactions.items()])
        if is_remote(snapshot.table_uri):
            write_deltalake(snapshot, self.stored(df).to_arrow(), mode="append", commit_properties=properties)
        else:
            self._append_files(snapshot, df, properties)
        return snapshot.version()

    def _append_files(self, snapshot: DeltaTable, df: pl.DataFrame, properties: CommitProperties) -> None:
        """On a local disk: the data files written by polars (a third of delta-rs's writer's time here), then one
        commit of their add actions on `snapshot` (the same conflict check as `write_deltalake`). A file of a
        commit that fails stays unreferenced; `vacuum(full=True)` deletes it."""
        root = Path(snapshot.table_uri.removeprefix("file://"))
        adds: list[AddAction | RemoveAction] = []
        stored = self.stored(df)
        for (day, hour), part in sorted(stored.group_by(list(PARTITION_COLUMNS)), key=lambda kv: kv[0]):
            relative = f"date={day.isoformat()}/hour={hour}/part-00000-{uuid.uuid4()}-c000.zstd.parquet"
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            # zstd level 1: on event rows, as small as the default level here and about a fifth faster to write.
            part.drop(list(PARTITION_COLUMNS)).write_parquet(path, compression="zstd", compression_level=1)
            adds.append(AddAction(
                relative, path.stat().st_size, {"date": day.isoformat(), "hour": str(hour)},
                int(time.time() * 1000), True, json.dumps({"numRecords": part.height}),
            ))  # fmt: skip
        snapshot.create_write_transaction(
            adds, "append", snapshot.schema(), partition_by=list(PARTITION_COLUMNS), commit_properties=properties
        )
        snapshot.update_incremental()

    def write(
        self, location: str, df: pl.DataFrame, name: str | None = None, *, transaction: tuple[str, int] | None = None
    ) -> int | None:
        """Append `df` to the table at `location` (created if missing) in one commit; returns its version, or None
        when nothing was written because the commit was already made.

        Idempotent where told how: `transaction=(app_id, version)` writes only when the table's version for
        `app_id` is below `version` (a writer with a monotonic position); a `name` writes once per name within the
        table's transaction retention (tests, tools and the simulators; the signals worker's outbox entries go
        through `write_parts`). Racing writers of the same are settled by Delta: the loser's commit fails, it
        reloads, and finds the commit made."""
        if name is not None and transaction is None:
            transaction = (f"write:{name}", 0)
        return self._append(location, [(transaction, df)])

    def write_parts(self, location: str, parts: Sequence[tuple[str, pl.DataFrame]]) -> int | None:
        """Append named frames in one commit, each once per name (`write`'s `name`, here several: one commit
        pays the log's fixed cost once for all of them). A part whose name the table holds is left out, so parts
        written once together and then again apart, or the other way round, are each in the table once.
        Returns the version made, or None when every part was already written."""
        return self._append(location, [((f"write:{name}", 0), df) for name, df in parts])

    def _append(self, location: str, parts: Sequence[tuple[tuple[str, int] | None, pl.DataFrame]]) -> int | None:
        """One commit of the parts not yet written (a part with a transaction: while the table's version for its
        application id is below the part's)."""
        # conformed before the table is created: a frame that breaks the schema leaves nothing
        parts = [(transaction, self.conform(df)) for transaction, df in parts if not df.is_empty()]
        if not parts:
            return None
        for _ in range(10):
            snapshot = self.create(location)
            todo = [(t, df) for t, df in parts if t is None or _below(snapshot.transaction_version(t[0]), t[1])]
            if not todo:
                return None
            df = todo[0][1] if len(todo) == 1 else pl.concat([df for _, df in todo])
            transactions = dict(t for t, _ in todo if t is not None)
            try:
                return self.commit(snapshot, df, transactions or None, expiring=True)
            except CommitFailedError:
                log.info("%s: a concurrent commit won; reloading and checking again", self.name)
        raise CommitFailedError(f"{self.name}: ten commits in a row lost to concurrent writers")

    # ------------------------------------------------------------ reading

    def scan(self, location: str, version: int | None = None) -> pl.LazyFrame | None:
        """A lazy scan of one version of the table at `location` (default the newest) with the declared schema,
        or None when the table does not exist yet."""
        table = self.open(location, version)
        return None if table is None else self.scan_table(table)

    def scan_table(self, table: DeltaTable) -> pl.LazyFrame:
        """The version `table` is at, with the declared schema (columns the table lacks read as null)."""
        present = {f.name for f in table.schema().fields}
        columns = [pl.col(c) if c in present else pl.lit(None, dtype=t).alias(c) for c, t in self.schema.items()]
        return pl.scan_delta(table).select(columns).cast(self.schema)

    def files(self, location: str) -> list[str]:
        """The data files of the newest version of the table at `location` (immutable: a cache may key on them)."""
        table = self.open(location)
        return [] if table is None else table.file_uris()

    def scan_files(self, files: Sequence[str]) -> pl.LazyFrame:
        """Some of the table's data files (`Table.files`), read with the declared schema."""
        return pl.scan_parquet(
            list(files), schema=self.schema, hive_partitioning=False, missing_columns="insert", extra_columns="ignore"
        )

    def read(self, location: str, version: int | None = None) -> pl.DataFrame:
        """The whole table (tests and tools; components scan lazily and select what they need)."""
        lf = self.scan(location, version)
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

DEAD_LETTERS = Table(
    name="dead_letters",
    path="dead_letters",
    schema=pl.Schema(
        {
            "reason": pl.String(),
            "source": pl.String(),  # "kafka:<topic>/<partition>/<offset>": unique per refused record
            "original": pl.Binary(),  # the record's bytes, as they came
            "received_at": _UTC_US,
        }
    ),
    partition_column="received_at",
    key=("source",),
)

TABLES: dict[str, Table] = {t.name: t for t in (EVENTS, REWARDS, DEAD_LETTERS)}

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


# The rows' times arrive as microseconds since the epoch: an Int64 column cast to Datetime costs nothing.
_ROWS_SCHEMA = pl.Schema({k: pl.Int64() if v == pl.Datetime("us", "UTC") else v for k, v in EVENTS.schema.items()})


def rows_frame(rows: Sequence[tuple[object, ...]]) -> pl.DataFrame:
    """Lake rows (`flywheel.fast_validate.LakeRow`, in `EVENTS.schema` order) as a frame, built column-wise."""
    if not rows:
        return EVENTS.empty()
    # zip(*rows) transposes in C; polars then converts each column in one go.
    columns = dict(zip(EVENTS.schema, (list(c) for c in zip(*rows, strict=True)), strict=True))
    return pl.DataFrame(columns, schema=_ROWS_SCHEMA).cast(EVENTS.schema)


def rewards_frame(records: Sequence[RewardRecord]) -> pl.DataFrame:
    """Rows of the rewards table, one per record (`signals` as JSON with sorted keys)."""
    rows = [{**r.model_dump(), "signals": json.dumps(r.signals, sort_keys=True)} for r in records]
    if not rows:
        return REWARDS.empty()
    return pl.DataFrame(rows, schema=REWARDS.schema)


def generation_events(
    location: str, generation_ids: Sequence[str], version: int | None = None
) -> dict[str, list[tuple[str, str]]]:
    """generation id -> every (properties JSON, user id) its `generation` events logged in the events table at
    `location` (at `version`, default the newest), in lake order (a forgery may share an id with serving's
    record: readers pick what they trust)."""
    events = EVENTS.scan(location, version)
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
