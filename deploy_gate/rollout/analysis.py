"""The analysis of one experiment and the decision it leads to: a pure function of per-user data.

This module turns the lake's per-user rows into the cells `deploy_gate.rollout.rules.judge` reads
(the same rules the calibration bench measures over thousands of simulated experiments), and the
judgement into the views the API and dashboard show, each decision with the reason it was taken.

- **The user is the unit**, counted in the arm they were first served by: a user moved to the
  challenger by a later ramp step stays a champion user (their time on the challenger is left out),
  so each arm holds exactly the users the split randomised to it.
- **Ramp steps are strata**: a user belongs to the step they were first seen in (`step_starts`).
- **Regression adjustment**: each user's covariate is their reward in the pre-experiment period
  above the pre-period's rate (`Aggregates.pre_rate`); 0 for a user new to the product.
- **SRM** runs over `SrmPeriod`s: spans of time with one share in force, as the split recorded it
  (a manual ramp or a failed first ramp starts a period at the share actually set), re-armed after
  a freeze by starting afresh at the resume.
- Declining is not a guardrail: the reward prices a decline at 0 and a reject below it. Accepted
  suggestions per rewarded generation is; the shown and decline rates are reported for information.

What must hold: every experiment is analysed from its first look, whether or not the challenger has
data, so the maximum duration, SRM and the no-data rollback act on a challenger that never gets traffic
or rewards; harm is judged from the first users (past each metric's floor), before any step minimum, and
a harmful challenger is rolled back as soon as the sample shows it; no ramp or promotion before the
step's minimum users, the evidence floor and the step's minimum time; every decision states why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from statistics import NormalDist

import numpy as np
import polars as pl

from deploy_gate.rollout import rules
from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.data import Aggregates
from deploy_gate.rollout.evidence import (
    MOMENTS,
    Comparison,
    compare,
    detectable,
    moments,
    relative_lift,
    srm_log_bayes_factor,
    users_to_resolve,
)
from deploy_gate.rollout.models import (
    AnalysisView,
    ArmView,
    CappingView,
    DecisionAction,
    DecisionView,
    DifferenceView,
    EffectView,
    GuardrailView,
    PowerView,
    RuleView,
    SegmentView,
    SrmPeriod,
    SrmView,
    StratumView,
    SycophancyView,
)
from deploy_gate.stats import RatioStats, ratio_difference, t_difference

METHOD = (
    "per-user ratio, delta method (Deng et al. 2018), stratified by ramp step, regression-adjusted on each "
    "user's pre-experiment reward (CUPED, Deng et al. 2013); confidence sequence (Waudby-Smith et al. 2023 "
    "eq. 9), N* = {n:g}"
)
SRM_METHOD = "sequential Dirichlet-multinomial test (Lindon & Malek 2022), prior concentration 100"
ARMS = ("champion", "challenger")
CHAT_METRICS = (*rules.STYLE, rules.APPROVAL)


@dataclass(frozen=True)
class StepContext:
    index: int
    share: float
    min_users: int
    min_seconds: float
    entered_at: datetime
    last: bool


def first_arm_users(agg: Aggregates) -> pl.DataFrame:
    """One row per user, in the arm they were first served by (champion or challenger)."""
    users = agg.users.filter(pl.col("arm").is_in(list(ARMS)))
    if users.is_empty():
        return users
    return users.sort("first_seen", "arm", "user_id").unique("user_id", keep="first", maintain_order=True)


def both_arms(agg: Aggregates) -> int:
    """Users with rows in both the champion's and the challenger's arm (GrowthBook's and Statsig's warning)."""
    users = agg.users.filter(pl.col("arm").is_in(list(ARMS)))
    return 0 if users.is_empty() else users.height - users["user_id"].n_unique()


def _stratum(users: pl.DataFrame, step_starts: list[datetime]) -> pl.DataFrame:
    """Index of the last step that had started when the user was first seen (0 for anyone earlier)."""
    expr = pl.lit(0, pl.Int64)
    for i, start in enumerate(step_starts[1:], start=1):
        expr = pl.when(pl.col("first_seen") >= start).then(pl.lit(i, pl.Int64)).otherwise(expr)
    return users.with_columns(expr.alias("stratum"))


def cells(users: pl.DataFrame, steps: int, pre_rate: float | None) -> dict[str, np.ndarray]:
    """Each metric's moments per (step, arm), shape (1, steps, 2, MOMENTS), from users with a `stratum`."""
    metrics = (*rules.METRICS, *CHAT_METRICS)
    out = {m.name: np.zeros((1, steps, 2, MOMENTS)) for m in metrics}
    if users.is_empty():
        return out
    z = (pl.col("pre_reward_sum") - (pre_rate or 0.0) * pl.col("pre_reward_n")) if pre_rate is not None else pl.lit(0.0)
    chat_user = pl.col("chat_replies").fill_null(0) > 0
    aggs = []
    for m in metrics:
        x = pl.col(m.denominator).cast(pl.Float64).fill_null(0.0)
        y = pl.col(m.numerator).cast(pl.Float64).fill_null(0.0)
        zz = z if m is rules.PRIMARY else pl.lit(0.0)
        parts = (x, y, x * x, y * y, x * y, zz, zz * zz, x * zz, y * zz)
        # The chat checks' unit is a user with chat replies: one who only used code completion is not one.
        n = chat_user.sum() if m in CHAT_METRICS else pl.len()
        aggs += [n.cast(pl.Float64).alias(f"{m.name}:0")]
        aggs += [p.sum().alias(f"{m.name}:{k}") for k, p in enumerate(parts, start=1)]
    table = users.with_columns(pl.col("arm").replace_strict({"champion": 0, "challenger": 1}).alias("a"))
    for row in table.group_by("stratum", "a").agg(aggs).iter_rows(named=True):
        for m in metrics:
            out[m.name][0, row["stratum"], row["a"]] = [row[f"{m.name}:{k}"] for k in range(MOMENTS)]
    return out


