"""Benchmark: the rollout controller's decisions over simulated experiments, demo and production alike.

By default (`table`), the figures issue 42 asks for, on users drawn so as not to flatter: no shared
pre-period (regression adjustment has nothing to feed on; the pre-period case is its own row), each
user's requests spread over the experiment (half at their first look, half later), propensities
spread wider (Beta concentration 4), and the real default ramp. For the defaults (the expected-loss
rule), the sequential rule and `flywheel up`'s settings, at 2,000 and 20,000 users: the A/A
wrong-decision rate (a false win or a harm rollback; goal <= 2%), the share of 10%-worse challengers
promoted (goal <= 1%), the share of 10%- and 30%-better ones promoted with the median users and days
to the decision, and experiments that never end (goal 0). `--legacy` runs the sections below.

Every row runs `--experiments` simulated experiments (clustered users: 3% heavy users with about
200 generations, the rest about 5) through the controller's own rules
(`deploy_gate.rollout.rules.judge`, via `deploy_gate.rollout.calibration`), ramp, guardrails,
sequential SRM and all, looked at every tick (the demo) or every hour (14-day experiments). Rows:

- A/A: wrong decisions (promoted as a win, rolled back as worse or on a guardrail), SRM false
  alarms, and how the rest ended; the target is at most alpha (5%) and the SRM alpha (0.1%).
- a challenger whose users accept 10% less often: the share promoted (target at most 1%).
- a trend shared by both arms (drift): the mean estimate, which stratifying by step keeps near 0.
- SRM power: 5% of the challenger's users lost before the lake.
- the sequential rule against an expected-loss rule (GrowthBook's Bayesian "risk") on the same
  scenarios: A/A wrong decisions, 10%-worse and 10%-better challengers promoted.
- power curves: users needed at 80% power for -10%, +5%, +10%, +20% changes in accept rate, without
  and with regression adjustment, on users whose behaviour persists and on users whose does not.

`--through-analyse N` instead runs N experiments of the demo configuration through
`deploy_gate.rollout.analysis.analyse` on polars frames, one call per tick, as the controller does
(slow; it also runs against the code before this bench existed, which is how the issue's table was
reproduced: see the README).

    python bench/rollout_decisions.py [--experiments 1000]
    python bench/rollout_decisions.py --experiments 200 --rules-only
    python bench/rollout_decisions.py --through-analyse 200
    python bench/rollout_decisions.py --large 40      # the table's configurations at 200,000 users
    python bench/rollout_decisions.py --dynamics 100  # a novelty effect; better on reward but slower
    python bench/rollout_decisions.py --capping       # heavy users capped at 1.0, 0.999, 0.99
"""

from __future__ import annotations

import argparse
import inspect
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from deploy_gate.rollout.config import RampStep, RolloutConfig
from deploy_gate.rollout.population import Population, users
from launcher.demo import DEMO as DEMO_OVERRIDES

# The demo's rollout configuration, as `flywheel up` sets it (launcher/demo.py, DEMO.rollout).
DEMO = dict(DEMO_OVERRIDES.rollout)
DAY = 86400.0


def demo_config(**extra: Any) -> RolloutConfig:
    fields = RolloutConfig.model_fields
    return RolloutConfig(**{k: v for k, v in {**DEMO, **extra}.items() if k in fields})


# Users who accept 31% of shown suggestions: the reward averages about +0.002 a generation (the demo's was
# 0.03), where a margin stated as a share of the mean reward collapsed to nothing.
NEAR_ZERO = Population(accept=0.31)


def configurations() -> list[tuple[str, RolloutConfig, int, float, Population]]:
    """(name, config, users over the maximum duration, seconds between looks, users)."""
    one = RolloutConfig(ramp=[RampStep(share=0.5, min_users=200, min_seconds=600)])
    pop = Population()
    return [
        ("demo (flywheel up), 40 users in 10 min", demo_config(), 40, 10.0, pop),
        ("demo configuration, 4,000 users in 10 min", demo_config(), 4000, 10.0, pop),
        ("demo configuration, reward level near 0, 4,000 users in 10 min", demo_config(), 4000, 10.0, NEAR_ZERO),
        ("defaults, one 50% step, 2,000 users in 14 days", one, 2000, 3600.0, pop),
        ("defaults (5/25/50% ramp), 20,000 users in 14 days", RolloutConfig(), 20000, 3600.0, pop),
        ("defaults, one 50% step, reward level near 0, 60,000 users in 14 days", one, 60000, 3600.0, NEAR_ZERO),
    ]


