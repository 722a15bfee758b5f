"""The controller's decisions over seeded simulated experiments, demo and production configurations alike.

Each test runs `deploy_gate.rollout.calibration.simulate`: clustered users (3% heavy users with about
200 generations, the rest about 5), the ramp, the guardrails and the sequential SRM test, decided by
the rules the controller calls, at every look. 200 experiments a case (the bench runs 1,000). The
bounds are the issue's targets; the controller before these rules failed them (demo configuration,
through `analyse`: 34.5% wrong decisions on A/A, 38.5% of 10%-worse challengers promoted).

`flywheel up --users 0` with an outside client whose feedback never changes between arms is the
"demo, 40 users" A/A case: over its 10-minute maximum duration (and any number of experiments in
30 minutes: each runs the same rules afresh) no promotion as a win and no guardrail rollback.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
import pytest

from deploy_gate.rollout import RampStep, RolloutConfig, rules
from deploy_gate.rollout.calibration import Scenario, simulate
from deploy_gate.rollout.evidence import (
    compare,
    half_width,
    moments,
    sequential_p_value,
    srm_log_bayes_factor,
    users_to_resolve,
)
from deploy_gate.rollout.population import Population, covariate, pre_rate, users
from deploy_gate.stats import RatioStats, ratio_difference

DEMO = RolloutConfig(
    ramp=[RampStep(share=0.25, min_users=1, min_seconds=60), RampStep(share=0.5, min_users=2, min_seconds=120)],
    max_duration_s=1800, planned_change=0.25, tuning_n=100, interval_s=10, srm_min_users=50,
)  # fmt: skip
ONE_STEP = RolloutConfig(ramp=[RampStep(share=0.5, min_users=200, min_seconds=600)], decision_rule="sequential")
CASES = {
    "demo, 40 users in 30 min": (DEMO, 40, 10.0),
    "demo, 4,000 users in 30 min": (DEMO, 4000, 10.0),
    "defaults, one step, 2,000 users in 14 days": (ONE_STEP, 2000, 4 * 3600.0),
    "defaults, 5/25/50% ramp, 12,000 users in 14 days": (RolloutConfig(), 12000, 6 * 3600.0),
}


def test_the_demo_configuration_is_the_launchers() -> None:
    from launcher import demo

    launched = demo.DEMO.rollout
    assert launched["ramp"] == DEMO.ramp and all(isinstance(s, RampStep) for s in launched["ramp"])
    assert launched["max_duration_s"] == DEMO.max_duration_s
    assert launched["planned_change"] == DEMO.planned_change
    assert launched["tuning_n"] == DEMO.tuning_n


@pytest.mark.parametrize("case", list(CASES))
def test_aa_wrong_decisions_and_srm_alarms_stay_within_their_alpha(case: str) -> None:
    cfg, n, look = CASES[case]
    out = simulate(Scenario(cfg, n, look), 200, seed=21)
    assert out.share(*rules.WRONG_ON_AA) <= cfg.alpha
    assert out.share(rules.FREEZE_SRM) <= 1 / 200  # nominal 0.1%: at most one of 200
    assert out.share(rules.PROMOTE_WIN) <= cfg.alpha / 2


@pytest.mark.parametrize("case", list(CASES))
def test_a_challenger_10_percent_worse_in_accept_rate_is_promoted_at_most_1_percent(case: str) -> None:
    cfg, n, look = CASES[case]
    out = simulate(Scenario(cfg, n, look, accept_factor=0.9), 200, seed=22)
    assert out.share(rules.PROMOTE_WIN, rules.PROMOTE_NON_INFERIOR) <= 0.01


def test_the_demo_says_not_enough_evidence_instead_of_deciding() -> None:
    out = simulate(Scenario(DEMO, 40, 10.0), 50, seed=23)
    assert set(out.code.tolist()) == {rules.ROLLBACK_NO_EVIDENCE}


def test_an_experiment_ends_at_its_planned_size_where_the_traffic_gets_there_and_at_the_clock_where_not() -> None:
    """A planned size ends a large product's experiment early with the same error bounds; a small product's runs
    on to the maximum duration, where it resolves more than a fixed short clock would have."""
    pop = Population(accept=0.25)
    big = [simulate(Scenario(DEMO, 9000, 20.0, accept_factor=f, population=pop), 200, seed=41) for f in (1.0, 0.9)]
    clock_only = DEMO.model_copy(update={"planned_change": None})
    assert np.nanmedian(big[0].at_s) < 0.5 * DEMO.max_duration_s  # ended by size, long before the clock
    assert big[0].share(*rules.WRONG_ON_AA) <= DEMO.alpha and big[1].share(*rules.PROMOTED) <= 0.01
    sized = rules.PROMOTE_LOW_RISK, rules.ROLLBACK_INCONCLUSIVE
    assert big[0].share(*sized) > 0.8  # decided by the end rule, read once at the planned size
    # The same users without the planned size run to the maximum duration.
    full = simulate(Scenario(clock_only, 9000, 20.0, population=pop), 200, seed=41)
    assert np.nanmedian(full.at_s) == pytest.approx(DEMO.max_duration_s, abs=20.0)
    # Rare accepts at a small product's traffic: the planned size is never reached, so the clock ends it.
    rare = Population(accept=0.05)
    small = simulate(Scenario(DEMO, 3600, 20.0, accept_factor=1.3, population=rare), 200, seed=42)
    assert np.nanmedian(small.at_s) == pytest.approx(DEMO.max_duration_s, abs=20.0)
    eight = DEMO.model_copy(update={"planned_change": None, "max_duration_s": 480.0})
    short = simulate(Scenario(eight, 3600 * 480 // 1800, 20.0, accept_factor=1.3, population=rare), 200, seed=42)
    assert small.share(*rules.PROMOTED) > short.share(*rules.PROMOTED) + 0.3


def test_the_planned_size_is_reached_only_when_its_change_is_resolved() -> None:
    """`planned_size_reached` against the minimum detectable difference stated by `detectable`."""
    from deploy_gate.rollout.evidence import detectable

    pop = Population(accept=0.3, returning=0.0)
    cells = _cells(pop, 0.0, 3000, seed=43)
    primary = rules.Interval.of(cells, rules.alphas(DEMO)[0], DEMO.tuning_n)
    c = primary.comparison
    mde = float(detectable(c.variance * c.users, c.users, primary.alpha, DEMO.tuning_n)[0])
    level = np.array([0.3])
    at = mde / (0.3 * DEMO.reward_per_accept)  # the change this experiment resolves now
    reached = [bool(rules.planned_size_reached(primary, level, DEMO.model_copy(update={"planned_change": p}))[0])
               for p in (at * 1.01, at * 0.99)]  # fmt: skip
    assert reached == [True, False]
    assert not rules.planned_size_reached(primary, level, DEMO.model_copy(update={"planned_change": None}))[0]
    assert not rules.planned_size_reached(primary, np.array([0.0]), DEMO)[0]  # no accepts: no size to reach


def test_the_reason_says_the_planned_size_ended_it_and_what_its_users_resolve() -> None:
    from deploy_gate.rollout.analysis import StepContext, analyse
    from deploy_gate.rollout.data import Aggregates

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    pop = Population(accept=0.3)
    n = 6000
    cols = users(np.random.default_rng(44), n, pop, np.ones(n), np.ones(n))
    arm = np.where(np.arange(n) % 2 == 0, "challenger", "champion")
    agg = Aggregates(_frame(cols, arm, t0), {}, {}, "r", pre_rate(pop))
    step = StepContext(index=1, share=0.5, min_users=2, min_seconds=120, entered_at=t0, last=True)
    view = analyse(agg, step, DEMO, started_at=t0, now=t0 + timedelta(seconds=600))  # well before the 1,800 s
    assert view is not None and view.power is not None and view.decision.action in ("promote", "rollback")
    assert f"at its planned size (its {view.power.users} users resolve a " in view.decision.reason
    assert "the planned 25%)" in view.decision.reason
    resolved = view.power.detectable_now / (view.power.champion_accept_rate * DEMO.reward_per_accept)
    assert resolved <= 0.25
    # Before the planned size (a tenth of the users), the same experiment keeps running and says when it ends.
    few = analyse(Aggregates(_frame({k: v[: n // 10] for k, v in cols.items()}, arm[: n // 10], t0), {}, {}, "r",
                             pre_rate(pop)), step, DEMO, started_at=t0, now=t0 + timedelta(seconds=600))  # fmt: skip
    assert few is not None and few.decision.action == "continue", few.decision.reason
    assert "it ends once it resolves the planned 25% change (" in few.decision.reason


def test_at_2000_users_no_challenger_harmed_beyond_the_stated_detectable_difference_is_promoted() -> None:
    cfg, n, look = CASES["defaults, one step, 2,000 users in 14 days"]
    stated = float(np.nanmedian(simulate(Scenario(cfg, n, look), 100, seed=24).mde))
    assert 0.03 < stated < 0.075  # wider than a 10% accept loss (about 0.031): the gate cannot resolve that one
    out = simulate(Scenario(cfg, n, look, accept_factor=0.75), 200, seed=24)  # about -0.078, beyond it
    assert out.share(rules.PROMOTE_WIN, rules.PROMOTE_NON_INFERIOR) <= 0.01
    assert out.share(rules.ROLLBACK_WORSE, rules.ROLLBACK_GUARDRAIL) >= 0.5


def test_a_trend_shared_by_both_arms_does_not_bias_the_stratified_estimate() -> None:
    out = simulate(Scenario(RolloutConfig(), 12000, 6 * 3600.0, drift=0.5), 200, seed=25)
    stratified, pooled = np.nanmean(out.raw_estimate), np.nanmean(out.pooled_estimate)
    assert abs(stratified) < 0.003
    assert pooled > 0.006  # pooling the ramp's steps credits the challenger with the trend


def _cells(pop: Population, change: float, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = users(rng, n, pop, np.ones(n), np.ones(n))
    b = users(rng, n, pop, np.full(n, 1 + change), np.ones(n))
    return np.stack([moments(c["reward_n"], c["reward_sum"], covariate(c, pre_rate(pop))) for c in (a, b)])[None, None]


def test_regression_adjustment_cuts_the_users_needed_where_behaviour_persists_and_costs_nothing_where_not() -> None:
    for persistence, low, high in ((1.0, 1.5, 10.0), (0.0, 0.95, 1.05)):
        c = compare(_cells(Population(persistence=persistence), 0.1, 40_000, seed=26))
        n = 80_000
        raw = users_to_resolve(c.raw_variance * n, 0.03, 0.025, 5000.0)
        adjusted = users_to_resolve(c.variance * n, 0.03, 0.025, 5000.0)
        assert low <= float(raw[0] / adjusted[0]) <= high, persistence


# ---- degenerate data ------------------------------------------------------------------------------


def test_zero_variance_is_no_evidence() -> None:
    same = moments(np.ones(400), np.full(400, 0.25))
    other = moments(np.ones(400), np.full(400, 0.5))
    c = compare(np.stack([same, other])[None, None])
    assert np.isnan(c.variance[0]) and np.isnan(c.raw_variance[0])
    assert c.estimate[0] == pytest.approx(0.25)  # an estimate, but no interval: nothing is decided on it


def test_four_identical_users_give_no_decision_through_analyse() -> None:
    from deploy_gate.rollout.analysis import StepContext, analyse
    from deploy_gate.rollout.data import USER_COLUMNS, Aggregates

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    rows = [{"arm": arm, "user_id": f"{arm}{i}", "first_seen": t0, "generations": 4, "reward_n": 4,
             "reward_sum": 1.0 if arm == "challenger" else 0.0} for arm in ("champion", "challenger") for i in range(2)]
    frame = pl.DataFrame(rows, schema={k: USER_COLUMNS[k] for k in rows[0]}).with_columns(
        [pl.lit(0, t).alias(c) for c, t in USER_COLUMNS.items() if c not in rows[0]]
    ).select(list(USER_COLUMNS))
    step = StepContext(index=0, share=0.5, min_users=1, min_seconds=0, entered_at=t0, last=True)
    view = analyse(Aggregates(frame, {}, {}, "r"), step, RolloutConfig(), started_at=t0, now=t0 + timedelta(hours=1))
    assert view is not None and view.decision.action == "continue"
    assert view.decision.reason.startswith("not enough evidence yet")
    assert view.difference is None and view.power is not None and view.power.detectable_now is None


def test_users_served_by_both_arms_are_counted_once_and_flagged() -> None:
    from deploy_gate.rollout.analysis import StepContext, analyse

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    rng = np.random.default_rng(41)
    n = 400
    cols = users(rng, n, Population(), np.ones(n), np.ones(n))
    arm = np.where(np.arange(n) % 2 == 0, "challenger", "champion")
    frame = _frame(cols, arm, t0)
    later = pl.lit(t0 + timedelta(hours=1)).alias("first_seen")  # two challenger users later also on the champion
    moved = frame.filter(pl.col("arm") == "challenger").head(2).with_columns(pl.lit("champion").alias("arm"), later)
    from deploy_gate.rollout.data import Aggregates

    step = StepContext(index=0, share=0.5, min_users=1, min_seconds=0, entered_at=t0, last=True)
    view = analyse(Aggregates(pl.concat([frame, moved]), {}, {}, "r"), step, RolloutConfig(), started_at=t0,
                   now=t0 + timedelta(hours=2))  # fmt: skip
    assert view.arms["challenger"].users + view.arms["champion"].users == n  # each counted once, in the first arm
    assert any(f.startswith("users_in_both_arms: 2 users") for f in view.flags), view.flags


def _frame(cols: dict[str, np.ndarray], arm: np.ndarray, t0: datetime) -> pl.DataFrame:
    from deploy_gate.rollout.data import USER_COLUMNS

    n = arm.size
    data = {c: cols[c] if c in cols else np.zeros(n) for c in USER_COLUMNS if c not in ("arm", "user_id", "first_seen")}
    frame = pl.DataFrame({"arm": arm, "user_id": [f"u{i}" for i in range(n)], "first_seen": [t0] * n, **data})
    return frame.select([pl.col(c).cast(t) for c, t in USER_COLUMNS.items()])


def test_the_gate_states_what_the_traffic_can_resolve_before_and_during_the_experiment() -> None:
    from deploy_gate.rollout.analysis import StepContext, analyse, plan
    from deploy_gate.rollout.data import Aggregates

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    pop = Population()
    rng = np.random.default_rng(29)
    n = 2000
    cols = users(rng, n, pop, np.ones(n), np.ones(n))
    champion_only = Aggregates(_frame(cols, np.array(["champion"] * n), t0), {}, {}, "r", pre_rate(pop))
    before = plan(champion_only, RolloutConfig(), running_s=3600.0)
    assert before is not None and before.note.startswith("before the challenger has rewards")
    assert before.detectable_now is not None and 0.03 < before.detectable_now < 0.2
    assert before.users_for_margin is not None and before.users_for_margin > n  # 5% of the accept rate: far more
    arm = np.where(rng.random(n) < 0.5, "challenger", "champion")
    agg = Aggregates(_frame(cols, arm, t0), {}, {}, "r", pre_rate(pop))
    step = StepContext(index=0, share=0.5, min_users=1, min_seconds=0, entered_at=t0, last=True)
    cfg = RolloutConfig(max_duration_s=3600.0)
    view = analyse(agg, step, cfg, started_at=t0, now=t0 + timedelta(hours=1))
    assert view is not None and view.power is not None and view.difference is not None
    assert view.power.users == n and view.power.detectable_now is not None
    assert set(view.power.users_for_changes) == {"-10%", "+5%", "+10%", "+20%"}
    # At the maximum duration an unresolved margin rolls back as inconclusive, saying what it would need.
    assert view.decision.action == "rollback" and view.decision.reason.startswith("inconclusive")
    assert f"needs {view.power.users_for_margin} users" in view.decision.reason
    assert view.difference.variance_reduction is not None and view.difference.variance_reduction > 0.2


# ---- golden values ---------------------------------------------------------------------------------


def test_one_stratum_without_a_covariate_is_the_delta_method_difference_checked_against_gbstats() -> None:
    rng = np.random.default_rng(27)
    k = 1 + rng.poisson(3, (2, 300))
    y = rng.binomial(k, 0.4).astype(float)
    c = compare(np.stack([moments(k[i].astype(float), y[i]) for i in (0, 1)])[None, None])
    a, b = (RatioStats.of(zip(k[i].astype(float), y[i], strict=True)) for i in (0, 1))
    d = ratio_difference(a, b)
    assert d is not None
    assert c.estimate[0] == pytest.approx(d.estimate, rel=1e-12)
    assert c.raw_variance[0] == pytest.approx(d.std_error**2, rel=1e-9)


def test_regression_adjustment_equals_the_least_squares_treatment_effect() -> None:
    """With one generation per user, CUPED with a pooled within-arm slope is ANCOVA: y ~ 1 + arm + z (Lin 2013)."""
    rng = np.random.default_rng(28)
    n = 500
    z = rng.normal(0, 1, 2 * n)
    arm = np.r_[np.zeros(n), np.ones(n)]
    y = 0.3 + 0.1 * arm + 0.8 * z + rng.normal(0, 0.5, 2 * n)
    cells = np.stack([moments(np.ones(n), y[arm == a], z[arm == a]) for a in (0, 1)])[None, None]
    c = compare(cells)
    # Within-arm centred z: the treatment coefficient is Δȳ − θ̂·Δz̄ with θ̂ the pooled within-arm slope.
    zc = z - np.where(arm == 1, z[arm == 1].mean(), z[arm == 0].mean())
    design = np.column_stack([np.ones(2 * n), arm, zc])
    theta = np.linalg.lstsq(design, y, rcond=None)[0][2]
    expected = (y[arm == 1].mean() - y[arm == 0].mean()) - theta * (z[arm == 1].mean() - z[arm == 0].mean())
    assert c.adjusted[0] == pytest.approx(expected, rel=1e-10)
    resid = y - theta * z
    var = resid[arm == 0].var(ddof=1) / n + resid[arm == 1].var(ddof=1) / n
    assert c.variance[0] == pytest.approx(var, rel=1e-9)


def test_the_sequential_p_value_is_the_alpha_at_which_the_interval_touches_zero() -> None:
    est, var, n = np.array([0.05]), np.array([0.02**2]), np.array([4000.0])
    p = sequential_p_value(est, var, n, 0.05, 5000.0)
    from deploy_gate.rollout.evidence import rho2

    r2 = rho2(0.05, 5000.0)
    assert 0 < p[0] < 1
    assert half_width(var, n, float(p[0]), 5000.0, rho2_=r2)[0] == pytest.approx(0.05, rel=1e-9)
    # Golden value, worked by hand from eq. (9) at d = 0.05, Var = 0.02², N = 4,000, α = 0.05, N* = 5,000:
    # ρ² = (−2 ln 0.05 + ln(−2 ln 0.05 + 1)) / 5000 = 0.00158723, Nρ² = 6.34892,
    # p = sqrt(7.34892)·exp(−2.69977) = 0.182229.
    assert r2 == pytest.approx(0.00158723, rel=1e-5)
    assert p[0] == pytest.approx(0.182229, rel=1e-5)


def test_the_srm_bayes_factor_is_the_dirichlet_multinomial_over_the_multinomial() -> None:
    from scipy import stats

    counts, theta = np.array([480, 520]), np.array([0.5, 0.5])
    dm = stats.dirichlet_multinomial.logpmf(counts, 100 * theta, counts.sum())
    mn = stats.multinomial.logpmf(counts, counts.sum(), theta)
    assert float(srm_log_bayes_factor(counts, theta)) == pytest.approx(dm - mn, rel=1e-10)
    # A 45/55 split of 4,000 users at 50/50 alarms; 50.5/49.5 does not.
    assert srm_log_bayes_factor(np.array([1800, 2200]), theta) > np.log(1000)
    assert srm_log_bayes_factor(np.array([2020, 1980]), theta) < 0


# ---- the non-inferiority margin where the reward averages near 0 ----------------------------------

# Users accept 31% of shown suggestions: the reward averages about +0.002 a generation, the accept rate is 0.26.
# Light users of 40 generations (no heavy ones) keep the users the margin needs near 7,000, so the test is fast.
NEAR_ZERO = Population(accept=0.31, heavy_share=0.0, light_generations=40.0)


def test_the_margin_is_a_share_of_the_accept_rate_and_does_not_collapse_where_the_reward_averages_near_0() -> None:
    cfg = ONE_STEP
    out = simulate(Scenario(cfg, 2000, 12 * 3600.0, population=NEAR_ZERO), 50, seed=30)
    assert abs(float(np.nanmedian(out.estimate))) < 0.05
    margin = float(np.nanmedian(out.margin))
    # 5% of an accept rate of about 0.26, at 1.0 reward per accept; a share of the level (+0.002) gave 0.0002.
    assert 0.011 < margin < 0.015
    wider = simulate(Scenario(cfg.model_copy(update={"reward_per_accept": 2.0}), 2000, 12 * 3600.0,
                              population=NEAR_ZERO), 50, seed=30)  # fmt: skip
    assert float(np.nanmedian(wider.margin)) == pytest.approx(2 * margin, rel=0.05)


def test_at_a_reward_level_near_0_an_equal_challenger_is_shown_non_inferior_and_a_harmed_one_is_not_promoted() -> None:
    cfg = ONE_STEP
    aa = simulate(Scenario(cfg, 20_000, 12 * 3600.0, population=NEAR_ZERO), 100, seed=31)
    # About 3x the users the margin needs: an equal challenger is released. With a share of the mean reward
    # as the margin (0.0002 here) none was: every one rolled back as inconclusive.
    assert aa.share(rules.PROMOTE_NON_INFERIOR, rules.PROMOTE_WIN) >= 0.8
    assert aa.share(*rules.WRONG_ON_AA) <= cfg.alpha
    harmed = simulate(Scenario(cfg, 20_000, 12 * 3600.0, accept_factor=0.9, population=NEAR_ZERO), 200, seed=32)
    assert harmed.share(rules.PROMOTE_WIN, rules.PROMOTE_NON_INFERIOR) <= 0.01


def test_a_champion_without_accepts_has_no_margin() -> None:
    level = np.array([0.0, np.nan, 0.3])
    m = rules.margin(level, RolloutConfig())
    assert np.isnan(m[0]) and np.isnan(m[1]) and m[2] == pytest.approx(0.05 * 0.3)


@pytest.mark.parametrize(
    "settings",
    [
        {"non_inferiority_accept_share": -0.1},
        {"non_inferiority_accept_share": 0.6},  # half the accepts lost is no guard
        {"non_inferiority_accept_share": float("nan")},
        {"reward_per_accept": 0.0},
        {"reward_per_accept": 3.0},  # the reward lies in [-1, 1]: no accept is worth more than 2
        {"reward_per_accept": float("inf")},
    ],
)
def test_a_nonsense_margin_is_refused_at_start(settings: dict[str, float]) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        RolloutConfig(**settings)  # type: ignore[arg-type]


def test_the_retired_share_of_the_mean_reward_is_refused_with_what_replaced_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    monkeypatch.setenv("FLYWHEEL_ROLLOUT_NON_INFERIORITY_SHARE", "0.1")
    with pytest.raises(ValidationError, match="NON_INFERIORITY_ACCEPT_SHARE"):
        RolloutConfig()
    monkeypatch.delenv("FLYWHEEL_ROLLOUT_NON_INFERIORITY_SHARE")
    with pytest.raises(ValidationError, match="NON_INFERIORITY_ACCEPT_SHARE"):
        RolloutConfig(non_inferiority_share=0.1)  # type: ignore[call-arg]


def test_the_demo_states_its_margin_the_users_it_needs_and_that_its_traffic_cannot_decide() -> None:
    from deploy_gate.rollout.analysis import StepContext, analyse
    from deploy_gate.rollout.data import Aggregates

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    pop = Population(accept=0.31)  # the demo's reward level is near 0 too
    rng = np.random.default_rng(33)
    n = 40  # the demo's 10 minutes of traffic
    cols = users(rng, n, pop, np.ones(n), np.ones(n))
    arm = np.where(np.arange(n) % 2 == 0, "challenger", "champion")
    agg = Aggregates(_frame(cols, arm, t0), {}, {}, "r", pre_rate(pop))
    step = StepContext(index=1, share=0.5, min_users=2, min_seconds=120, entered_at=t0, last=True)
    view = analyse(agg, step, DEMO, started_at=t0, now=t0 + timedelta(seconds=300))
    assert view is not None and view.power is not None
    p = view.power
    assert p.margin is not None and p.champion_accept_rate is not None
    assert p.margin == pytest.approx(0.05 * p.champion_accept_rate * 1.0)
    assert p.margin > 0.005  # a share of the mean reward gave a tenth of that or less
    assert p.users_for_margin is not None and p.users_projected is not None
    assert p.users_for_margin > p.users_projected and p.margin_reachable is False
    assert view.decision.reason.startswith("not enough evidence yet")
    assert f"needs {p.users_for_margin} users" in view.decision.reason
    assert "cannot show non-inferiority" in view.decision.reason
    # Which rule ends it is said: the expected-loss rule (the demo's) does not wait on the margin.
    assert ("expected-loss rule in force" in view.decision.reason) == (DEMO.decision_rule == "expected_loss")
    assert ("will end inconclusive" in view.decision.reason) == (DEMO.decision_rule == "sequential")


# ---- the expected-loss rule, compared ----------------------------------------------------------------


# Users drawn without a shared pre-period (nothing for regression adjustment to feed on), 2,000 of them over the
# default ramp's 14 days: a small product's traffic, where the sequential rule's margin cannot be resolved.
SMALL = (RolloutConfig(), 2000, 4 * 3600.0, Population(returning=0.0))


def test_the_small_traffic_rule_never_promotes_a_harmed_challenger_and_keeps_a_a_within_its_bound() -> None:
    cfg, n, look, pop = SMALL
    assert cfg.decision_rule == "expected_loss"  # the default
    aa = simulate(Scenario(cfg, n, look, population=pop), 200, seed=36)
    assert aa.share(*rules.WRONG_ON_AA) <= 0.02  # no false win, no harm rollback of an equal challenger
    assert aa.share(rules.CONTINUE_LAST) == 0  # every experiment ends
    worse = simulate(Scenario(cfg, n, look, accept_factor=0.9, population=pop), 200, seed=37)
    assert worse.share(*rules.PROMOTED) <= 0.01
    harmed = simulate(Scenario(cfg, n, look, accept_factor=0.75, population=pop), 100, seed=38)
    assert harmed.share(*rules.PROMOTED) == 0
    # What it buys: a 30%-better challenger ships, where the sequential rule's margin leaves most inconclusive.
    better = [simulate(Scenario(cfg, n, look, accept_factor=1.3, population=pop, rule=r), 100, seed=39)
              for r in ("expected_loss", "sequential")]  # fmt: skip
    assert better[0].share(*rules.PROMOTED) >= 0.9 > 0.7 >= better[1].share(*rules.PROMOTED)


@pytest.mark.parametrize("accept", [0.05, 0.6])
def test_a_a_at_a_rare_or_common_accept_rate_does_not_trip_the_explicit_reactions_guardrail(accept: float) -> None:
    """At accept 0.05 a thumbs up is about 1 generation in 250: an arm's own variance collapsed at 0-3 of them
    and 27.5% of A/A experiments stopped on this guardrail. Its bound is its share of alpha (about 0.36%)."""
    cfg, n, look, _ = SMALL
    aa = simulate(Scenario(cfg, n, look, population=Population(accept=accept, returning=0.0)), 200, seed=40)
    bound = rules.alphas(cfg)[1]
    assert aa.tripped["explicit_up_rate"].mean() <= max(bound, 1 / 200)
    assert aa.share(*rules.WRONG_ON_AA) <= 0.02


def test_the_analysis_shows_the_expected_loss_of_shipping_and_of_keeping() -> None:
    from deploy_gate.rollout.analysis import StepContext, analyse
    from deploy_gate.rollout.data import Aggregates

    t0 = datetime(2026, 11, 25, tzinfo=UTC)
    pop = Population()
    rng = np.random.default_rng(35)
    n = 1000
    cols = users(rng, n, pop, np.ones(n), np.ones(n))
    arm = np.where(np.arange(n) % 2 == 0, "challenger", "champion")
    agg = Aggregates(_frame(cols, arm, t0), {}, {}, "r", pre_rate(pop))
    step = StepContext(index=0, share=0.5, min_users=1, min_seconds=0, entered_at=t0, last=True)
    view = analyse(agg, step, RolloutConfig(), started_at=t0, now=t0 + timedelta(hours=1))
    assert view is not None and view.difference is not None
    d = view.difference
    assert d.expected_loss_ship is not None and d.expected_loss_keep is not None
    assert d.expected_loss_ship > 0 and d.expected_loss_keep > 0
    # E[max(0, d)] − E[max(0, −d)] = E[d]: the two losses differ by the adjusted estimate.
    assert d.expected_loss_keep - d.expected_loss_ship == pytest.approx(d.adjusted_estimate, rel=1e-9, abs=1e-12)
    # The rule in force and what it risks: the chance a challenger worse by the margin ships at today's precision.
    rule = view.rule
    assert rule is not None and rule.name == "expected_loss" and rule.threshold is not None
    assert rule.ship_above is not None and rule.margin_worse_promoted is not None
    assert 0 < rule.margin_worse_promoted < 0.5 and "worse by the margin" in rule.note


def test_the_low_risk_cutoff_is_where_shippings_expected_loss_meets_the_threshold() -> None:
    variance, threshold = np.array([1e-4, 4e-4, np.nan]), np.array([2e-3, 2e-3, 2e-3])
    cut = rules.low_risk_cutoff(variance, threshold)
    ship, _ = rules.expected_loss(cut[:2], variance[:2])
    assert ship == pytest.approx(threshold[:2], rel=1e-6)
    assert cut[0] < cut[1] and np.isnan(cut[2])  # noisier: a higher estimate is needed to ship; no variance: never


def test_the_default_reward_per_accept_is_the_default_definitions_accept_minus_reject() -> None:
    """The gate cannot read the reward definition (components do not import each other): this keeps them in step."""
    from signals.reward import RewardDefinition

    w = RewardDefinition().weights
    assert RolloutConfig().reward_per_accept == pytest.approx(w.accept - w.reject)
