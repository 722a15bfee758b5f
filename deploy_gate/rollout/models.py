"""The `GET /api/experiment` and `/api/experiment/series` answers (the contract with the dashboard).

Field names and shapes are the contract: change them only together with the dashboard.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

ExperimentState = Literal["ramping", "holding", "promoted", "rolled_back", "frozen", "idle"]
DecisionAction = Literal["continue", "ramp", "promote", "rollback", "freeze"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RampView(_Model):
    share: float
    min_users: int
    min_seconds: float
    entered_at: datetime | None = None
    left_at: datetime | None = None


class ArmView(_Model):
    """One arm over all its users: mean reward per generation and its 1 - alpha interval, users as the unit."""

    users: int
    generations: int
    mean: float | None
    ci: tuple[float, float] | None


class StratumView(_Model):
    """One ramp step's users (by the step they were first seen in) and its own difference."""

    step: int
    users: list[int]  # champion, challenger
    estimate: float | None


class DifferenceView(_Model):
    """Challenger minus champion, stratified by ramp step. What decides is `sequential_ci` (always valid,
    regression-adjusted) at `alpha`; `p_value` is the sequential p-value of the same test. `ci` is the
    fixed-sample interval of the unadjusted estimate, shown for reference only (not valid when peeked at)."""

    estimate: float
    ci: tuple[float, float]
    sequential_ci: tuple[float, float]
    alpha: float
    method: str
    p_value: float | None = None
    adjusted_estimate: float | None = None
    unadjusted_sequential_ci: tuple[float, float] | None = None
    variance_reduction: float | None = None  # 1 - Var(adjusted) / Var(unadjusted)
    decisive: bool = True  # False below the evidence floor: the interval is shown, not yet trusted or acted on
    strata: list[StratumView] = []
    # Reward per generation lost by shipping the challenger / keeping the champion, E[max(0, ∓d)] under the
    # normal posterior of the adjusted difference (GrowthBook's "risk"); shown, not decided on (`rules`).
    expected_loss_ship: float | None = None
    expected_loss_keep: float | None = None
    # Challenger / champion - 1 on each arm's mean over all its users, with its fixed-sample 1 - alpha interval
    # (delta method, as gbstats' relative effect: `evidence.relative_lift`); None without a positive champion
    # mean. What GrowthBook and Statsig users read first; shown, not decided on.
    relative_estimate: float | None = None
    relative_ci: tuple[float, float] | None = None


class SrmPeriod(_Model):
    """A span of time with one challenger share in force; `until` None: still in force."""

    share: float
    since: datetime
    until: datetime | None = None


class SrmView(_Model):
    """Users first seen since `since`, by their first arm, against the shares in force (the current period);
    `p_value` is the sequential test's over every period since the test was (re-)armed."""

    observed: list[int]
    expected_shares: list[float]
    p_value: float
    alarm: bool
    since: datetime | None = None
    periods: int = 1
    method: str = ""


class GuardrailView(_Model):
    """One check of the challenger against the champion. Kind "info" is a rate shown for information
    (shown, declined): its `ok` is always true and it never decides anything."""

    name: str
    champion: float | None
    challenger: float | None
    bound: str
    ok: bool
    kind: Literal["guardrail", "reward_hacking", "info"] = "guardrail"
    ci: tuple[float, float] | None = None  # always-valid interval of challenger - champion, at `alpha`
    alpha: float | None = None


class SycophancyView(_Model):
    """The chat sycophancy check (`rules`): replies longer, more agreeing or more flattering without a rise in
    the thumbs-up rate among chat votes. "flagged" blocks a promotion; "not_enough_evidence" says what it needs.
    Absent on an experiment without chat replies. Its figures are the `guardrails` rows it names."""

    status: Literal["flagged", "clear", "not_enough_evidence"]
    reason: str
    checks: list[str] = []  # names of its rows in `guardrails`


class DecisionView(_Model):
    action: DecisionAction
    reason: str
    at: datetime
    # A rollback for want of evidence, not for harm shown: the version's served data is not quarantined.
    inconclusive: bool = False
    why: str = ""  # the rule that decided, machine-readable ("guardrail", "worse", "no_data", "win", ...)