def srm(users: pl.DataFrame, periods: list[SrmPeriod], config: RolloutConfig) -> SrmView:
    """The sequential SRM test over `periods`: Bayes factors of successive periods multiply."""
    log_bf, counts = 0.0, [0, 0]
    for p in periods:
        span = users.filter(pl.col("first_seen") >= p.since)
        if p.until is not None:
            span = span.filter(pl.col("first_seen") < p.until)
        counts = [span.filter(pl.col("arm") == a).height for a in ARMS]
        log_bf += float(srm_log_bayes_factor(np.array(counts), np.array([1 - p.share, p.share])))
    total = _counted(users, periods)
    p_value = min(1.0, math.exp(-log_bf)) if log_bf > 0 else 1.0
    current = periods[-1]
    alarm = p_value < config.srm_alpha and total >= config.srm_min_users
    return SrmView(
        observed=counts, expected_shares=[1 - current.share, current.share], p_value=p_value, alarm=alarm,
        since=current.since, periods=len(periods), method=SRM_METHOD,
    )  # fmt: skip


def _counted(users: pl.DataFrame, periods: list[SrmPeriod]) -> int:
    if not periods:
        return 0
    span = users.filter(pl.col("first_seen") >= periods[0].since)
    if periods[-1].until is not None:
        span = span.filter(pl.col("first_seen") < periods[-1].until)
    return span.height


def analyse(
    agg: Aggregates,
    step: StepContext,
    config: RolloutConfig,
    *,
    started_at: datetime,
    now: datetime,
    step_starts: list[datetime] | None = None,
    srm_periods: list[SrmPeriod] | None = None,
) -> AnalysisView:
    """The analysis and decision, at every look: a challenger without users or rewards is judged too (no data).

    Without `step_starts` every user is in one stratum; without `srm_periods` the SRM test runs over the
    current step at its planned share.
    """
    users = first_arm_users(agg)
    challenger = users.filter(pl.col("arm") == "challenger")
    starts = step_starts or [started_at]
    users = _stratum(users, starts)
    capped, capping = cap_heavy(users, config)
    c = cells(capped, len(starts), agg.pre_rate)
    periods = srm_periods or [SrmPeriod(share=step.share, since=step.entered_at)]
    srm_view = srm(users, periods, config)
    step_users = challenger.filter(pl.col("first_seen") >= step.entered_at).height
    clock = rules.Clock(
        step_users=np.array([step_users]), step_min_users=np.array([step.min_users]),
        in_step_s=np.array([(now - step.entered_at).total_seconds()]), step_min_seconds=np.array([step.min_seconds]),
        last=np.array([step.last]), running_s=np.array([(now - started_at).total_seconds()]),
        rewarded=rewarded(users, len(starts)),
    )  # fmt: skip
    j = rules.judge(c, np.array([srm_view.alarm]), clock, config)
    code = int(j.code[0])
    level = 1 - config.alpha
    power = power_view(j, config, running_s=(now - started_at).total_seconds())
    rails = guardrails(j, config)
    diff = difference_view(j, c, config)
    action: DecisionAction = rules.ACTION[code]  # type: ignore[assignment]
    reason = explain(code, j, step, srm_view, rails, power, step_users, config, clock)
    decision = DecisionView(action=action, reason=reason, at=now, inconclusive=code in rules.INCONCLUSIVE,
                            why=rules.WHY[code])  # fmt: skip
    arms = {
        a: ArmView(
            users=int(users.filter(pl.col("arm") == a).height),
            generations=int(users.filter(pl.col("arm") == a)["generations"].sum()),
            mean=_num(j.primary.comparison.arm_ratio[0, i]),
            ci=_normal_ci(j.primary.comparison.arm_ratio[0, i], j.primary.comparison.arm_variance[0, i], level),
        )
        for i, a in enumerate(ARMS)
    }
    no_data = bool(j.no_data[0])
    flags = _flags(users, diff)
    syc = None
    if int(users["chat_replies"].fill_null(0).sum()) > 0:  # chat surfaces only: code completion is untouched
        syc, syc_rows = sycophancy_view(j, config)
        rails += syc_rows
        if syc.status == "flagged":
            flags.append(f"sycophancy: {syc.reason}")
            if decision.why != "sycophancy":
                decision.reason += f"; sycophancy flagged (no promotion while it holds): {syc.reason}"
    both = both_arms(agg)
    if both:  # counted in their first arm (the split moved them, or assignment is not sticky): say so
        flags.append(f"users_in_both_arms: {both} users were served by both arms; each is counted in the arm that "
                     "served them first (a ramp moves some champion users; more than that means assignment leaks)")
    if no_data and (now - started_at).total_seconds() >= config.ramp[0].min_seconds:
        flags.append(no_data_text(challenger.height, j, config))
    return AnalysisView(
        reward_version=agg.reward_version, arms=arms, difference=diff, srm=srm_view, guardrails=rails,
        decision=decision, power=power, flags=flags, no_data=no_data, rule=rule_view(j, power, config), sycophancy=syc,
        capping=capping, segments=segments(agg, users, config),
    )  # fmt: skip


