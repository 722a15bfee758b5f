"""What GrowthBook and Statsig users expect of a release gate: the relative lift with its interval, and heavy
users capped. Seeded, on per-user frames through `analysis.analyse`, as the controller calls it."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta
from statistics import NormalDist

import numpy as np
import polars as pl
import pytest

from deploy_gate.gate import DeployGate
from deploy_gate.rollout import RolloutConfig, RolloutController
from deploy_gate.rollout.analysis import StepContext, analyse, cap_heavy
from deploy_gate.rollout.data import SEGMENT_COLUMNS, USER_COLUMNS, Aggregates
from deploy_gate.rollout.evidence import relative_lift
from deploy_gate.rollout.models import AnalysisView
from flywheel.settings import Settings
from tests.rollout_sim import write_batch
from tests.test_rollout import CHAMPION, Clock, config, gate, registry, versions  # noqa: F401  (fixtures)

T0 = datetime(2026, 11, 25, tzinfo=UTC)


def frame(rng: np.random.Generator, n: int, accept: dict[str, float]) -> pl.DataFrame:
    """`n` users an arm, clustered (5% with about 100 generations, the rest about 5), accepting at `accept[arm]`."""
    parts = []
    for arm, p in accept.items():
        heavy = rng.random(n) < 0.05
        k = np.where(heavy, rng.poisson(100, n), 1 + rng.poisson(4, n))
        a = rng.binomial(k, rng.beta(p * 10, (1 - p) * 10, n))
        zero = np.zeros(n, dtype=np.int64)
        cols = {"arm": [arm] * n, "user_id": [f"{arm}-{i}" for i in range(n)], "first_seen": [T0] * n,
                "generations": k, "reward_n": k, "reward_sum": 0.75 * a - 0.25 * (k - a), "explicit_n": zero,
                "thumbs_up": zero, "thumbs_down": zero, "shown": k, "accepted": a, "undone": zero, "declined": zero,
                "suggested": k, "empty": zero, "truncated": zero, "length_sum": 40.0 * k, "latency_sum": 50.0 * k}
        parts.append(pl.DataFrame({c: cols.get(c) for c in USER_COLUMNS}, schema=USER_COLUMNS))  # fmt: skip
    return pl.concat(parts)


def run(users: pl.DataFrame, config: RolloutConfig) -> AnalysisView:
    agg = Aggregates(users, {"champion": 50.0, "challenger": 50.0}, {"champion": 5000, "challenger": 5000}, "rules-v1")
    step = StepContext(index=0, share=0.5, min_users=10, min_seconds=0, entered_at=T0, last=True)
    return analyse(agg, step, config, started_at=T0, now=T0 + timedelta(hours=1))


def test_relative_lift_golden_values() -> None:
    # By hand: var = 2e-4 / 0.2^2 + 0.25^2 x 1e-4 / 0.2^4 = 0.005 + 0.00390625 = 0.00890625.
    lift, (lo, hi) = relative_lift(0.2, 1e-4, 0.25, 2e-4, 0.05) or (0.0, (0.0, 0.0))
    half = 1.959963984540054 * math.sqrt(0.00890625)
    assert lift == pytest.approx(0.25, abs=1e-15)
    assert (lo, hi) == pytest.approx((0.25 - half, 0.25 + half), abs=1e-12)
    # A share of a champion mean at or below 0 means nothing (the reward's zero is arbitrary).
    assert relative_lift(0.0, 1e-4, 0.1, 1e-4, 0.05) is None
    assert relative_lift(-0.1, 1e-4, 0.1, 1e-4, 0.05) is None


def test_the_analysis_states_the_relative_lift_computed_directly_from_its_users() -> None:
    users = frame(np.random.default_rng(1), 600, {"champion": 0.45, "challenger": 0.55})
    config = RolloutConfig(cap_percentile=1.0)
    d = run(users, config).difference
    assert d is not None and d.relative_estimate is not None and d.relative_ci is not None
    stats = {}
    for arm in ("champion", "challenger"):
        u = users.filter(pl.col("arm") == arm)
        x, y = u["reward_n"].to_numpy().astype(float), u["reward_sum"].to_numpy()
        r = y.sum() / x.sum()
        # The delta method's variance of a ratio of sums over users: Var(y - r x) / (n mean(x)^2).
        stats[arm] = (r, np.var(y - r * x, ddof=1) / (x.size * x.mean() ** 2))
    (ra, va), (rb, vb) = stats["champion"], stats["challenger"]
    half = NormalDist().inv_cdf(1 - config.alpha / 2) * math.sqrt(vb / ra**2 + rb**2 * va / ra**4)
    assert d.relative_estimate == pytest.approx(rb / ra - 1, rel=1e-9)
    assert d.relative_ci == pytest.approx((rb / ra - 1 - half, rb / ra - 1 + half), rel=1e-9)
    assert d.relative_ci[0] > 0  # about +50% on a reward near 0.2 from 0.45 to 0.55 accepts: resolved


def test_the_relative_interval_covers_the_true_lift_at_its_level() -> None:
    """2,000 seeded experiments of 400 users an arm (per-user ratios, clustered): coverage near 95%."""
    rng = np.random.default_rng(3)
    e, n = 2000, 400
    sums = {}
    for arm, p in (("champion", 0.4), ("challenger", 0.44)):
        k = 1 + rng.poisson(np.where(rng.random((e, n)) < 0.05, 100, 4))
        acc = rng.binomial(k, rng.beta(p * 10, (1 - p) * 10, (e, n)))
        sums[arm] = (k.astype(float), 0.75 * acc - 0.25 * (k - acc))
    truth = (0.44 - 0.25) / (0.4 - 0.25) - 1  # reward per generation = accept - 0.25
    stats = []
    for arm in ("champion", "challenger"):
        x, y = sums[arm]
        r = y.sum(axis=1) / x.sum(axis=1)
        stats.append((r, np.var(y - r[:, None] * x, axis=1, ddof=1) / (n * x.mean(axis=1) ** 2)))
    covered = 0
    for i in range(e):
        out = relative_lift(stats[0][0][i], stats[0][1][i], stats[1][0][i], stats[1][1][i], 0.05)
        assert out is not None
        covered += out[1][0] <= truth <= out[1][1]
    assert 0.93 <= covered / e <= 0.97


def test_a_heavy_user_is_capped_at_the_pooled_percentile_and_keeps_their_own_rate() -> None:
    rng = np.random.default_rng(2)
    users = frame(rng, 1500, {"champion": 0.5, "challenger": 0.5})
    # One scripted client in the challenger: 200,000 generations, none accepted.
    bot = users.filter(pl.col("arm") == "challenger").head(1).with_columns(
        pl.lit("bot").alias("user_id"), *(pl.lit(200_000, pl.Int64).alias(c) for c in
                                           ("generations", "reward_n", "shown", "suggested")),
        pl.lit(0, pl.Int64).alias("accepted"), pl.lit(-50_000.0).alias("reward_sum"))  # fmt: skip
    users = pl.concat([users, bot])
    config = RolloutConfig(cap_percentile=0.999)
    capped, view = cap_heavy(users, config)
    assert view is not None and view.users_capped >= 1
    cap = float(users["generations"].quantile(0.999, interpolation="higher") or 0)
    assert view.cap_generations == cap and cap < 1000
    row = capped.filter(pl.col("user_id") == "bot")
    assert row["generations"][0] == pytest.approx(cap)
    assert row["reward_sum"][0] / row["reward_n"][0] == pytest.approx(-0.25)  # their own rate stands
    # Everyone under the cap is untouched.
    light = users["generations"] <= cap
    assert capped.filter(light)["reward_sum"].to_list() == users.filter(light)["reward_sum"].to_list()
    # Capped, the bot no longer decides the experiment; uncapped it drags the challenger to "worse".
    on, off = run(users, config), run(users, RolloutConfig(cap_percentile=1.0))
    assert on.capping == view and off.capping is None
    assert on.difference is not None and off.difference is not None
    assert off.difference.estimate < -0.1 < on.difference.estimate
    assert on.difference.sequential_ci[0] < 0 < on.difference.sequential_ci[1]


def test_capping_waits_for_enough_users_to_set_a_percentile() -> None:
    users = frame(np.random.default_rng(4), 100, {"champion": 0.5, "challenger": 0.5})
    capped, view = cap_heavy(users, RolloutConfig(cap_percentile=0.999))
    assert view is not None and view.users_capped == 0 and view.cap_generations == users["generations"].max()
    assert capped["reward_sum"].to_list() == users["reward_sum"].to_list()


def test_the_plan_endpoint_gives_flywheel_gate_plan_given_or_measured(
    gate: DeployGate, settings: Settings, versions: tuple[str, str]  # noqa: F811  (the fixtures imported)
) -> None:
    """`GET /api/experiment/plan` (the dashboard's duration calculator) is the CLI's plan; what is not given is
    measured on the running experiment, up to its last look."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from deploy_gate.rollout.api import router
    from deploy_gate.rollout.duration import plan

    cfg = config()
    app = FastAPI()
    app.include_router(router)
    app.state.gate, app.state.rollout_config = gate, cfg
    api = TestClient(app)
    given = api.get("/api/experiment/plan", params={"users_per_day": 2000, "accept_rate": 0.3}).json()
    assert given["lines"] == plan(cfg, 2000, 0.3).lines(cfg, 0.3) and given["measured"] is False
    assert api.get("/api/experiment/plan").json() is None  # nothing running, nothing given
    clock = Clock()
    controller = RolloutController(gate, cfg, clock=clock)
    controller.tick()
    split = gate.splits.get()
    assert split is not None
    write_batch(settings, split, {"champion": CHAMPION, "challenger": CHAMPION}, users=300, at=clock.now,
                rng=random.Random(5), user_ids=[f"user-{i}" for i in range(300)])  # fmt: skip
    clock.now += timedelta(hours=6)
    view = controller.tick().analysis
    assert view is not None and view.power is not None and view.power.champion_accept_rate is not None
    seen = sum(a.users for a in view.arms.values())
    # The lake's rewards by their generation's surface (these events name none): one segment, every user in it.
    assert [s.surface for s in view.segments] == ["(none)"]
    assert view.segments[0].users == [view.arms["champion"].users, view.arms["challenger"].users]
    got = api.get("/api/experiment/plan").json()
    assert got["measured"] is True and got["users_per_day"] == pytest.approx(seen * 4)  # six hours: x4 a day
    assert got["accept_rate"] == pytest.approx(view.power.champion_accept_rate)
    assert got["lines"] == plan(cfg, seen * 4, got["accept_rate"]).lines(cfg, got["accept_rate"])


def test_segments_by_surface_are_shown_per_arm_and_decide_nothing() -> None:
    rng = np.random.default_rng(6)
    users = frame(rng, 400, {"champion": 0.45, "challenger": 0.5})
    # Each user's rewards split over two surfaces; the challenger is worse on chat, better on completion.
    seg = []
    for i, row in enumerate(users.iter_rows(named=True)):
        chat_n = row["reward_n"] // 2
        worse = (-0.2 if row["arm"] == "challenger" else 0.0) + 0.01 * (i % 5 - 2)  # users differ
        seg.append({"arm": row["arm"], "user_id": row["user_id"], "surface": "chat", "reward_n": chat_n,
                    "reward_sum": (0.1 + worse) * chat_n})  # fmt: skip
        seg.append({"arm": row["arm"], "user_id": row["user_id"], "surface": "completion",
                    "reward_n": row["reward_n"] - chat_n, "reward_sum": row["reward_sum"] - (0.1 + worse) * chat_n})
    segments = pl.DataFrame(seg, schema=SEGMENT_COLUMNS).filter(pl.col("reward_n") > 0)
    lat, n = {"champion": 50.0, "challenger": 50.0}, {"champion": 5000, "challenger": 5000}
    step = StepContext(index=0, share=0.5, min_users=10, min_seconds=0, entered_at=T0, last=True)
    views = [analyse(Aggregates(users, lat, n, "rules-v1", segments=s), step, RolloutConfig(), started_at=T0,
                     now=T0 + timedelta(hours=1)) for s in (None, segments)]  # fmt: skip
    assert views[0].segments == [] and [s.surface for s in views[1].segments] == ["chat", "completion"]
    assert views[0].decision == views[1].decision  # informational: the same decision with or without them
    for s in views[1].segments:
        part = segments.filter(pl.col("surface") == s.surface)
        means = []
        for arm in ("champion", "challenger"):
            a = part.filter(pl.col("arm") == arm)
            means.append(a["reward_sum"].sum() / a["reward_n"].sum())
            assert s.users[("champion", "challenger").index(arm)] == a.height
        assert s.means == pytest.approx(means) and s.difference == pytest.approx(means[1] - means[0])
        assert s.ci is not None and s.ci[0] < s.difference < s.ci[1]
    chat = views[1].segments[0]
    assert chat.difference == pytest.approx(-0.2, abs=0.01) and chat.relative_estimate == pytest.approx(-2.0, abs=0.1)
    assert chat.ci is not None and chat.ci[1] < 0  # shown worse on chat, yet the decision did not change
