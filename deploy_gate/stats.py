"""Sufficient statistics of a reward stream, and the interval the dashboard shows.

`RewardStats` holds (n, sum, sum of squares) and adds across partitions, time buckets and
workers, like gbstats' `SampleMeanStatistic`: the mean and interval of a merged set equal
those computed over all of its rewards at once.

>>> a = RewardStats.of([1.0, 0.0]) + RewardStats.of([1.0])
>>> a.n, round(a.mean, 4)
(3, 0.6667)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RewardStats:
    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0

    @classmethod
    def of(cls, rewards: Iterable[float]) -> RewardStats:
        xs = list(rewards)
        return cls(len(xs), math.fsum(xs), math.fsum(x * x for x in xs))

    def __add__(self, other: RewardStats) -> RewardStats:
        return RewardStats(self.n + other.n, self.total + other.total, self.total_sq + other.total_sq)

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    @property
    def variance(self) -> float | None:
        """Sample variance (n - 1 in the denominator); None below two rewards."""
        if self.n < 2:
            return None
        # Rewards are bounded (about [-1, 1]), so the sum-of-squares form loses nothing that matters;
        # clamp the tiny negative values rounding can leave when every reward is equal.
        return max(0.0, (self.total_sq - self.total * self.total / self.n) / (self.n - 1))

    def confidence_interval(self, level: float = 0.95) -> tuple[float, float] | None:
        """Student-t interval for the mean: mean ± t_{(1+level)/2, n-1} · s / sqrt(n).

        The textbook one-sample t interval (e.g. NIST/SEMATECH e-Handbook 7.2.2.1); it is
        what `scipy.stats.t.interval(level, n - 1, mean, sem)` gives. None below two rewards:
        there is no spread to judge from.
        """
        from scipy import stats  # imported here: the CLI should not pay for scipy at startup

        var = self.variance
        mean = self.mean
        if var is None or mean is None:
            return None
        half = float(stats.t.ppf((1 + level) / 2, self.n - 1)) * math.sqrt(var / self.n)
        return mean - half, mean + half


@dataclass(frozen=True)
class Difference:
    """Challenger minus champion: estimate, fixed-sample interval and two-sided p-value."""

    estimate: float
    ci: tuple[float, float]
    p_value: float
    std_error: float


def welch_difference(a: RewardStats, b: RewardStats, alpha: float = 0.05) -> Difference | None:
    """B's mean minus A's with Welch's t interval (unequal variances), as GrowthBook's frequentist engine.

    se = sqrt(s_a²/n_a + s_b²/n_b), Welch–Satterthwaite degrees of freedom
    ν = se⁴ / ((s_a²/n_a)²/(n_a-1) + (s_b²/n_b)²/(n_b-1)) (Welch 1947); the interval is
    d ± t_{1-α/2, ν}·se. GrowthBook's published example (gbstats tests):

    >>> d = welch_difference(RewardStats(3407, 1396.87, 52377.9767), RewardStats(3461, 2422.7, 134698.29))
    >>> round(d.estimate, 2), round(d.ci[0], 5), round(d.ci[1], 5), round(d.p_value, 5)
    (0.29, 0.04538, 0.53462, 0.02016)
    """
    va, vb, ma, mb = a.variance, b.variance, a.mean, b.mean
    if va is None or vb is None or ma is None or mb is None:
        return None
    return t_difference(mb - ma, va / a.n, vb / b.n, a.n, b.n, alpha)


def t_difference(d: float, wa: float, wb: float, na: int, nb: int, alpha: float) -> Difference:
    """d ± t_{1-α/2, ν}·sqrt(wa + wb), `wa`, `wb` each arm's variance of its estimate, ν Welch–Satterthwaite's
    degrees of freedom over `na`, `nb` units, as gbstats' `TwoSidedTTest` computes them."""
    from scipy import stats

    se2 = wa + wb
    if se2 <= 0:
        return Difference(d, (d, d), 1.0 if d == 0 else 0.0, 0.0)
    denom = wa * wa / max(na - 1, 1) + wb * wb / max(nb - 1, 1)
    df = se2 * se2 / denom if denom > 0 else float(na + nb - 2)
    se = math.sqrt(se2)
    q = float(stats.t.ppf(1 - alpha / 2, df))
    p = float(2 * stats.t.sf(abs(d) / se, df))
    return Difference(d, (d - q * se, d + q * se), p, se)


def check_srm(observed: list[int], expected_shares: list[float]) -> float:
    """Sample-ratio-mismatch p-value: Pearson's chi-square of observed units against the planned shares.

    χ² = Σ (O_i − E_i)² / E_i with E_i = share_i · Σ O, k − 1 degrees of freedom (scipy.stats.chisquare).
    GrowthBook's published value:

    >>> f"{check_srm([1000, 1200], [0.5, 0.5]):.4e}"
    '2.0079e-05'
    """
    from scipy import stats

    total = sum(observed)
    share_sum = sum(expected_shares)
    if total == 0 or share_sum <= 0:
        return 1.0
    expected = [total * s / share_sum for s in expected_shares]
    pairs = [(o, e) for o, e in zip(observed, expected, strict=True) if e > 0]
    if len(pairs) < 2:
        return 1.0
    return float(stats.chisquare([o for o, _ in pairs], [e for _, e in pairs]).pvalue)