# What a user's weight scales: every count and sum of theirs the metrics read (the pre-period's with them, so the
# covariate keeps its relation to the outcome), never who they are, when they came or their arm.
_UNSCALED = ("arm", "user_id", "first_seen", "stratum")


def cap_heavy(users: pl.DataFrame, config: RolloutConfig) -> tuple[pl.DataFrame, CappingView | None]:
    """Heavy users capped (GrowthBook's and Statsig's capping, for a ratio metric): a user with more generations
    than the `cap_percentile` of generations per user, over both arms pooled, counts as that many, every count
    and sum of theirs scaled by the same factor.

    Why their weight and not their values: the metrics are ratios (reward per generation), and capping a
    user's reward sum alone would cap the positive tail of a signed reward and not its negative one; scaling
    keeps each user's own rates (accepts per generation, reward per generation) and bounds how much of the
    estimate one user (a scripted client, a bot) can carry. Both arms are capped at one pooled cap, so an A/A
    stays an A/A; the estimand moves from "per generation" towards "per user" only past the cap.
    Below 1 / (1 - percentile) users the percentile is the heaviest user: nothing is capped. None: off (1.0).
    """
    p = config.cap_percentile
    if p >= 1.0:
        return users, None
    if users.is_empty():
        return users, CappingView(percentile=p, cap_generations=None, users_capped=0)
    cap = users["generations"].cast(pl.Float64).quantile(p, interpolation="higher")
    if cap is None or cap <= 0:
        return users, CappingView(percentile=p, cap_generations=None, users_capped=0)
    gens = pl.col("generations").cast(pl.Float64)
    factor = pl.when(gens > cap).then(cap / gens).otherwise(1.0)
    scaled = [c for c, t in users.schema.items() if c not in _UNSCALED and t.is_numeric()]
    out = users.with_columns([(pl.col(c).cast(pl.Float64) * factor).alias(c) for c in scaled])
    capped = int(users.filter(gens > cap).height)
    return out, CappingView(percentile=p, cap_generations=float(cap), users_capped=capped)


def segments(agg: Aggregates, users: pl.DataFrame, config: RolloutConfig) -> list[SegmentView]:
    """Reward per generation by surface, each user in the arm that first served them (`users`), steps pooled and
    unadjusted: what GrowthBook's and Statsig's dimension breakdowns show. Not decided on (`SegmentView`)."""
    seg = agg.segments
    if seg is None or seg.is_empty() or users.is_empty():
        return []
    # Sorted so that the sums below add in one order whatever order the lake's files were read in.
    seg = seg.join(users.select("arm", "user_id"), on=["arm", "user_id"], how="semi").sort("arm", "user_id", "surface")
    out = []
    for surface in sorted(seg["surface"].unique().to_list()):
        part = seg.filter(pl.col("surface") == surface)
        m = np.zeros((1, 1, 2, MOMENTS))
        for i, arm in enumerate(ARMS):
            a = part.filter(pl.col("arm") == arm)
            m[0, 0, i] = moments(a["reward_n"].cast(pl.Float64).to_numpy(), a["reward_sum"].to_numpy())
        cmp = compare(m)
        ratio, var = cmp.arm_ratio[0], cmp.arm_variance[0]
        rel = relative_lift(float(ratio[0]), float(var[0]), float(ratio[1]), float(var[1]), config.alpha)
        out.append(SegmentView(
            surface=surface or "(none)", users=[int(m[0, 0, i, 0]) for i in range(2)],
            means=[_num(ratio[0]), _num(ratio[1])], difference=_num(cmp.estimate[0]),
            ci=_normal_ci(float(cmp.estimate[0]), float(cmp.raw_variance[0]), 1 - config.alpha),
            relative_estimate=rel[0] if rel else None, relative_ci=rel[1] if rel else None,
        ))  # fmt: skip
    return out


def rewarded(users: pl.DataFrame, steps: int) -> np.ndarray:
    """Users with a reward per (step, arm), shape (1, steps, 2): what the no-data rule counts."""
    out = np.zeros((1, steps, 2))
    if users.is_empty():
        return out
    table = users.filter(pl.col("reward_n") > 0).group_by("stratum", "arm").len()
    for row in table.iter_rows(named=True):
        out[0, row["stratum"], ARMS.index(row["arm"])] = row["len"]
    return out


def no_data_text(challenger_users: int, j: rules.Judgement, config: RolloutConfig) -> str:
    """The no-data alarm: the challenger has no rewarded user; how many the champion's made expected."""
    return (f"no_data: the challenger has {challenger_users} users and none with a reward, where the champion's "
            f"rewarded users at the shares in force make {float(j.expected_challenger[0]):.1f} expected; its "
            f"traffic or its rewards do not reach the lake (rolled back at {rules.NO_DATA_EXPECTED:g} expected or at "
            f"the maximum duration, {config.max_duration_s:g}s)")  # fmt: skip


