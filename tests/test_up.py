"""`flywheel up` runs the whole loop: every component as its own process, driven by simulated users."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import polars as pl
import pytest
import redis

from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from launcher.embedded import free_port


@pytest.mark.slow
def test_up_serves_simulated_users_and_lands_their_events_in_the_lake(
    tiny_model_dir: Path, redis_url: str, tmp_path: Path
) -> None:
    data_dir = tmp_path / "var"
    env = {
        **os.environ,
        "FLYWHEEL_DATA_DIR": str(data_dir),
        "FLYWHEEL_MODEL_PATH": str(tiny_model_dir),
        "FLYWHEEL_REDIS_URL": redis_url,
        "FLYWHEEL_REDIS_PREFIX": f"test-up:{uuid.uuid4().hex[:8]}:",
        "FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS": "",
        "FLYWHEEL_MLFLOW_TRACKING_URI": "",
        "FLYWHEEL_EMBEDDED_KAFKA_PORT": str(free_port()),
        "FLYWHEEL_SERVING_PORT": str(free_port()),
        "FLYWHEEL_COLLECTOR_PORT": str(free_port()),
        "FLYWHEEL_GATE_PORT": str(free_port()),
        "FLYWHEEL_TRAINER_PORT": str(free_port()),
        "FLYWHEEL_INGEST_METRICS_PORT": str(free_port()),
        "FLYWHEEL_SIGNALS_METRICS_PORT": str(free_port()),
        "FLYWHEEL_REWARD_WINDOW_S": "2",
    }
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "launcher", "up", "--duration", "20", "--users", "2", "--no-auto-approve"],
            env=env, capture_output=True, text=True, timeout=400,
        )
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{env['FLYWHEEL_REDIS_PREFIX']}*"))
        if keys:
            client.delete(*keys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"dashboard: http://127.0.0.1:{env['FLYWHEEL_GATE_PORT']}/" in proc.stdout
    events = EVENTS.scan(EVENTS.at(data_dir / "lake"))
    assert events is not None, "ingest wrote nothing to the lake"
    counts = dict(events.group_by("type").agg(pl.len()).collect().iter_rows())
    assert counts.get("generation", 0) > 0 and counts.get("shown", 0) > 0, counts


def test_a_split_left_in_redis_by_another_registry_is_reset_to_the_champion(
    settings: Settings, tiny_model_dir: Path
) -> None:
    from flywheel.connections import redis_client
    from flywheel.contract import TrafficSplit
    from flywheel.traffic import TrafficSplitStore
    from launcher.up import ensure_champion

    store = TrafficSplitStore(redis_client(settings), settings)
    store.put(TrafficSplit(champion_version="9", challenger_version="10", challenger_share=0.2, state="running"))
    version = ensure_champion(settings.model_copy(update={"model_path": str(tiny_model_dir)}), progress=False)
    split = store.get()
    assert split is not None
    assert (split.champion_version, split.challenger_version, split.challenger_share) == (version, None, 0.0)
    # A second start keeps the champion and the split as they are.
    assert ensure_champion(settings, progress=False) == version
    assert store.get() == split


def test_demo_mode_approves_the_newest_candidate_and_leaves_a_running_one_to_the_controller(
    settings: Settings, tiny_model_dir: Path
) -> None:
    from deploy_gate import DeployGate
    from flywheel.contract import ModelLineage
    from launcher.up import auto_approve, ensure_champion
    from model_registry import ModelRegistry

    champion = ensure_champion(settings.model_copy(update={"model_path": str(tiny_model_dir)}), progress=False)
    registry = ModelRegistry(settings)
    older, newer = (registry.register(tiny_model_dir, ModelLineage(base="t", parent_version=champion))
                    for _ in range(2))  # fmt: skip
    gate = DeployGate.from_settings(settings)
    assert auto_approve(gate) == [f"approved v{newer} as challenger"]
    assert registry.gate_state(newer) == "approved" and registry.gate_state(older) == "rejected"
    assert gate.status().challenger == newer
    assert auto_approve(gate) == []  # nothing pending: nothing changes
    # A newer candidate waits while the challenger runs: the demo no longer settles it on raw means
    # (which rolled challengers back before any of their rewards existed); the controller decides.
    newest = registry.register(tiny_model_dir, ModelLineage(base="t", parent_version=champion))
    assert auto_approve(gate) == []
    assert gate.status().challenger == newer and registry.gate_state(newest) == "pending"
