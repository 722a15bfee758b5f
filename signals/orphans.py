"""Orphan feedback: events in the lake about a generation id that no `generation` event ever named.

They are kept (a generation event may be replayed later) and score nothing; the worker counts them
(`flywheel_signals_events_total{outcome="orphan"}`) once no window could still hold them, and this
lists them from the lake for `flywheel signals orphans`.
"""

from __future__ import annotations

import polars as pl

from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings

SCHEMA: dict[str, pl.DataType] = {
    "generation_id": pl.String(),
    "events": pl.UInt32(),
    "types": pl.List(pl.String()),
    "first_ts": pl.Datetime("us", "UTC"),
    "last_ts": pl.Datetime("us", "UTC"),
}


def orphan_feedback(settings: Settings) -> pl.DataFrame:
    """One row per orphan generation id: how many events, of which types, first and last event time;
    the most recent first."""
    lf = EVENTS.scan(EVENTS.at(settings.lake_root))
    if lf is None:
        return pl.DataFrame(schema=SCHEMA)
    rows = lf.select("event_id", "type", "generation_id", "ts").unique(list(EVENTS.key), keep="first")
    generations = rows.filter(pl.col("type") == "generation").select("generation_id").unique()
    return (
        rows.filter(pl.col("type") != "generation")
        .join(generations, on="generation_id", how="anti")
        .group_by("generation_id")
        .agg(
            pl.len().cast(pl.UInt32).alias("events"),
            pl.col("type").unique().sort().alias("types"),
            pl.col("ts").min().alias("first_ts"),
            pl.col("ts").max().alias("last_ts"),
        )
        .sort("last_ts", "generation_id", descending=[True, False])
        .collect()
        .select(list(SCHEMA))
    )