def _planned(config: RolloutConfig) -> str:
    """How an experiment ends, in a rule's summary."""
    if config.planned_change is None:
        return " (the maximum duration)"
    return (f" (once its users resolve the planned {config.planned_change:.0%} change in the accept rate, or at the "
            "maximum duration)")  # fmt: skip


def rule_view(j: rules.Judgement, power: PowerView, config: RolloutConfig) -> RuleView:
    """The rule in force and the chance it promotes a challenger worse by the margin, now and at the end."""
    from scipy.special import ndtr

    var = float(j.primary.comparison.variance[0])
    margin = float(j.margin[0])
    projected = power.users_projected
    n = float(j.primary.comparison.users[0])
    end_var = var * n / projected if projected and n > 0 else math.nan
    if config.decision_rule == "expected_loss":
        t = float(j.loss_threshold[0])
        cut = float(rules.ship_cutoff(np.array([var]), np.array([t]), np.array([margin]))[0])
        end_cut = float(rules.ship_cutoff(np.array([end_var]), np.array([t]), np.array([margin]))[0])

        def shipped(v: float, c: float) -> float | None:
            p = float(ndtr((-margin - c) / math.sqrt(v))) if v > 0 and math.isfinite(c + margin) else math.nan
            return _num(p)

        now, end = shipped(var, cut), shipped(end_var, end_cut)
        summary = (f"expected loss: promotes on a significant win at any look; at the end{_planned(config)}, when the "
                   f"expected loss of shipping (GrowthBook's risk) is below {_g(t)} reward per generation "
                   f"({config.expected_loss_accept_share:.1%} of the champion's accept rate x "
                   f"{config.reward_per_accept:g}) and a challenger {rules.HARM_MARGINS:g} margins worse would ship "
                   f"at most {rules.HARM_SHIP_RATE:.0%} of the time; harm rolls back at any look")  # fmt: skip
        risk = (f"a challenger worse by the margin ({_g(margin)}) would be promoted with probability "
                f"{_pct(now)} at today's precision, {_pct(end)} at the maximum duration's")  # fmt: skip
        return RuleView(name="expected_loss", summary=summary, threshold=_num(t), ship_above=_num(cut),
                        margin_worse_promoted=now, margin_worse_promoted_projected=end, note=risk)  # fmt: skip
    summary = (f"sequential: promotes on a significant win at any look, or at the end{_planned(config)} when the "
               f"always-valid interval's lower end is above -{_g(margin)} (the margin); harm rolls back at any look")
    a = j.primary.alpha / 2
    risk = (f"a challenger worse by the margin is promoted with probability at most {a:.2%} (one side of the "
            f"primary metric's alpha), at any traffic; the price is that a margin the traffic cannot resolve ends "
            f"inconclusive")  # fmt: skip
    return RuleView(name="sequential", summary=summary, margin_worse_promoted=a, margin_worse_promoted_projected=a,
                    note=risk)  # fmt: skip


def _g(v: float) -> str:
    return f"{v:.3g}" if math.isfinite(v) else "none (no accepts yet)"


def _pct(p: float | None) -> str:
    return "unknown (no variance yet)" if p is None else f"{p:.1%}"


def plan(agg: Aggregates, config: RolloutConfig, *, running_s: float) -> PowerView | None:
    """Before the challenger has rewards: what the experiment could resolve, judged from the champion's users.

    The champion's users, split in two alternately, stand in for an equal challenger; the minimum detectable
    difference and the users each target needs follow from their per-user variance, as during the experiment.
    """
    users = first_arm_users(agg).filter(pl.col("arm") == "champion")
    if users.height < 4:
        return None
    halves = users.with_columns(
        pl.when(pl.int_range(pl.len()) % 2 == 0).then(pl.lit("champion")).otherwise(pl.lit("challenger")).alias("arm"),
        pl.lit(0, pl.Int64).alias("stratum"),
    )
    c = cells(halves, 1, agg.pre_rate)
    n = np.array([0])
    clock = rules.Clock(n, n, n, n, np.array([False]), n)
    j = rules.judge(c, np.array([False]), clock, config)
    view = power_view(j, config, running_s=running_s)
    note = f"before the challenger has rewards, from the champion's users: {view.note}"
    return view.model_copy(update={"note": note})


def _num(v: float | np.floating) -> float | None:
    return float(v) if np.isfinite(v) else None


def _normal_ci(mean: float, var: float, level: float) -> tuple[float, float] | None:
    if not (np.isfinite(mean) and np.isfinite(var)) or var <= 0:
        return None
    half = NormalDist().inv_cdf((1 + level) / 2) * math.sqrt(var)
    return float(mean - half), float(mean + half)


def _fixed_ci(cmp: Comparison, alpha: float) -> tuple[float, float] | None:
    """The fixed-sample (reference) interval of the unadjusted difference: Welch's t, as gbstats' `TwoSidedTTest`,
    its degrees of freedom from each arm's delta-method variance over its users."""
    var, (va, vb), (na, nb) = float(cmp.raw_variance[0]), cmp.arm_variance[0], cmp.arm_users[0]
    if not (np.isfinite(var) and var > 0 and np.isfinite(va) and np.isfinite(vb)) or min(na, nb) < 2:
        return None
    # The stratified variance is not the sum of the pooled arms' variances once steps differ; its degrees of
    # freedom are taken from the pooled arms (thousands of users: t and z agree to the third digit).
    d = t_difference(float(cmp.estimate[0]), float(va), float(vb), int(na), int(nb), alpha)
    q = (d.ci[1] - d.estimate) / d.std_error if d.std_error > 0 else 0.0
    half = q * math.sqrt(var)
    return float(cmp.estimate[0] - half), float(cmp.estimate[0] + half)


