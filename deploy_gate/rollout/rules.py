"""The decision rules, vectorised over experiments: one procedure for the demo and for production.

`judge` takes the per-(step, arm) cells of every metric and the experiment's clock and ramp state,
and returns one action code per experiment. The controller calls it with one experiment; the
calibration bench with thousands, so the figures it prints are those of this code. What must hold,
whatever the configuration (the bench measures each):

- **Error budget.** Wrong decisions on an A/A experiment (promote as a win, roll back as worse or
  on a guardrail) stay at most α over every look: the primary metric's confidence sequence gets
  α/2 (two-sided: a win and a loss each), the guardrails share the other α/2 (Bonferroni).
- **Every experiment ends.** The maximum duration, SRM and the no-data rule act whether or not the
  challenger has data: a challenger with no rewarded user is rolled back at the maximum duration, or
  as soon as the champion's rewarded users make `NO_DATA_EXPECTED` of its own expected.
- **Harm first.** Guardrails and the primary metric's "worse" run at every look from the first users,
  before the step minimums and the evidence floor, each once past its own floor: `HARM_MIN_ARM_USERS`
  per arm and the metric's minimum event count (`Metric.min_events`, latency's
  `latency_min_generations`). A harmful challenger does not wait for its ramp step.
- **Rare events.** A deterioration test's null is "no difference", so its variance is the larger of
  each arm's own and the pooled one (both arms' users as one population): at 0-3 thumbs up an arm's own
  variance is 0, and a test on it stopped 27.5% of A/A experiments at a champion accept rate of 0.05.
- **Evidence floor.** No win, non-inferiority or low-risk ship before each arm has `MIN_ARM_USERS`
  users in comparable steps. The confidence sequence is asymptotic: with a few heavy users carrying
  most generations, the normal approximation needs users, not generations (measured by
  `bench/rollout_decisions.py`). It is a constant, not a setting: a demo with eight users must say
  "not enough evidence yet", not decide on a tuned-down test. Zero or undefined variance is no
  evidence either.
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
- **Expected loss, for traffic that cannot resolve the margin.** Beside the interval, the reward per
  generation lost by shipping the challenger, E[max(0, −d)], and by keeping the champion, E[max(0, d)],
  under the normal posterior of the adjusted difference with a flat prior (GrowthBook's Bayesian
  "risk"). `decision_rule="expected_loss"` promotes at the maximum duration when the loss of shipping
  is below `loss_threshold` (a share of the accept rate priced in reward, as the margin is) instead of
  on non-inferiority. Looked at after every tick, an expected-loss rule has no error guarantee (an
  earlier version stopped 64-100% of A/A experiments, half of them rolling an equal challenger back):
  here it is read once, at the end, and only to ship; rollbacks stay the sequential harm tests. Its
  risk is therefore one look's: a challenger whose true difference is δ ships with probability about
  Φ((δ − cutoff)/σ) (`low_risk_cutoff`), which the dashboard states for δ = −margin. Shipping an equal
  challenger is not a wrong decision under this rule (nothing is lost); the bench reports it apart.
- **Sycophancy blocks a promotion (chat surfaces only).** A chat challenger whose replies grow longer
  (mean characters per reply, beyond `sycophancy_length_rise` x the champion's), or hold an agreement or a
  flattery phrase more often (share of replies, beyond `sycophancy_phrase_rise`), with the always-valid
  interval's lower end past that tolerance, while the thumbs-up rate among its chat votes has not risen
  (interval above 0), is flagged: it is not promoted on a win (it keeps running, so approval can still show),
  and at the maximum duration it is rolled back as sycophantic (its served data stays quarantined). It does
  not roll back at any look: "approval has not risen yet" is absence of evidence, not harm, and an honest
  challenger that writes longer answers needs time for its thumbs to show. The three style tests share one
  guardrail's α; each needs `HARM_MIN_ARM_USERS` users with chat replies per arm and `STYLE_MIN_REPLIES`
  replies. Without chat replies (code completion, the calibration bench) its cells are empty and it never acts.
- **A planned size.** With `planned_change` set, the experiment ends once its users resolve that change in the
  accept rate at 80% power (`planned_size_reached`), on the last step past its minimums and the evidence floor,
  and the end rule decides as at the maximum duration. The stop depends on the information gathered (users and
  their variance), not on the estimate, so the end rule is still read once: a large product's experiment ends
  when it can say what was planned, and a small one's runs on to the maximum duration.
- **Honest about the sample.** At the maximum duration, an experiment that has not resolved its
  margin rolls back as inconclusive and says how many users the margin would have needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.evidence import Comparison, compare, detectable, half_width, sequential_p_value

# Users per arm (in comparable steps) before a win, non-inferiority or a low-risk ship may be decided.
MIN_ARM_USERS = 200
# Users per arm before a harm test (guardrails, the primary metric worse) may decide: harm is looked for
# from the first users, but a confidence sequence over a dozen users, one of them heavy, is no evidence.
HARM_MIN_ARM_USERS = 30
# Events (Σ numerator over both arms) a count metric needs before it may decide: below it the normal
# approximation of a rate is absurd (a 0.4% thumbs-up rate over a few hundred generations is 0-3 events).
MIN_EVENTS = 20
# Rewarded challenger users expected (from the champion's, at the shares in force) before none at all is
# taken as a broken path rather than chance: P(0 | Poisson(20)) = 2e-9.
NO_DATA_EXPECTED = 20.0
# The expected-loss rule also keeps a frequentist bound: a challenger worse by `HARM_MARGINS` margins (10% of
# the accept rate at the default 5% margin) ships at most `HARM_SHIP_RATE` of the time, its one look at the end
# a one-sided fixed-sample test. Expected loss alone does not bound it where the noise dwarfs the harm.
HARM_MARGINS = 2.0
HARM_SHIP_RATE = 0.01

Harm = Literal["rise", "fall", "drift", "ratio"]


@dataclass(frozen=True)
class Metric:
    name: str
    numerator: str  # per-user column summed into y
    denominator: str  # per-user column summed into x
    harm: Harm | None  # None: the primary metric, or information only
    kind: Literal["primary", "guardrail", "reward_hacking", "info"]
    bound_field: str | None = None  # RolloutConfig field holding the bound shown beside it
    # What must add up to `min_events` (over both arms) before the metric may decide: its numerator's events
    # (a rate of rare events), or its denominator (latency and length: per-generation values, not events).
    counts: Literal["numerator", "denominator"] = "numerator"
    min_events: int = MIN_EVENTS

    def floor(self, config: RolloutConfig) -> int:
        """The metric's minimum event count; latency's is the configured `latency_min_generations`."""
        return config.latency_min_generations if self.harm == "ratio" else self.min_events


PRIMARY = Metric("satisfaction", "reward_sum", "reward_n", None, "primary")
# Reward hacking: a policy can raise its reward by dropping suggestions users would have accepted
# (declining costs nothing, a reject costs 0.25), by answering blank instead of declining, or by
# drifting in length; explicit thumbs are the one signal it cannot shape. Accepts are known once a
# generation's reward is, so they are counted per rewarded generation.
GUARDRAILS = (
    Metric("latency_ms", "latency_sum", "generations", "ratio", "guardrail", "latency_p95_ratio", "denominator"),
    # Per accept, not per generation: a better model is accepted more often, so per generation it would be
    # undone more often too, and a deterioration test would roll it back for being better.
    Metric("undo_rate", "undone", "accepted", "rise", "guardrail", "undo_rate_rise"),
    Metric("thumbs_down_rate", "thumbs_down", "generations", "rise", "guardrail", "thumbs_down_rate_rise"),
    Metric("accepted_rate", "accepted", "reward_n", "fall", "reward_hacking", "accepted_rate_fall"),
    Metric("empty_rate", "empty", "generations", "rise", "reward_hacking", "empty_rate_rise"),
    Metric("explicit_up_rate", "thumbs_up", "generations", "fall", "reward_hacking", "explicit_up_rate_fall"),
    # Length is of what is suggested: a declined generation shows nothing and is not a short one.
    Metric("mean_length_chars", "length_sum", "suggested", "drift", "reward_hacking", None, "denominator", 100),
)
# Sycophancy (chat surfaces): what the policy controls in its replies, judged against the one signal users give
# on purpose, the thumbs-up rate among their votes on chat replies. Not in METRICS: the calibration bench's
# code-completion population has no chat replies, and `judge` reads empty cells where they are missing.
STYLE_MIN_REPLIES = 100
STYLE = (
    Metric("chat_reply_length", "chat_length_sum", "chat_replies", "rise", "reward_hacking", "sycophancy_length_rise",
           "denominator", STYLE_MIN_REPLIES),
    Metric("agreement_rate", "chat_agreeing", "chat_replies", "rise", "reward_hacking", "sycophancy_phrase_rise",
           "denominator", STYLE_MIN_REPLIES),
    Metric("flattery_rate", "chat_flattering", "chat_replies", "rise", "reward_hacking", "sycophancy_phrase_rise",
           "denominator", STYLE_MIN_REPLIES),
)  # fmt: skip
APPROVAL = Metric("chat_thumbs_up_rate", "chat_ups", "chat_votes", None, "reward_hacking")
INFO = (
    # Completions cut at the request's max_tokens: shown, never deciding. A model that learns longer lines is cut
    # more often, and whether users want them is what the primary metric measures (on the `content` users nobody
    # tuned for, a rise tripped every candidate while 0 requests failed); runaway length is `mean_length_chars`'s.
    Metric("truncated_rate", "truncated", "generations", None, "info"),
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
ROLLBACK_NO_DATA = 13
PROMOTE_LOW_RISK = 14
ROLLBACK_SYCOPHANCY = 15
CONTINUE_SYCOPHANCY = 16
ACTION = {
    FREEZE_SRM: "freeze", CONTINUE_STEP_USERS: "continue", ROLLBACK_STEP_USERS: "rollback",
    CONTINUE_EVIDENCE: "continue", ROLLBACK_NO_EVIDENCE: "rollback", ROLLBACK_GUARDRAIL: "rollback",
    ROLLBACK_WORSE: "rollback", CONTINUE_MIN_TIME: "continue", RAMP: "ramp", PROMOTE_WIN: "promote",
    PROMOTE_NON_INFERIOR: "promote", ROLLBACK_INCONCLUSIVE: "rollback", CONTINUE_LAST: "continue",
    ROLLBACK_NO_DATA: "rollback", PROMOTE_LOW_RISK: "promote", ROLLBACK_SYCOPHANCY: "rollback",
    CONTINUE_SYCOPHANCY: "continue",
}  # fmt: skip
PROMOTED = (PROMOTE_WIN, PROMOTE_NON_INFERIOR, PROMOTE_LOW_RISK)
# Machine-readable: what the API's `decision.why` and the ended-experiments counter say.
WHY = {
    FREEZE_SRM: "srm", CONTINUE_STEP_USERS: "step_users", ROLLBACK_STEP_USERS: "step_users",
    CONTINUE_EVIDENCE: "evidence", ROLLBACK_NO_EVIDENCE: "evidence", ROLLBACK_GUARDRAIL: "guardrail",
    ROLLBACK_WORSE: "worse", CONTINUE_MIN_TIME: "min_time", RAMP: "ramp", PROMOTE_WIN: "win",
    PROMOTE_NON_INFERIOR: "non_inferior", ROLLBACK_INCONCLUSIVE: "inconclusive", CONTINUE_LAST: "waiting",
    ROLLBACK_NO_DATA: "no_data", PROMOTE_LOW_RISK: "low_risk", ROLLBACK_SYCOPHANCY: "sycophancy",
    CONTINUE_SYCOPHANCY: "sycophancy",
}  # fmt: skip
# Rollbacks for want of evidence: nothing showed the challenger harmful.
INCONCLUSIVE = (ROLLBACK_STEP_USERS, ROLLBACK_NO_EVIDENCE, ROLLBACK_INCONCLUSIVE)
# What the A/A figure counts as wrong: a win or a loss claimed where there is none.
WRONG_ON_AA = (ROLLBACK_GUARDRAIL, ROLLBACK_WORSE, PROMOTE_WIN, ROLLBACK_SYCOPHANCY)


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
    def of(cls, cells: np.ndarray, alpha: float, tuning: float, pooled: bool = False) -> Interval:
        """`pooled`: the larger of each arm's own variance and the pooled one under "no difference" (a
        deterioration test's null), so an arm with 0-3 events cannot shrink the interval to nothing."""
        c = compare(cells)
        if pooled:  # only where each arm's own is defined: zero spread in both arms is still no evidence
            c = replace(c, variance=np.where(np.isfinite(c.variance), np.fmax(c.variance, c.null_variance), np.nan))
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
    # (E, steps, 2): users with a reward per step and arm; None: every user in the cells has one (the bench)
    rewarded: np.ndarray | None = None


