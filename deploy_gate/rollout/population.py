"""Simulated users, clustered as real products' are: per-user columns the rollout's rules read.

A few heavy users (3% by default, about 200 generations each) carry over half of the generations,
the rest make about 5. Each user has their own propensity to accept (Beta around 0.35), kept
between the pre-experiment period and the experiment when `persistence` is 1 (what regression
adjustment feeds on) and drawn afresh when it is 0. A challenger whose users accept
`factor` times as often changes the reward, the accepted rate and the thumbs as a real one would.
Rewards follow the rules definition's weights (+0.75 accept, -0.25 reject, -0.1 undone, ±1 thumbs).

Numpy only, so the calibration bench can run it against any version of the decision code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Population:
    heavy_share: float = 0.03
    heavy_generations: float = 200.0
    light_generations: float = 5.0
    accept: float = 0.35  # mean P(accept | shown)
    accept_concentration: float = 10.0  # Beta(accept·c, (1 − accept)·c) per user
    shown: float = 0.85
    undo: float = 0.05
    thumbs: float = 0.1
    error: float = 0.01  # share of completions cut at max_tokens (`truncated_rate`, shown only)
    latency_ms: float = 50.0
    returning: float = 0.7  # share of users seen before the experiment (a pre-period to adjust on)
    persistence: float = 1.0  # 1: a user's propensity is the same before and during; 0: independent
    # > 0: generations per user are 1 + Poisson(lognormal with this sigma) around `light_generations`, a heavy tail
    # of its own instead of the two classes of users (heavy_share is then ignored)
    activity_sigma: float = 0.0


def users(
    rng: np.random.Generator, m: int, pop: Population, factor: np.ndarray, level: np.ndarray
) -> dict[str, np.ndarray]:
    """Per-user columns (the controller's USER_COLUMNS that the rules read) for `m` users."""
    heavy = rng.random(m) < pop.heavy_share
    k = np.where(heavy, rng.poisson(pop.heavy_generations, m), 1 + rng.poisson(pop.light_generations - 1, m))
    if pop.activity_sigma > 0:  # mean light_generations, lognormal spread: a few users with thousands
        s = pop.activity_sigma
        heavy = np.zeros(m, dtype=bool)
        k = 1 + rng.poisson(rng.lognormal(math.log(pop.light_generations - 1) - s * s / 2, s, m))
    c = pop.accept_concentration
    base = rng.beta(pop.accept * c, (1 - pop.accept) * c, m)
    p = np.clip(base * factor * level, 0.0, 1.0)
    shown = rng.binomial(k, pop.shown)
    accepted = rng.binomial(shown, p)
    rejected = shown - accepted
    undone = rng.binomial(accepted, pop.undo)
    up = rng.binomial(accepted - undone, pop.thumbs)
    down = rng.binomial(rejected, pop.thumbs)
    reward = 0.75 * (accepted - undone - up) - 0.1 * undone + up - 0.25 * (rejected - down) - down
    # The pre-experiment period: returning users, same kind of user, same or fresh propensity.
    back = rng.random(m) < pop.returning
    k_pre = np.where(back, np.where(heavy, rng.poisson(pop.heavy_generations, m), 1 + rng.poisson(4, m)), 0)
    fresh = rng.beta(pop.accept * c, (1 - pop.accept) * c, m)
    p_pre = np.where(rng.random(m) < pop.persistence, base, fresh)
    shown_pre = rng.binomial(k_pre, pop.shown)
    acc_pre = rng.binomial(shown_pre, p_pre)
    reward_pre = 0.75 * acc_pre - 0.25 * (shown_pre - acc_pre)
    mu = rng.lognormal(math.log(pop.latency_ms), 0.2, m)
    kf = k.astype(float)
    return {
        "generations": kf, "reward_n": kf, "reward_sum": reward.astype(float),
        "pre_reward_sum": reward_pre.astype(float), "pre_reward_n": k_pre.astype(float),
        "thumbs_up": up.astype(float), "thumbs_down": down.astype(float), "shown": shown.astype(float),
        "accepted": accepted.astype(float), "undone": undone.astype(float), "declined": (k - shown).astype(float),
        "suggested": shown.astype(float), "empty": np.zeros(m), "truncated": rng.binomial(k, pop.error).astype(float),
        "length_sum": shown * rng.lognormal(math.log(40), 0.3, m),
        "latency_sum": kf * mu + np.sqrt(kf) * 0.3 * mu * rng.standard_normal(m),
        "latency_mu": mu,  # the user's typical latency (generations scatter ±30% around it)
    }  # fmt: skip


def pre_rate(pop: Population) -> float:
    """The population's pre-period reward per generation: the centre of each user's covariate."""
    return pop.shown * (pop.accept - 0.25)


def covariate(cols: dict[str, np.ndarray], rate: float) -> np.ndarray:
    """A user's pre-period reward above the pre-period rate (0 for a new user): what CUPED adjusts on."""
    return cols["pre_reward_sum"] - rate * cols["pre_reward_n"]