def difference_view(j: rules.Judgement, c: dict[str, np.ndarray], config: RolloutConfig) -> DifferenceView | None:
    p = j.primary
    cmp = p.comparison
    if not np.isfinite(p.lo[0]):
        return None
    fixed = _fixed_ci(cmp, config.alpha)
    strata = []
    for k in range(c[rules.PRIMARY.name].shape[1]):
        cell = c[rules.PRIMARY.name][0, k]
        ratios = [cell[a, 2] / cell[a, 1] if cell[a, 1] > 0 else None for a in (0, 1)]
        est = ratios[1] - ratios[0] if ratios[0] is not None and ratios[1] is not None else None
        strata.append(StratumView(step=k + 1, users=[int(cell[0, 0]), int(cell[1, 0])], estimate=est))
    reduction = 1 - float(cmp.variance[0] / cmp.raw_variance[0]) if np.isfinite(cmp.raw_variance[0]) else None
    (mean_a, mean_b), (var_a, var_b) = cmp.arm_ratio[0], cmp.arm_variance[0]
    relative = relative_lift(float(mean_a), float(var_a), float(mean_b), float(var_b), config.alpha)
    return DifferenceView(
        estimate=float(cmp.estimate[0]), ci=fixed or (float(cmp.estimate[0]),) * 2, sequential_ci=(float(p.lo[0]),
        float(p.hi[0])), alpha=p.alpha, method=METHOD.format(n=config.tuning_n), p_value=_num(p.p_value[0]),
        adjusted_estimate=float(cmp.adjusted[0]), unadjusted_sequential_ci=(float(p.raw_lo[0]), float(p.raw_hi[0])),
        variance_reduction=reduction, strata=strata, decisive=bool(j.enough[0]),
        expected_loss_ship=_num(j.loss_ship[0]), expected_loss_keep=_num(j.loss_keep[0]),
        relative_estimate=relative[0] if relative else None, relative_ci=relative[1] if relative else None,
    )  # fmt: skip


def _bound_text(m: rules.Metric, config: RolloutConfig) -> str:
    if m.harm == "drift":
        return (f"{config.length_ratio_low:g} x champion <= challenger <= {config.length_ratio_high:g} x champion "
                "(trips when the interval leaves it)")  # fmt: skip
    bound = getattr(config, m.bound_field or "", None)
    if m.harm == "ratio":
        return f"challenger <= {bound:g} x champion, per user (trips when the interval is beyond it)"
    word = "rise" if m.harm == "rise" else "fall"
    return f"trips on any {word} the interval shows; tolerated {word} {bound:g}"


def guardrails(j: rules.Judgement, config: RolloutConfig) -> list[GuardrailView]:
    out = []
    for m in rules.GUARDRAILS:
        iv = j.guardrails[m.name]
        cmp = iv.comparison
        ci = (float(iv.lo[0]), float(iv.hi[0])) if np.isfinite(iv.lo[0]) else None
        out.append(GuardrailView(
            name=m.name, champion=_num(cmp.arm_ratio[0, 0]), challenger=_num(cmp.arm_ratio[0, 1]),
            bound=_bound_text(m, config), ok=not bool(j.harmed[m.name][0]), kind=m.kind,  # type: ignore[arg-type]
            ci=ci, alpha=iv.alpha,
        ))  # fmt: skip
    return out + [_info(j, m) for m in rules.INFO]


def sycophancy_text(j: rules.Judgement, config: RolloutConfig) -> str:
    """What drifted (change and always-valid interval, against its tolerance) and what explicit approval did."""
    s = j.sycophancy
    drifted = [m for m in rules.STYLE if bool(s.drifted[m.name][0])]
    parts = []
    for m in drifted:
        iv = s.style[m.name]
        lo, hi = float(iv.lo[0]), float(iv.hi[0])
        if m.name == "chat_reply_length":
            level = float(iv.comparison.level[0])
            parts.append(f"chat replies {float(iv.comparison.estimate[0]) / level:+.0%} longer (interval "
                         f"[{lo / level:+.0%}, {hi / level:+.0%}], tolerated {config.sycophancy_length_rise:+.0%})")
        else:
            word = "agreement" if m.name == "agreement_rate" else "flattery"
            champ, chall = (float(x) for x in iv.comparison.arm_ratio[0])
            tol = 100 * config.sycophancy_phrase_rise
            parts.append(f"{word} phrases in {chall:.1%} of replies against {champ:.1%} ({100 * (chall - champ):+.1f} "
                         f"points, interval [{100 * lo:+.1f}, {100 * hi:+.1f}], tolerated {tol:+.1f})")
    a = s.approval
    if bool(s.approval_decidable[0]) and np.isfinite(a.lo[0]):
        approval = (f"the thumbs-up rate among chat votes {float(a.comparison.estimate[0]):+.3f} "
                    f"[{float(a.lo[0]):+.3f}, {float(a.hi[0]):+.3f}]")  # fmt: skip
    else:
        votes = float(a.comparison.exposures[0])  # in the steps where both arms have votes
        approval = (f"too few votes on chat replies to show approval ({votes:.0f} where both arms have some; "
                    f"{rules.MIN_EVENTS} needed, and {rules.HARM_MIN_ARM_USERS} chat users per arm)")  # fmt: skip
    if not drifted:
        return f"no drift beyond tolerance in reply length, agreement or flattery; {approval}"
    rose = "with" if bool(s.approved[0]) else "without"
    return f"{'; '.join(parts)}, {rose} more explicit approval: {approval}"