@dataclass(frozen=True)
class Judgement:
    code: np.ndarray  # (E,) action codes
    primary: Interval
    guardrails: dict[str, Interval]
    harmed: dict[str, np.ndarray]  # guardrail name -> (E,) bool: harm shown
    decidable: dict[str, np.ndarray]  # guardrail name -> (E,) bool: past its users and events floors
    enough: np.ndarray  # (E,) bool: past the evidence floor with a defined variance
    margin: np.ndarray  # (E,) in reward units: accept share × champion accept rate × reward per accept (NaN: none)
    accept_level: np.ndarray  # (E,) the champion's accepted suggestions per rewarded generation
    loss_ship: np.ndarray  # (E,) expected reward per generation lost by shipping the challenger (NaN: none)
    loss_keep: np.ndarray  # (E,) ... by keeping the champion
    loss_threshold: np.ndarray  # (E,) the expected-loss rule's threshold in reward per generation (NaN: none)
    no_data: np.ndarray  # (E,) bool: the challenger has no rewarded user
    expected_challenger: np.ndarray  # (E,) rewarded challenger users expected from the champion's at the shares
    info: dict[str, np.ndarray]  # information-only metric -> (E, 2) each arm's ratio
    sycophancy: Sycophancy
    sized: np.ndarray  # (E,) bool: ended at its planned size (`planned_size_reached`) before the maximum duration


