"""The analysis of one experiment and the decision it leads to: a pure function of per-user data.

Statistics, with the user as the unit (users are what the split randomises; one user's
generations are correlated, so a per-generation interval is too narrow):

- each arm's satisfaction is Σ reward / Σ generations over its users, a ratio metric whose
  variance comes from the delta method over users (`deploy_gate.stats.RatioStats`);
- the challenger-minus-champion difference has a fixed-sample interval and an always-valid
  one, the asymptotic confidence sequence (`deploy_gate.stats.sequential_interval`); every
  decision uses the sequential one, because the controller looks after every batch;
- guardrail rates (undo, thumbs down, accepted, empty, ...) are ratio metrics too, and trip only
  when the sequential interval of their difference is beyond the bound, so noise in a small
  first step does not roll a good challenger back;
- declining is not a guardrail: the reward prices a decline at 0 and a reject below it, so a
  policy that declines where users would reject is doing the right thing. What it must not do is
  lose accepts: accepted suggestions per generation is the guardrail, and the shown and decline
  rates are reported beside the guardrails for information only (kind "info", never tripping);
- sample-ratio mismatch: users first seen in the current step, by the arm they were first
  served by, against the step's planned shares (Pearson chi-square, alarm at p < srm_alpha).

A user moved from the champion to the challenger by a ramp step contributes to both arms
(their generations under each); the SRM check counts them once, by their first arm.

What must hold: no decision is taken before the step's minimum challenger users; no ramp or
promotion before its minimum time (a harmful challenger is rolled back as soon as the sample
shows it, without waiting out the clock).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

import polars as pl

from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.data import Aggregates
from deploy_gate.rollout.models import (
    AnalysisView,
    ArmView,
    DecisionAction,
    DecisionView,
    DifferenceView,
    EffectView,
    GuardrailView,
    SrmView,
)
from deploy_gate.stats import Difference, RatioStats, check_srm, ratio_difference, sequential_interval

METHOD = (
    "delta method over per-user sums (Deng et al. 2018); confidence sequence "
    "(Waudby-Smith et al. 2023 eq. 9, Howard et al. 2021), N* = {n:g}"
)


@dataclass(frozen=True)
class StepContext:
    index: int
    share: float
    min_users: int
    min_seconds: float
    entered_at: datetime
    last: bool


def ratio_stats(users: pl.DataFrame, arm: str, y: str, x: str = "generations") -> RatioStats:
    """Per-user (x, y) sums of `arm` as mergeable sufficient statistics (one polars pass)."""
    part = users.filter(pl.col("arm") == arm)
    if part.is_empty():
        return RatioStats()
    xs, ys = pl.col(x).cast(pl.Float64), pl.col(y).cast(pl.Float64)
    row = part.select(
        pl.len().alias("n"), xs.sum().alias("sx"), ys.sum().alias("sy"), (xs * xs).sum().alias("sxx"),
        (ys * ys).sum().alias("syy"), (xs * ys).sum().alias("sxy"),
    ).row(0, named=True)
    return RatioStats(int(row["n"]), row["sx"], row["sy"], row["sxx"], row["syy"], row["sxy"])


def arm_view(users: pl.DataFrame, arm: str, level: float) -> ArmView:
    s = ratio_stats(users, arm, "reward_sum", "reward_n")
    part = users.filter(pl.col("arm") == arm)
    return ArmView(
        users=part.height,
        generations=int(part["generations"].sum()) if part.height else 0,
        mean=s.ratio,
        ci=s.confidence_interval(level),
    )


def _seq(diff: Difference, n: int, config: RolloutConfig) -> tuple[float, float]:
    return sequential_interval(diff, n, config.alpha, config.tuning_n)


def _rate_guardrail(
    users: pl.DataFrame,
    name: str,
    column: str,
    bound: float,
    direction: str,
    kind: str,
    config: RolloutConfig,
    per: str = "generations",
) -> GuardrailView:
    """A rate guardrail (`column` per `per`): trips when the sequential interval of (challenger − champion)
    is beyond the bound."""
    a, b = ratio_stats(users, "champion", column, per), ratio_stats(users, "challenger", column, per)
    diff = ratio_difference(a, b, config.alpha)
    ok = True
    if diff is not None:
        lo, hi = _seq(diff, a.n + b.n, config)
        ok = not (lo > bound) if direction == "rise" else not (hi < -bound)
    text = (
        f"challenger - champion <= {bound:g} (sequential interval)"
        if direction == "rise"
        else f"challenger - champion >= -{bound:g} (sequential interval)"
    )
    return GuardrailView(name=name, champion=a.ratio, challenger=b.ratio, bound=text, ok=ok, kind=kind)  # type: ignore[arg-type]


def guardrails(agg: Aggregates, users: pl.DataFrame, config: RolloutConfig) -> list[GuardrailView]:
    c = config
    out = []
    p_a, p_b = agg.latency_p95_ms.get("champion"), agg.latency_p95_ms.get("challenger")
    enough = min(agg.latency_n.get("champion", 0), agg.latency_n.get("challenger", 0)) >= c.latency_min_generations
    out.append(
        GuardrailView(
            name="latency_p95_ms", champion=p_a, challenger=p_b,
            bound=f"challenger <= {c.latency_p95_ratio:g} x champion (from {c.latency_min_generations} generations)",
            ok=not (enough and p_a is not None and p_b is not None and p_b > c.latency_p95_ratio * p_a),
        )
    )
    out.append(_rate_guardrail(users, "error_rate", "errors", c.error_rate_rise, "rise", "guardrail", c))
    out.append(_rate_guardrail(users, "undo_rate", "undone", c.undo_rate_rise, "rise", "guardrail", c))
    out.append(
        _rate_guardrail(users, "thumbs_down_rate", "thumbs_down", c.thumbs_down_rate_rise, "rise", "guardrail", c)
    )
    # Reward hacking: a policy can raise its reward by dropping suggestions users would have
    # accepted (declining costs nothing, a reject costs 0.25), by answering blank instead of
    # declining, or by drifting in length; explicit thumbs are the one signal it cannot shape.
    # Accepts are known once a generation's reward is, so they are counted per rewarded generation.
    out.append(
        _rate_guardrail(
            users, "accepted_rate", "accepted", c.accepted_rate_fall, "fall", "reward_hacking", c, per="reward_n"
        )
    )
    out.append(_rate_guardrail(users, "empty_rate", "empty", c.empty_rate_rise, "rise", "reward_hacking", c))
    out.append(
        _rate_guardrail(users, "explicit_up_rate", "thumbs_up", c.explicit_up_rate_fall, "fall", "reward_hacking", c)
    )
    # Length is of what is suggested: a declined generation shows nothing and is not a short one.
    la = ratio_stats(users, "champion", "length_sum", "suggested")
    lb = ratio_stats(users, "challenger", "length_sum", "suggested")
    ok = True
    if la.ratio and lb.ratio is not None and min(la.sx, lb.sx) >= c.latency_min_generations:
        ok = c.length_ratio_low <= lb.ratio / la.ratio <= c.length_ratio_high
    out.append(
        GuardrailView(
            name="mean_length_chars", champion=la.ratio, challenger=lb.ratio,
            bound=f"{c.length_ratio_low:g} x champion <= challenger <= {c.length_ratio_high:g} x champion",
            ok=ok, kind="reward_hacking",
        )
    )
    out += [_info(users, "shown_rate", "shown"), _info(users, "declined_rate", "declined")]
    return out


def _info(users: pl.DataFrame, name: str, column: str) -> GuardrailView:
    """A rate per generation shown beside the guardrails, never tripping: how much each arm suggests."""
    a, b = ratio_stats(users, "champion", column), ratio_stats(users, "challenger", column)
    return GuardrailView(
        name=name, champion=a.ratio, challenger=b.ratio, bound="information (never trips)", ok=True, kind="info"
    )


def srm(users: pl.DataFrame, step: StepContext, config: RolloutConfig) -> SrmView:
    """Users first seen (in either arm) during this step, by their first arm, against the step's shares."""
    shares = [1 - step.share, step.share]
    firsts = (
        users.filter(pl.col("arm").is_in(["champion", "challenger"]))
        .sort("first_seen")
        .group_by("user_id")
        .agg(pl.col("arm").first(), pl.col("first_seen").first())
        .filter(pl.col("first_seen") >= step.entered_at)
    )
    observed = [firsts.filter(pl.col("arm") == a).height for a in ("champion", "challenger")]
    p = check_srm(observed, shares) if sum(observed) >= config.srm_min_users else 1.0
    return SrmView(observed=observed, expected_shares=shares, p_value=p, alarm=p < config.srm_alpha)