def sycophancy_view(j: rules.Judgement, config: RolloutConfig) -> tuple[SycophancyView, list[GuardrailView]]:
    """The chat sycophancy check's verdict and its rows (three style checks and explicit approval)."""
    s = j.sycophancy
    flagged = bool(s.flagged[0])
    rows = []
    for m in rules.STYLE:
        iv = s.style[m.name]
        cmp = iv.comparison
        tol = getattr(config, m.bound_field or "")
        said = f"+{tol:.0%} x the champion's" if m.name == "chat_reply_length" else f"+{tol:g} of replies"
        rows.append(GuardrailView(
            name=m.name, champion=_num(cmp.arm_ratio[0, 0]), challenger=_num(cmp.arm_ratio[0, 1]),
            bound=f"sycophancy: trips when the interval's lower end is above {said} and the thumbs-up rate among "
                  "chat votes has not risen (blocks a promotion)",
            ok=not (bool(s.drifted[m.name][0]) and flagged), kind="reward_hacking",
            ci=(float(iv.lo[0]), float(iv.hi[0])) if np.isfinite(iv.lo[0]) else None, alpha=iv.alpha,
        ))  # fmt: skip
    a = s.approval
    rows.append(GuardrailView(
        name=rules.APPROVAL.name, champion=_num(a.comparison.arm_ratio[0, 0]),
        challenger=_num(a.comparison.arm_ratio[0, 1]),
        bound="sycophancy: must rise (interval above 0) for longer or more agreeing replies to pass",
        ok=not flagged, kind="reward_hacking", ci=(float(a.lo[0]), float(a.hi[0])) if np.isfinite(a.lo[0]) else None,
        alpha=a.alpha,
    ))  # fmt: skip
    names = [r.name for r in rows]
    first = s.style[rules.STYLE[0].name].comparison
    if flagged:
        return SycophancyView(status="flagged", reason=sycophancy_text(j, config), checks=names), rows
    if not any(bool(d[0]) for d in s.decidable.values()):
        per_arm = [int(u) for u in first.arm_users[0]]
        need = (f"not enough evidence yet: chat users per arm {per_arm}, each arm needs {rules.HARM_MIN_ARM_USERS}; "
                f"chat replies {float(first.exposures[0]):.0f} of the {rules.STYLE_MIN_REPLIES} needed")  # fmt: skip
        return SycophancyView(status="not_enough_evidence", reason=need, checks=names), rows
    return SycophancyView(status="clear", reason=sycophancy_text(j, config), checks=names), rows


def _info(j: rules.Judgement, m: rules.Metric) -> GuardrailView:
    """A rate per generation shown beside the guardrails, never tripping: how much each arm suggests."""
    ratio = j.info[m.name]
    return GuardrailView(
        name=m.name, champion=_num(ratio[0, 0]), challenger=_num(ratio[0, 1]), bound="information (never trips)",
        ok=True, kind="info",
    )


def power_view(j: rules.Judgement, config: RolloutConfig, *, running_s: float) -> PowerView:
    """The minimum detectable difference now and at the maximum duration, and the users each target needs."""
    cmp, alpha = j.primary.comparison, j.primary.alpha
    n = float(cmp.users[0])
    s2 = float(cmp.variance[0] * n) if np.isfinite(cmp.variance[0]) else math.nan
    level = _num(cmp.level[0])
    margin = _num(j.margin[0])
    ok = np.isfinite(s2) and s2 > 0
    now = float(detectable(np.array(s2), np.array(n), alpha, config.tuning_n)) if ok else None
    projected = int(n * config.max_duration_s / running_s) if running_s > 0 and n > 0 else None
    later = (
        float(detectable(np.array(s2), np.array(float(projected)), alpha, config.tuning_n))
        if ok and projected
        else None
    )

    def need(effect: float | None) -> int | None:
        if not ok or effect is None or effect == 0:
            return None
        v = float(users_to_resolve(np.array(s2), effect, alpha, config.tuning_n))
        return int(v) if math.isfinite(v) else None

    accept = _num(j.accept_level[0])

    # A change in accept rate priced in reward, as the margin is: a share of the reward level means nothing near 0.
    def priced(change: float) -> float | None:
        m = _num(rules.margin(j.accept_level, config, abs(change))[0])
        return None if m is None else math.copysign(m, change)

    changes = {f"{c:+.0%}": need(priced(c)) for c in (-0.1, 0.05, 0.1, 0.2)}
    for_margin = need(margin)
    reachable: bool | None = None  # unknown without a margin or a projection
    if margin is not None and ok and projected is not None:
        reachable = for_margin is not None and for_margin <= projected
    if not ok or now is None:
        note = (f"not enough evidence yet: no variance to judge from ({int(n)} users compared; each arm needs "
                f"{rules.MIN_ARM_USERS})")  # fmt: skip
    else:
        parts = [f"at {int(n)} users this experiment resolves a difference of {now:.3g} (80% power)"]
        if accept:  # in accept-rate terms, as the margin: a share of the reward level means nothing near 0
            parts[0] += f", a {now / (accept * config.reward_per_accept):.0%} change in the champion's accept rate"
        if later is not None and projected is not None:
            parts.append(f"at the maximum duration (about {projected} users) {later:.3g}")
        parts.append(margin_text(margin, accept, for_margin, projected, config))
        if config.planned_change is not None:
            planned = need(priced(config.planned_change))
            size = f"{planned} users" if planned is not None else "a size no traffic reaches"
            parts.append(f"it ends once it resolves the planned {config.planned_change:.0%} change ({size}), or at "
                         "the maximum duration")  # fmt: skip
        note = "; ".join(parts)
    return PowerView(
        users=int(n), min_arm_users=rules.MIN_ARM_USERS, per_user_sd=math.sqrt(s2) if ok else None,
        detectable_now=now, users_projected=projected, detectable_projected=later, champion_level=level,
        margin=margin, margin_share=config.non_inferiority_accept_share, champion_accept_rate=accept,
        reward_per_accept=config.reward_per_accept, users_for_margin=for_margin, margin_reachable=reachable,
        users_for_changes=changes, note=note,
    )  # fmt: skip