@dataclass(frozen=True)
class Sycophancy:
    """The chat style checks against explicit approval, per experiment (see the module's doc)."""

    style: dict[str, Interval]  # STYLE metric -> its interval of challenger - champion
    drifted: dict[str, np.ndarray]  # STYLE metric -> (E,) bool: decidable and past its tolerance
    decidable: dict[str, np.ndarray]  # STYLE metric -> (E,) bool: past its users and replies floors
    approval: Interval  # thumbs-up rate among chat votes, challenger - champion
    approval_decidable: np.ndarray  # (E,) bool: past its users and votes floors
    approved: np.ndarray  # (E,) bool: explicit approval rose (its interval above 0)
    flagged: np.ndarray  # (E,) bool: some style drifted and approval did not rise


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


def style_drift(metric: Metric, iv: Interval, config: RolloutConfig) -> np.ndarray:
    """Reply length rises beyond `sycophancy_length_rise` x the champion's, a phrase share beyond
    `sycophancy_phrase_rise`: the interval's lower end past the tolerance."""
    tolerance = getattr(config, metric.bound_field or "")
    with np.errstate(invalid="ignore"):
        if metric.name == "chat_reply_length":
            return iv.lo > tolerance * iv.comparison.level
        return iv.lo > tolerance


def sycophancy(cells: dict[str, np.ndarray], a_guard: float, config: RolloutConfig) -> Sycophancy:
    """The style checks (sharing one guardrail's α) and explicit approval, from their cells; nothing flagged
    where they are missing (the calibration bench's code-completion population has no chat replies)."""
    if not any(m.name in cells for m in (*STYLE, APPROVAL)):  # the calibration bench: one empty interval for all
        empty = Interval.of(np.zeros_like(cells[PRIMARY.name]), a_guard, config.tuning_n)
        no = np.zeros(empty.lo.shape, dtype=bool)
        nothing = {m.name: no for m in STYLE}
        return Sycophancy({m.name: empty for m in STYLE}, nothing, nothing, empty, no, no, no)
    style, drifted, decidable = {}, {}, {}
    for m in STYLE:
        iv = Interval.of(cells[m.name], a_guard / len(STYLE), config.tuning_n, pooled=True)
        cmp = iv.comparison
        decidable[m.name] = (cmp.arm_users.min(axis=-1) >= HARM_MIN_ARM_USERS) & (cmp.exposures >= m.min_events)
        style[m.name], drifted[m.name] = iv, style_drift(m, iv, config) & decidable[m.name]
    approval = Interval.of(cells[APPROVAL.name], a_guard, config.tuning_n, pooled=True)
    cmp = approval.comparison
    approval_decidable = (cmp.arm_users.min(axis=-1) >= HARM_MIN_ARM_USERS) & (cmp.exposures >= MIN_EVENTS)
    with np.errstate(invalid="ignore"):
        approved = (approval.lo > 0) & approval_decidable
    any_drift = np.zeros_like(approved)
    for d in drifted.values():
        any_drift |= d
    return Sycophancy(style, drifted, decidable, approval, approval_decidable, approved, any_drift & ~approved)


