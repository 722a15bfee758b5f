"""How long an experiment needs, before it starts: the ramp's minimums, the margin and effect sizes at a traffic.

`flywheel gate plan` prints it. Inputs are the traffic (new users a day, all arms) and the champion's
accept rate; the per-user spread of the reward comes from the caller (measured on the champion's users)
or, without one, from simulated users at that accept rate (`population`: a few heavy users, no
pre-period), which is an assumption the plan says it makes. What it computes:

- each ramp step's days: its minimum challenger users at the step's share of the traffic, or its
  minimum time, whichever is longer; whether the ramp finishes within the maximum duration;
- the users the maximum duration brings, each arm's share of them, and what they resolve (80% power,
  the deciding alpha, the same confidence sequence as the rules: `evidence.detectable`);
- the rule in force and what it risks: under "expected_loss" the probability that a challenger worse
  by the margin, or by 10% of the accept rate, is promoted at the end (`rules.ship_cutoff`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deploy_gate.rollout import rules
from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.evidence import compare, detectable, moments, users_to_resolve
from deploy_gate.rollout.population import Population, users

DAY = 86400.0


@dataclass(frozen=True)
class StepPlan:
    share: float
    min_users: int
    days: float  # to reach its minimum users and time at this traffic
    starts_day: float


@dataclass(frozen=True)
class DurationPlan:
    steps: list[StepPlan]
    ramp_days: float  # the ramp's minimums end (the earliest promotion)
    max_days: float
    reachable: bool  # the ramp's minimums fit in the maximum duration
    users: int  # users the maximum duration brings
    arm_users: tuple[int, int]  # champion, challenger (by the share in force when each arrived)
    per_user_sd: float
    sd_assumed: bool  # from simulated users, not measured
    margin: float
    users_for_margin: float
    detectable: float  # at the maximum duration, in reward per generation
    changes: dict[str, float]  # "+10%": users needed to resolve that change in the accept rate
    promoted_if_margin_worse: float  # the rule's chance of promoting a challenger worse by the margin
    promoted_if_10pct_worse: float
    users_for_planned: float | None = None  # users that resolve `config.planned_change` (None: no planned size)
    planned_day: float | None = None  # when they have arrived, past the ramp's minimums (inf: never in time)

    def lines(self, config: RolloutConfig, accept: float) -> list[str]:
        out = [f"decision rule: {config.decision_rule}"]
        for i, s in enumerate(self.steps, 1):
            out.append(f"step {i}: {s.share:.0%} of users, from day {s.starts_day:.1f}: {s.min_users} challenger "
                       f"users and {config.ramp[i - 1].min_seconds / DAY:.2g} days minimum -> {s.days:.1f} days")
        verdict = "fits" if self.reachable else "does NOT fit: every experiment ends 'too little evidence'"
        out.append(f"ramp minimums end on day {self.ramp_days:.1f} of {self.max_days:.1f}: {verdict}")
        sd = "assumed from simulated users at this accept rate" if self.sd_assumed else "measured"
        out.append(f"by the maximum duration: {self.users:,} users ({self.arm_users[0]:,} champion, "
                   f"{self.arm_users[1]:,} challenger); per-user sd {self.per_user_sd:.3g} ({sd})")
        out.append(f"resolves (80% power) a difference of {self.detectable:.3g} reward per generation, a "
                   f"{self.detectable / (accept * config.reward_per_accept):.0%} change in the accept rate")
        need = "never" if not math.isfinite(self.users_for_margin) else f"{self.users_for_margin:,.0f} users"
        out.append(f"margin {self.margin:.3g} ({config.non_inferiority_accept_share:.0%} of the accept rate "
                   f"{accept:g}): needs {need}")
        out.append("users needed per change in the accept rate: " + ", ".join(
            f"{k} {v:,.0f}" if math.isfinite(v) else f"{k} never" for k, v in self.changes.items()))
        out.append(f"promoted at the end if worse by the margin: {self.promoted_if_margin_worse:.2%}; if 10% "
                   f"worse: {self.promoted_if_10pct_worse:.2%}")
        if self.users_for_planned is not None and self.planned_day is not None:
            size = f"planned size: a {config.planned_change:.0%} change in the accept rate needs "
            if math.isfinite(self.users_for_planned) and self.planned_day <= self.max_days:
                out.append(f"{size}{self.users_for_planned:,.0f} users: the experiment ends about day "
                           f"{self.planned_day:.1f}, before the maximum duration")  # fmt: skip
            else:
                need = f"{self.users_for_planned:,.0f} users" if math.isfinite(self.users_for_planned) else "never"
                out.append(f"{size}{need}, not reached in time: the maximum duration ends the experiment")
        return out


def per_user_sd(accept: float, seed: int = 0, n: int = 50_000) -> float:
    """The per-user sd of the reward difference's influence, from simulated users at `accept` (no pre-period)."""
    pop = Population(accept=accept, returning=0.0)
    rng = np.random.default_rng(seed)
    cells = np.stack([
        moments(c["reward_n"], c["reward_sum"]) for c in (users(rng, n, pop, np.ones(n), np.ones(n)) for _ in (0, 1))
    ])[None, None]  # fmt: skip
    c = compare(cells)
    return math.sqrt(float(c.raw_variance[0]) * n / 2)  # Var(d) = s²·(1/n + 1/n)


