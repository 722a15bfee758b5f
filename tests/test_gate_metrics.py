"""Reward per arm: the metrics endpoint against a numpy/scipy reference on a written rewards table."""

from __future__ import annotations

import json
import math
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from fastapi.testclient import TestClient
from scipy import stats

from deploy_gate.app import create_app
from deploy_gate.gate import DeployGate
from deploy_gate.metrics import arm_metrics
from deploy_gate.stats import RewardStats
from flywheel.connections import redis_client
from flywheel.contract import ModelLineage, RewardRecord
from flywheel.lake import write_partitioned
from flywheel.settings import Settings
from model_registry import ModelRegistry

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
ARMS = {("champion", "1"): (30, 0.55), ("challenger", "2"): (12, 0.70)}  # per hour: n, accept probability


def reward_frame(records: list[RewardRecord]) -> pl.DataFrame:
    """Rows as the lake holds them (docs/design.md, "Lake tables"): RewardRecord fields, signals as JSON text."""
    rows = [r.model_dump() | {"signals": json.dumps(r.signals)} for r in records]
    return pl.DataFrame(rows).with_columns(
        pl.col(c).dt.cast_time_unit("us").dt.convert_time_zone("UTC")
        for c in ("window_start", "window_end", "emitted_at")
    )


def make_rewards(seed: int = 7) -> tuple[list[RewardRecord], dict[tuple[str, str, int], list[float]]]:
    """Records to write, and the rewards that should count per (arm, version, hour)."""
    rng = np.random.default_rng(seed)
    records: list[RewardRecord] = []
    expected: dict[tuple[str, str, int], list[float]] = defaultdict(list)

    def record(arm: str, version: str, at: datetime, reward: float, **kw: object) -> RewardRecord:
        fields: dict = dict(
            generation_id=uuid.UUID(int=int(rng.integers(2**63))).hex,
            reward_version="r1",
            reward=reward,
            confidence=0.9,
            label_source=str(rng.choice(["explicit", "implicit", "default"])),
            signals={"accepted": float(reward > 0)},
            arm=arm,
            model_version=version,
            user_id="u",
            window_start=at,
            window_end=at + timedelta(minutes=10),
            emitted_at=at + timedelta(minutes=11),
        )
        return RewardRecord(**(fields | kw))

    for hour in range(3):
        for (arm, version), (n, p) in ARMS.items():
            for _ in range(n):
                at = T0 + timedelta(hours=hour, seconds=float(rng.uniform(0, 3599)))
                reward = 0.75 if rng.random() < p else -0.25
                rec = record(arm, version, at, reward)
                if rng.random() < 0.2:
                    # A late event revised this reward: only revision 1 counts.
                    records.append(rec.model_copy(update={"reward": 9.0, "revision": 0}))
                    rec = rec.model_copy(
                        update={"revision": 1, "emitted_at": rec.emitted_at + timedelta(minutes=5)}
                    )
                records.append(rec)
                expected[(arm, version, hour)].append(reward)
    # One reward alone in its bucket: a mean without an interval.
    lone = record("challenger", "2", T0 + timedelta(hours=3, minutes=5), 0.75)
    records.append(lone)
    expected[("challenger", "2", 3)].append(0.75)
    # An older reward definition, emitted earlier: not mixed into the newest one's figures.
    records.append(record("champion", "1", T0, -100.0, reward_version="r0", emitted_at=T0))
    return records, expected


def interval(xs: list[float]) -> tuple[float, float | None, float | None]:
    a = np.asarray(xs, dtype=np.float64)
    if a.size < 2:
        return float(a.mean()), None, None
    lo, hi = stats.t.interval(0.95, a.size - 1, loc=a.mean(), scale=a.std(ddof=1) / math.sqrt(a.size))
    return float(a.mean()), float(lo), float(hi)


@pytest.fixture
def rewards_written(settings: Settings) -> dict[tuple[str, str, int], list[float]]:
    records, expected = make_rewards()
    df = reward_frame(records)
    half = len(df) // 2  # two files per partition, as two signals workers would write
    table = settings.lake_dir / "rewards"
    write_partitioned(df.head(half), table, "worker-a", ts_column="emitted_at")
    write_partitioned(df.tail(len(df) - half), table, "worker-b", ts_column="emitted_at")
    return expected


@pytest.fixture
def gate_settings(settings: Settings) -> Settings:
    return settings  # each test has its own MLflow store and Redis prefix (conftest)


@pytest.fixture
def client(gate_settings: Settings, tmp_path: Path) -> Iterator[TestClient]:
    s = gate_settings
    registry = ModelRegistry(s)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    v = registry.register(ckpt, ModelLineage(base="fake"))
    registry.set_alias("champion", v)
    with TestClient(create_app(s, gate=DeployGate(registry, redis_client(s), s))) as c:
        yield c