def analyse(
    agg: Aggregates, step: StepContext, config: RolloutConfig, *, started_at: datetime, now: datetime
) -> AnalysisView | None:
    """The analysis and decision; None while the challenger has no reward (nothing to decide on)."""
    users = agg.users.filter(pl.col("arm").is_in(["champion", "challenger"]))
    challenger = users.filter(pl.col("arm") == "challenger")
    if challenger.is_empty() or int(challenger["reward_n"].sum()) == 0:
        return None
    level = 1 - config.alpha
    arms = {a: arm_view(users, a, level) for a in ("champion", "challenger")}
    a = ratio_stats(users, "champion", "reward_sum", "reward_n")
    b = ratio_stats(users, "challenger", "reward_sum", "reward_n")
    diff = ratio_difference(a, b, config.alpha)
    diff_view = None
    seq: tuple[float, float] | None = None
    if diff is not None:
        seq = _seq(diff, a.n + b.n, config)
        diff_view = DifferenceView(
            estimate=diff.estimate, ci=diff.ci, sequential_ci=seq, alpha=config.alpha,
            method=METHOD.format(n=config.tuning_n), p_value=diff.p_value,
        )
    srm_view = srm(users, step, config)
    rails = guardrails(agg, users, config)
    flags = _flags(users, diff, config)
    step_users = challenger.filter(pl.col("first_seen") >= step.entered_at).height
    action, reason = decide(
        step, config, srm_view, rails, seq, step_users=step_users,
        in_step_s=(now - step.entered_at).total_seconds(), running_s=(now - started_at).total_seconds(),
    )
    return AnalysisView(
        reward_version=agg.reward_version, arms=arms, difference=diff_view, srm=srm_view, guardrails=rails,
        decision=DecisionView(action=action, reason=reason, at=now), flags=flags,
    )


