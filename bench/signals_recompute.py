"""Batch recompute throughput: event rows/s over the lake, as a ratio over a bare polars group-by.

Builds a synthetic lake events table (late and duplicated events included), then times
(a) `recompute_records` (scan, replay of watermarks and revisions, every signal, one RewardRecord
per generation and revision) and (b) a bare polars scan + group_by(generation_id) over the same files.

    python bench/signals_recompute.py [--generations 20000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zlib
from datetime import timedelta
from pathlib import Path

import polars as pl

from flywheel.contract import Event, utcnow
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from signals.recompute import recompute_records
from signals.reward import DEFAULT_DEFINITION
from simulator.telemetry import history, write_events


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--generations", type=int, default=20_000)
    ap.add_argument("--partitions", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), reward_window_s=2.0, allowed_lateness_s=0.5)
        hist = history(args.generations, start=utcnow() - timedelta(days=1), seed=0, spacing_s=0.05)
        offsets = [0] * args.partitions
        events: list[Event] = []
        positions: list[tuple[str, int, int]] = []
        seen: set[str] = set()
        for e in hist.events:  # what ingest would write: partition by key, offsets in arrival order, no duplicate
            p = zlib.crc32(e.generation_id.encode()) % args.partitions
            if e.event_id not in seen:
                seen.add(e.event_id)
                events.append(e)
                positions.append((settings.events_topic, p, offsets[p]))
            offsets[p] += 1
        n_rows = write_events(settings, events, at=positions).height

        def bare() -> int:
            lf = EVENTS.scan(EVENTS.at(settings.lake_root))
            assert lf is not None
            return lf.group_by("generation_id").agg(pl.len(), pl.col("ts").max()).collect().height

        def full() -> int:
            return len(recompute_records(settings, DEFAULT_DEFINITION))

        bare()  # warm the file cache for both
        timings = {}
        for name, fn in (("bare", bare), ("recompute", full)):
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter()
                out = fn()
                best = min(best, time.perf_counter() - t)
            timings[name] = (best, out)
        (tb, groups), (tr, records) = timings["bare"], timings["recompute"]
        print(f"rows: {n_rows} events, {groups} generations -> {records} reward records")
        print(f"bare polars group_by: {n_rows / tb:,.0f} rows/s ({tb * 1000:.1f} ms)")
        print(f"signals recompute:    {n_rows / tr:,.0f} rows/s ({tr * 1000:.1f} ms)")
        print(f"ratio recompute/bare: {tb / tr:.4f} (recompute is {tr / tb:.1f}x slower)")


if __name__ == "__main__":
    main()