def vectorised(experiments: int) -> None:
    from deploy_gate.rollout import rules
    from deploy_gate.rollout.calibration import Scenario, simulate

    names = {v: k for k, v in vars(rules).items() if k.isupper() and isinstance(v, int) and k != "MIN_ARM_USERS"}
    for name, cfg, n, look, pop in configurations():
        t0 = time.perf_counter()
        aa = simulate(Scenario(cfg, n, look, population=pop), experiments, seed=1)
        harm = simulate(Scenario(cfg, n, look, accept_factor=0.9, population=pop), experiments, seed=2)
        ends = {names[int(c)]: f"{(aa.code == c).mean():.1%}" for c in np.unique(aa.code)}
        print(f"{name}  ({experiments} experiments a row, {time.perf_counter() - t0:.1f}s)")
        print(f"  A/A: wrong decisions {aa.share(*rules.WRONG_ON_AA):.1%} (alpha {cfg.alpha:.0%}); SRM false alarms "
              f"{aa.share(rules.FREEZE_SRM):.2%} (alpha {cfg.srm_alpha:.1%}); interval ever excluded 0 past the floor "
              f"{aa.ever_excluded_zero.mean():.1%}; ended: {ends}")  # fmt: skip
        mde = np.nanmedian(harm.mde) if np.isfinite(harm.mde).any() else float("nan")
        margin = np.nanmedian(aa.margin) if np.isfinite(aa.margin).any() else float("nan")
        need = np.nanmedian(aa.margin_users) if np.isfinite(aa.margin_users).any() else float("nan")
        print(f"  10%-worse challenger (true difference {harm_size(cfg, pop):+.3f}): promoted "
              f"{harm.share(rules.PROMOTE_WIN, rules.PROMOTE_NON_INFERIOR):.1%}, rolled back as worse or on a "
              f"guardrail {harm.share(rules.ROLLBACK_WORSE, rules.ROLLBACK_GUARDRAIL):.1%}; minimum detectable "
              f"difference stated at the decision (median) {mde:.3f}; A/A promoted as non-inferior "
              f"{aa.share(rules.PROMOTE_NON_INFERIOR):.1%}; margin (median) {margin:.4f}, users it needs "
              f"(median, as stated) "
              f"{need:,.0f} against {n:,} arriving")  # fmt: skip
    cfg = RolloutConfig()
    retired_margin(experiments)
    drift = simulate(Scenario(cfg, 20000, 3600.0, drift=0.3), experiments, seed=3)
    print(f"drift: both arms' accept rate +30% over 14 days, defaults, 20,000 users: A/A wrong "
          f"{drift.share(*rules.WRONG_ON_AA):.1%}; mean estimate stratified by step "
          f"{np.nanmean(drift.raw_estimate):+.4f} "
          f"(adjusted {np.nanmean(drift.estimate):+.4f}), the steps pooled {np.nanmean(drift.pooled_estimate):+.4f} "
          f"(sd of one estimate {np.nanstd(drift.raw_estimate):.4f})")  # fmt: skip
    one = configurations()[3]
    big = simulate(Scenario(one[1], one[2], one[3], accept_factor=0.8), experiments, seed=6)
    promoted = big.share(rules.PROMOTE_WIN, rules.PROMOTE_NON_INFERIOR)
    print(f"{one[0]}: a challenger whose users accept 20% less (true {harm_size(one[1], factor=0.8):+.3f}, beyond the "
          f"stated minimum detectable difference): promoted {promoted:.1%}, rolled back as worse or on a guardrail "
          f"{big.share(rules.ROLLBACK_WORSE, rules.ROLLBACK_GUARDRAIL):.1%}")
    lost = simulate(Scenario(cfg, 20000, 3600.0, srm_loss=0.05), experiments, seed=4)
    print(f"SRM power: 5% of the challenger's users lost, defaults, 20,000 users: frozen "
          f"{lost.share(rules.FREEZE_SRM):.1%}")


