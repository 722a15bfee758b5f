"""`flywheel up` runs the whole loop: every component as its own process, driven by simulated users."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time
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
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    counts: dict[str, int] = {}
    try:
        # Stopped as soon as ingest has landed both kinds of event, as a deployment stops it (SIGTERM), instead of
        # after a fixed run: the events land seconds after the components are ready, and `--duration` only
        # bounds a run that never gets there.
        with out.open("w") as stdout, err.open("w") as stderr:
            args = ["up", "--duration", "120", "--users", "2", "--no-auto-approve"]
            proc = subprocess.Popen([sys.executable, "-m", "launcher", *args], env=env, stdout=stdout, stderr=stderr)
            try:
                while proc.poll() is None and not (counts.get("generation", 0) and counts.get("shown", 0)):
                    time.sleep(0.5)
                    counts = event_counts(data_dir)
                servers = ("serving", "collector", "gate", "trainer")
                kept = kept_alive_after({n: int(env[f"FLYWHEEL_{n.upper()}_PORT"]) for n in servers}, idle_s=6.0)
                proc.send_signal(signal.SIGTERM)
                returncode = proc.wait(timeout=120)
            finally:
                if proc.poll() is None:
                    proc.kill()
    finally:
        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{env['FLYWHEEL_REDIS_PREFIX']}*"))
        if keys:
            client.delete(*keys)
    stdout_text = out.read_text()
    assert returncode == 0, stdout_text[-3000:] + err.read_text()[-3000:]
    assert f"dashboard: http://127.0.0.1:{env['FLYWHEEL_GATE_PORT']}/" in stdout_text
    assert counts.get("generation", 0) > 0 and counts.get("shown", 0) > 0, counts
    assert event_counts(data_dir).keys() >= {"generation", "shown"}, "the lake holds them after the stop"
    # Every server keeps an idle connection past httpx's 5-s pool expiry (Settings.http_keep_alive_s): with
    # uvicorn's own 5 s the two timers race, and a request sent as the server closes is reset (2 of 10,790
    # requests in a 60-minute outside-traffic run).
    assert len(kept) == 4 and all(kept.values()), kept


def kept_alive_after(ports: dict[str, int], idle_s: float) -> dict[str, bool]:
    """Per server, whether a second request on one connection, `idle_s` after the first, is answered on it."""
    conns = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=30) for name, port in ports.items()}
    kept = {}
    try:
        for conn in conns.values():
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            conn.auto_open = 0  # never reconnect silently: a connection the server closed must fail below
        time.sleep(idle_s)
        for name, conn in conns.items():
            try:
                conn.request("GET", "/healthz")
                conn.getresponse().read()
                kept[name] = True
            except (ConnectionError, http.client.HTTPException):
                kept[name] = False
    finally:
        for conn in conns.values():
            conn.close()
    return kept


def event_counts(data_dir: Path) -> dict[str, int]:
    """Events in `flywheel up`'s lake by type (none yet: empty)."""
    events = EVENTS.scan(EVENTS.at(data_dir / "lake"))
    if events is None:
        return {}
    return dict(events.group_by("type").agg(pl.len()).collect().iter_rows())


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
    # Its offline gates run meanwhile, once, so it can start as soon as the experiment ends.
    newest = registry.register(tiny_model_dir, ModelLineage(base="t", parent_version=champion))
    assert auto_approve(gate) == [f"v{newest} passed its offline gates while v{newer} runs; it starts when that "
                                  "ends unless a newer one passes first"]
    assert auto_approve(gate) == []
    assert gate.status().challenger == newer and registry.gate_state(newest) == "pending"


