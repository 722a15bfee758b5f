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
