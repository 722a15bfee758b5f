"""Simulated experiments run through the controller's own rules, thousands at once (numpy).

Users are clustered as real products' are: a few heavy users (3% by default, about 200
generations each) carry over half of the generations, the rest make about 5. Each user has their
own propensity to accept (Beta around 0.35), kept between the pre-experiment period and the
experiment when `persistence` is 1 (what regression adjustment feeds on) and drawn afresh when it
is 0. A challenger whose users accept `accept_factor` times as often changes the reward, the
accepted rate and the thumbs as a real one would.

Each experiment runs the ramp of a `RolloutConfig` look by look: new users arrive (Poisson), are
assigned at the share of the step in force, and belong to that step; after every look the same
`deploy_gate.rollout.rules.judge` the controller calls decides, and a ramp, promotion, rollback or
freeze is applied as the controller applies it. The sequential SRM test counts users per step
against the step's share. Simplification: a user's generations all arrive at their first look
(nobody is moved across arms by a later step), which is the pooled-ramp case the strata must handle.

Used by bench/rollout_decisions.py (figures) and tests/test_rollout_decisions.py (seeded bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from deploy_gate.rollout import rules
from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.evidence import MOMENTS, srm_log_bayes_factor


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
    error: float = 0.01
    latency_ms: float = 50.0
    returning: float = 0.7  # share of users seen before the experiment (a pre-period to adjust on)
    persistence: float = 1.0  # 1: a user's propensity is the same before and during; 0: independent


@dataclass(frozen=True)
class Scenario:
    config: RolloutConfig
    users: int  # expected users arriving over the maximum duration
    look_s: float  # seconds between looks (the controller's tick, or coarser for long experiments)
    accept_factor: float = 1.0  # the challenger's users accept this many times as often
    drift: float = 0.0  # both arms' accept propensity grows by this share over the maximum duration
    population: Population = field(default_factory=Population)
    srm_loss: float = 0.0  # share of challenger users lost before the lake (a broken logging path)


@dataclass(frozen=True)
class Outcomes:
    code: np.ndarray  # final action code per experiment (CONTINUE_LAST: undecided at the end)
    at_s: np.ndarray  # when it was taken
    users: np.ndarray  # users seen by then (both arms)
    ever_excluded_zero: np.ndarray  # the primary interval excluded 0 at some look (before a decision)
    mde: np.ndarray  # the minimum detectable harm the gate stated at its decision (absolute reward)
    margin: np.ndarray
    estimate: np.ndarray  # final adjusted estimate
    raw_estimate: np.ndarray

    def share(self, *codes: int) -> float:
        return float(np.isin(self.code, codes).mean())


def _users(
    rng: np.random.Generator, m: int, pop: Population, factor: np.ndarray, level: np.ndarray
) -> dict[str, np.ndarray]:
    """Per-user columns (the controller's USER_COLUMNS that the rules read) for `m` users."""
    heavy = rng.random(m) < pop.heavy_share
    k = np.where(heavy, rng.poisson(pop.heavy_generations, m), 1 + rng.poisson(pop.light_generations - 1, m))
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
        "suggested": shown.astype(float), "empty": np.zeros(m), "errors": rng.binomial(k, pop.error).astype(float),
        "length_sum": shown * rng.lognormal(math.log(40), 0.3, m),
        "latency_sum": kf * mu + np.sqrt(kf) * 0.3 * mu * rng.standard_normal(m),
    }  # fmt: skip


def pre_rate(pop: Population) -> float:
    """The population's pre-period reward per generation: the centre of each user's covariate."""
    return pop.shown * (pop.accept - 0.25)


def covariate(cols: dict[str, np.ndarray], rate: float) -> np.ndarray:
    """A user's pre-period reward above the pre-period rate (0 for a new user): what CUPED adjusts on."""
    return cols["pre_reward_sum"] - rate * cols["pre_reward_n"]