def levels(pop: Population) -> tuple[float, float]:
    """(mean reward, accepted per rewarded generation) of the champion's users, from 200,000 of them."""
    rng = np.random.default_rng(0)
    a = users(rng, 200_000, pop, np.ones(200_000), np.ones(200_000))
    return float(a["reward_sum"].sum() / a["reward_n"].sum()), float(a["accepted"].sum() / a["reward_n"].sum())


def retired_margin(experiments: int) -> None:
    """The baseline in the same run: the near-0 rows' A/A under the retired margin, 10% of the mean reward.

    Emulated through `reward_per_accept`, so the same rules run: share x accept x r = 0.1 x level.
    """
    from deploy_gate.rollout import rules
    from deploy_gate.rollout.calibration import Scenario, simulate

    for name, cfg, n, look, pop in configurations():
        if pop is not NEAR_ZERO:
            continue
        level, accept = levels(pop)
        old = cfg.model_copy(update={"reward_per_accept": 0.1 * level / (cfg.non_inferiority_accept_share * accept)})
        new = simulate(Scenario(cfg, n, look, population=pop), experiments, seed=1)
        was = simulate(Scenario(old, n, look, population=pop), experiments, seed=1)
        shares = [o.share(rules.PROMOTE_NON_INFERIOR, rules.PROMOTE_WIN) for o in (new, was)]
        ratio = f"{shares[0] / shares[1]:.1f}x" if shares[1] > 0 else "from none"
        print(f"{name}: A/A promoted (an equal challenger released) with the margin {np.nanmedian(new.margin):.4f} "
              f"(5% of the accept rate {accept:.3f}) {shares[0]:.1%}; with the retired margin {0.1 * level:.4f} "
              f"(10% of the mean reward {level:+.4f}) {shares[1]:.1%} ({ratio})")  # fmt: skip


def rules_compared(experiments: int) -> None:
    """The sequential rule against the expected-loss rule (GrowthBook's Bayesian "risk"), same scenarios and seeds.

    Everything but the primary metric's rule is shared (guardrails, SRM, evidence floor, ramp). Reported per
    configuration: A/A wrong decisions, a 10%-worse challenger promoted, a 10%-better one promoted (power).
    """
    from deploy_gate.rollout import rules
    from deploy_gate.rollout.calibration import Scenario, simulate

    promoted = rules.PROMOTED
    print(f"decision rules compared ({experiments} experiments a cell; expected loss: ship at the maximum duration "
          f"when it is under {RolloutConfig().expected_loss_accept_share:g} x the accept rate):")  # fmt: skip
    for name, cfg, n, look, pop in configurations():
        cells = []
        for rule in ("sequential", "expected_loss"):
            aa = simulate(Scenario(cfg, n, look, population=pop, rule=rule), experiments, seed=1)  # type: ignore[arg-type]
            worse = simulate(Scenario(cfg, n, look, 0.9, population=pop, rule=rule), experiments, seed=2)  # type: ignore[arg-type]
            better = simulate(Scenario(cfg, n, look, 1.1, population=pop, rule=rule), experiments, seed=7)  # type: ignore[arg-type]
            cells.append(f"{rule}: A/A wrong {aa.share(*rules.WRONG_ON_AA):.1%} (as a win "
                         f"{aa.share(rules.PROMOTE_WIN):.1%}, as worse {aa.share(rules.ROLLBACK_WORSE):.1%}), "
                         f"10%-worse promoted {worse.share(*promoted):.1%}, 10%-better promoted "
                         f"{better.share(*promoted):.1%}")  # fmt: skip
        print(f"  {name}: " + "; ".join(cells))


