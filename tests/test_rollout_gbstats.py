"""The rollout's statistics against GrowthBook gbstats 0.8.0's own outputs, on stored inputs.

`tests/golden/gbstats_values.json` holds per-arm sufficient statistics and what gbstats 0.8.0 computed
from them (`tests/golden/gbstats_values.py` wrote it; it needs gbstats, which the project does not
depend on, and is not run in CI). Each statistic the dashboard shows is checked here:

- each arm's ratio and its delta-method variance (the per-arm mean and interval, the time chart's points;
  gbstats 0.8.0 gives no per-arm interval: the rollout's is ratio ± z·sd over the variance checked here);
- the difference, its variance, the fixed-sample (reference) interval with Welch's t, and the holdout's
  `ratio_difference`;
- the always-valid interval (confidence sequence) and the sequential p-value, at the primary metric's and
  a guardrail's α, at the defaults' and the demo's N*;
- the regression-adjusted (CUPED) estimate, its variance and its sequential interval and p-value;
- the expected loss of shipping and of keeping (gbstats' Bayesian `risk`, flat prior), shown beside them.

Where the method is gbstats' the tolerance is 1e-9 relative (rounding only). Where it differs on purpose
the test states the difference and bounds the gap:

- **CUPED's slope.** gbstats 0.8.0 regresses the outcome on the covariate over both arms pooled
  (`compute_theta`: the joint covariance over the joint variance, each around the grand mean, so a
  treatment effect leaks into θ); the rollout pools the within-arm covariances and variances (the
  ANCOVA slope, Lin 2013), which no treatment effect can move. Given the rollout's θ, gbstats' formulas
  give the rollout's numbers to 1e-9; with gbstats' own θ the slopes differ by up to 0.7%, the estimates
  by up to 0.6% of their standard error (the case of 300 users a side and an effect of 5 standard
  errors, where the effect moves gbstats' θ most) and the variances by under 0.005%.
- **Strata and ratios.** gbstats 0.8.0 has no post-stratification and no regression-adjusted ratio; the
  rollout's stratified, adjusted ratio reduces to the cases here with one ramp step and x ≡ 1, which is
  how they are compared. The sequential SRM test (Lindon & Malek) has no gbstats counterpart; gbstats'
  chi-square SRM is compared with `deploy_gate.stats.check_srm`.
- **Zero variance.** gbstats answers "no decision" (p = 1); the rollout gives NaN, and nothing is
  decided on NaN.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from deploy_gate.rollout.evidence import MOMENTS, SX, SXX, SXY, SXZ, SY, SYY, SYZ, SZ, SZZ, N, compare, half_width
from deploy_gate.rollout.evidence import sequential_p_value as seq_p
from deploy_gate.stats import RatioStats, RewardStats, check_srm, ratio_difference, welch_difference

GOLDEN = json.loads((Path(__file__).parent / "golden" / "gbstats_values.json").read_text())
TIGHT = 1e-9


def _ratio_cells(arms: list[dict[str, float]]) -> np.ndarray:
    cells = np.zeros((1, 1, 2, MOMENTS))
    for i, m in enumerate(arms):
        cells[0, 0, i, [N, SX, SY, SXX, SYY, SXY]] = [m["n"], m["sx"], m["sy"], m["sxx"], m["syy"], m["sxy"]]
    return cells


def _mean_cells(arms: list[dict[str, float]], covariate: bool = True) -> np.ndarray:
    """A mean metric is a ratio with x ≡ 1 per user; z is the pre-experiment value."""
    cells = np.zeros((1, 1, 2, MOMENTS))
    for i, m in enumerate(arms):
        n = m["n"]
        row = {N: n, SX: n, SXX: n, SY: m["sy"], SYY: m["syy"], SXY: m["sy"]}
        if covariate:
            row |= {SZ: m["sz"], SZZ: m["szz"], SXZ: m["sz"], SYZ: m["syz"]}
        for k, v in row.items():
            cells[0, 0, i, k] = v
    return cells


def _check_sequential(estimate: float, variance: float, users: float, case: dict[str, Any]) -> None:
    for s in case["sequential"]:
        h = float(half_width(np.array([variance]), np.array([users]), s["alpha"], s["tuning"])[0])
        assert estimate - h == pytest.approx(s["ci"][0], rel=TIGHT)
        assert estimate + h == pytest.approx(s["ci"][1], rel=TIGHT)
        p = float(seq_p(np.array([estimate]), np.array([variance]), np.array([users]), s["alpha"], s["tuning"])[0])
        assert p == pytest.approx(s["p"], rel=TIGHT, abs=1e-15)


@pytest.mark.parametrize("i", range(len(GOLDEN["ratio"])))
def test_the_ratio_metric_and_its_sequential_test_equal_gbstats(i: int) -> None:
    case = GOLDEN["ratio"][i]
    c = compare(_ratio_cells(case["arms"]))
    n = [a["n"] for a in case["arms"]]
    for arm in (0, 1):
        assert c.arm_ratio[0, arm] == pytest.approx(case["arm_mean"][arm], rel=TIGHT)
        assert c.arm_variance[0, arm] * n[arm] == pytest.approx(case["arm_variance"][arm], rel=TIGHT)
    assert c.estimate[0] == pytest.approx(case["estimate"], rel=TIGHT)
    assert c.raw_variance[0] == pytest.approx(case["variance"], rel=TIGHT)
    assert c.users[0] == sum(n)
    _check_sequential(float(c.estimate[0]), float(c.raw_variance[0]), float(c.users[0]), case)
    # Without a covariate the adjusted estimate is the unadjusted one.
    assert c.adjusted[0] == pytest.approx(case["estimate"], rel=TIGHT)
    # The holdout's difference and the per-bucket statistics: RatioStats from the same sums.
    a, b = (RatioStats(int(m["n"]), m["sx"], m["sy"], m["sxx"], m["syy"], m["sxy"]) for m in case["arms"])
    d = ratio_difference(a, b)
    assert d is not None
    assert d.estimate == pytest.approx(case["estimate"], rel=TIGHT)
    assert d.ci[0] == pytest.approx(case["fixed_ci"][0], rel=TIGHT)
    assert d.ci[1] == pytest.approx(case["fixed_ci"][1], rel=TIGHT)
    assert d.p_value == pytest.approx(case["fixed_p"], rel=1e-7)
    assert (a.ratio_variance() or 0) * a.n == pytest.approx(case["arm_variance"][0], rel=TIGHT)


@pytest.mark.parametrize("i", range(len(GOLDEN["ratio"])))
def test_the_dashboards_fixed_sample_interval_is_gbstats_welch_t(i: int) -> None:
    from deploy_gate.rollout.analysis import _fixed_ci

    case = GOLDEN["ratio"][i]
    ci = _fixed_ci(compare(_ratio_cells(case["arms"])), 0.05)
    assert ci is not None
    assert ci[0] == pytest.approx(case["fixed_ci"][0], rel=TIGHT)
    assert ci[1] == pytest.approx(case["fixed_ci"][1], rel=TIGHT)


@pytest.mark.parametrize("i", range(len(GOLDEN["cuped"])))
def test_cuped_with_the_rollouts_slope_equals_gbstats_formulas(i: int) -> None:
    case = GOLDEN["cuped"][i]
    ours = case["within_arm_theta"]
    c = compare(_mean_cells(case["arms"]))
    assert c.adjusted[0] == pytest.approx(ours["estimate"], rel=TIGHT)
    assert c.variance[0] == pytest.approx(ours["variance"], rel=TIGHT)
    _check_sequential(float(c.adjusted[0]), float(c.variance[0]), float(c.users[0]), ours)
    # The unadjusted estimate beside it is gbstats' SampleMeanStatistic test.
    raw = case["unadjusted"]
    assert c.estimate[0] == pytest.approx(raw["estimate"], rel=TIGHT)
    assert c.raw_variance[0] == pytest.approx(raw["variance"], rel=TIGHT)
    _check_sequential(float(c.estimate[0]), float(c.raw_variance[0]), float(c.users[0]), raw)


@pytest.mark.parametrize("i", range(len(GOLDEN["cuped"])))
def test_cuped_differs_from_gbstats_own_slope_by_a_bounded_gap(i: int) -> None:
    """gbstats' θ pools over both arms around the grand mean; the rollout's within each arm (see the module)."""
    case = GOLDEN["cuped"][i]
    theirs = case["gbstats_theta"]
    c = compare(_mean_cells(case["arms"]))
    se = float(np.sqrt(theirs["variance"]))
    assert abs(float(c.adjusted[0]) - theirs["estimate"]) <= 0.01 * se
    assert float(c.variance[0]) == pytest.approx(theirs["variance"], rel=1e-4)
    assert case["within_arm_theta"]["theta"] == pytest.approx(theirs["theta"], rel=0.01)
    # Both cut the variance by about the same share: the adjustment is what matters, not how θ is pooled.
    raw = case["unadjusted"]["variance"]
    assert 1 - float(c.variance[0]) / raw == pytest.approx(1 - theirs["variance"] / raw, abs=1e-3)


@pytest.mark.parametrize("i", range(len(GOLDEN["welch"])))
def test_the_mean_metric_difference_equals_gbstats_welch_t(i: int) -> None:
    case = GOLDEN["welch"][i]
    a, b = (RewardStats(int(m["n"]), m["sy"], m["syy"]) for m in case["arms"])
    d = welch_difference(a, b)
    assert d is not None
    assert d.estimate == pytest.approx(case["estimate"], rel=TIGHT)
    assert d.std_error**2 == pytest.approx(case["variance"], rel=TIGHT)
    assert d.ci[0] == pytest.approx(case["fixed_ci"][0], rel=TIGHT)
    assert d.ci[1] == pytest.approx(case["fixed_ci"][1], rel=TIGHT)
    assert d.p_value == pytest.approx(case["fixed_p"], rel=1e-7)
    c = compare(_mean_cells(case["arms"], covariate=False))
    _check_sequential(float(c.estimate[0]), float(c.raw_variance[0]), float(c.users[0]), case)


def _cases_with_risk() -> list[tuple[float, float, list[float]]]:
    """(estimate, variance, gbstats' risk [keep the control, ship the treatment]) of every stored case."""
    out = [(c["estimate"], c["variance"], c["risk"]) for c in GOLDEN["ratio"] + GOLDEN["welch"]]
    for c in GOLDEN["cuped"]:
        out += [(c[k]["estimate"], c[k]["variance"], c[k]["risk"]) for k in ("within_arm_theta", "unadjusted")]
    return out


def test_the_expected_loss_shown_equals_gbstats_bayesian_risk() -> None:
    """gbstats integrates the truncated normal numerically (scipy's truncnorm); the rollout uses the closed form."""
    from deploy_gate.rollout.rules import expected_loss

    for estimate, variance, (keep, ship) in _cases_with_risk():
        ours_ship, ours_keep = expected_loss(np.array([estimate]), np.array([variance]))
        assert float(ours_ship[0]) == pytest.approx(ship, rel=1e-6, abs=1e-12)
        assert float(ours_keep[0]) == pytest.approx(keep, rel=1e-6, abs=1e-12)


def test_the_chi_square_srm_equals_gbstats() -> None:
    for case in GOLDEN["srm"]:
        assert check_srm(case["users"], case["weights"]) == pytest.approx(case["p"], rel=1e-7, abs=1e-15)


def test_zero_variance_gives_no_decision_where_gbstats_gives_p_1() -> None:
    case = GOLDEN["degenerate"]
    assert case["p"] == 1.0 and case["error"] == "ZERO_NEGATIVE_VARIANCE"
    c = compare(_mean_cells([{**m, "sz": 0.0, "szz": 0.0, "syz": 0.0} for m in case["arms"]]))
    assert np.isnan(c.variance[0]) and np.isnan(c.raw_variance[0])
    p = seq_p(c.adjusted, c.variance, c.users, 0.05, 5000.0)
    assert np.isnan(p[0])  # no p-value, so no test passes: nothing is decided on it
    assert ratio_difference(RatioStats.of([(1.0, 0.5)] * 2), RatioStats.of([(1.0, 1.0)] * 2)) is None


def test_the_golden_values_came_from_gbstats_0_8_0() -> None:
    assert GOLDEN["gbstats"] == "0.8.0"