def test_metrics_per_arm_match_a_numpy_reference(
    client: TestClient, gate_settings: Settings, rewards_written: dict[tuple[str, str, int], list[float]]
) -> None:
    body = client.get("/api/metrics/arms?bucket=1h").json()
    assert body["reward_version"] == "r1" and body["confidence"] == 0.95
    assert [(a["arm"], a["model_version"]) for a in body["arms"]] == [("champion", "1"), ("challenger", "2")]
    for arm in body["arms"]:
        key = (arm["arm"], arm["model_version"])
        hours = sorted(h for (a, v, h) in rewards_written if (a, v) == key)
        everything = [x for h in hours for x in rewards_written[(*key, h)]]
        mean, lo, hi = interval(everything)
        assert arm["n"] == len(everything)
        assert arm["mean"] == pytest.approx(mean, abs=1e-12)
        assert (arm["ci_low"], arm["ci_high"]) == (pytest.approx(lo, abs=1e-9), pytest.approx(hi, abs=1e-9))
        assert sum(arm["label_sources"].values()) == len(everything)
        assert [datetime.fromisoformat(b["start"]) for b in arm["buckets"]] == [
            T0 + timedelta(hours=h) for h in hours
        ]
        for b, h in zip(arm["buckets"], hours, strict=True):
            mean, lo, hi = interval(rewards_written[(*key, h)])
            assert (b["n"], b["mean"]) == (len(rewards_written[(*key, h)]), pytest.approx(mean, abs=1e-12))
            if lo is None:
                assert b["ci_low"] is None and b["ci_high"] is None
            else:
                assert (b["ci_low"], b["ci_high"]) == (
                    pytest.approx(lo, abs=1e-9),
                    pytest.approx(hi, abs=1e-9),
                )

    recent = client.get("/api/metrics/arms?since_hours=1").json()  # T0 lies long in the past
    assert recent["arms"] == []
    later = arm_metrics(gate_settings, since=T0 + timedelta(hours=2))
    assert {b.start for a in later.arms for b in a.buckets} == {
        T0 + timedelta(hours=2),
        T0 + timedelta(hours=3),
    }

    old = client.get("/api/metrics/arms?reward_version=r0").json()
    assert [(a["arm"], a["n"], a["mean"]) for a in old["arms"]] == [("champion", 1, -100.0)]


def test_label_source_mix_matches_polars(
    client: TestClient, settings: Settings, rewards_written: dict[tuple[str, str, int], list[float]]
) -> None:
    df = pl.read_parquet(list((settings.lake_dir / "rewards").rglob("*.parquet")))
    latest = (
        df.filter(pl.col("reward_version") == "r1")
        .sort("revision")
        .group_by("generation_id")
        .agg(pl.all().last())
        .group_by("arm", "label_source")
        .len()
    )
    want = {(r["arm"], r["label_source"]): r["len"] for r in latest.iter_rows(named=True)}
    body = client.get("/api/metrics/arms").json()
    got = {(a["arm"], src): n for a in body["arms"] for src, n in a["label_sources"].items()}
    assert got == want


def test_dashboard_shows_each_arm_with_its_sample_size(
    client: TestClient, rewards_written: dict[tuple[str, str, int], list[float]]
) -> None:
    page = client.get("/").text
    n_champion = sum(len(v) for (a, _, _), v in rewards_written.items() if a == "champion")
    n_challenger = sum(len(v) for (a, _, _), v in rewards_written.items() if a == "challenger")
    assert "<svg" in page and "<circle" in page
    assert f"champion v1 (n={n_champion})" in page and f"challenger v2 (n={n_challenger})" in page
    assert "95% CI [" in page  # point tooltips carry the interval


def test_no_rewards_yet_gives_an_empty_answer(client: TestClient) -> None:
    body = client.get("/api/metrics/arms").json()
    assert body["arms"] == [] and body["reward_version"] is None
    assert "No rewards yet" in client.get("/").text


def test_reward_stats_merged_equal_stats_over_everything() -> None:
    rng = np.random.default_rng(3)
    xs = rng.normal(0.3, 0.5, size=501)
    parts = np.array_split(xs, 7)
    merged = sum((RewardStats.of(p.tolist()) for p in parts), RewardStats())
    whole = RewardStats.of(xs.tolist())
    assert merged.n == whole.n == 501
    assert merged.mean == pytest.approx(float(xs.mean()), abs=1e-12)
    assert merged.variance == pytest.approx(float(xs.var(ddof=1)), rel=1e-9)
    ci = merged.confidence_interval()
    ref = stats.t.interval(0.95, 500, loc=xs.mean(), scale=xs.std(ddof=1) / math.sqrt(501))
    assert ci == (pytest.approx(ref[0], abs=1e-9), pytest.approx(ref[1], abs=1e-9))
    assert RewardStats.of([0.5]).confidence_interval() is None
    assert RewardStats.of([0.5, 0.5, 0.5]).confidence_interval() == (0.5, 0.5)


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no /usr/bin/chromium on this machine (and no internet to fetch a browser); "
    "the HTML checks above cover the page's content",
)
def test_dashboard_renders_in_a_browser(
    gate_settings: Settings, client: TestClient, rewards_written: dict, tmp_path: Path
) -> None:  # pragma: no cover - needs a browser
    import threading

    import uvicorn

    from launcher.embedded import free_port

    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    port = free_port()
    config = uvicorn.Config(create_app(gate_settings), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=str(CHROMIUM),
                args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            )
            page = browser.new_page()
            for _ in range(50):  # wait for the server to accept connections
                try:
                    page.goto(f"http://127.0.0.1:{port}/")
                    break
                except sync_api.Error:
                    page.wait_for_timeout(100)
            assert page.locator("svg.chart circle").count() > 0
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
        assert shot.stat().st_size > 10_000
    finally:
        server.should_exit = True
        thread.join(timeout=10)