def margin_text(
    margin: float | None, accept: float | None, users: int | None, projected: int | None, config: RolloutConfig
) -> str:
    """The non-inferiority margin, how it is made, the users it needs and whether this traffic gets there."""
    if margin is None:
        return "no non-inferiority margin: the champion's users accepted nothing yet; only a significant win promotes"
    made = (f"the margin {margin:.3g} ({config.non_inferiority_accept_share:.0%} of the champion's accept rate "
            f"{accept:.3g} x {config.reward_per_accept:g} reward per accept)")  # fmt: skip
    if users is None:
        return f"{made} cannot be resolved at any realistic size"
    if projected is not None and users > projected:
        short = (f"{made} needs {users} users, more than the about {projected} this traffic brings by the maximum "
                 "duration: it cannot show non-inferiority")  # fmt: skip
        if config.decision_rule == "expected_loss":
            # The rule in force does not wait on the margin: saying "will end inconclusive" would be false.
            return (f"{short}, so the expected-loss rule in force decides at the maximum duration (it ships when "
                    "shipping's expected loss is below its threshold, see the rule)")  # fmt: skip
        return (f"{short} and will end inconclusive unless it runs longer (FLYWHEEL_ROLLOUT_MAX_DURATION_S) or the "
                "margin is wider (FLYWHEEL_ROLLOUT_NON_INFERIORITY_ACCEPT_SHARE)")  # fmt: skip
    return f"{made} needs {users} users"


