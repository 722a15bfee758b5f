"""Benchmark: the dashboard's per-arm reward metrics over a rewards lake.

Measures `deploy_gate.arm_metrics` (scan, newest revision per generation, hourly buckets,
t intervals, label-source mix) against a bare baseline in the same run: one polars scan
and a mean per arm over the same files. Prints the ratio and the absolute times.

    python bench/gate_metrics.py [--rows 200000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl

from deploy_gate.metrics import arm_metrics
from flywheel.lake.tables import REWARDS
from flywheel.settings import Settings


def make_rewards(rows: int, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    start = [t0 + timedelta(seconds=float(s)) for s in rng.uniform(0, 24 * 3600, rows)]
    arm = np.where(rng.random(rows) < 0.2, "challenger", "champion")
    return pl.DataFrame(
        {
            "generation_id": [f"g{i}" for i in range(rows)],
            "reward_version": "r1",
            "revision": rng.integers(0, 2, rows),
            "reward": np.where(rng.random(rows) < 0.6, 0.75, -0.25),
            "confidence": 0.9,
            "label_source": rng.choice(["explicit", "implicit", "default"], rows),
            "signals": "{}",
            "user_id": "u",
            "model_version": np.where(arm == "challenger", "2", "1"),
            "arm": arm,
            "experiment": "default",
            "window_start": start,
            "window_end": [s + timedelta(minutes=10) for s in start],
            "late_events": 0,
            "emitted_at": [s + timedelta(minutes=11) for s in start],
        }
    ).with_columns(pl.col("window_start", "window_end", "emitted_at").dt.cast_time_unit("us"))


def best_of(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp))
        table = REWARDS.at(settings.lake_root)
        REWARDS.write(table, make_rewards(args.rows), "bench")
        files = REWARDS.files(table)

        def bare() -> pl.DataFrame:
            return pl.scan_parquet(files).group_by("arm").agg(pl.col("reward").mean()).collect()

        def gate() -> object:
            return arm_metrics(settings, bucket="1h")

        bare(), gate()  # warm caches and imports
        t_bare, t_gate = best_of(bare), best_of(gate)
    print(f"rows={args.rows} files={len(files)}")
    print(f"bare polars mean per arm: {t_bare * 1000:.1f} ms")
    print(f"arm_metrics (dedupe, buckets, CI): {t_gate * 1000:.1f} ms ({args.rows / t_gate:,.0f} rewards/s)")
    print(f"ratio arm_metrics / bare: {t_gate / t_bare:.1f}x")


if __name__ == "__main__":
    main()