class PowerView(_Model):
    """What this experiment's traffic can resolve, before and during it (80% power, the deciding alpha)."""

    users: int  # users compared so far (both arms)
    min_arm_users: int  # no test decides before each arm has this many
    per_user_sd: float | None  # of the adjusted difference, per user (s in s / sqrt(N))
    detectable_now: float | None  # smallest true difference resolved at today's users
    users_projected: int | None  # at the maximum duration, at the arrival rate so far
    detectable_projected: float | None
    champion_level: float | None
    margin: float | None  # reward units: margin_share x champion_accept_rate x reward_per_accept
    margin_share: float  # of the champion's accept rate
    users_for_margin: int | None  # users needed to resolve a difference of the margin
    # "-10%": users needed for a 10% change in the champion's accept rate, priced in reward as the margin is
    users_for_changes: dict[str, int | None]
    note: str
    champion_accept_rate: float | None = None  # accepted suggestions per rewarded generation
    reward_per_accept: float | None = None
    margin_reachable: bool | None = None  # users_for_margin within the users projected at the maximum duration


class DurationPlanView(_Model):
    """The duration calculator (`deploy_gate.rollout.duration.plan`, as `flywheel gate plan` prints it) at a
    traffic and accept rate: given, or measured on the running experiment (`measured`)."""

    users_per_day: float
    accept_rate: float
    measured: bool  # the traffic and accept rate are the running experiment's, not the caller's
    reachable: bool  # the ramp's minimums fit in the maximum duration
    ramp_days: float
    max_days: float
    users: int  # users the maximum duration brings
    promoted_if_margin_worse: float
    promoted_if_10pct_worse: float
    lines: list[str]


class RuleView(_Model):
    """The decision rule in force (`RolloutConfig.decision_rule`) and what it risks at today's precision."""

    name: Literal["sequential", "expected_loss"]
    summary: str  # how it decides, in words
    threshold: float | None = None  # expected_loss: shipping's expected loss must be below this (reward/generation)
    ship_above: float | None = None  # expected_loss: the estimate above which it would ship, at today's variance
    # The probability that a challenger worse by the margin is promoted at the maximum duration: at today's
    # precision, and at the precision the traffic brings by then (None: no variance or margin yet).
    margin_worse_promoted: float | None = None
    margin_worse_promoted_projected: float | None = None
    note: str = ""


class SegmentView(_Model):
    """One surface's users (those with rewards there, in the arm that first served them): reward per generation
    per arm, the difference with its fixed-sample interval and the relative lift. Informational: nothing is
    decided on a segment (several surfaces and every look would multiply the false alarms; the decision is
    on all users, whose primary metric pools the surfaces)."""

    surface: str
    users: list[int]  # champion, challenger
    means: list[float | None]  # champion, challenger
    difference: float | None
    ci: tuple[float, float] | None
    relative_estimate: float | None = None
    relative_ci: tuple[float, float] | None = None


class CappingView(_Model):
    """Heavy users capped: each user's generations (and every count and sum of theirs with them) scaled down to
    the cap, the `percentile` of generations per user over both arms pooled, so the user's own rates stand."""

    percentile: float
    cap_generations: float | None  # None: too few users to set one (nothing capped)
    users_capped: int


class AnalysisView(_Model):
    unit: Literal["user"] = "user"
    metric: str = "satisfaction"
    reward_version: str | None
    arms: dict[str, ArmView]
    difference: DifferenceView | None
    srm: SrmView
    guardrails: list[GuardrailView]
    decision: DecisionView
    power: PowerView | None = None
    # Visible warnings that are not (yet) a rollback, e.g. "reward_up_explicit_down", "no_data".
    flags: list[str] = []
    no_data: bool = False  # the challenger has no rewarded user yet (its traffic or rewards may not arrive)
    rule: RuleView | None = None
    capping: CappingView | None = None  # heavy users' weight capped (`RolloutConfig.cap_percentile`)
    segments: list[SegmentView] = []  # by surface; shown, never decided on
    sycophancy: SycophancyView | None = None  # chat surfaces only


class TimelineEntry(_Model):
    at: datetime
    event: str
    by: str


class EffectView(_Model):
    estimate: float
    ci: tuple[float, float]


class HoldoutView(_Model):
    share: float
    version: str
    users: int
    mean: float | None
    cumulative_effect: EffectView | None


class ExperimentView(_Model):
    experiment: str
    state: ExperimentState
    champion: str | None
    challenger: str | None
    holdout_version: str | None
    share: float
    ramp: list[RampView]
    step: int
    analysis: AnalysisView | None
    timeline: list[TimelineEntry]
    holdout: HoldoutView | None
    srm_periods: list[SrmPeriod] = []
    plan: PowerView | None = None  # before the challenger has rewards: what the traffic could resolve
    bucket: str = "1h"  # the time chart's bucket, following the experiment's length


class SeriesBucket(_Model):
    start: datetime
    arm: str
    users: int
    mean: float | None
    ci: tuple[float, float] | None


class SeriesView(_Model):
    buckets: list[SeriesBucket]
