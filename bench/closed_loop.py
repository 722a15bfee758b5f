"""Closed-loop benchmark: simulated users with hidden preferences, K training cycles, every stage real.

Each population is its own product (its own Flywheel deployment, the base model as first champion;
`--together` puts them all on one deployment instead). `simulator.closed_loop.ClosedLoop` runs the
loop as production does: serving, the collector's Segment API, the broker, ingest, signals, the
trainer's cycle, the gate's offline gates and approval, the rollout controller. Printed per cycle:

- the ground truth of the A/B traffic per arm (accept rate of shown suggestions, shown rate, Cursor's
  expected reward per request) and the gate's estimate of challenger - champion with its sequential
  interval, and whether the interval holds the truth's difference;
- the decision and its reason; the wall time of each stage and this process's CPU time in it (on a
  shared machine the wall time counts everyone's work, the CPU time the loop's own); the turnaround
  (last feedback trained on -> the candidate serving traffic);
- the champion after the cycle on fixed held-out contexts (the independent measurement): accept,
  shown, reward, harmful rate (shown and accepted under a quarter of the time), and where the users
  wanted no suggestion, the shown rate there.

Then per population: base -> final champion accept rate (relative change), with the harmful rate.
`--control-runs N` adds N seeded runs whose challenger is harmed in place of the trained one: trained on
the same data with every reward negated (even runs), or seeded weight noise of 0.05-0.5 times each
matrix's std (odd runs). Each says the harmed challenger's ground truth against the champion's and the
decision; no challenger worse in ground truth may become champion.
A PNG of accept rate over cycles per population goes to `--out` with the table (`--report`.md).

Settings: unless a flag names one, every trainer, rollout, signals and gate setting is the product's, what
`flywheel up` runs with (`launcher.up.demo_trainer_config`, `demo_rollout_config`, `SignalsConfig()`,
`Settings()`); the run prints them, where each came from, and which populations chose them
(`simulator.populations.tuning_populations`). The flags that size the run (users, requests, rounds, cycles,
`--promotions`, `--wall-budget`) are traffic and patience, not settings; the reward window is a clock
setting (every event of a simulated request carries one timestamp, so no reward depends on it). Per
deployment: each promotion's ground truth against the champion it replaced (worse: a lower expected reward
per request on the held-out contexts).

    python bench/closed_loop.py [--model DIR] [--populations content,noisy,...] [--cycles 5] [--promotions 5]
        [--users 400] [--requests 400] [--max-rounds 40] [--wall-budget 0] [--control-runs 0] [--out bench/results]

Without --model a default-preset model is bootstrapped for --bootstrap-seconds (240).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from deploy_gate.rollout.config import RolloutConfig
from flywheel.connections import delete_prefix, redis_client
from flywheel.lm import PRESETS, bootstrap_model, load_policy
from flywheel.settings import Settings
from launcher.demo import DEMO
from launcher.embedded import free_port, start_embedded
from launcher.up import demo_rollout_config, demo_trainer_config
from signals.config import SignalsConfig
from simulator.closed_loop import ClosedLoop, CycleRecord, LoopPlan, Truth, harm_weights, train_inverted
from simulator.contexts import held_out_contexts
from simulator.populations import Population, default_populations, populations_named, tuning_populations
from trainer.config import TrainerConfig

HARM_SCALES = (0.05, 0.1, 0.2, 0.5)


def harm_kind(seed: int) -> str:
    """Even control runs train on inverted rewards; odd ones add weight noise (scales in turn)."""
    return "inverted rewards" if seed % 2 == 0 else f"noise {HARM_SCALES[(seed // 2) % len(HARM_SCALES)]} x std"


def trainer_config(args: argparse.Namespace) -> TrainerConfig:
    """`flywheel up`'s trainer configuration (launcher/up.py), with only the fields a flag names overridden."""
    flags = {"learning_rate": args.lr, "epochs": args.epochs, "max_samples": args.max_samples,
             "time_budget_s": args.time_budget, "ope_holdout_share": args.ope_holdout, "baseline": args.baseline,
             "abstain_coef": args.abstain_coef, "target_kl": args.target_kl,
             "own_samples": args.own_samples, "update": args.update}  # fmt: skip
    return demo_trainer_config(seed=args.seed, **{k: v for k, v in flags.items() if v is not None})