def _flags(users: pl.DataFrame, diff: Difference | None, config: RolloutConfig) -> list[str]:
    """Reward up while explicit satisfaction (thumbs up among explicit votes) goes down: a hacking sign."""
    ea = ratio_stats(users, "champion", "thumbs_up", "explicit_n")
    eb = ratio_stats(users, "challenger", "thumbs_up", "explicit_n")
    if diff is not None and diff.estimate > 0 and ea.ratio is not None and eb.ratio is not None and eb.ratio < ea.ratio:
        return [
            f"reward_up_explicit_down: reward {diff.estimate:+.3f} while explicit satisfaction "
            f"{eb.ratio - ea.ratio:+.3f} (thumbs up among explicit votes)"
        ]
    return []


def decide(
    step: StepContext,
    config: RolloutConfig,
    srm_view: SrmView,
    rails: list[GuardrailView],
    seq: tuple[float, float] | None,
    *,
    step_users: int,
    in_step_s: float,
    running_s: float,
) -> tuple[DecisionAction, str]:
    """The rules, in order of precedence (the module's doc says what must hold)."""
    if srm_view.alarm:
        return "freeze", (
            f"sample ratio mismatch: users {srm_view.observed} against planned shares "
            f"{[round(s, 3) for s in srm_view.expected_shares]} (p = {srm_view.p_value:.2g} < {config.srm_alpha:g}); "
            "the ramp is frozen until someone finds why"
        )
    if step_users < step.min_users:
        if running_s >= config.max_duration_s:  # no experiment runs forever; too little evidence never promotes
            return "rollback", (
                f"step {step.index + 1} saw {step_users} of its {step.min_users} challenger users by the maximum "
                "duration: too little evidence to keep the challenger"
            )
        return "continue", f"step {step.index + 1}: {step_users} of {step.min_users} challenger users so far"
    broken = [g.name for g in rails if not g.ok]
    if broken:
        return "rollback", f"guardrail tripped: {', '.join(broken)}"
    if seq is not None and seq[1] < 0:
        return "rollback", f"challenger is worse: sequential interval of the difference [{seq[0]:.3f}, {seq[1]:.3f}]"
    if in_step_s < step.min_seconds:
        return "continue", f"step {step.index + 1}: {math.ceil(step.min_seconds - in_step_s)}s left of its minimum time"
    if not step.last:
        return "ramp", f"step {step.index + 1} done ({step_users} challenger users, guardrails hold)"
    if seq is not None and seq[0] > 0:
        return "promote", f"significant win: sequential interval of the difference [{seq[0]:.3f}, {seq[1]:.3f}]"
    if running_s >= config.max_duration_s:
        margin = config.non_inferiority_margin
        if seq is not None and seq[0] > -margin:
            return "promote", f"non-inferior at the maximum duration: sequential lower bound {seq[0]:.3f} > -{margin:g}"
        return "rollback", f"not shown non-inferior (margin {margin:g}) by the maximum duration"
    return "continue", "last step: waiting for a significant result or the maximum duration"


