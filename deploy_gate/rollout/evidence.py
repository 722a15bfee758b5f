"""The rollout's evidence as arrays: per-step, per-arm sufficient statistics in, intervals and tests out.

Everything here is vectorised over a leading axis of experiments, so the controller (one
experiment, shape (1, ...)) and the calibration bench (thousands of simulated experiments at
once) run the same code. What must hold:

- **The user is the unit.** Each metric is a ratio Σy/Σx over users, summarised by the moments
  (n, Σx, Σy, Σx², Σy², Σxy, Σz, Σz², Σxz, Σyz) of each (step, arm) cell, where z is the user's
  pre-experiment value of y (0 for a user new to the product). Cells add, like `RatioStats`.
- **Steps are not pooled.** A user belongs to the ramp step they were first seen in. Each step is
  a randomised experiment of its own at its own share; the difference is estimated within each
  step and the steps are combined with weights proportional to their users (a stratified
  estimator), so a trend that both arms share over the ramp cancels instead of biasing the
  challenger, which has most of its users late.
- **Regression adjustment (CUPED).** The delta-method influence of each user on the ratio,
  (y − R·x)/μx, is adjusted by θ·(z − z̄) with θ the pooled least-squares slope of influence on z
  (Deng, Xu, Kohavi, Walker 2013, "Improving the sensitivity of online controlled experiments by
  utilizing pre-experiment data"; for ratios, Deng, Knoblich & Lu 2018 section 4). The estimate is
  unchanged in expectation (z is fixed before assignment); the variance shrinks by 1 − ρ².
- **Always valid.** Intervals are the asymptotic confidence sequence of Waudby-Smith et al. (2023)
  eq. (9) over N users (`deploy_gate.stats.sequential_interval`), so looking after every tick costs
  nothing; the sequential p-value is that sequence inverted at the configured tuning.
- **No evidence, no decision.** A cell below two users, a non-positive denominator, or a total
  variance of zero gives NaN, and every comparison with NaN is false: nothing is decided on it.
- **SRM is sequential too.** Users first seen while a share was in force, counted by their first
  arm, are tested against that share with the Dirichlet-multinomial Bayes factor of Lindon & Malek
  (2022), "Anytime-valid inference for multinomial count data" (NeurIPS); the Bayes factors of
  successive periods multiply (each is a test martingale started afresh), and the alarm at
  BF ≥ 1/α_srm holds its rate over every look by Ville's inequality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.special import gammaln

# Moments of one (step, arm) cell, in this order along the last axis.
N, SX, SY, SXX, SYY, SXY, SZ, SZZ, SXZ, SYZ = range(10)
MOMENTS = 10

# The SRM prior: Dirichlet(c·θ0). c = 100 puts the prior's spread of an arm's share near ±5% at 50/50:
# alarms on a mismatch of a few percent within thousands of users, and costs little power on bigger ones.
SRM_PRIOR_CONCENTRATION = 100.0


def moments(x: np.ndarray, y: np.ndarray, z: np.ndarray | None = None) -> np.ndarray:
    """Per-user (x, y, z) rows, shape (..., users), to their moments (..., MOMENTS)."""
    z = np.zeros_like(y) if z is None else z
    one = np.ones_like(x)
    parts = (one, x, y, x * x, y * y, x * y, z, z * z, x * z, y * z)
    return np.stack([p.sum(axis=-1) for p in parts], axis=-1)


@dataclass(frozen=True)
class Comparison:
    """Challenger minus champion for one metric, per experiment (arrays of shape (E,)); NaN: undefined."""

    estimate: np.ndarray  # stratified difference of the ratios, unadjusted
    adjusted: np.ndarray  # the same, regression-adjusted (CUPED); equals `estimate` where z carries nothing
    variance: np.ndarray  # of the adjusted estimate
    raw_variance: np.ndarray  # of the unadjusted one
    users: np.ndarray  # users in the steps that could be compared (both arms)
    arm_users: np.ndarray  # (E, 2): users per arm in those steps
    level: np.ndarray  # the champion's ratio, weighted like the difference
    arm_ratio: np.ndarray  # (E, 2): each arm's ratio over all its users
    arm_variance: np.ndarray  # (E, 2): delta-method variance of each arm's ratio (users as the unit)
    null_variance: np.ndarray  # of the adjusted estimate under "no difference": both arms' users pooled
    events: np.ndarray  # Σy over both arms in the compared steps (thumbs, errors ...: the rare events)
    exposures: np.ndarray  # Σx over both arms in the compared steps (generations ...)


def _cell(m: np.ndarray) -> dict[str, np.ndarray]:
    """Ratio, and per-user influence moments, of each cell (..., MOMENTS); NaN where undefined."""
    with np.errstate(divide="ignore", invalid="ignore"):
        n = m[..., N]
        ok = (n >= 2) & (m[..., SX] > 0)
        n = np.where(ok, n, np.nan)
        mx, my, mz = m[..., SX] / n, m[..., SY] / n, m[..., SZ] / n
        r = my / mx
        vx = (m[..., SXX] - n * mx * mx) / (n - 1)
        vy = (m[..., SYY] - n * my * my) / (n - 1)
        cxy = (m[..., SXY] - n * mx * my) / (n - 1)
        vz = (m[..., SZZ] - n * mz * mz) / (n - 1)
        cxz = (m[..., SXZ] - n * mx * mz) / (n - 1)
        cyz = (m[..., SYZ] - n * my * mz) / (n - 1)
        # Influence of a user on R = Σy/Σx: ℓ = (y − R·x)/μx (delta method). Its variance over users and
        # its covariance with z:
        vl = np.maximum((vy - 2 * r * cxy + r * r * vx) / (mx * mx), 0.0)
        clz = (cyz - r * cxz) / mx
    return {"n": n, "r": r, "vl": vl, "vz": np.maximum(vz, 0.0), "clz": clz}


def compare(m: np.ndarray) -> Comparison:
    """Stratified, regression-adjusted comparison of arm 1 (challenger) with arm 0, from cells (E, K, 2, MOMENTS)."""
    c = _cell(m)
    n, r, vl, vz, clz = c["n"], c["r"], c["vl"], c["vz"], c["clz"]  # each (E, K, 2)
    with np.errstate(divide="ignore", invalid="ignore"):
        usable = np.isfinite(r).all(axis=-1)  # (E, K): both arms of the step have a ratio
        nk = np.where(usable, np.nansum(n, axis=-1), 0.0)
        total = nk.sum(axis=-1)  # (E,)
        w = nk / total[:, None]
        d_k = r[..., 1] - r[..., 0]
        raw_v_k = vl[..., 1] / n[..., 1] + vl[..., 0] / n[..., 0]
        # θ: one slope per step, pooled over both arms (the covariate is balanced by randomisation).
        num = (clz * (n - 1)).sum(axis=-1)
        den = (vz * (n - 1)).sum(axis=-1)
        theta = np.where(den > 0, num / den, 0.0)
        # Each arm's ratio moves with its mean influence, which moves with its mean z by θ: removing
        # θ·(z̄_challenger − z̄_champion) removes the chance imbalance in pre-experiment behaviour.
        adj_k = d_k - theta * (m[..., 1, SZ] / n[..., 1] - m[..., 0, SZ] / n[..., 0])
        adj_vl = np.maximum(vl - 2 * theta[..., None] * clz + theta[..., None] ** 2 * vz, 0.0)
        adj_v_k = adj_vl[..., 1] / n[..., 1] + adj_vl[..., 0] / n[..., 0]
        wz = np.where(usable, w, 0.0)
        estimate = np.where(total > 0, np.nansum(wz * np.where(usable, d_k, 0.0), axis=-1), np.nan)
        adjusted = np.where(total > 0, np.nansum(wz * np.where(usable, adj_k, 0.0), axis=-1), np.nan)
        raw_var = np.where(total > 0, np.nansum(wz**2 * np.where(usable, raw_v_k, 0.0), axis=-1), np.nan)
        var = np.where(total > 0, np.nansum(wz**2 * np.where(usable, adj_v_k, 0.0), axis=-1), np.nan)
        # No spread, no evidence: zero variance is not certainty.
        raw_var = np.where(raw_var > 0, raw_var, np.nan)
        var = np.where(var > 0, var, np.nan)
        level = np.where(total > 0, np.nansum(wz * np.where(usable, r[..., 0], 0.0), axis=-1), np.nan)
        arm_users = np.where(usable[..., None], np.nan_to_num(n), 0.0).sum(axis=1)
        pooled = _cell(m.sum(axis=1))  # each arm over all its steps: what the dashboard shows per arm
        arm_ratio = pooled["r"]
        arm_var = pooled["vl"] / pooled["n"]
        # Under "no difference" both arms' users are draws of one population: their influence variance is
        # estimated on the pooled users of the step (the pooled two-sample test). Each arm's own variance
        # collapses where its events are few (0 thumbs up: 0 variance, however many users); the pooled one
        # does not, since the other arm's events count too.
        both = _cell(m.sum(axis=-2))  # (E, K), regression-adjusted with the step's θ as each arm is
        null_vl = np.maximum(both["vl"] - 2 * theta * both["clz"] + theta**2 * both["vz"], 0.0)
        null_k = null_vl * (1 / n[..., 1] + 1 / n[..., 0])
        null_var = np.where(total > 0, np.nansum(wz**2 * np.where(usable, null_k, 0.0), axis=-1), np.nan)
        null_var = np.where(null_var > 0, null_var, np.nan)
        events = np.where(usable, m[..., SY].sum(axis=-1), 0.0).sum(axis=-1)
        exposures = np.where(usable, m[..., SX].sum(axis=-1), 0.0).sum(axis=-1)
    return Comparison(
        estimate, adjusted, var, raw_var, total, arm_users, level, arm_ratio, arm_var, null_var, events, exposures
    )


def relative_lift(
    mean_a: float, var_a: float, mean_b: float, var_b: float, alpha: float
) -> tuple[float, tuple[float, float]] | None:
    """Challenger over champion minus 1, and its fixed-sample 1 - alpha interval; None without a positive champion.

    `var_a`, `var_b` are the variances of each arm's mean (for a ratio metric, its delta-method variance over
    users). The delta method for the ratio of two independent means (Deng, Knoblich & Lu 2018, "Applying the
    Delta Method in Metric Analytics", section 3.3, percent change; what gbstats computes for a relative
    effect, `frequentist_variance(..., relative=True)` through `variance_of_ratios` with no covariance):

        Var(mean_b / mean_a) ~ var_b / mean_a^2 + mean_b^2 var_a / mean_a^4

    with a normal quantile (gbstats takes Student's t with Welch's degrees of freedom: the same to the third
    digit past a few hundred users). A share of a champion mean at or below 0 has no meaning (the reward's zero
    is arbitrary): None, and the absolute difference is what reads. Shown, never decided on.
    """
    from statistics import NormalDist

    values = (mean_a, var_a, mean_b, var_b)
    if not all(math.isfinite(v) for v in values) or mean_a <= 0 or min(var_a, var_b) < 0:
        return None
    lift = mean_b / mean_a - 1
    var = var_b / mean_a**2 + mean_b**2 * var_a / mean_a**4
    half = NormalDist().inv_cdf(1 - alpha / 2) * math.sqrt(var)
    return lift, (lift - half, lift + half)


def rho2(alpha: float, tuning: float) -> float:
    """ρ² of the normal-mixture boundary, tightest at N* = `tuning` users (Waudby-Smith et al. 2023, eq. 161)."""
    return (-2 * math.log(alpha) + math.log(-2 * math.log(alpha) + 1)) / tuning


def half_width(
    variance: np.ndarray, users: np.ndarray, alpha: float, tuning: float, rho2_: float | None = None
) -> np.ndarray:
    """Half-width of the asymptotic confidence sequence at `users` units, Var(estimate) = `variance`.

    Eq. (9) of Waudby-Smith et al. (2023) with s² = N·Var(estimate), the per-unit variance; ρ fixed
    by the configured α and N* (pass `rho2_` to test another α against the same sequence).
    """
    r2 = rho2(alpha, tuning) if rho2_ is None else rho2_
    n = np.maximum(users, 1.0)
    with np.errstate(invalid="ignore"):
        s2 = n * variance
        return np.sqrt(s2 * 2 * (n * r2 + 1) / (n * n * r2) * np.log(np.sqrt(n * r2 + 1) / alpha))


def sequential_p_value(
    estimate: np.ndarray, variance: np.ndarray, users: np.ndarray, alpha: float, tuning: float
) -> np.ndarray:
    """The smallest α' at which the confidence sequence (ρ tuned for `alpha`) excludes 0.

    Solving |d| = half-width for α' in eq. (9), half² = s²·2(Nρ²+1)/(N²ρ²)·log(sqrt(Nρ²+1)/α') with s² = N·Var:
    p = sqrt(Nρ²+1)·exp(−d²·N·ρ² / (2·Var·(Nρ²+1))), capped at 1. NaN where the variance is undefined.
    """
    r2 = rho2(alpha, tuning)
    n = np.maximum(users, 1.0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        p = np.sqrt(n * r2 + 1) * np.exp(-(estimate**2) * n * r2 / (2 * variance * (n * r2 + 1)))
    return np.minimum(p, 1.0)


def users_to_resolve(
    per_user_variance: np.ndarray, effect: float | np.ndarray, alpha: float, tuning: float, power: float = 0.8
) -> np.ndarray:
    """Users (both arms) at which a true difference of size `effect` is resolved with probability `power`.

    Resolved: the confidence sequence at N users excludes the point `effect` away, i.e.
    half(N) + z_power·sqrt(s²/N) ≤ |effect|. Bisection on N (the left side falls with N).
    Infinite where the variance is undefined.
    """
    from statistics import NormalDist

    zp = NormalDist().inv_cdf(power)
    s2 = np.asarray(per_user_variance, dtype=float)
    eff = np.abs(np.broadcast_to(np.asarray(effect, dtype=float), s2.shape))
    lo, hi = np.full(s2.shape, 2.0), np.full(s2.shape, 1e12)

    def short(nn: np.ndarray) -> np.ndarray:
        return half_width(s2 / nn, nn, alpha, tuning) + zp * np.sqrt(s2 / nn) > eff

    for _ in range(80):
        mid = np.sqrt(lo * hi)
        bad = short(mid)
        lo, hi = np.where(bad, mid, lo), np.where(bad, hi, mid)
    out = np.ceil(hi)
    return np.where(np.isfinite(s2) & (s2 > 0) & (eff > 0) & (out < 1e12), out, np.inf)


def detectable(
    per_user_variance: np.ndarray, users: np.ndarray, alpha: float, tuning: float, power: float = 0.8
) -> np.ndarray:
    """The smallest true difference resolved with probability `power` at `users` users (the MDE)."""
    from statistics import NormalDist

    zp = NormalDist().inv_cdf(power)
    n = np.maximum(users, 1.0)
    s2 = np.asarray(per_user_variance, dtype=float)
    return half_width(s2 / n, n, alpha, tuning) + zp * np.sqrt(s2 / n)


def srm_log_bayes_factor(counts: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """log BF of "assignment is not at `shares`" from the users per arm, (..., arms) each.

    Dirichlet-multinomial marginal likelihood over the multinomial at θ0 (Lindon & Malek 2022), prior Dirichlet(c·θ0):
    log BF = lnΓ(c) − lnΓ(c + n) + Σ [lnΓ(cθ0ᵢ + xᵢ) − lnΓ(cθ0ᵢ) − xᵢ ln θ0ᵢ].
    Arms with share 0 (nobody routed there) must hold no users; they are left out.
    """
    theta = np.asarray(shares, dtype=float)
    x = np.asarray(counts, dtype=float)
    live = theta > 0
    a = SRM_PRIOR_CONCENTRATION * np.where(live, theta, 1.0)
    n = np.where(live, x, 0.0).sum(axis=-1)
    c = np.where(live, a, 0.0).sum(axis=-1)
    with np.errstate(divide="ignore"):
        terms = np.where(live, gammaln(a + x) - gammaln(a) - x * np.log(np.where(live, theta, 1.0)), 0.0)
    return gammaln(c) - gammaln(c + n) + terms.sum(axis=-1)
