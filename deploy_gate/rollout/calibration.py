"""Simulated experiments that check the controller's test: its false-positive rate and its power.

Each simulated user gets 1 + Poisson(2) generations whose rewards are Bernoulli with a
per-user propensity (Beta(2, 2), plus `effect` in the challenger arm), so one user's rewards are
correlated, as real users' are. After every batch of users the experiment is looked at twice:

- the controller's way: the asymptotic confidence sequence on the per-user ratio difference
  (`deploy_gate.stats.sequential_interval`), a winner declared when it excludes zero;
- the naive way: the fixed-sample interval recomputed at every look, a winner declared when it
  excludes zero, which is what watching a classical dashboard all day amounts to.

Used by bench/rollout_stats.py (figures) and tests/test_rollout_stats.py (the A/A bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deploy_gate.stats import RatioStats, ratio_difference, sequential_interval


@dataclass(frozen=True)
class Outcome:
    sequential_look: int | None  # first look whose confidence sequence excludes 0 (None: never)
    sequential_sign: int
    naive_look: int | None  # first look whose fixed-sample interval excludes 0
    final_fixed_significant: bool  # the fixed-sample test at the planned end (the last look)
    final_fixed_sign: int
    users_per_look: int


def _arm_users(rng: np.random.Generator, n: int, effect: float) -> np.ndarray:
    k = 1 + rng.poisson(2.0, n)
    p = np.clip(rng.beta(2.0, 2.0, n) + effect, 0.0, 1.0)
    y = rng.binomial(k, p).astype(float)
    x = k.astype(float)
    return np.stack([np.ones(n), x, y, x * x, y * y, x * y], axis=1)


def simulate(
    *, effect: float, looks: int, users_per_look: int, alpha: float = 0.05, tuning: float = 5000.0, seed: int = 0
) -> Outcome:
    """One experiment, both arms growing by `users_per_look` users (50/50 by a fair coin) per look."""
    rng = np.random.default_rng(seed)
    sums = {"a": np.zeros(6), "b": np.zeros(6)}
    seq_look = naive_look = None
    seq_sign = 0
    diff = None
    for look in range(1, looks + 1):
        n_b = int(rng.binomial(users_per_look, 0.5))
        sums["a"] = sums["a"] + _arm_users(rng, users_per_look - n_b, 0.0).sum(axis=0)
        sums["b"] = sums["b"] + _arm_users(rng, n_b, effect).sum(axis=0)
        a = RatioStats(int(sums["a"][0]), *map(float, sums["a"][1:]))
        b = RatioStats(int(sums["b"][0]), *map(float, sums["b"][1:]))
        diff = ratio_difference(a, b, alpha)
        if diff is None:
            continue
        if naive_look is None and (diff.ci[0] > 0 or diff.ci[1] < 0):
            naive_look = look
        if seq_look is None:
            lo, hi = sequential_interval(diff, a.n + b.n, alpha, tuning)
            if lo > 0 or hi < 0:
                seq_look, seq_sign = look, 1 if lo > 0 else -1
    final = diff is not None and (diff.ci[0] > 0 or diff.ci[1] < 0)
    sign = 0 if diff is None else (1 if diff.estimate > 0 else -1)
    return Outcome(seq_look, seq_sign, naive_look, final, sign, users_per_look)


def run_many(
    n: int, *, effect: float, looks: int, users_per_look: int, alpha: float = 0.05, seed: int = 0
) -> list[Outcome]:
    return [
        simulate(effect=effect, looks=looks, users_per_look=users_per_look, alpha=alpha, seed=seed * 1_000_003 + i)
        for i in range(n)
    ]