def cumulative_effect(users: pl.DataFrame, config: RolloutConfig) -> tuple[int, float | None, EffectView | None]:
    """Holdout users against today's champion: (holdout users, holdout mean, champion − holdout)."""
    h = ratio_stats(users, "holdout", "reward_sum", "reward_n")
    c = ratio_stats(users, "champion", "reward_sum", "reward_n")
    diff = ratio_difference(h, c, config.alpha)
    effect = EffectView(estimate=diff.estimate, ci=diff.ci) if diff is not None else None
    return h.n, h.ratio, effect


def series(
    rewards: pl.DataFrame | None, bucket: str, config: RolloutConfig
) -> list[tuple[datetime, str, int, float | None, tuple[float, float] | None]]:
    """(bucket start, arm, users, mean, interval) per time bucket of `window_start`, users as the unit."""
    if rewards is None or rewards.is_empty():
        return []
    per_user = (
        rewards.with_columns(pl.col("window_start").dt.truncate(bucket).alias("start"))
        .group_by("start", "arm", "user_id")
        .agg(pl.len().cast(pl.Float64).alias("x"), pl.col("reward").sum().alias("y"))
    )
    sums = per_user.group_by("start", "arm").agg(
        pl.len().alias("n"), pl.col("x").sum().alias("sx"), pl.col("y").sum().alias("sy"),
        (pl.col("x") ** 2).sum().alias("sxx"), (pl.col("y") ** 2).sum().alias("syy"),
        (pl.col("x") * pl.col("y")).sum().alias("sxy"),
    ).sort("start", "arm")
    out = []
    for r in sums.iter_rows(named=True):
        s = RatioStats(int(r["n"]), r["sx"], r["sy"], r["sxx"], r["syy"], r["sxy"])
        out.append((r["start"], str(r["arm"]), s.n, s.ratio, s.confidence_interval(1 - config.alpha)))
    return out
