"""The decision rules, vectorised over experiments: one procedure for the demo and for production.

`judge` takes the per-(step, arm) cells of every metric and the experiment's clock and ramp state,
and returns one action code per experiment. The controller calls it with one experiment; the
calibration bench with thousands, so the figures it prints are those of this code. What must hold,
whatever the configuration (the bench measures each):

- **Error budget.** Wrong decisions on an A/A experiment (promote as a win, roll back as worse or
  on a guardrail) stay at most α over every look: the primary metric's confidence sequence gets
  α/2 (two-sided: a win and a loss each), the guardrails share the other α/2 (Bonferroni).
- **Evidence floor.** No test decides before each arm has `MIN_ARM_USERS` users in comparable
  steps. The confidence sequence is asymptotic: with a few heavy users carrying most generations,
  the normal approximation needs users, not generations (measured by `bench/rollout_decisions.py`).
  It is a constant, not a setting: a demo with eight users must say "not enough evidence yet",
  not decide on a tuned-down test. Zero or undefined variance is no evidence either.
- **Guardrails are deterioration tests.** A guardrail trips when its interval shows any harm (the
  whole interval on the harmful side of 0), so a harm smaller than the configured bound is caught
  too; the bound is what the dashboard reports beside it. Two exceptions keep a tolerance: mean
  length may drift both ways within its ratio bounds, and latency (each user's mean) may rise up to
  `latency_p95_ratio` x the champion's, since two versions served by one machine differ by whatever
  else it does; each trips when its interval leaves the tolerance.
- **A margin on a ratio scale.** At the maximum duration the challenger is promoted if the
  interval's lower end is above −margin, margin = accept share × the champion's accept rate ×
  reward per accept (`margin`): the reward a challenger loses when its users accept that share less
  often and reject instead. The accept rate has a natural zero; the reward's zero is arbitrary (it
  can be negative), so a share of the champion's mean reward collapsed where it averages near 0
  (the demo's 0.03 gave 0.003, resolved by no traffic at all). Without accepts there is no margin
  and nothing is promoted as non-inferior.
- **Expected loss is shown, not decided on.** Beside the interval, the reward per generation lost
  by shipping the challenger, E[max(0, −d)], and by keeping the champion, E[max(0, d)], under the
  normal posterior of the adjusted difference with a flat prior (GrowthBook's Bayesian "risk").
  `judge(..., rule="expected_loss")` decides on it instead (ship when the loss of shipping is below
  `LOSS_SHARE` x the margin); the bench runs both on the same scenarios. Looked at after every tick
  it has no error guarantee: it stopped 64-100% of A/A experiments (about half shipping an equal
  challenger as a win, half rolling it back) and promoted 1.3% of 10%-worse challengers at 2,000
  users, where the sequential rule stopped 1-1.6% and promoted none; it gains power (+10%: 90-98%
  promoted against 51-84%) that the error budget cannot pay for, so the controller keeps the
  sequential rule.
- **Honest about the sample.** At the maximum duration, an experiment that has not resolved its
  margin rolls back as inconclusive and says how many users the margin would have needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.evidence import Comparison, compare, half_width, sequential_p_value

# Users per arm (in comparable steps) before any test may decide; see the module's doc and the bench.
MIN_ARM_USERS = 200
# The expected-loss rule's threshold, a share of the margin: 1/20 is GrowthBook's default risk threshold
# (0.25%) against our 5% accept-rate margin. Only `rule="expected_loss"` (the bench) decides on it.
LOSS_SHARE = 0.05

Harm = Literal["rise", "fall", "drift", "ratio"]


@dataclass(frozen=True)
class Metric:
    name: str
    numerator: str  # per-user column summed into y
    denominator: str  # per-user column summed into x
    harm: Harm | None  # None: the primary metric, or information only
    kind: Literal["primary", "guardrail", "reward_hacking", "info"]
    bound_field: str | None = None  # RolloutConfig field holding the bound shown beside it


PRIMARY = Metric("satisfaction", "reward_sum", "reward_n", None, "primary")
# Reward hacking: a policy can raise its reward by dropping suggestions users would have accepted
# (declining costs nothing, a reject costs 0.25), by answering blank instead of declining, or by
# drifting in length; explicit thumbs are the one signal it cannot shape. Accepts are known once a
# generation's reward is, so they are counted per rewarded generation.
GUARDRAILS = (
    Metric("latency_ms", "latency_sum", "generations", "ratio", "guardrail", "latency_p95_ratio"),
    Metric("error_rate", "errors", "generations", "rise", "guardrail", "error_rate_rise"),
    # Per accept, not per generation: a better model is accepted more often, so per generation it would be
    # undone more often too, and a deterioration test would roll it back for being better.
    Metric("undo_rate", "undone", "accepted", "rise", "guardrail", "undo_rate_rise"),
    Metric("thumbs_down_rate", "thumbs_down", "generations", "rise", "guardrail", "thumbs_down_rate_rise"),
    Metric("accepted_rate", "accepted", "reward_n", "fall", "reward_hacking", "accepted_rate_fall"),
    Metric("empty_rate", "empty", "generations", "rise", "reward_hacking", "empty_rate_rise"),
    Metric("explicit_up_rate", "thumbs_up", "generations", "fall", "reward_hacking", "explicit_up_rate_fall"),
    # Length is of what is suggested: a declined generation shows nothing and is not a short one.
    Metric("mean_length_chars", "length_sum", "suggested", "drift", "reward_hacking"),
)
INFO = (
    Metric("shown_rate", "shown", "generations", None, "info"),
    Metric("declined_rate", "declined", "generations", None, "info"),
)
METRICS = (PRIMARY, *GUARDRAILS, *INFO)

# Action codes, in the order of precedence `judge` applies them.
FREEZE_SRM = 0
CONTINUE_STEP_USERS = 1
ROLLBACK_STEP_USERS = 2
CONTINUE_EVIDENCE = 3
ROLLBACK_NO_EVIDENCE = 4
ROLLBACK_GUARDRAIL = 5
ROLLBACK_WORSE = 6
CONTINUE_MIN_TIME = 7
RAMP = 8
PROMOTE_WIN = 9
PROMOTE_NON_INFERIOR = 10
ROLLBACK_INCONCLUSIVE = 11
CONTINUE_LAST = 12
ACTION = {
    FREEZE_SRM: "freeze", CONTINUE_STEP_USERS: "continue", ROLLBACK_STEP_USERS: "rollback",
    CONTINUE_EVIDENCE: "continue", ROLLBACK_NO_EVIDENCE: "rollback", ROLLBACK_GUARDRAIL: "rollback",
    ROLLBACK_WORSE: "rollback", CONTINUE_MIN_TIME: "continue", RAMP: "ramp", PROMOTE_WIN: "promote",
    PROMOTE_NON_INFERIOR: "promote", ROLLBACK_INCONCLUSIVE: "rollback", CONTINUE_LAST: "continue",
}  # fmt: skip
# Rollbacks for want of evidence: nothing showed the challenger harmful.
INCONCLUSIVE = (ROLLBACK_STEP_USERS, ROLLBACK_NO_EVIDENCE, ROLLBACK_INCONCLUSIVE)
# What the A/A figure counts as wrong: a win or a loss claimed where there is none.
WRONG_ON_AA = (ROLLBACK_GUARDRAIL, ROLLBACK_WORSE, PROMOTE_WIN)


def alphas(config: RolloutConfig) -> tuple[float, float]:
    """(α of the primary metric's two-sided sequence, α of each guardrail's), summing to config.alpha."""
    return config.alpha / 2, config.alpha / 2 / len(GUARDRAILS)


@dataclass(frozen=True)
class Interval:
    """A comparison with its always-valid interval at a given α, per experiment."""

    comparison: Comparison
    alpha: float
    lo: np.ndarray
    hi: np.ndarray
    raw_lo: np.ndarray  # the unadjusted estimate's interval
    raw_hi: np.ndarray
    p_value: np.ndarray  # sequential p-value of the adjusted estimate

    @classmethod
    def of(cls, cells: np.ndarray, alpha: float, tuning: float) -> Interval:
        c = compare(cells)
        h = half_width(c.variance, c.users, alpha, tuning)
        raw_h = half_width(c.raw_variance, c.users, alpha, tuning)
        p = sequential_p_value(c.adjusted, c.variance, c.users, alpha, tuning)
        return cls(c, alpha, c.adjusted - h, c.adjusted + h, c.estimate - raw_h, c.estimate + raw_h, p)


@dataclass(frozen=True)
class Clock:
    """The ramp and the clock of each experiment, arrays of shape (E,)."""

    step_users: np.ndarray  # challenger users first seen in the current step
    step_min_users: np.ndarray
    in_step_s: np.ndarray
    step_min_seconds: np.ndarray
    last: np.ndarray  # bool: the current step is the last
    running_s: np.ndarray


@dataclass(frozen=True)
class Judgement:
    code: np.ndarray  # (E,) action codes
    primary: Interval
    guardrails: dict[str, Interval]
    harmed: dict[str, np.ndarray]  # guardrail name -> (E,) bool: harm shown
    enough: np.ndarray  # (E,) bool: past the evidence floor with a defined variance
    margin: np.ndarray  # (E,) in reward units: accept share × champion accept rate × reward per accept (NaN: none)
    accept_level: np.ndarray  # (E,) the champion's accepted suggestions per rewarded generation
    loss_ship: np.ndarray  # (E,) expected reward per generation lost by shipping the challenger (NaN: none)
    loss_keep: np.ndarray  # (E,) ... by keeping the champion
    info: dict[str, np.ndarray]  # information-only metric -> (E, 2) each arm's ratio


def expected_loss(mean: np.ndarray, variance: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E[max(0, −d)], E[max(0, d)]) for d ~ N(mean, variance): the loss of shipping and of keeping the champion.

    For X ~ N(μ, σ²), E[max(0, X)] = μ·Φ(μ/σ) + σ·φ(μ/σ) (the normal partial expectation); GrowthBook's
    Bayesian engine reports it as "risk" with a flat prior on the difference. NaN where the variance is not
    positive: no spread is no evidence, and no loss can be read from it.
    """
    from scipy.special import ndtr

    with np.errstate(invalid="ignore", divide="ignore"):
        sd = np.sqrt(np.where(variance > 0, variance, np.nan))
        z = mean / sd
        density = np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)
        keep = mean * ndtr(z) + sd * density
        ship = -mean * ndtr(-z) + sd * density
    return ship, keep


