"""Simulated experiments run through the controller's own rules, thousands at once (numpy).

Users come from `deploy_gate.rollout.population` (clustered: a few heavy users carry most
generations). Each experiment runs the ramp of a `RolloutConfig` look by look: new users arrive (Poisson), are
assigned at the share of the step in force, and belong to that step; after every look the same
`deploy_gate.rollout.rules.judge` the controller calls decides, and a ramp, promotion, rollback or
freeze is applied as the controller applies it. The sequential SRM test counts users per step
against the step's share. A user's generations arrive at their first look, or with `spread` half
then and half at a look drawn uniformly over the rest of the experiment (as a product's users return);
nobody is moved across arms by a later step, which is the pooled-ramp case the strata must handle.

Used by bench/rollout_decisions.py (figures) and tests/test_rollout_decisions.py (seeded bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from deploy_gate.rollout import rules
from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.evidence import MOMENTS, compare, detectable, srm_log_bayes_factor, users_to_resolve
from deploy_gate.rollout.population import Population, covariate, pre_rate, users


@dataclass(frozen=True)
class Scenario:
    config: RolloutConfig
    users: int  # expected users arriving over the maximum duration
    look_s: float  # seconds between looks (the controller's tick, or coarser for long experiments)
    accept_factor: float = 1.0  # the challenger's users accept this many times as often
    drift: float = 0.0  # both arms' accept propensity grows by this share over the maximum duration
    population: Population = field(default_factory=Population)
    srm_loss: float = 0.0  # share of challenger users lost before the lake (a broken logging path)
    rule: Literal["sequential", "expected_loss"] | None = None  # None: the config's `decision_rule`
    spread: bool = False  # a user's requests spread over the experiment, not all at their first look
    # A novelty effect: the challenger's users arriving at time t accept (accept_factor + novelty x exp(-t / tau))
    # times as often, tau = novelty_days; a user keeps the propensity of their arrival (calendar-time fading).
    novelty: float = 0.0
    novelty_days: float = 2.0
    latency_factor: float = 1.0  # the challenger serves each generation this many times slower


@dataclass(frozen=True)
class Outcomes:
    code: np.ndarray  # final action code per experiment (CONTINUE_LAST: undecided at the end)
    at_s: np.ndarray  # when it was taken
    users: np.ndarray  # users seen by then (both arms)
    ever_excluded_zero: np.ndarray  # the primary interval excluded 0 at some look (before a decision)
    mde: np.ndarray  # the minimum detectable harm the gate stated at its decision (absolute reward)
    margin: np.ndarray
    margin_users: np.ndarray  # users (both arms) the margin needed at 80% power, as the gate stated it
    estimate: np.ndarray  # final adjusted estimate
    raw_estimate: np.ndarray
    pooled_estimate: np.ndarray  # the same users with the steps pooled (what the controller did before strata)
    tripped: dict[str, np.ndarray]  # guardrail name -> (E,) bool: it showed harm at the decision

    def share(self, *codes: int) -> float:
        return float(np.isin(self.code, codes).mean())


def _deliver(
    cells: dict[str, np.ndarray], flat: np.ndarray, cols: dict[str, np.ndarray], z: np.ndarray, old: float, new: float
) -> None:
    """Add to `cells` what users' columns scaled from `old` to `new` of their activity change in each moment.

    A user is counted (n) and their pre-period covariate z added when first delivered (`old` = 0); the per-user
    sums x, y scale with the share delivered, so their squares and products change by the difference."""
    size = int(cells[rules.PRIMARY.name][..., 0].size)
    shape = cells[rules.PRIMARY.name].shape
    m = flat.size
    first = np.full(m, 1.0 if old == 0 else 0.0)
    d1, d2 = new - old, new * new - old * old
    for metric in rules.METRICS:
        x, y = cols[metric.denominator], cols[metric.numerator]
        zz = z if metric is rules.PRIMARY else np.zeros(m)
        parts = (first, x * d1, y * d1, x * x * d2, y * y * d2, x * y * d2, zz * first, zz * zz * first,
                 x * zz * d1, y * zz * d1)  # fmt: skip
        add = np.stack([np.bincount(flat, w, size) for w in parts], axis=-1)
        cells[metric.name] += add.reshape(shape)


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
    margin_users = np.full(e_, np.nan)
    est = np.full(e_, np.nan)
    raw = np.full(e_, np.nan)
    pooled = np.full(e_, np.nan)
    tripped = {m.name: np.zeros(e_, dtype=bool) for m in rules.GUARDRAILS}
    rate = scenario.users / cfg.max_duration_s * scenario.look_s
    # Past the maximum duration a step may still wait out its minimum time: look until that is over too.
    horizon = cfg.max_duration_s + sum(s.min_seconds for s in cfg.ramp) + scenario.look_s
    looks = int(math.ceil(horizon / scenario.look_s))
    log_alarm = math.log(1 / cfg.srm_alpha)
    centre = pre_rate(pop)
    last_look = int(cfg.max_duration_s // scenario.look_s)
    later: dict[int, list[tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]]] = {}  # look -> second halves
    for look in range(1, looks + 1):
        t = look * scenario.look_s
        for flat, cols, z in later.pop(look, []):
            live_users = ~done[flat // (steps * 2)]
            _deliver(cells, flat[live_users], {k: v[live_users] for k, v in cols.items()}, z[live_users], 0.5, 1.0)
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
            novel = scenario.novelty * math.exp(-t / (scenario.novelty_days * 86400.0))
            factor = np.where(arm == 1, scenario.accept_factor + novel, 1.0)
            level = np.full(m, 1.0 + scenario.drift * t / cfg.max_duration_s)
            cols = users(rng, m, pop, factor, level)
            if scenario.latency_factor != 1.0:
                cols["latency_sum"] = cols["latency_sum"] * np.where(arm == 1, scenario.latency_factor, 1.0)
            z = covariate(cols, centre)
            flat = (who * steps + st) * 2 + arm
            size = e_ * steps * 2
            if scenario.spread and look < last_look:
                _deliver(cells, flat, cols, z, 0.0, 0.5)
                when = rng.integers(look + 1, last_look + 1, m)
                needed = {mt.denominator for mt in rules.METRICS} | {mt.numerator for mt in rules.METRICS}
                for w in np.unique(when):
                    pick = when == w
                    later.setdefault(int(w), []).append((flat[pick], {k: cols[k][pick] for k in needed}, z[pick]))
            else:
                _deliver(cells, flat, cols, z, 0.0, 1.0)
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
        j = rules.judge(cells, alarm, clock, cfg, scenario.rule)
        live = ~done
        with np.errstate(invalid="ignore"):
            ever |= live & j.enough & ((j.primary.lo > 0) | (j.primary.hi < 0))
        act = np.array([rules.ACTION[c] for c in range(len(rules.ACTION))])[j.code]
        ramp = live & (act == "ramp")
        step = np.where(ramp, step + 1, step)
        entered = np.where(ramp, t, entered)
        end = live & np.isin(act, ["promote", "rollback", "freeze"])
        if end.any():
            code[end], at[end] = j.code[end], t
            seen[end] = j.primary.comparison.users[end]
            s2 = j.primary.comparison.variance * j.primary.comparison.users
            mde[end] = detectable(s2, j.primary.comparison.users, j.primary.alpha, cfg.tuning_n)[end]
            margin[end] = j.margin[end]
            with np.errstate(invalid="ignore"):
                need = users_to_resolve(s2[end], np.nan_to_num(j.margin[end]), j.primary.alpha, cfg.tuning_n)
            margin_users[end] = np.where(np.isfinite(j.margin[end]), need, np.nan)
            est[end], raw[end] = j.primary.comparison.adjusted[end], j.primary.comparison.estimate[end]
            pooled[end] = compare(cells[rules.PRIMARY.name].sum(axis=1, keepdims=True)).estimate[end]
            for name, harmed in j.harmed.items():
                tripped[name][end] = harmed[end]
            done |= end
        if done.all():
            break
    return Outcomes(code, at, seen, ever, mde, margin, margin_users, est, raw, pooled, tripped)