def srm_calibration(experiments: int = 100_000) -> None:
    """The sequential SRM test alone on many more experiments: its false-alarm rate against its alpha."""
    import math

    from deploy_gate.rollout.evidence import srm_log_bayes_factor

    rng = np.random.default_rng(8)
    cfg = RolloutConfig()
    shares = np.array([s.share for s in cfg.ramp])
    theta = np.stack([1 - shares, shares], axis=-1)
    counts = np.zeros((experiments, len(shares), 2))
    alarm = np.zeros(experiments, dtype=bool)
    for look in range(1, 337):  # 14 days of hourly looks, 20,000 users; steps change after 20 and 60 hours
        step = 0 if look <= 20 else 1 if look <= 60 else 2
        n = rng.poisson(20000 / 336, experiments)
        challenger = rng.binomial(n, shares[step])
        counts[:, step, 1] += challenger
        counts[:, step, 0] += n - challenger
        log_bf = srm_log_bayes_factor(counts, np.broadcast_to(theta, counts.shape)).sum(axis=-1)
        alarm |= log_bf >= math.log(1 / cfg.srm_alpha)
    print(f"SRM alone, {experiments:,} A/A experiments of 20,000 users over the default ramp, looked at hourly: "
          f"false alarms {alarm.mean():.3%} (alpha {cfg.srm_alpha:.1%})")


def harm_size(cfg: RolloutConfig, pop: Population | None = None, factor: float = 0.9) -> float:
    """True difference in reward per generation of a challenger whose users accept `factor` times as often."""
    pop = pop or Population()
    rng = np.random.default_rng(0)
    a = users(rng, 200_000, pop, np.ones(200_000), np.ones(200_000))
    b = users(rng, 200_000, pop, np.full(200_000, factor), np.ones(200_000))
    return float(b["reward_sum"].sum() / b["reward_n"].sum() - a["reward_sum"].sum() / a["reward_n"].sum())


def power_curves() -> None:
    """Users needed at 80% power, from the per-user variance of the difference with and without adjustment."""
    from deploy_gate.rollout import rules
    from deploy_gate.rollout.evidence import compare, moments, users_to_resolve
    from deploy_gate.rollout.population import covariate, pre_rate

    cfg = RolloutConfig()
    alpha = rules.alphas(cfg)[0]
    print(f"power curves, defaults (alpha {alpha:g} for the primary metric, N* {cfg.tuning_n:g}): users needed "
          "(both arms) at 80% power")  # fmt: skip
    for persistence in (1.0, 0.0):
        pop = Population(persistence=persistence)
        rng = np.random.default_rng(5)
        row = []
        for change in (-0.10, 0.05, 0.10, 0.20):
            n = 200_000
            a = users(rng, n, pop, np.ones(n), np.ones(n))
            b = users(rng, n, pop, np.full(n, 1 + change), np.ones(n))
            cells = np.stack([
                moments(c["reward_n"], c["reward_sum"], covariate(c, pre_rate(pop))) for c in (a, b)
            ])[None, None]  # fmt: skip
            cmp = compare(cells)
            true = float(cmp.estimate[0])
            raw = float(users_to_resolve(cmp.raw_variance * 2 * n, true, alpha, cfg.tuning_n)[0])
            adj = float(users_to_resolve(cmp.variance * 2 * n, true, alpha, cfg.tuning_n)[0])
            row.append(f"{change:+.0%} ({true:+.4f}): {raw:,.0f} -> {adj:,.0f} ({raw / adj:.2f}x)")
        print(f"  behaviour {'persists' if persistence else 'does not persist'}: " + "; ".join(row))
    check_power(cfg, alpha)