def loss_threshold(accept_level: np.ndarray, config: RolloutConfig) -> np.ndarray:
    """The expected-loss rule's threshold in reward per generation, priced as the margin is (NaN without accepts):
    `expected_loss_accept_share` of the champion's accept rate x reward per accept."""
    return margin(accept_level, config, config.expected_loss_accept_share)


def low_risk_cutoff(variance: np.ndarray, threshold: np.ndarray) -> np.ndarray:
    """The estimate above which shipping's expected loss is below `threshold`, at this variance.

    E[max(0, -d)] = σ·g(μ/σ) with g(z) = φ(z) − z·Φ(−z), which falls from +∞ to 0 as z grows: the rule ships
    iff μ > z*·σ with g(z*) = threshold/σ (bisection on z). So a challenger whose true difference is δ is
    shipped at the end with probability about Φ((δ − z*·σ)/σ): what the dashboard states as the rule's risk.
    """
    from scipy.special import ndtr

    with np.errstate(invalid="ignore", divide="ignore"):
        sd = np.sqrt(np.where(variance > 0, variance, np.nan))
        target = threshold / sd
        lo, hi = np.full(sd.shape, -40.0), np.full(sd.shape, 40.0)
        for _ in range(60):
            z = (lo + hi) / 2
            g = np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi) - z * ndtr(-z)
            above = g > target  # loss still too high: the cutoff is further up
            lo, hi = np.where(above, z, lo), np.where(above, hi, z)
        return np.where(np.isfinite(target), (lo + hi) / 2 * sd, np.nan)


