"""Benchmark: the rollout controller's decision time for one experiment with 1M rewards in the lake.

Writes `--rows` rewards and their generation events (one experiment: champion and a 50% challenger,
about 5 generations per user) to a temporary lake, then times `RolloutController.tick()` (read the
split from Redis, scan both tables, latest revision per generation, per-user aggregates, all
statistics, guardrails, SRM and the decision) against a bare baseline in the same run: one polars
scan of the same reward files and a group-by (arm, user) of count and sum. Needs Redis
(FLYWHEEL_REDIS_URL, default 127.0.0.1:6379); MLflow runs on SQLite in the temporary directory.

    python bench/rollout_decision.py [--rows 1000000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl

from deploy_gate.gate import DeployGate
from deploy_gate.rollout import RampStep, RolloutConfig, RolloutController
from flywheel.connections import redis_client
from flywheel.contract import TrafficSplit
from flywheel.lake.tables import EVENTS, REWARDS
from flywheel.settings import Settings
from model_registry import ModelRegistry


def write_lake(lake: Path, rows: int, split: TrafficSplit, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    n_users = max(rows // 5, 1)
    users = np.array([f"u{i}" for i in range(n_users)])
    arm_of = np.array([split.arm_for(u) for u in users])
    pick = rng.integers(0, n_users, rows)
    user, arm = users[pick], arm_of[pick]
    version = np.where(arm == "challenger", split.challenger_version or "", split.champion_version)
    ts = [t0 + timedelta(seconds=float(s)) for s in np.sort(rng.uniform(0, 6 * 3600, rows))]
    gid = [f"g{i}" for i in range(rows)]
    shown = rng.random(rows) < 0.9
    reward = np.where(shown, np.where(rng.random(rows) < 0.55, 1.0, -0.2), 0.0)
    sig = np.where(shown, json.dumps({"shown": 1.0}), "{}")
    chunk = 250_000
    for i in range(0, rows, chunk):
        s = slice(i, i + chunk)
        REWARDS.write(REWARDS.at(lake), pl.DataFrame({
            "generation_id": gid[s], "reward_version": "rules-v1", "revision": 0, "reward": reward[s],
            "confidence": 1.0, "label_source": "implicit", "signals": sig[s], "user_id": user[s],
            "model_version": version[s], "arm": arm[s], "experiment": "default", "window_start": ts[s],
            "window_end": ts[s], "late_events": 0, "emitted_at": ts[s],
        }, schema=REWARDS.schema), f"bench-{i}")  # fmt: skip
        props = [json.dumps({"arm": a, "model_version": v, "latency_ms": 40.0, "completion": " x = 1\n",
                             "finish_reason": "stop"}) for a, v in zip(arm[s], version[s], strict=True)]  # fmt: skip
        EVENTS.write(EVENTS.at(lake), pl.DataFrame({
            "event_id": [g + "e" for g in gid[s]], "type": "generation", "schema_version": 1,
            "generation_id": gid[s], "user_id": user[s], "session_id": "", "ts": ts[s], "received_at": ts[s],
            "source": "serving", "properties": props, "kafka_topic": "t", "kafka_partition": 0,
            "kafka_offset": np.arange(i, i + len(props)),
        }, schema=EVENTS.schema), f"bench-{i}")  # fmt: skip


def bare_group_by(lake: Path) -> int:
    df = (
        pl.scan_delta(REWARDS.at(lake))
        .group_by("arm", "user_id")
        .agg(pl.len(), pl.col("reward").sum())
        .collect()
    )
    return df.height


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp) / "data", redis_prefix=f"bench:{time.time_ns()}:",
                            mlflow_tracking_uri=f"sqlite:///{tmp}/mlflow.db")  # fmt: skip
        client = redis_client(settings)
        gate = DeployGate(ModelRegistry(settings), client, settings)
        split = TrafficSplit(champion_version="1", challenger_version="2", challenger_share=0.5, state="running",
                             salt="bench")  # fmt: skip
        gate.splits.put(split)
        t = time.perf_counter()
        write_lake(settings.lake_dir, args.rows, split)
        print(f"wrote {args.rows} rewards and generation events in {time.perf_counter() - t:.1f}s")
        start = datetime(2026, 1, 1, tzinfo=UTC)
        cfg = RolloutConfig(ramp=[RampStep(share=0.5, min_users=10**9, min_seconds=0)])  # decide, never act
        controller = RolloutController(gate, cfg, clock=lambda: start)
        t = time.perf_counter()
        controller.tick()  # starts the experiment at `start` (every row counts); parses every file once
        cold = time.perf_counter() - t
        t = time.perf_counter()
        RolloutController(gate, cfg, clock=lambda: start).tick()  # a fresh process: nothing cached, scipy loaded
        fresh = time.perf_counter() - t
        ticks, bares = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            rec = controller.tick()
            ticks.append(time.perf_counter() - t)
            t = time.perf_counter()
            groups = bare_group_by(settings.lake_dir)
            bares.append(time.perf_counter() - t)
        assert rec.analysis is not None
        a = rec.analysis
        print(f"decision: {a.decision.action} ({a.decision.reason}); users "
              f"{a.arms['champion'].users} + {a.arms['challenger'].users}, {groups} (arm, user) groups")
        tick, bare = statistics.median(ticks), statistics.median(bares)
        print(f"controller tick, files already parsed (median of {args.repeat}): {tick:.3f}s; "
              f"bare polars group-by of the rewards: {bare:.3f}s; ratio {tick / bare:.1f}x")
        print(f"controller tick parsing every file (a restarted controller): {fresh:.3f}s, ratio {fresh / bare:.1f}x; "
              f"first tick of the process (imports too): {cold:.3f}s")
        keys = list(client.scan_iter(match=f"{settings.redis_prefix}*"))
        if keys:
            client.delete(*keys)


if __name__ == "__main__":
    main()