def test_the_console_says_each_promotion_and_rollback_once_with_its_reason() -> None:
    from datetime import UTC, datetime

    from deploy_gate import GateStatus
    from deploy_gate.views import VersionView
    from launcher.up import decisions

    def status(*states: tuple[str, str, str]) -> GateStatus:
        versions = [VersionView(version=v, created_at=datetime(2026, 12, 3, tzinfo=UTC), gate_state=s, aliases=[],
                                parent_version=None, sample_count=0, run_id=None, reason=why)
                    for v, s, why in reversed(states)]  # fmt: skip
        return GateStatus(split=None, champion=None, challenger=None, pending=[], versions=versions)

    said: set[tuple[str, str]] = set()
    assert decisions(status(("1", "champion", "initial champion")), said) == ["promoted v1: initial champion"]
    won = ("2", "champion", "accepted +0.03 [0.01, 0.05]")
    later = status(("1", "approved", "superseded by 2"), won, ("3", "rolled_back", "guardrail: accepted rate"),
                   ("4", "refused", "offline gates failed"))  # fmt: skip
    assert decisions(later, said) == [f"promoted v2: {won[2]}", "rolled back v3: guardrail: accepted rate"]
    # The same state on every later tick, and the quarantine that follows a rollback: nothing new to say.
    quarantined = status(won, ("3", "quarantined", "quarantined on rollback"))
    assert decisions(later, said) == [] and decisions(quarantined, said) == []
    # An inconclusive end: rolled back, quarantined, then lifted. The registry's latest reason is the lifting
    # note; the console says the controller's reason, from the gate history.
    from model_registry import GateChange

    at = datetime(2026, 12, 4, tzinfo=UTC)
    why = "inconclusive at its planned size: shipping's expected loss 0.004 is not below 0.002"
    changes = [GateChange("approved", "pending", "demo", at, "demo loop"),
               GateChange("rolled_back", "approved", "rollout-controller", at, why),
               GateChange("quarantined", "rolled_back", "rollout-controller", at, f"quarantined on rollback: {why}"),
               GateChange("rolled_back", "quarantined", "rollout-controller", at, "unquarantine: inconclusive: ...")]
    lifted = status(won, ("5", "rolled_back", "unquarantine: inconclusive: ..."))
    assert decisions(lifted, said, history=lambda v: changes if v == "5" else []) == [f"rolled back v5: {why}"]


def test_a_new_deployment_forgets_what_an_earlier_run_left_in_redis(settings: Settings, tiny_model_dir: Path) -> None:
    """A fresh registry (a new data dir) must not inherit the earlier run's experiment, window state or
    training lock from a shared Redis; once it has a champion, a restart keeps everything."""
    from flywheel.connections import redis_client
    from launcher.up import ensure_champion, forget_an_earlier_deployment

    client = redis_client(settings)
    left = [f"{settings.redis_prefix}rollout:default", f"{settings.redis_prefix}trainer:cycle-lock"]
    for key in left:
        client.set(key, "from an earlier run")
    assert forget_an_earlier_deployment(settings) == len(left)
    assert not any(client.exists(k) for k in left)
    ensure_champion(settings.model_copy(update={"model_path": str(tiny_model_dir)}), progress=False)
    client.set(left[0], "this deployment's")
    assert forget_an_earlier_deployment(settings) == 0
    assert client.get(left[0]) == b"this deployment's"


def test_the_progress_table_shows_no_nan_before_any_simulated_user_is_served() -> None:
    # `flywheel up --users 0` (outside traffic only) and the first seconds of any run: dashes, not NaN.
    from rich.console import Console

    from deploy_gate.views import GateStatus
    from flywheel.contract import TrafficSplit
    from launcher.up import progress_table
    from simulator.users import UserSimulator

    sim = UserSimulator("http://127.0.0.1:9", "http://127.0.0.1:9", "key", n_users=0)
    status = GateStatus(split=TrafficSplit(champion_version="1"), champion="1", challenger=None, pending=[],
                        versions=[])  # fmt: skip
    console = Console(width=150, record=True)
    console.print(progress_table(sim, status, started=0.0))
    text = console.export_text()
    assert "nan" not in text and "champion" in text and "challenger" in text


def test_the_demo_ends_without_waiting_for_offline_gates_still_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread still inside the offline gates when `flywheel up` stops is not waited for: the process ends at once
    with status 0 (the interpreter shutting down around torch work in a thread aborts it with status 134). A thread
    that has finished is joined and nothing more happens."""
    from launcher import up

    ended: list[int] = []

    def fake_exit(code: int) -> None:  # os._exit would end the test process itself
        ended.append(code)

    monkeypatch.setattr(up.os, "_exit", fake_exit)
    release = threading.Event()
    busy = threading.Thread(target=release.wait, daemon=True)
    busy.start()
    up.end_unless_still_running(busy, wait_s=0.05)
    assert ended == [0]
    release.set()
    busy.join()
    up.end_unless_still_running(busy, wait_s=0.05)
    up.end_unless_still_running(None)
    assert ended == [0]