def rollout_config(args: argparse.Namespace) -> RolloutConfig:
    """`flywheel up`'s rollout configuration (its ramp, maximum duration, N*, non-inferiority margin and
    guardrails), with only what a flag names overridden. Its metrics endpoint is off: the controller runs in
    this process."""
    flags = {"max_duration_s": args.max_duration, "non_inferiority_accept_share": args.margin}
    return demo_rollout_config(metrics_port=0, **{k: v for k, v in flags.items() if v is not None})


def settings_used(args: argparse.Namespace, pops: list[Population]) -> list[str]:
    """What this run decides with, where each setting came from, and which populations chose the defaults."""
    trainer, rollout = trainer_config(args), rollout_config(args)
    base = TrainerConfig()
    changed = {k: v for k, v in trainer.to_dict().items() if v != getattr(base, k) and k != "seed"}
    names = ("lr", "epochs", "max_samples", "time_budget", "ope_holdout", "baseline", "abstain_coef",
             "target_kl", "own_samples", "update", "max_duration", "margin")  # fmt: skip
    overridden = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is not None]
    demo_rollout = sorted(DEMO.rollout)
    tuning = {p.name for p in tuning_populations()}
    kinds = [f"{p.name} ({'a tuning population' if p.name in tuning else 'not used for tuning'}:"
             f" {type(p).__name__})" for p in pops]  # fmt: skip
    return [
        "settings: " + ("overridden by " + ", ".join(overridden) if overridden else "the product's (`flywheel up`)"),
        f"- trainer: TrainerConfig defaults with {changed} (flywheel up: {DEMO.trainer})",
        f"- rollout: RolloutConfig defaults with flywheel up's {demo_rollout}: ramp "
        + ", ".join(f"{r.share:.0%} from {r.min_users} users and {r.min_seconds:.0f}s" for r in rollout.ramp)
        + f"; maximum duration {rollout.max_duration_s:.0f}s, then non-inferiority within"
        f" {rollout.non_inferiority_accept_share:.0%} of the champion's accept rate;"
        f" N* {rollout.tuning_n:.0f}; alpha {rollout.alpha};"
        f" latency guardrail {rollout.latency_p95_ratio}x",
        "- signals, offline gates, approval: their defaults (SignalsConfig(), Settings())",
        f"- reward window {args.window}s (flywheel up: 60s): a clock setting only, every event of a simulated"
        " request carries one timestamp, so no reward changes with it",
        f"- these defaults were chosen on the tuning populations: {', '.join(sorted(tuning))}",
        f"- this run: {', '.join(kinds)}",
    ]


def fmt_truth(t: Truth | None) -> str:
    if t is None:
        return "-"
    unwanted = f" unwanted-shown {t.unwanted_shown_rate:.2f}" if t.unwanted_shown_rate is not None else ""
    return (f"accept {t.accept_rate:.3f} shown {t.shown_rate:.2f} reward {t.reward:+.3f}"
            f" harmful {t.harmful_rate:.2f}{unwanted}")  # fmt: skip


def report_cycle(name: str, r: CycleRecord) -> list[str]:
    lines = [f"| {name} | {r.cycle} | {'harmed ' if r.harmed else ''}v{r.candidate or '-'} ({r.trained_on} samples) "
             f"| {r.decision}: {r.reason[:90]} |"]  # fmt: skip
    truth = r.ab_difference()
    if r.estimate is not None:
        est, lo, hi = r.estimate
        inside = "" if truth is None else (" (truth inside)" if lo <= truth <= hi else " (truth OUTSIDE)")
        lines[0] += f" {est:+.3f} [{lo:+.3f}, {hi:+.3f}]{inside} |"
    else:
        lines[0] += " - |"
    lines[0] += f" {'-' if truth is None else f'{truth:+.3f}'} |"
    stages = [f"{k} {v:.0f}s/{r.cpu_seconds.get(k, 0.0):.0f}" for k, v in r.seconds.items()]
    lines[0] += f" {', '.join(stages)}; all {sum(r.seconds.values()):.0f}s/{sum(r.cpu_seconds.values()):.0f} |"
    lines[0] += f" {'-' if r.turnaround_s is None else f'{r.turnaround_s:.0f}s'} |"
    if r.trainer_note:
        m = r.trainer_metrics
        lines.append(f"|  | | trainer: {r.trainer_note}; {m.get('steps', 0):.0f} steps, KL to the champion"
                     f" {m.get('kl_to_champion', float('nan')):.4f} | | | | | |")  # fmt: skip
    for pop, t in r.truth_candidate.items():
        lines.append(f"|  | | candidate, {pop}: {fmt_truth(t)} | | | | | |")
    if r.offline_verdict:
        ope = "-" if r.offline_estimate is None else f"{r.offline_estimate:+.3f}"
        lines.append(f"|  | | offline estimate (ope_satisfaction, DR - champion's logged mean): {ope}, "
                     f"{r.offline_verdict} | | | | | |")  # fmt: skip
    for pop, t in r.truth_eval.items():
        lines.append(f"|  | | champion after, {pop}: {fmt_truth(t)} | | | | | |")
    return lines