def check_power(cfg: RolloutConfig, alpha: float, experiments: int = 1000) -> None:
    """The users-needed formula against simulation: at the stated users, the share of experiments whose
    adjusted interval excludes 0 (one look at that size) should be about 80%."""
    from deploy_gate.rollout.evidence import compare, half_width, moments, users_to_resolve
    from deploy_gate.rollout.population import covariate, pre_rate

    pop = Population()
    rng = np.random.default_rng(9)
    big = 100_000
    a = users(rng, big, pop, np.ones(big), np.ones(big))
    b = users(rng, big, pop, np.full(big, 1.2), np.ones(big))
    probe = compare(np.stack([moments(c["reward_n"], c["reward_sum"], covariate(c, pre_rate(pop))) for c in (a, b)])[
        None, None])  # fmt: skip
    need = float(users_to_resolve(probe.variance * 2 * big, float(probe.estimate[0]), alpha, cfg.tuning_n)[0])
    half = int(need // 2)
    cells = np.zeros((experiments, 1, 2, 10))
    for arm, factor in ((0, 1.0), (1, 1.2)):
        c = users(rng, experiments * half, pop, np.full(experiments * half, factor), np.ones(experiments * half))
        z = covariate(c, pre_rate(pop))
        cells[:, 0, arm] = moments(c["reward_n"].reshape(experiments, half), c["reward_sum"].reshape(experiments, half),
                                   z.reshape(experiments, half))  # fmt: skip
    cmp = compare(cells)
    lo = cmp.adjusted - half_width(cmp.variance, cmp.users, alpha, cfg.tuning_n)
    print(f"  check: +20% at the stated {2 * half:,} users, {experiments} simulated experiments: the adjusted interval "
          f"excludes 0 in {(lo > 0).mean():.1%} (target 80%)")


def through_analyse(experiments: int) -> None:
    """The demo configuration through `analyse` itself, one polars frame per tick (runs on older code too)."""
    import polars as pl

    from deploy_gate.rollout import analysis
    from deploy_gate.rollout.data import USER_COLUMNS, Aggregates

    cfg = demo_config(non_inferiority_margin=0.25)
    params = inspect.signature(analysis.analyse).parameters
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    pop = Population()
    for factor, label in ((1.0, "A/A"), (0.9, "10%-worse challenger")):
        rng = np.random.default_rng(11 if factor == 1.0 else 12)
        ends: dict[str, int] = {}
        ever = 0
        for _ in range(experiments):
            rows: list[dict[str, Any]] = []
            lat: dict[str, list[np.ndarray]] = {"champion": [], "challenger": []}
            step, entered, starts, excluded = 0, t0, [t0], False
            outcome = "undecided"
            for look in range(1, 200):
                now = t0 + timedelta(seconds=10 * look)
                k = rng.poisson(40 / 60)
                shares = cfg.ramp[step].share
                for _u in range(k):
                    arm = "challenger" if rng.random() < shares else "champion"
                    c = users(rng, 1, pop, np.array([factor if arm == "challenger" else 1.0]), np.ones(1))
                    row = {col: float(v[0]) for col, v in c.items()}
                    lat[arm].append(row["latency_mu"] * rng.lognormal(0, 0.3, int(row["generations"])))
                    rows.append({**row, "arm": arm, "user_id": f"u{len(rows)}", "first_seen": now})
                if not rows:
                    continue
                frame = pl.DataFrame([{c: r.get(c, 0) for c in USER_COLUMNS} for r in rows], schema=USER_COLUMNS)
                p95 = {a: float(np.quantile(np.concatenate(v), 0.95)) if v else None for a, v in lat.items()}
                nlat = {a: int(sum(x.size for x in v)) for a, v in lat.items()}
                agg = Aggregates(frame, p95, nlat, "rules-v1")
                ctx = analysis.StepContext(index=step, share=shares, min_users=cfg.ramp[step].min_users,
                                           min_seconds=cfg.ramp[step].min_seconds, entered_at=entered,
                                           last=step == len(cfg.ramp) - 1)  # fmt: skip
                kw: dict[str, Any] = {"started_at": t0, "now": now}
                if "step_starts" in params:
                    kw["step_starts"] = starts
                view = analysis.analyse(agg, ctx, cfg, **kw)
                if view is None:
                    continue
                d = view.difference
                decisive = getattr(d, "decisive", True)  # the code before the evidence floor trusted every interval
                excluded |= d is not None and decisive and (d.sequential_ci[0] > 0 or d.sequential_ci[1] < 0)
                action, reason = view.decision.action, view.decision.reason
                if action == "ramp":
                    step, entered = step + 1, now
                    starts.append(now)
                elif action in ("promote", "rollback", "freeze"):
                    outcome = f"{action}: {reason.split(':')[0].split(' (')[0]}"
                    break
            ends[outcome] = ends.get(outcome, 0) + 1
            ever += excluded
        print(f"through analyse(), demo configuration, 40 users in 10 min, {label}, {experiments} experiments: "
              f"interval ever excluded 0 {ever / experiments:.1%}; "
              + ", ".join(f"{k} {v / experiments:.1%}" for k, v in sorted(ends.items(), key=lambda kv: -kv[1])))


# The bench's users: no pre-period, wider propensities (the "users drawn otherwise").
PLAIN = Population(returning=0.0, accept_concentration=4.0)


def _row(cfg: RolloutConfig, n: int, look: float, pop: Population, experiments: int, seed: int) -> str:
    """One configuration at one traffic: A/A, 10% worse, 10% and 30% better, through `calibration.simulate`."""
    from deploy_gate.rollout import rules
    from deploy_gate.rollout.calibration import Scenario, simulate

    out = {f: simulate(Scenario(cfg, n, look, accept_factor=f, population=pop, spread=True), experiments, seed + i)
           for i, f in enumerate((1.0, 0.9, 1.1, 1.3))}  # fmt: skip
    aa = out[1.0]
    never = np.mean([o.share(rules.CONTINUE_LAST) for o in out.values()])

    def won(o: Any) -> str:
        p = np.isin(o.code, rules.PROMOTED)
        if not p.any():
            return "0.0%"
        return f"{p.mean():.1%} ({np.median(o.users[p]):,.0f} users, {np.median(o.at_s[p]) / DAY:.1f} d)"

    return (f"| {aa.share(*rules.WRONG_ON_AA):.1%} | {aa.share(*rules.PROMOTED):.1%} | "
            f"{out[0.9].share(*rules.PROMOTED):.1%} | {won(out[1.1])} | {won(out[1.3])} | {never:.1%} |")  # fmt: skip


def table(experiments: int) -> None:
    """The issue's figures as a markdown table; 20,000-user rows run half the experiments (each is 10x the work)."""
    seq = RolloutConfig(decision_rule="sequential")
    demo_n = demo_config()
    rows: list[tuple[str, RolloutConfig, int, float, Population]] = []
    for n in (2000, 20000):
        rows += [
            (f"defaults (expected loss, 5/25/50% ramp), {n:,} users in 14 days", RolloutConfig(), n, 4 * 3600.0, PLAIN),
            (f"sequential rule (the former default), {n:,} users in 14 days", seq, n, 4 * 3600.0, PLAIN),
            (f"flywheel up's settings, {n:,} users in 10 min", demo_n, n, 10.0, PLAIN),
        ]
    rows += [
        ("defaults, 2,000 users, 70% with a persistent pre-period (CUPED)", RolloutConfig(), 2000, 4 * 3600.0,
         Population(accept_concentration=4.0)),
        ("defaults, 2,000 users, champion accept rate 0.05", RolloutConfig(), 2000, 4 * 3600.0,
         Population(returning=0.0, accept_concentration=4.0, accept=0.05)),
        ("defaults, 2,000 users, champion accept rate 0.6", RolloutConfig(), 2000, 4 * 3600.0,
         Population(returning=0.0, accept_concentration=4.0, accept=0.6)),
        ("sequential rule, 2,000 users, champion accept rate 0.05", seq, 2000, 4 * 3600.0,
         Population(returning=0.0, accept_concentration=4.0, accept=0.05)),
        ("defaults, 2,000 users, heavy-tailed activity (lognormal sigma 1.5)", RolloutConfig(), 2000, 4 * 3600.0,
         Population(returning=0.0, accept_concentration=4.0, activity_sigma=1.5, light_generations=10.0)),
    ]  # fmt: skip
    print(f"{experiments} experiments a cell (20,000-user rows: {experiments // 2}); users without a pre-period unless "
          "said, requests spread over the experiment, Beta(4) propensities; looks every 4 h (10 s for flywheel up)")
    print("\n| configuration | A/A wrong (goal <= 2%) | A/A shipped (no loss) | 10% worse promoted (goal <= 1%) | "
          "10% better promoted (median users, days) | 30% better promoted | never ended (goal 0) | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for i, (name, cfg, n, look, pop) in enumerate(rows):
        t0 = time.perf_counter()
        cells = _row(cfg, n, look, pop, experiments // 2 if n > 10_000 else experiments, seed=100 * i)
        print(f"| {name} {cells} {time.perf_counter() - t0:.0f} |", flush=True)


def large(experiments: int) -> None:
    """The table's configurations at 200,000 users (each experiment is 100x a 2,000-user one: run fewer)."""
    rows = [
        ("defaults (expected loss, 5/25/50% ramp), 200,000 users in 14 days", RolloutConfig(), 4 * 3600.0),
        ("sequential rule (the former default), 200,000 users in 14 days", RolloutConfig(decision_rule="sequential"),
         4 * 3600.0),
        ("flywheel up's settings, 200,000 users in 10 min", demo_config(), 10.0),
    ]  # fmt: skip
    print(f"{experiments} experiments a cell, 200,000 users, same users and looks as the table")
    for i, (name, cfg, look) in enumerate(rows):
        t0 = time.perf_counter()
        cells = _row(cfg, 200_000, look, PLAIN, experiments, seed=5000 + 100 * i)
        print(f"| {name} {cells} {time.perf_counter() - t0:.0f} |", flush=True)


def _ends(o: Any) -> str:
    """How the experiments of one scenario ended: promoted, rolled back on harm, inconclusive; median days."""
    from deploy_gate.rollout import rules

    p = np.isin(o.code, rules.PROMOTED)
    days = f" ({np.median(o.at_s[p]) / DAY:.1f} d)" if p.any() else ""
    return (f"promoted {p.mean():.1%}{days}, rolled back on a guardrail {o.share(rules.ROLLBACK_GUARDRAIL):.1%}, "
            f"as worse {o.share(rules.ROLLBACK_WORSE):.1%}, inconclusive {o.share(*rules.INCONCLUSIVE):.1%}, "
            f"never ended {o.share(rules.CONTINUE_LAST):.1%}")  # fmt: skip


def dynamics(experiments: int) -> None:
    """A novelty effect (better at first, fading to worse) and a challenger better on reward but slower."""
    from deploy_gate.rollout.calibration import Scenario, simulate

    cfg = RolloutConfig()
    print(f"{experiments} experiments a cell; defaults, users and looks as the table")
    for n in (2000, 20000):
        # Users arriving on day 0 accept 30% more often, those arriving after a week about 10% less (tau 2 days).
        o = simulate(Scenario(cfg, n, 4 * 3600.0, 0.9, population=PLAIN, spread=True, novelty=0.4,
                              novelty_days=2.0), experiments, 7000 + n)  # fmt: skip
        print(f"| novelty: +30% on day 0 fading to 10% worse (tau 2 d), {n:,} users | {_ends(o)} |", flush=True)
    for slow in (1.1, 1.5):
        o = simulate(Scenario(cfg, 20000, 4 * 3600.0, 1.1, population=PLAIN, spread=True, latency_factor=slow),
                     experiments, 8000 + int(slow * 10))  # fmt: skip
        print(f"| 10% better on reward, {slow:g}x the latency (tolerance {cfg.latency_p95_ratio:g}x), 20,000 users | "
              f"{_ends(o)} |", flush=True)


def capping(n: int = 20_000) -> None:
    """Heavy users capped (`analysis.cap_heavy`) at 1.0 (off), 0.999 and 0.99 on one seeded draw of `n` users an
    arm, clustered and heavy-tailed: the difference's standard error and the estimate of a 10%-better challenger
    (through `analysis.cells` and `evidence.compare`, as the controller computes them)."""
    import polars as pl

    from deploy_gate.rollout.analysis import cap_heavy, cells
    from deploy_gate.rollout.data import USER_COLUMNS

    pops = {"clustered (3% heavy)": PLAIN, "heavy-tailed (lognormal sigma 1.5)": Population(
        returning=0.0, accept_concentration=4.0, activity_sigma=1.5, light_generations=10.0)}  # fmt: skip
    from deploy_gate.rollout.evidence import compare

    for name, pop in pops.items():
        rng = np.random.default_rng(21)
        parts = []
        for arm, f in (("champion", 1.0), ("challenger", 1.1)):
            c = users(rng, n, pop, np.full(n, f), np.ones(n))
            cols = {k: c.get(k, np.zeros(n)) for k in USER_COLUMNS if k not in ("arm", "user_id", "first_seen")}
            parts.append(pl.DataFrame({**cols, "arm": [arm] * n, "user_id": [f"{arm}{i}" for i in range(n)],
                                       "stratum": np.zeros(n, dtype=np.int64)}))  # fmt: skip
        frame = pl.concat(parts, how="diagonal_relaxed")
        row = []
        for p in (1.0, 0.999, 0.99):
            capped, view = cap_heavy(frame, RolloutConfig(cap_percentile=p))
            cmp = compare(cells(capped, 1, None)["satisfaction"])
            cap = f", cap {view.cap_generations:.0f} generations, {view.users_capped} users" if view else ""
            se = np.sqrt(float(cmp.raw_variance[0]))
            row.append(f"{p:g}{cap}: estimate {float(cmp.estimate[0]):+.4f} +- {se:.4f}")
        print(f"capping, {name}, {n:,} users an arm, 10%-better challenger: " + "; ".join(row), flush=True)


def worse_only(experiments: int) -> None:
    """The goals closest to their bound on more experiments: 10%-worse challengers promoted under the defaults at
    2,000 users, without and with a pre-period, A/A wrong decisions on the same draws, and A/A at 20,000 users."""
    from deploy_gate.rollout import rules
    from deploy_gate.rollout.calibration import Scenario, simulate

    for name, pop in (("no pre-period", PLAIN), ("70% with a pre-period", Population(accept_concentration=4.0))):
        worse = simulate(Scenario(RolloutConfig(), 2000, 4 * 3600.0, 0.9, population=pop, spread=True), experiments, 7)
        aa = simulate(Scenario(RolloutConfig(), 2000, 4 * 3600.0, population=pop, spread=True), experiments, 8)
        print(f"defaults, 2,000 users, {name}, {experiments} experiments: 10%-worse promoted "
              f"{worse.share(*rules.PROMOTED):.2%}; A/A wrong {aa.share(*rules.WRONG_ON_AA):.2%}, never ended "
              f"{aa.share(rules.CONTINUE_LAST):.2%}", flush=True)  # fmt: skip
    for name, cfg in (("defaults", RolloutConfig()), ("sequential rule", RolloutConfig(decision_rule="sequential"))):
        aa = simulate(Scenario(cfg, 20000, 4 * 3600.0, population=PLAIN, spread=True), experiments // 5, 9)
        print(f"{name}, 20,000 users, no pre-period, {experiments // 5} A/A experiments: wrong "
              f"{aa.share(*rules.WRONG_ON_AA):.2%} (false wins {aa.share(rules.PROMOTE_WIN):.2%}), never ended "
              f"{aa.share(rules.CONTINUE_LAST):.2%}", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", type=int, default=200)
    ap.add_argument("--legacy", action="store_true", help="the earlier sections (pre-period population, no spread)")
    ap.add_argument("--worse-only", type=int, default=0, metavar="N", help="10%%-worse and A/A at 2,000 users, N each")
    ap.add_argument("--heavy-tail", type=int, default=0, metavar="N", help="only the heavy-tailed row, N experiments")
    ap.add_argument("--through-analyse", type=int, default=0, metavar="N")
    ap.add_argument("--large", type=int, default=0, metavar="N", help="the 200,000-user rows, N experiments a cell")
    ap.add_argument("--dynamics", type=int, default=0, metavar="N", help="novelty and slower-challenger rows")
    ap.add_argument("--capping", action="store_true", help="heavy users capped at 1.0, 0.999, 0.99")
    ap.add_argument("--rules-only", action="store_true", help="only the sequential against the expected-loss rule")
    args = ap.parse_args()
    if args.through_analyse:
        through_analyse(args.through_analyse)
        return
    if args.worse_only:
        worse_only(args.worse_only)
        return
    if args.large:
        large(args.large)
        return
    if args.capping:
        capping()
        return
    if args.dynamics:
        dynamics(args.dynamics)
        return
    if args.heavy_tail:
        pop = Population(returning=0.0, accept_concentration=4.0, activity_sigma=1.5, light_generations=10.0)
        print("| defaults, 2,000 users, heavy-tailed activity (lognormal sigma 1.5) "
              + _row(RolloutConfig(), 2000, 4 * 3600.0, pop, args.heavy_tail, seed=1100) + " |")
        return
    if not (args.legacy or args.rules_only):
        table(args.experiments)
        return
    if args.rules_only:
        rules_compared(args.experiments)
        return
    vectorised(args.experiments)
    rules_compared(args.experiments)
    srm_calibration()
    power_curves()


if __name__ == "__main__":
    main()