@dataclass(frozen=True)
class RatioStats:
    """Per-unit sums of a ratio metric Σy/Σx (reward per generation, with users as the unit), mergeable.

    Holds n (users), Σx, Σy, Σx², Σy², Σxy over users, where x is a user's generation count and y
    their summed reward. The users are independent; their generations are not, which is why the
    interval comes from the delta method over users rather than a t interval over generations.

    >>> r = RatioStats.of([(2, 1.0), (1, 0.0)]) + RatioStats.of([(1, 1.0)])
    >>> r.n, r.ratio
    (3, 0.5)
    """

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    syy: float = 0.0
    sxy: float = 0.0

    @classmethod
    def of(cls, units: Iterable[tuple[float, float]]) -> RatioStats:
        us = list(units)
        return cls(
            len(us),
            math.fsum(x for x, _ in us),
            math.fsum(y for _, y in us),
            math.fsum(x * x for x, _ in us),
            math.fsum(y * y for _, y in us),
            math.fsum(x * y for x, y in us),
        )

    def __add__(self, o: RatioStats) -> RatioStats:
        return RatioStats(
            self.n + o.n, self.sx + o.sx, self.sy + o.sy, self.sxx + o.sxx, self.syy + o.syy, self.sxy + o.sxy
        )

    @property
    def ratio(self) -> float | None:
        return self.sy / self.sx if self.sx else None

    def ratio_variance(self) -> float | None:
        """Var(Σy/Σx) by the delta method (Deng, Knoblich & Lu, KDD 2018, eq. 2):

        Var ≈ (1/n) · (σ_y²/μ_x² − 2·μ_y·σ_xy/μ_x³ + μ_y²·σ_x²/μ_x⁴), with sample moments over units.

        >>> RatioStats.of([(1, 1.0), (1, 0.0), (1, 1.0), (1, 0.0)]).ratio_variance()  # x ≡ 1: var(ȳ)
        0.08333333333333333
        """
        n = self.n
        if n < 2 or self.sx <= 0:
            return None
        mx, my = self.sx / n, self.sy / n
        vx = max(0.0, (self.sxx - n * mx * mx) / (n - 1))
        vy = max(0.0, (self.syy - n * my * my) / (n - 1))
        cxy = (self.sxy - n * mx * my) / (n - 1)
        var = (vy / mx**2 - 2 * my * cxy / mx**3 + my * my * vx / mx**4) / n
        return max(0.0, var)

    def confidence_interval(self, level: float = 0.95) -> tuple[float, float] | None:
        """Normal interval ratio ± z·sqrt(delta-method variance)."""
        from scipy import stats

        var, r = self.ratio_variance(), self.ratio
        if var is None or r is None:
            return None
        half = float(stats.norm.ppf((1 + level) / 2)) * math.sqrt(var)
        return r - half, r + half


def ratio_difference(a: RatioStats, b: RatioStats, alpha: float = 0.05) -> Difference | None:
    """B's ratio minus A's, with the delta-method variance of each arm (arms are independent).

    Welch's t with Welch–Satterthwaite degrees of freedom over users, as gbstats' `TwoSidedTTest` on two
    `RatioStatistic`s (checked against its outputs in tests/test_rollout_gbstats.py); with one generation
    per user it is Welch's difference of means.
    """
    va, vb, ra, rb = a.ratio_variance(), b.ratio_variance(), a.ratio, b.ratio
    if va is None or vb is None or ra is None or rb is None or va + vb <= 0:
        return None  # zero variance is no evidence, not certainty (gbstats: "no decision", p = 1)
    return t_difference(rb - ra, va, vb, a.n, b.n, alpha)


def sequential_interval(
    diff: Difference, n_total: int, alpha: float = 0.05, tuning: float = 5000.0
) -> tuple[float, float]:
    """An always-valid interval for the difference: the asymptotic confidence sequence.

    Waudby-Smith, Arnold, Wu, Howard, Ramdas (2023), "Time-uniform central limit theory and
    asymptotic confidence sequences", eq. (9) (Howard et al. 2021's normal mixture boundary):

        d ± sqrt(s²) · sqrt( 2(Nρ² + 1) / (N²ρ²) · log( sqrt(Nρ² + 1) / α ) )

    where N is the number of units seen, s² = N · Var(d) the per-unit variance, and ρ tunes where the
    sequence is tightest: ρ = sqrt((−2 log α + log(−2 log α + 1)) / N*) (ibid., eq. 161), with
    N* = 5000 as GrowthBook's default. It covers the true difference at every N simultaneously
    with probability ≥ 1 − α, so the dashboard may be watched, and the test run, after every batch.

    >>> d = Difference(0.29, (0.045, 0.535), 0.02, 0.1247836)
    >>> lo, hi = sequential_interval(d, 6868)
    >>> lo < 0.045 and hi > 0.535  # wider than the fixed-sample interval
    True
    """
    n = max(n_total, 1)
    rho2 = (-2 * math.log(alpha) + math.log(-2 * math.log(alpha) + 1)) / tuning
    s2 = n * diff.std_error**2
    half = math.sqrt(s2) * math.sqrt(2 * (n * rho2 + 1) / (n * n * rho2) * math.log(math.sqrt(n * rho2 + 1) / alpha))
    return diff.estimate - half, diff.estimate + half