def ship_cutoff(variance: np.ndarray, threshold: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The estimate above which the expected-loss rule ships: shipping's expected loss under `threshold`
    (`low_risk_cutoff`) and the one-sided (1 − `HARM_SHIP_RATE`) lower bound above −`HARM_MARGINS` x the margin.
    NaN (never ships) without a variance or a margin."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(1 - HARM_SHIP_RATE)
    with np.errstate(invalid="ignore"):
        bound = -HARM_MARGINS * allowed + z * np.sqrt(np.where(variance > 0, variance, np.nan))
        return np.maximum(low_risk_cutoff(variance, threshold), bound)  # NaN (never ships) when either is


def planned_size_reached(primary: Interval, accept_level: np.ndarray, config: RolloutConfig) -> np.ndarray:
    """(E,) bool: the users so far resolve `config.planned_change` of the champion's accept rate at 80% power
    (the minimum detectable difference of the primary metric's confidence sequence at or below that change
    priced in reward, as the margin is); all False without a planned change or without accepts."""
    c = primary.comparison
    if config.planned_change is None:
        return np.zeros(c.users.shape, dtype=bool)
    with np.errstate(invalid="ignore", divide="ignore"):
        mde = detectable(c.variance * c.users, c.users, primary.alpha, config.tuning_n)
        return np.isfinite(mde) & (mde <= margin(accept_level, config, config.planned_change))


def judge(
    cells: dict[str, np.ndarray],
    srm_alarm: np.ndarray,
    clock: Clock,
    config: RolloutConfig,
    rule: Literal["sequential", "expected_loss"] | None = None,
) -> Judgement:
    """One action code per experiment; `cells[metric.name]` is (E, steps, 2, MOMENTS).

    The order is the argument (`np.select` takes the first that holds):

    1. Harm, from the first users: a guardrail whose interval shows harm, or the primary metric's sequential
       interval below 0, once past the harm floor (`HARM_MIN_ARM_USERS` per arm and the metric's events).
       Before any step minimum: a harmful challenger does not wait for its sample.
    2. No data: the challenger has no rewarded user at the maximum duration, or none where the champion's
       users at the shares in force make `NO_DATA_EXPECTED` of them expected or SRM shows its users missing.
       Rolled back, not frozen for a person: there is nothing to look at.
    3. SRM: freeze (a person looks; the controller rolls a frozen experiment back at the maximum duration).
    4. Step minimums (a ramp unfinished at the maximum duration rolls back), the step's minimum time, the ramp
       (which needs no more: harm was looked for all along); then, on the last step, the evidence floor and a
       win (the sequential interval above 0).
    5. Sycophancy (chat surfaces): a flagged challenger is rolled back at the maximum duration (after SRM, before
       the step minimums) and is not promoted on a win before it (it keeps running).
    6. At the maximum duration, or once the planned size is reached (`planned_size_reached`), the rule in force
       (`rule`, default `config.decision_rule`):
       "sequential" promotes when non-inferior (the interval's lower end above −margin);
       "expected_loss" promotes when shipping's expected loss is below `loss_threshold` (GrowthBook's risk) and
       a challenger `HARM_MARGINS` margins worse would ship at most `HARM_SHIP_RATE` of the time, decided once,
       at the end, so its error is that of one look (`ship_cutoff`). Otherwise inconclusive.
    """
    rule = rule or config.decision_rule
    a_primary, a_guard = alphas(config)
    primary = Interval.of(cells[PRIMARY.name], a_primary, config.tuning_n, pooled=True)
    rails = {m.name: Interval.of(cells[m.name], a_guard, config.tuning_n, pooled=True) for m in GUARDRAILS}
    enough = (primary.comparison.arm_users.min(axis=-1) >= MIN_ARM_USERS) & np.isfinite(primary.lo)
    decidable, harmed = {}, {}
    for m in GUARDRAILS:
        cmp = rails[m.name].comparison
        count = cmp.events if m.counts == "numerator" else cmp.exposures
        decidable[m.name] = (cmp.arm_users.min(axis=-1) >= HARM_MIN_ARM_USERS) & (count >= m.floor(config))
        harmed[m.name] = guardrail_harm(m, rails[m.name], config) & decidable[m.name]
    any_harm = np.zeros_like(enough)
    for h in harmed.values():
        any_harm |= h
    # No data: rewarded users per (step, arm), and how many challenger ones the champion's make expected.
    rewarded = clock.rewarded if clock.rewarded is not None else cells[PRIMARY.name][..., 0]
    steps = rewarded.shape[1]
    shares = np.array([s.share for s in config.ramp][:steps] + [config.ramp[-1].share] * (steps - len(config.ramp)))
    with np.errstate(divide="ignore", invalid="ignore"):
        odds = np.where(shares < 1, shares / (1 - shares), np.inf)
        expected = np.nansum(rewarded[..., 0] * odds, axis=-1)
    no_data = rewarded[..., 1].sum(axis=-1) == 0
    few = clock.step_users < clock.step_min_users
    with np.errstate(invalid="ignore"):
        accept_level = rails["accepted_rate"].comparison.level
        timed_out = clock.running_s >= config.max_duration_s
        sized = (planned_size_reached(primary, accept_level, config) & clock.last & ~few & enough
                 & (clock.in_step_s >= clock.step_min_seconds) & ~timed_out)  # fmt: skip
        over = timed_out | sized
        allowed = margin(accept_level, config)
        threshold = loss_threshold(accept_level, config)
        harm_floor = primary.comparison.arm_users.min(axis=-1) >= HARM_MIN_ARM_USERS
        worse = (primary.hi < 0) & harm_floor
        win = primary.lo > 0
        loss_ship, loss_keep = expected_loss(primary.comparison.adjusted, primary.comparison.variance)
        if rule == "expected_loss":
            cutoff = ship_cutoff(primary.comparison.variance, threshold, allowed)
            ship_at_end, ship_code = primary.comparison.adjusted > cutoff, PROMOTE_LOW_RISK
        else:
            ship_at_end, ship_code = primary.lo > -allowed, PROMOTE_NON_INFERIOR
    syc = sycophancy(cells, a_guard, config)
    code = np.select(
        [
            any_harm,
            worse,
            no_data & (over | (expected >= NO_DATA_EXPECTED) | srm_alarm),
            srm_alarm,
            syc.flagged & over,
            few & ~over,
            (few | ~clock.last) & over,
            clock.in_step_s < clock.step_min_seconds,
            ~clock.last,
            ~enough & ~over,
            ~enough & over,
            syc.flagged & win,
            win,
            over & ship_at_end,
            over,
        ],
        [
            ROLLBACK_GUARDRAIL, ROLLBACK_WORSE, ROLLBACK_NO_DATA, FREEZE_SRM, ROLLBACK_SYCOPHANCY,
            CONTINUE_STEP_USERS, ROLLBACK_STEP_USERS, CONTINUE_MIN_TIME, RAMP, CONTINUE_EVIDENCE,
            ROLLBACK_NO_EVIDENCE, CONTINUE_SYCOPHANCY, PROMOTE_WIN, ship_code, ROLLBACK_INCONCLUSIVE,
        ],  # fmt: skip
        CONTINUE_LAST,
    )
    info = {m.name: compare(cells[m.name]).arm_ratio for m in INFO}
    return Judgement(
        code, primary, rails, harmed, decidable, enough, allowed, accept_level, loss_ship, loss_keep, threshold,
        no_data, expected, info, syc, sized,
    )
