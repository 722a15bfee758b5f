"""Reward per arm: the metrics endpoint against a numpy/scipy reference on a written rewards table.

The dashboard that shows these figures is tested in a browser in tests/test_gate_dashboard.py.
"""

from __future__ import annotations

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
from flywheel.lake.tables import REWARDS, rewards_frame
from flywheel.settings import Settings
from model_registry import ModelRegistry

T0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
ARMS = {("champion", "1"): (30, 0.55), ("challenger", "2"): (12, 0.70)}  # per hour: n, accept probability


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
    df = rewards_frame(records)
    half = len(df) // 2  # two files per partition, as two signals workers would write
    table = REWARDS.at(settings.lake_root)
    REWARDS.write(table, df.head(half), "worker-a")
    REWARDS.write(table, df.tail(len(df) - half), "worker-b")
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
    df = pl.read_delta(REWARDS.at(settings.lake_root))
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


def test_no_rewards_yet_gives_an_empty_answer(client: TestClient) -> None:
    body = client.get("/api/metrics/arms").json()
    assert body["arms"] == [] and body["reward_version"] is None


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