def margin(accept_level: np.ndarray, config: RolloutConfig, share: float | None = None) -> np.ndarray:
    """The reward lost when users accept `share` (default: the configured one) less often, NaN without accepts.

    An accept lost to a reject costs `reward_per_accept` (the reward definition's accept minus reject weight),
    so a share s of the champion's accept rate a is s·a·reward_per_accept in reward per generation. This is
    also how `users_for_changes` prices a -10%/+5%/... change (`analysis.power_view`).
    """
    s = config.non_inferiority_accept_share if share is None else share
    with np.errstate(invalid="ignore"):
        return np.where(accept_level > 0, s * accept_level * config.reward_per_accept, np.nan)


def guardrail_harm(metric: Metric, iv: Interval, config: RolloutConfig) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        if metric.harm == "rise":
            return iv.lo > 0
        if metric.harm == "fall":
            return iv.hi < 0
        level = iv.comparison.level
        if metric.harm == "ratio":  # latency: a tolerance, not a deterioration test (see the module's doc)
            return iv.lo > (config.latency_p95_ratio - 1) * level
        return (iv.lo > (config.length_ratio_high - 1) * level) | (iv.hi < (config.length_ratio_low - 1) * level)


def judge(
    cells: dict[str, np.ndarray],
    srm_alarm: np.ndarray,
    clock: Clock,
    config: RolloutConfig,
    rule: Literal["sequential", "expected_loss"] = "sequential",
) -> Judgement:
    """One action code per experiment; `cells[metric.name]` is (E, steps, 2, MOMENTS).

    `rule="expected_loss"` swaps the primary metric's tests for the expected-loss rule (the bench compares
    the two): a win when shipping loses less than `LOSS_SHARE` x the margin, worse when keeping the champion
    does, and non-inferior at the maximum duration on the win's condition. Guardrails, SRM, the evidence
    floor and the ramp are the same.
    """
    a_primary, a_guard = alphas(config)
    primary = Interval.of(cells[PRIMARY.name], a_primary, config.tuning_n)
    rails = {m.name: Interval.of(cells[m.name], a_guard, config.tuning_n) for m in GUARDRAILS}
    enough = (primary.comparison.arm_users.min(axis=-1) >= MIN_ARM_USERS) & np.isfinite(primary.lo)
    harmed = {
        m.name: guardrail_harm(m, rails[m.name], config)
        & (rails[m.name].comparison.arm_users.min(axis=-1) >= MIN_ARM_USERS)
        for m in GUARDRAILS
    }
    any_harm = np.zeros_like(enough)
    for h in harmed.values():
        any_harm |= h
    with np.errstate(invalid="ignore"):
        accept_level = rails["accepted_rate"].comparison.level
        allowed = margin(accept_level, config)
        worse = primary.hi < 0
        win = primary.lo > 0
        non_inferior = primary.lo > -allowed
        loss_ship, loss_keep = expected_loss(primary.comparison.adjusted, primary.comparison.variance)
        if rule == "expected_loss":
            threshold = LOSS_SHARE * allowed
            win = loss_ship < threshold
            worse = loss_keep < threshold
            non_inferior = win
    over = clock.running_s >= config.max_duration_s
    few = clock.step_users < clock.step_min_users
    # np.select takes the first condition that holds: the precedence of the rules.
    code = np.select(
        [
            srm_alarm,
            few & ~over,
            few & over,
            ~enough & ~over,
            ~enough & over,
            any_harm,
            worse,
            clock.in_step_s < clock.step_min_seconds,
            ~clock.last,
            win,
            over & non_inferior,
            over,
        ],
        [
            FREEZE_SRM, CONTINUE_STEP_USERS, ROLLBACK_STEP_USERS, CONTINUE_EVIDENCE, ROLLBACK_NO_EVIDENCE,
            ROLLBACK_GUARDRAIL, ROLLBACK_WORSE, CONTINUE_MIN_TIME, RAMP, PROMOTE_WIN, PROMOTE_NON_INFERIOR,
            ROLLBACK_INCONCLUSIVE,
        ],  # fmt: skip
        CONTINUE_LAST,
    )
    info = {m.name: compare(cells[m.name]).arm_ratio for m in INFO}
    return Judgement(code, primary, rails, harmed, enough, allowed, accept_level, loss_ship, loss_keep, info)