def run_deployment(name: str, pops: list[Population], model: Path, args: argparse.Namespace, root: Path,
                   *, harm_seed: int | None = None) -> tuple[ClosedLoop, list[CycleRecord]]:  # fmt: skip
    data = root / name
    settings = Settings(data_dir=data, redis_prefix=f"bench-loop:{data.name}:{time.time_ns()}:",
                        reward_window_s=args.window, allowed_lateness_s=0.5)  # fmt: skip
    stack = start_embedded(settings, broker_port=free_port())
    try:
        preset = args.preset
        contexts = held_out_contexts(300, args.seed, preset=preset)
        evals = held_out_contexts(args.eval_contexts, args.seed + 10_000, preset=preset)
        plan = LoopPlan(cycles=args.cycles, users=args.users, requests=args.requests, warmup_rounds=args.warmup,
                        max_rounds=args.max_rounds, max_tokens=args.max_tokens, seed=args.seed)  # fmt: skip
        loop = ClosedLoop(stack.settings, model, pops, contexts, evals, plan, trainer_config(args),
                          rollout_config(args), SignalsConfig())  # fmt: skip
        for pop, t in loop.base_eval.items():
            print(f"|  | 0 | base model, {pop}: {fmt_truth(t)} | | | | | |", flush=True)
        with loop.running():
            loop.warm_up()
            if harm_seed is not None:
                kind = harm_kind(harm_seed)
                if kind == "inverted rewards":
                    harmed = partial(train_inverted, loop.settings, loop.trainer, loop.base)
                    rec = loop.cycle(1, harm=lambda src, out: harmed(out))
                else:
                    scale = HARM_SCALES[(harm_seed // 2) % len(HARM_SCALES)]
                    rec = loop.cycle(1, harm=lambda src, out: harm_weights(src, out, scale, harm_seed))
                worse = rec.truth_candidate[pops[0].name].reward - loop.base_eval[pops[0].name].reward
                print(
                    f"control run {harm_seed} ({pops[0].name}): {kind}, ground-truth reward"
                    f" {worse:+.3f} against the champion -> {rec.decision}: {rec.reason[:100]}",
                    flush=True,
                )
                return loop, [rec]
            records: list[CycleRecord] = []
            deadline = time.monotonic() + args.wall_budget if args.wall_budget else None
            for k in range(1, args.cycles + 1):
                if deadline is not None and time.monotonic() > deadline:
                    print(f"{name}: the {args.wall_budget:.0f}-s wall budget is spent after {k - 1} cycles", flush=True)
                    break
                rec = loop.cycle(k)
                records.append(rec)
                print("\n".join(report_cycle(name, rec)), flush=True)
                if args.promotions and sum(r.decision == "promoted" for r in records) >= args.promotions:
                    break
        return loop, records
    finally:
        delete_prefix(redis_client(stack.settings), settings.redis_prefix)  # on a shared Redis: its state
        stack.stop()


def promotions(base: dict[str, Truth], records: list[CycleRecord]) -> list[str]:
    """Every promotion's ground truth on the held-out contexts against the champion it replaced; a promotion
    is worse in ground truth when its expected reward per request (Cursor's) is lower than that champion's."""
    lines = ["| promotion | cycle | version | population | accept before -> after | reward before -> after "
             "| worse in ground truth | truth A/B difference |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    before, k = base, 0
    for r in records:
        if r.decision == "promoted":
            k += 1
            ab = r.ab_difference()
            for pop, t1 in r.truth_eval.items():
                t0 = before[pop]
                worse = "**yes**" if t1.reward < t0.reward else "no"
                lines.append(f"| {k} | {r.cycle} | v{r.candidate} | {pop} | {t0.accept_rate:.3f} ->"
                             f" {t1.accept_rate:.3f} | {t0.reward:+.3f} -> {t1.reward:+.3f} | {worse}"
                             f" | {'-' if ab is None else f'{ab:+.3f}'} |")  # fmt: skip
        before = r.truth_eval or before
    return lines if k else ["no promotion"]


def plot(results: dict[str, tuple[dict[str, Truth], list[CycleRecord]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (base, records) in results.items():
        for pop, t0 in base.items():
            ys = [t0.accept_rate] + [r.truth_eval[pop].accept_rate for r in records]
            ax.plot(range(len(ys)), ys, marker="o", label=pop if len(results) == 1 else f"{name}: {pop}")
    ax.set_xlabel("training cycle (0 = base model)")
    ax.set_ylabel("accept rate of shown suggestions (ground truth)")
    ax.set_title("Champion's accept rate on held-out contexts, per population")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    # A run stopped by SIGTERM unwinds as Ctrl-C does, so the broker, Valkey and services it started stop with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--bootstrap-seconds", type=float, default=240.0)
    ap.add_argument("--populations", default=",".join(p.name for p in default_populations()))
    ap.add_argument("--together", action="store_true", help="all populations on one deployment")
    ap.add_argument("--cycles", type=int, default=5, help="cycles at most")
    ap.add_argument("--promotions", type=int, default=5, help="stop after this many promotions (0: run every cycle)")
    ap.add_argument(
        "--wall-budget",
        type=float,
        default=0.0,
        help="start no cycle after this many seconds of a deployment (0: none); what ran is reported",
    )
    ap.add_argument("--users", type=int, default=400, help="per population")
    ap.add_argument("--requests", type=int, default=400, help="per population per traffic round")
    ap.add_argument("--warmup", type=int, default=1, help="traffic rounds on the base model first")
    ap.add_argument(
        "--max-rounds",
        type=int,
        default=40,
        help="rounds a cycle waits for the controller (it decides by its maximum duration first)",
    )
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--window",
        type=float,
        default=2.0,
        help="reward window seconds (flywheel up: 60): a clock setting, no reward depends on it here",
    )
    ap.add_argument("--eval-contexts", type=int, default=100)
    ap.add_argument("--control-runs", type=int, default=0)
    # Unset, each of these is what `flywheel up` runs with (launcher/up.py); set, it overrides that one field.
    product = demo_trainer_config()
    demo = demo_rollout_config(metrics_port=0)
    ap.add_argument("--lr", type=float, help=f"TrainerConfig.learning_rate (flywheel up: {product.learning_rate})")
    ap.add_argument("--epochs", type=int, help=f"TrainerConfig.epochs (flywheel up: {product.epochs})")
    ap.add_argument(
        "--max-samples",
        type=int,
        help="TrainerConfig.max_samples: at most this many samples a cycle, a seeded uniform (reservoir)"
        f" sample of the eligible ones, the rest reported (flywheel up: {product.max_samples}, all)",
    )
    ap.add_argument(
        "--ope-holdout",
        type=float,
        help="TrainerConfig.ope_holdout_share, traffic held out of training for the offline gate's "
        f"estimate (flywheel up: {product.ope_holdout_share})",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        help="TrainerConfig.time_budget_s, seconds a cycle's training may take; the samples it did not"
        f" reach are reported (flywheel up: {product.time_budget_s})",
    )
    ap.add_argument("--baseline", type=float, help=f"TrainerConfig.baseline (flywheel up: {product.baseline})")
    ap.add_argument(
        "--abstain-coef", type=float, help=f"TrainerConfig.abstain_coef (flywheel up: {product.abstain_coef})"
    )
    ap.add_argument("--target-kl", type=float, help=f"TrainerConfig.target_kl, nats (flywheel up: {product.target_kl})")
    ap.add_argument(
        "--update",
        choices=["full", "lora"],
        help=f"TrainerConfig.update: every weight or a LoRA adapter (flywheel up: {product.update})",
    )
    ap.add_argument(
        "--own-samples",
        type=int,
        help=f"TrainerConfig.own_samples, 0: the logged samples (flywheel up: {product.own_samples})",
    )
    ap.add_argument(
        "--max-duration", type=float, help=f"RolloutConfig.max_duration_s (flywheel up: {demo.max_duration_s:.0f})"
    )
    ap.add_argument(
        "--margin",
        type=float,
        help="RolloutConfig.non_inferiority_accept_share at the maximum duration, a share of the champion's"
        f" accept rate (flywheel up: {demo.non_inferiority_accept_share}; 0: only a significant win)",
    )
    ap.add_argument("--report", default="closed_loop", help="file name (no suffix) of the table and PNG in --out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    # A name in both means the reporting kind (`noisy` judging like `style`); results before this change
    # ran the default kind (judging like `length`).
    pops = populations_named(args.populations.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model or bootstrap_model(root / "model", preset=args.preset, seed=0,
                                              max_seconds=args.bootstrap_seconds, progress=False)  # fmt: skip
        print(
            f"model {model} ({sum(p.numel() for p in load_policy(model).model.parameters()):,} parameters); "
            f"{args.cycles} cycles, {args.users} users and {args.requests} requests a round per population"
        )
        header = ["| deployment | cycle | candidate | decision | gate estimate [sequential interval] | truth A/B "
                  "difference | stage seconds, wall/CPU (this process's) | turnaround |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        used = settings_used(args, pops)
        print("\n".join(used))
        print("\n".join(header))
        groups = [("all", pops)] if args.together else [(p.name, [p]) for p in pops]
        groups = groups if args.cycles else []  # --cycles 0: control runs only
        results: dict[str, tuple[dict[str, Truth], list[CycleRecord]]] = {}
        lines = [f"# bench/closed_loop.py {' '.join(sys.argv[1:])}", "", *used, "", *header]
        for name, group in groups:
            started = time.perf_counter()
            loop, records = run_deployment(name, group, model, args, root)
            results[name] = (loop.base_eval, records)
            lines += [line for r in records for line in report_cycle(name, r)]
            print(f"{name}: {time.perf_counter() - started:.0f}s", flush=True)
        summary = ["", "| population | base accept | final accept | relative | base shown | final shown "
                   "| base harmful | final harmful | unwanted shown base -> final |",
                   "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for _name, (base, records) in results.items():
            for pop, t0 in base.items():
                t1 = records[-1].truth_eval[pop] if records else t0
                rel = (t1.accept_rate / t0.accept_rate - 1) if t0.accept_rate else float("nan")
                unwanted = ("-" if t0.unwanted_shown_rate is None
                            else f"{t0.unwanted_shown_rate:.2f} -> {t1.unwanted_shown_rate:.2f}")  # fmt: skip
                summary.append(f"| {pop} | {t0.accept_rate:.3f} | {t1.accept_rate:.3f} | {rel:+.0%}"
                               f" | {t0.shown_rate:.2f} | {t1.shown_rate:.2f} | {t0.harmful_rate:.2f}"
                               f" | {t1.harmful_rate:.2f} | {unwanted} |")  # fmt: skip
        for name, (base, records) in results.items():
            decisions = ", ".join(r.decision for r in records)
            n_promoted = sum(r.decision == "promoted" for r in records)
            summary += ["", f"{name}: {n_promoted} promotions in {len(records)} cycles ({decisions})", "",
                        *promotions(base, records)]  # fmt: skip
        print("\n".join(summary))
        lines += summary
        if args.control_runs:
            control = []  # (decision, ground-truth reward of the harmed challenger minus the champion's)
            for i in range(args.control_runs):
                target = pops[(i // 2) % len(pops)]  # each population gets both kinds of harm
                loop, recs = run_deployment(f"control-{i}", [target], model, args, root,
                                            harm_seed=args.seed * 1000 + i)  # fmt: skip
                worse = recs[0].truth_candidate[target.name].reward - loop.base_eval[target.name].reward
                control.append((recs[0].decision, worse))
                lines.append(f"control run {i} ({target.name}, {harm_kind(i)}):"
                             f" ground truth {worse:+.3f} against the champion -> {recs[0].decision}")  # fmt: skip
            promoted = [w for d, w in control if d == "promoted"]
            by = {d: sum(c == d for c, _ in control) for d in sorted({c for c, _ in control})}
            worse_total, worse_promoted = sum(w < 0 for _, w in control), sum(w < 0 for w in promoted)
            line = (
                f"control runs: {len(control)} harmed challengers, {worse_total} worse than the champion in"
                f" ground truth; promoted {len(promoted)}, of them worse {worse_promoted}; decisions {by}"
            )
            print(line)
            lines += ["", line]
        (args.out / f"{args.report}.md").write_text("\n".join(lines) + "\n")
        plot(results, args.out / f"{args.report}.png")
        print(f"wrote {args.out / args.report}.md and .png")


if __name__ == "__main__":
    main()