def plan(config: RolloutConfig, users_per_day: float, accept: float, sd: float | None = None) -> DurationPlan:
    """The plan of an experiment under `config` at `users_per_day` new users and a champion accept rate `accept`."""
    from scipy.special import ndtr

    assumed = sd is None
    s = per_user_sd(accept) if sd is None else sd
    max_days = config.max_duration_s / DAY
    steps, day, n0, n1 = [], 0.0, 0.0, 0.0
    for k, step in enumerate(config.ramp):
        rate = users_per_day * step.share
        days = max(step.min_users / rate if rate > 0 else math.inf, step.min_seconds / DAY)
        last = k == len(config.ramp) - 1
        steps.append(StepPlan(step.share, step.min_users, days, day))
        span = max(0.0, (max_days - day) if last else min(days, max_days - day))
        n1 += users_per_day * span * step.share
        n0 += users_per_day * span * (1 - step.share)
        day += days
    ramp_days = day
    total = n0 + n1
    alpha = rules.alphas(config)[0]
    with np.errstate(divide="ignore"):
        var = s * s * (1 / n0 + 1 / n1) if n0 > 0 and n1 > 0 else math.inf
    per_unit = var * total  # what `users_to_resolve` and `detectable` take: Var(d)·N
    level = np.array([accept])
    margin = float(rules.margin(level, config)[0])

    def need(effect: float) -> float:
        return float(users_to_resolve(np.array(per_unit), effect, alpha, config.tuning_n))

    changes = {f"{c:+.0%}": need(c * accept * config.reward_per_accept) for c in (-0.1, 0.05, 0.1, 0.2)}
    mde = float(detectable(np.array(per_unit), np.array(total), alpha, config.tuning_n))
    sd_d = math.sqrt(var)
    if config.decision_rule == "expected_loss":
        threshold = rules.loss_threshold(level, config)
        cut = float(rules.ship_cutoff(np.array([var]), threshold, np.array([margin]))[0])
        worse_margin = float(ndtr((-margin - cut) / sd_d))
        worse_10 = float(ndtr((-0.1 * accept * config.reward_per_accept - cut) / sd_d))
    else:  # the sequential rule's promotion of a worse challenger is bounded by its alpha, at any traffic
        worse_margin = worse_10 = alpha / 2
    planned_users = planned_day = None
    if config.planned_change is not None:
        planned_users = need(config.planned_change * accept * config.reward_per_accept)
        planned_day = max(ramp_days, planned_users / users_per_day) if math.isfinite(planned_users) else math.inf
    return DurationPlan(
        steps=steps, ramp_days=ramp_days, max_days=max_days, reachable=ramp_days <= max_days, users=int(total),
        arm_users=(int(n0), int(n1)), per_user_sd=s, sd_assumed=assumed, margin=margin,
        users_for_margin=need(margin), detectable=mde, changes=changes, promoted_if_margin_worse=worse_margin,
        promoted_if_10pct_worse=worse_10, users_for_planned=planned_users, planned_day=planned_day,
    )  # fmt: skip