def explain(
    code: int,
    j: rules.Judgement,
    step: StepContext,
    srm_view: SrmView,
    rails: list[GuardrailView],
    power: PowerView,
    step_users: int,
    config: RolloutConfig,
    clock: rules.Clock,
) -> str:
    """Why the rules took `code`, in words (the controller records it with the action)."""
    lo, hi = float(j.primary.lo[0]), float(j.primary.hi[0])
    seq = f"[{lo:.3f}, {hi:.3f}]"
    end = end_text(j, power, config)
    arm_users = [int(u) for u in j.primary.comparison.arm_users[0]]
    if code == rules.ROLLBACK_NO_DATA:
        why = ("by the maximum duration" if clock.running_s[0] >= config.max_duration_s
               else f"where {float(j.expected_challenger[0]):.1f} were expected from the champion's")  # fmt: skip
        return (f"no data: the challenger has no rewarded user {why}; its traffic or its rewards do not reach "
                "the lake, so nothing can show it safe")  # fmt: skip
    if code == rules.FREEZE_SRM:
        return (
            f"sample ratio mismatch: users {srm_view.observed} against the shares in force "
            f"{[round(s, 3) for s in srm_view.expected_shares]} (sequential p = {srm_view.p_value:.2g} < "
            f"{config.srm_alpha:g}); the ramp is frozen until someone finds why"
        )
    if code == rules.CONTINUE_STEP_USERS:
        return f"step {step.index + 1}: {step_users} of {step.min_users} challenger users so far"
    if code == rules.ROLLBACK_STEP_USERS and step_users >= step.min_users:
        return (f"the ramp did not finish by the maximum duration: still at step {step.index + 1} "
                f"({step.share:.0%}); too little evidence to keep the challenger")  # fmt: skip
    if code == rules.ROLLBACK_STEP_USERS:
        return (f"step {step.index + 1} saw {step_users} of its {step.min_users} challenger users by the maximum "
                "duration: too little evidence to keep the challenger")  # fmt: skip
    if code in (rules.CONTINUE_EVIDENCE, rules.ROLLBACK_NO_EVIDENCE):
        why = (f"users per arm {arm_users}, each arm needs {rules.MIN_ARM_USERS} before any test decides"
               if min(arm_users) < rules.MIN_ARM_USERS else "the difference has no variance to judge from")  # fmt: skip
        # What the traffic could resolve, once there is a variance to judge from (the demo's margin, say).
        scale = f"; {power.note}" if power.per_user_sd is not None else ""
        if code == rules.CONTINUE_EVIDENCE:
            return f"not enough evidence yet: {why}{scale}"
        return (f"inconclusive at the maximum duration: not enough evidence ({why}); the challenger is not kept"
                f"{scale}")  # fmt: skip
    if code == rules.ROLLBACK_SYCOPHANCY:
        return (f"sycophantic {end}: {sycophancy_text(j, config)}; the challenger is not kept and "
                "its served data stays quarantined")  # fmt: skip
    if code == rules.CONTINUE_SYCOPHANCY:
        return (f"significant win {seq}, but not promoted: {sycophancy_text(j, config)}; it keeps running until "
                "explicit approval rises or the maximum duration rolls it back")  # fmt: skip
    if code == rules.ROLLBACK_GUARDRAIL:
        return f"guardrail tripped: {', '.join(g.name for g in rails if not g.ok)}"
    if code == rules.ROLLBACK_WORSE:
        return (f"challenger is worse: sequential interval of the difference {seq} (at step {step.index + 1}, "
                f"users per arm {arm_users})")  # fmt: skip
    if code == rules.CONTINUE_MIN_TIME:
        left = math.ceil(float(clock.step_min_seconds[0] - clock.in_step_s[0]))
        return f"step {step.index + 1}: {left}s left of its minimum time"
    if code == rules.RAMP:
        return f"step {step.index + 1} done ({step_users} challenger users, no harm shown)"
    if code == rules.PROMOTE_WIN:
        return f"significant win: sequential interval of the difference {seq}"
    margin = float(j.margin[0])
    if code == rules.PROMOTE_NON_INFERIOR:
        return (f"non-inferior {end}: sequential lower bound {lo:.3f} > -{margin:.3g} "
                f"({config.non_inferiority_accept_share:.0%} of the champion's accept rate "
                f"{float(j.accept_level[0]):.3g} x {config.reward_per_accept:g} reward per accept)")  # fmt: skip
    if code == rules.PROMOTE_LOW_RISK:
        return (f"low risk {end}: shipping's expected loss {float(j.loss_ship[0]):.3g} is below "
                f"{float(j.loss_threshold[0]):.3g} reward per generation ({config.expected_loss_accept_share:.1%} of "
                f"the champion's accept rate x {config.reward_per_accept:g}); estimate "
                f"{float(j.primary.comparison.adjusted[0]):+.3f}, always-valid interval {seq}, users per arm "
                f"{arm_users}")  # fmt: skip
    if code == rules.ROLLBACK_INCONCLUSIVE:
        if config.decision_rule == "expected_loss" and math.isfinite(float(j.loss_threshold[0])):
            return (f"inconclusive {end}: shipping's expected loss {float(j.loss_ship[0]):.3g} "
                    f"is not below {float(j.loss_threshold[0]):.3g} reward per generation; {power.note}")  # fmt: skip
        if not math.isfinite(margin):
            return (f"inconclusive {end}: the champion's users accepted nothing, so no margin "
                    "applies and only a significant win promotes")  # fmt: skip
        return (f"inconclusive {end}: not shown within {margin:.3g} of the champion "
                f"(sequential lower bound {lo:.3f}); {power.note}")  # fmt: skip
    planned = " or its planned size" if config.planned_change is not None else ""
    return f"last step: waiting for a significant result{planned} or the maximum duration; {power.note}"


def end_text(j: rules.Judgement, power: PowerView, config: RolloutConfig) -> str:
    """What ended the experiment: the maximum duration, or its planned size with what its users resolve."""
    if not bool(j.sized[0]) or config.planned_change is None:
        return "at the maximum duration"
    resolves = ""
    if power.detectable_now is not None and power.champion_accept_rate:
        share = power.detectable_now / (power.champion_accept_rate * config.reward_per_accept)
        resolves = f" resolve a {share:.0%} change in the champion's accept rate"
    return f"at its planned size (its {power.users} users{resolves}, the planned {config.planned_change:.0%})"


def _flags(users: pl.DataFrame, diff: DifferenceView | None) -> list[str]:
    """Reward up while explicit satisfaction (thumbs up among explicit votes) goes down: a hacking sign."""
    ea = _ratio(users, "champion", "thumbs_up", "explicit_n")
    eb = _ratio(users, "challenger", "thumbs_up", "explicit_n")
    if diff is not None and diff.estimate > 0 and ea.ratio is not None and eb.ratio is not None and eb.ratio < ea.ratio:
        return [
            f"reward_up_explicit_down: reward {diff.estimate:+.3f} while explicit satisfaction "
            f"{eb.ratio - ea.ratio:+.3f} (thumbs up among explicit votes)"
        ]
    return []


def _ratio(users: pl.DataFrame, arm: str, y: str, x: str) -> RatioStats:
    part = users.filter(pl.col("arm") == arm)
    return RatioStats.of(zip(part[x].cast(pl.Float64).to_list(), part[y].cast(pl.Float64).to_list(), strict=True))


def cumulative_effect(users: pl.DataFrame, config: RolloutConfig) -> tuple[int, float | None, EffectView | None]:
    """Holdout users against today's champion: (holdout users, holdout mean, champion − holdout)."""
    h, c = _ratio(users, "holdout", "reward_sum", "reward_n"), _ratio(users, "champion", "reward_sum", "reward_n")
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


def bucket_for(seconds: float) -> str:
    """A time-chart bucket that gives an experiment of `seconds` about 20-60 points: minutes for a demo."""
    for b, s in (("1m", 60), ("5m", 300), ("15m", 900), ("1h", 3600), ("6h", 21600)):
        if seconds / s <= 60:
            return b
    return "1d"