def simulate(scenario: Scenario, experiments: int, seed: int) -> Outcomes:
    cfg, pop = scenario.config, scenario.population
    rng = np.random.default_rng(seed)
    shares = np.array([s.share for s in cfg.ramp])
    min_users = np.array([s.min_users for s in cfg.ramp])
    min_seconds = np.array([s.min_seconds for s in cfg.ramp])
    steps, e_ = len(cfg.ramp), experiments
    cells = {m.name: np.zeros((e_, steps, 2, MOMENTS)) for m in rules.METRICS}
    srm_counts = np.zeros((e_, steps, 2))
    step = np.zeros(e_, dtype=int)
    entered = np.zeros(e_)
    done = np.zeros(e_, dtype=bool)
    code = np.full(e_, rules.CONTINUE_LAST)
    at = np.full(e_, np.nan)
    seen = np.zeros(e_)
    ever = np.zeros(e_, dtype=bool)
    mde = np.full(e_, np.nan)
    margin = np.full(e_, np.nan)
    est = np.full(e_, np.nan)
    raw = np.full(e_, np.nan)
    rate = scenario.users / cfg.max_duration_s * scenario.look_s
    # Past the maximum duration a step may still wait out its minimum time: look until that is over too.
    horizon = cfg.max_duration_s + sum(s.min_seconds for s in cfg.ramp) + scenario.look_s
    looks = int(math.ceil(horizon / scenario.look_s))
    log_alarm = math.log(1 / cfg.srm_alpha)
    centre = pre_rate(pop)
    for look in range(1, looks + 1):
        t = look * scenario.look_s
        arrivals = rng.poisson(rate, e_) * ~done
        m = int(arrivals.sum())
        if m:
            who = np.repeat(np.arange(e_), arrivals)
            st = step[who]
            arm = (rng.random(m) < shares[st]).astype(int)
            if scenario.srm_loss:
                keep = ~((arm == 1) & (rng.random(m) < scenario.srm_loss))
                who, st, arm = who[keep], st[keep], arm[keep]
                m = who.size
            factor = np.where(arm == 1, scenario.accept_factor, 1.0)
            level = np.full(m, 1.0 + scenario.drift * t / cfg.max_duration_s)
            cols = _users(rng, m, pop, factor, level)
            z = covariate(cols, centre)
            flat = (who * steps + st) * 2 + arm
            size = e_ * steps * 2
            for metric in rules.METRICS:
                x, y = cols[metric.denominator], cols[metric.numerator]
                zz = z if metric is rules.PRIMARY else np.zeros(m)
                parts = (np.ones(m), x, y, x * x, y * y, x * y, zz, zz * zz, x * zz, y * zz)
                add = np.stack([np.bincount(flat, w, size) for w in parts], axis=-1)
                cells[metric.name] += add.reshape(e_, steps, 2, MOMENTS)
            srm_counts += np.bincount(flat, minlength=size).reshape(e_, steps, 2)
        # The sequential SRM test: one Bayes factor per step at its share, multiplied over the steps.
        theta = np.stack([1 - shares, shares], axis=-1)  # (steps, 2)
        log_bf = srm_log_bayes_factor(srm_counts, np.broadcast_to(theta, srm_counts.shape)).sum(axis=-1)
        alarm = (log_bf >= log_alarm) & (srm_counts.sum(axis=(1, 2)) >= cfg.srm_min_users)
        idx = np.arange(e_)
        clock = rules.Clock(
            step_users=srm_counts[idx, step, 1], step_min_users=min_users[step], in_step_s=t - entered,
            step_min_seconds=min_seconds[step], last=step == steps - 1, running_s=np.full(e_, t),
        )  # fmt: skip
        j = rules.judge(cells, alarm, clock, cfg)
        live = ~done
        with np.errstate(invalid="ignore"):
            ever |= live & j.enough & ((j.primary.lo > 0) | (j.primary.hi < 0))
        act = np.array([rules.ACTION[c] for c in range(13)])[j.code]
        ramp = live & (act == "ramp")
        step = np.where(ramp, step + 1, step)
        entered = np.where(ramp, t, entered)
        end = live & np.isin(act, ["promote", "rollback", "freeze"])
        if end.any():
            code[end], at[end] = j.code[end], t
            seen[end] = j.primary.comparison.users[end]
            s2 = j.primary.comparison.variance * j.primary.comparison.users
            from deploy_gate.rollout.evidence import detectable

            mde[end] = detectable(s2, j.primary.comparison.users, j.primary.alpha, cfg.tuning_n)[end]
            margin[end] = j.margin[end]
            est[end], raw[end] = j.primary.comparison.adjusted[end], j.primary.comparison.estimate[end]
            done |= end
        if done.all():
            break
    return Outcomes(code, at, seen, ever, mde, margin, est, raw)
