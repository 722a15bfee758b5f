"""Where reward records go: the rewards topic and the lake's rewards table.

`records_frame` is the lake schema of `RewardRecord` (docs/design.md, "Lake tables": `signals` as a
JSON string, datetimes as µs UTC); `read_rewards` reads it back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from flywheel.bus import Outgoing, Producer
from flywheel.contract import RewardRecord
from flywheel.lake import scan, write_partitioned
from flywheel.settings import Settings

_DT = pl.Datetime("us", "UTC")
SCHEMA: dict[str, pl.DataType] = {
    "generation_id": pl.String(),
    "reward_version": pl.String(),
    "revision": pl.Int64(),
    "reward": pl.Float64(),
    "confidence": pl.Float64(),
    "label_source": pl.String(),
    "signals": pl.String(),
    "user_id": pl.String(),
    "model_version": pl.String(),
    "arm": pl.String(),
    "experiment": pl.String(),
    "window_start": _DT,
    "window_end": _DT,
    "late_events": pl.Int64(),
    "emitted_at": _DT,
}


def rewards_dir(settings: Settings) -> Path:
    return settings.lake_dir / "rewards"


def records_frame(records: Sequence[RewardRecord]) -> pl.DataFrame:
    rows = []
    for r in records:
        d = r.model_dump()
        d["signals"] = json.dumps(r.signals, sort_keys=True)
        rows.append(d)
    return pl.DataFrame(rows, schema=SCHEMA, orient="row") if rows else pl.DataFrame(schema=SCHEMA)


def write_rewards(settings: Settings, records: Sequence[RewardRecord], name: str) -> list[Path]:
    """Write records to the lake under a deterministic `name`: writing the same batch twice replaces it."""
    return write_partitioned(records_frame(records), rewards_dir(settings), name, ts_column="emitted_at")


def produce_rewards(producer: Producer, settings: Settings, records: Sequence[RewardRecord]) -> None:
    producer.send_all(
        [
            Outgoing(
                settings.rewards_topic,
                r.to_bytes(),
                r.generation_id.encode(),
                (("record_id", f"{r.reward_version}:{r.generation_id}:{r.revision}".encode()),),
            )
            for r in records
        ]
    )


def read_rewards(settings: Settings, *, latest_only: bool = False) -> pl.DataFrame:
    """The lake's rewards; `latest_only` keeps the highest revision per generation and version."""
    lf = scan(rewards_dir(settings))
    if lf is None:
        return pl.DataFrame(schema=SCHEMA)
    df = lf.collect()
    if latest_only and not df.is_empty():
        df = df.sort("revision").unique(["generation_id", "reward_version"], keep="last", maintain_order=True)
    return df
