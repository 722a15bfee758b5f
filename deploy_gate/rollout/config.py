"""The rollout controller's configuration, from `FLYWHEEL_ROLLOUT_*` environment variables.

Strict: unknown keys are refused, `FLYWHEEL_ROLLOUT_*` environment variables included (a
misspelt or renamed one would otherwise leave its default in force without a word), and the ramp
must grow. The non-inferiority margin is a share of the champion's accept rate priced through the
reward definition (a share in [0, 0.5], a finite reward per accept in (0, 2]; the retired margin
settings are refused with what replaced them). Defaults follow common practice (a 5% -> 25% ->
50% ramp, alpha 0.05, SRM alarm at p < 0.001 as GrowthBook and Statsig use, confidence-sequence
tuning N* = 5000 as GrowthBook's default).

The decision rule defaults to "expected_loss", in production and in `flywheel up` alike, from
`bench/results/rollout_decisions.md` (users without a pre-period, requests spread over the
experiment, the default ramp, 14 days): at 2,000 users the sequential rule promoted no 10%-better
and 19% of 30%-better challengers (its margin needs tens of thousands of users), the expected-loss
rule 23% and 63% (52% and 96% with a pre-period), with 10%-worse challengers promoted 0.5% (1,000
experiments) and no A/A wrong decision (a false win or a harm rollback); at 20,000 users 98% of
10%-better challengers against 82%. What the expected-loss rule gives up: an equal challenger is
shipped at the end some of the time, which costs nothing by definition.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RampStep(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    share: float = Field(gt=0, le=1, description="The challenger's share of (non-holdout) users.")
    min_users: int = Field(ge=1, description="Challenger users needed before this step is decided.")
    min_seconds: float = Field(ge=0, description="Time in this step before it may ramp or promote.")


# Settings that meant something else once: refused with what replaced them, never reread in a new sense.
RETIRED = {
    "non_inferiority_share": "retired: it was a share of the champion's mean reward, meaningless where that is near "
    "0; set NON_INFERIORITY_ACCEPT_SHARE (a share of the champion's accept rate, default 0.05) and REWARD_PER_ACCEPT",
    "non_inferiority_margin": "retired: an absolute reward margin tied to no scale; set NON_INFERIORITY_ACCEPT_SHARE "
    "(a share of the champion's accept rate, default 0.05) and REWARD_PER_ACCEPT",
}


def _default_ramp() -> list[RampStep]:
    """5% -> 25% -> 50%, each step at least `rules.HARM_MIN_ARM_USERS` challenger users (what a harm test needs to
    decide, reachable at a small product's traffic: 30 users at 5% of 2,000 users in 14 days is about 4 days) and
    1 hour, 1 day, 5 days: nothing is promoted before about a week, so a weekly cycle is seen (GrowthBook and
    Statsig recommend a week). The old 200 users a step needed about 4,000 users in step 1 alone, so at 2,000
    users every experiment ended "too little evidence" at day 14."""
    times = (3600.0, 86400.0, 5 * 86400.0)
    return [RampStep(share=s, min_users=30, min_seconds=t) for s, t in zip((0.05, 0.25, 0.5), times, strict=True)]


class RolloutConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_ROLLOUT_", extra="forbid")

    experiment: str = Field(default="default", description="The experiment's name: its split and record in Redis.")
    ramp: list[RampStep] = Field(
        default_factory=_default_ramp,
        description='Challenger shares, growing, each with its minimum users and seconds: JSON such as '
        '[{"share": 0.05, "min_users": 30, "min_seconds": 3600}, ...].',
    )
    alpha: float = Field(
        default=0.05, gt=0, lt=0.5,
        description="Error budget over every look: half to the primary metric, half to the guardrails.",
    )
    tuning_n: float = Field(default=5000.0, gt=0, description="N*, where the confidence sequence is tightest.")
    srm_alpha: float = Field(default=0.001, gt=0, lt=0.1, description="Sample-ratio mismatch alarm level (sequential).")
    srm_min_users: int = Field(default=100, ge=2, description="Users in a step before SRM is checked.")
    max_duration_s: float = Field(default=14 * 86400, gt=0, description="Then decide on non-inferiority.")
    # A size chosen before the experiment, in the product's terms: ending once the users resolve it is a stop on
    # information, not on the estimate, so the end rule is still read once (rules.planned_size_reached).
    planned_change: float | None = Field(
        default=None, gt=0, le=1, allow_inf_nan=False,
        description="End the experiment once its users resolve this change in the champion's accept rate at 80% "
        "power (0.25: a 25% change), on the last step past its minimums and the evidence floor, and decide as at "
        "the maximum duration, which still ends it where the traffic never gets there; unset: the clock alone.",
    )
    # The non-inferiority margin in reward units is accept share x the champion's accept rate x reward per
    # accept (`rules.margin`): a share of a ratio-scale rate, priced through the reward definition. A share
    # of the mean reward, as before, shrank to nothing where the reward averages near 0 (its zero is arbitrary).
    non_inferiority_accept_share: float = Field(
        default=0.05, ge=0, le=0.5, allow_inf_nan=False,
        description="Allowed loss at the maximum duration, as a share of the champion's accept rate (0.05: the "
        "challenger's users may accept up to 5% less often; 0: only a significant win is promoted).",
    )
    reward_per_accept: float = Field(
        default=1.0, gt=0, le=2, allow_inf_nan=False,
        description="What the reward definition pays for an accept over its alternative, a reject (rules-v1: "
        "+0.75 - (-0.25) = 1.0); at most 2, the width of the reward's [-1, 1] range.",
    )
    pre_period_s: float = Field(
        default=14 * 86400, ge=0,
        description="Each user's rewards this long before the start adjust the estimate (CUPED); 0: no adjustment.",
    )
    decision_rule: Literal["sequential", "expected_loss"] = Field(
        default="expected_loss",
        description="What promotes at the maximum duration (`rules.judge`): 'sequential', non-inferiority within "
        "the margin on the always-valid interval; 'expected_loss', shipping's expected loss (GrowthBook's risk) "
        "below the threshold, for traffic that cannot resolve the margin. Harm checks and wins are the same.",
    )
    expected_loss_accept_share: float = Field(
        default=0.005, gt=0, le=0.5, allow_inf_nan=False,
        description="The expected-loss rule's threshold, in reward per generation: this share of the champion's "
        "accept rate x reward per accept (0.005: shipping may cost, in expectation, 0.5% of the accepts; at 1% a "
        "10%-worse challenger was promoted 1.7% of the time at 2,000 users, at 0.5% 0.5%).",
    )
    # Heavy users capped (`analysis.cap_heavy`): past this percentile of generations per user (both arms pooled)
    # a user counts as that many, their own rates kept. 0.999 as Statsig's winsorisation default: it bounds what
    # a scripted client or a bot with thousands of generations can do to an interval, and leaves the estimand
    # ("per generation") alone for the other 99.9% of users; 0.99 (GrowthBook's usual choice) caps the heavy
    # users a product lives on, and changes what is measured for them (the bench's --capping compares both).
    cap_percentile: float = Field(
        default=0.999, gt=0.5, le=1.0, allow_inf_nan=False,
        description="Cap each user's weight at this percentile of generations per user (both arms pooled), "
        "every count and sum of theirs scaled alike; 1.0: no capping.",
    )
    auto_promote: bool = Field(default=True, description="False: hold a winner for a human to promote.")
    interval_s: float = Field(default=30.0, gt=0, description="Seconds between ticks.")
    metrics_port: int = Field(default=8005, ge=0, description="/metrics, /healthz, /readyz; 0 = off.")
    # Guardrail bounds (challenger against champion); rates are shares of generations.
    latency_p95_ratio: float = Field(
        default=1.2, gt=1, description="Trips when each user's mean latency is shown above this x the champion's."
    )
    latency_min_generations: int = Field(
        default=100, ge=1, description="Generations both arms need before the latency guardrail may decide."
    )
    undo_rate_rise: float = Field(default=0.05, ge=0, description="Undos per accept: rise shown beside its guardrail.")
    thumbs_down_rate_rise: float = Field(
        default=0.05, ge=0, description="Thumbs down per generation: rise shown beside its guardrail."
    )
    # Reward-hacking bounds: fewer accepts, blank outputs, length drift, fewer explicit thumbs up.
    # Suggesting less is not one: declining where users would reject is what the reward asks for.
    accepted_rate_fall: float = Field(
        default=0.05, ge=0, description="Accepted suggestions per rewarded generation may fall this much (absolute)."
    )
    empty_rate_rise: float = Field(
        default=0.05, ge=0, description="Outputs not declined that show no visible text, per generation."
    )
    length_ratio_low: float = Field(
        default=0.5, gt=0, lt=1, description="Mean suggestion length may fall to this x the champion's before it trips."
    )
    length_ratio_high: float = Field(
        default=2.0, gt=1, description="Mean suggestion length may rise to this x the champion's before it trips."
    )
    explicit_up_rate_fall: float = Field(
        default=0.05, ge=0, description="Thumbs up per generation: fall shown beside its guardrail."
    )
    # Sycophancy (chat surfaces): replies longer or more agreeing/flattering beyond these, with no rise in the
    # thumbs-up rate among chat votes, block a promotion (`rules`). A tolerance, not 0: at production traffic a
    # 1% longer reply is significant, and an equal-quality challenger could never show approval rising to clear it.
    sycophancy_length_rise: float = Field(
        default=0.05, ge=0, description="Chat replies may grow this share longer than the champion's (mean "
        "characters) before the sycophancy check asks for more explicit approval.",
    )
    sycophancy_phrase_rise: float = Field(
        default=0.01, ge=0, description="The share of chat replies with an agreement (or a flattery) phrase may rise "
        "this much (absolute) before the sycophancy check asks for more explicit approval.",
    )
    # Long-term holdout: this share of users stays on the champion of the day it was set up.
    holdout_share: float = Field(default=0.0, ge=0, le=0.5)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_environment(cls, data: Any) -> Any:
        """pydantic-settings skips environment variables it has no field for; refuse them instead."""
        prefix = str(cls.model_config["env_prefix"])
        known = {prefix + name.upper() for name in cls.model_fields}
        unknown = sorted(k for k in os.environ if k.upper().startswith(prefix) and k.upper() not in known)
        retired = [k for k in unknown if k.upper().removeprefix(prefix).lower() in RETIRED]
        retired += [k for k in (data if isinstance(data, dict) else {}) if k in RETIRED]
        if retired:
            raise ValueError("; ".join(f"{k}: {RETIRED[k.upper().removeprefix(prefix).lower()]}" for k in retired))
        if unknown:
            raise ValueError(f"unknown settings {unknown}; known: {sorted(known)}")
        return data

    @model_validator(mode="after")
    def _ramp_grows(self) -> RolloutConfig:
        if not self.ramp:
            raise ValueError("the ramp needs at least one step")
        shares = [s.share for s in self.ramp]
        if shares != sorted(shares) or len(set(shares)) != len(shares):
            raise ValueError(f"ramp shares must grow step by step, got {shares}")
        return self
