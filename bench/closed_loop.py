"""Closed-loop benchmark: simulated users with hidden preferences, K training cycles, every stage real.

Each population is its own product (its own Flywheel deployment, the base model as first champion;
`--together` puts them all on one deployment instead). `simulator.closed_loop.ClosedLoop` runs the
loop as production does: serving, the collector's Segment API, the broker, ingest, signals, the
trainer's cycle, the gate's offline gates and approval, the rollout controller. Printed per cycle:

- the ground truth of the A/B traffic per arm (accept rate of shown suggestions, shown rate, Cursor's
  expected reward per request) and the gate's estimate of challenger - champion with its sequential
  interval, and whether the interval holds the truth's difference;
- the decision and its reason; the wall time of each stage; the turnaround (last feedback trained
  on -> the candidate serving traffic);
- the champion after the cycle on fixed held-out contexts (the independent measurement): accept,
  shown, reward, harmful rate (shown and accepted under a quarter of the time), and where the users
  wanted no suggestion, the shown rate there.

Then per population: base -> final champion accept rate (relative change), with the harmful rate.
`--control-runs N` adds N seeded runs whose challenger is harmed in place of the trained one: trained on
the same data with every reward negated (even runs), or seeded weight noise of 0.05-0.5 times each
matrix's std (odd runs). Each says the harmed challenger's ground truth against the champion's and the
decision; no challenger worse in ground truth may become champion.
A PNG of accept rate over cycles per population goes to `--out` with the table (closed_loop.md).

    python bench/closed_loop.py [--model DIR] [--populations length,style,...] [--cycles 5]
        [--users 40] [--requests 60] [--max-rounds 6] [--control-runs 0] [--out bench/results]

Without --model a default-preset model is bootstrapped for --bootstrap-seconds (240).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from functools import partial
from pathlib import Path

from deploy_gate.rollout.config import RampStep, RolloutConfig
from flywheel.lm import PRESETS, bootstrap_model, load_policy
from flywheel.settings import Settings
from launcher.embedded import free_port, start_embedded
from signals.config import SignalsConfig
from simulator.closed_loop import ClosedLoop, CycleRecord, LoopPlan, Truth, harm_weights, train_inverted
from simulator.contexts import held_out_contexts
from simulator.populations import Population, default_populations, reporting_populations
from trainer.config import TrainerConfig

HARM_SCALES = (0.05, 0.1, 0.2, 0.5)


def harm_kind(seed: int) -> str:
    """Even control runs train on inverted rewards; odd ones add weight noise (scales in turn)."""
    return "inverted rewards" if seed % 2 == 0 else f"noise {HARM_SCALES[(seed // 2) % len(HARM_SCALES)]} x std"


def rollout_config(max_duration_s: float, margin: float) -> RolloutConfig:
    """One 50% step, decided on the sequential interval or, at the maximum duration, on non-inferiority
    within `margin`, a share of the champion's accept rate priced at the reward per accept (0: only a
    significant win is promoted).

    Latency is not a guardrail here: both arms run in one process on a shared machine, so their
    latency differs by whatever else the machine is doing.
    """
    return RolloutConfig(
        ramp=[RampStep(share=0.5, min_users=10, min_seconds=0)], max_duration_s=max_duration_s, tuning_n=400,
        non_inferiority_accept_share=margin, latency_p95_ratio=100.0, srm_min_users=10_000, metrics_port=0,
    )  # fmt: skip


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
    lines[0] += " " + ", ".join(f"{k} {v:.0f}s" for k, v in r.seconds.items()) + " |"
    lines[0] += f" {'-' if r.turnaround_s is None else f'{r.turnaround_s:.0f}s'} |"
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
                        reward_window_s=args.window, allowed_lateness_s=0.5,
                        min_train_samples=args.min_samples)  # fmt: skip
    stack = start_embedded(settings, broker_port=free_port())
    try:
        preset = args.preset
        contexts = held_out_contexts(300, args.seed, preset=preset)
        evals = held_out_contexts(args.eval_contexts, args.seed + 10_000, preset=preset)
        plan = LoopPlan(cycles=args.cycles, users=args.users, requests=args.requests, warmup_rounds=args.warmup,
                        max_rounds=args.max_rounds, max_tokens=args.max_tokens, seed=args.seed)  # fmt: skip
        trainer = TrainerConfig(learning_rate=args.lr, batch_size=16, epochs=args.epochs, baseline=args.baseline,
                                max_samples=args.max_samples, time_budget_s=args.time_budget,
                                ope_holdout_share=args.ope_holdout,
                                abstain_coef=args.abstain_coef,
                                seed=args.seed)  # fmt: skip
        loop = ClosedLoop(stack.settings, model, pops, contexts, evals, plan, trainer,
                          rollout_config(args.max_duration, args.margin), SignalsConfig())  # fmt: skip
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
                print(f"control run {harm_seed} ({pops[0].name}): {kind}, ground-truth reward"
                      f" {worse:+.3f} against the champion -> {rec.decision}: {rec.reason[:100]}", flush=True)
                return loop, [rec]
            records = []
            for k in range(1, args.cycles + 1):
                rec = loop.cycle(k)
                records.append(rec)
                print("\n".join(report_cycle(name, rec)), flush=True)
        return loop, records
    finally:
        stack.stop()


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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--bootstrap-seconds", type=float, default=240.0)
    ap.add_argument("--populations", default=",".join(p.name for p in default_populations()))
    ap.add_argument("--together", action="store_true", help="all populations on one deployment")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--users", type=int, default=400, help="per population")
    ap.add_argument("--requests", type=int, default=400, help="per population per traffic round")
    ap.add_argument("--warmup", type=int, default=1, help="traffic rounds on the base model first")
    ap.add_argument("--max-rounds", type=int, default=12, help="rounds a cycle waits for the controller")
    ap.add_argument("--max-duration", type=float, default=200.0, help="the controller's max experiment seconds")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--window", type=float, default=2.0, help="reward window seconds")
    ap.add_argument("--min-samples", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-samples", type=int, default=800,
                    help="samples a cycle trains on at most, a seeded uniform (reservoir) sample of the eligible ones,"
                    " the rest reported: bounds the step a cycle takes, so the offline gates' perplexity and KL"
                    " bounds hold while data accumulates (0: all)")
    ap.add_argument("--ope-holdout", type=float, default=0.2,
                    help="share of traffic held out of training for the offline gate's estimate (flywheel/holdout.py)")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds a cycle's training may take; the samples it did not reach are reported (0: none)")
    ap.add_argument("--baseline", type=float, default=0.0, help="PG baseline: 0 = the value of not suggesting")
    ap.add_argument("--abstain-coef", type=float, default=0.0,
                    help="weight of the trainer's abstain term (TrainerConfig.abstain_coef; 0: off)")
    ap.add_argument("--eval-contexts", type=int, default=100)
    ap.add_argument("--control-runs", type=int, default=0)
    ap.add_argument("--margin", type=float, default=0.0,
                    help="non-inferiority margin at the maximum duration, a share of the champion's accept rate "
                         "(0: promote only a significant win)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    wanted = args.populations.split(",")
    # A name in both means the default kind (the committed results' `noisy` judges like `length`).
    known = {p.name: p for p in reporting_populations()} | {p.name: p for p in default_populations()}
    pops = [p for name, p in known.items() if name in wanted]
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model or bootstrap_model(root / "model", preset=args.preset, seed=0,
                                              max_seconds=args.bootstrap_seconds, progress=False)  # fmt: skip
        print(f"model {model} ({sum(p.numel() for p in load_policy(model).model.parameters()):,} parameters); "
              f"{args.cycles} cycles, {args.users} users and {args.requests} requests a round per population")
        header = ["| deployment | cycle | candidate | decision | gate estimate [sequential interval] | truth A/B "
                  "difference | stage seconds | turnaround |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        print("\n".join(header))
        groups = [("all", pops)] if args.together else [(p.name, [p]) for p in pops]
        groups = groups if args.cycles else []  # --cycles 0: control runs only
        results: dict[str, tuple[dict[str, Truth], list[CycleRecord]]] = {}
        lines = list(header)
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
            line = (f"control runs: {len(control)} harmed challengers, {worse_total} worse than the champion in"
                    f" ground truth; promoted {len(promoted)}, of them worse {worse_promoted}; decisions {by}")
            print(line)
            lines += ["", line]
        (args.out / "closed_loop.md").write_text("\n".join(lines) + "\n")
        plot(results, args.out / "closed_loop.png")
        print(f"wrote {args.out / 'closed_loop.md'} and {args.out / 'closed_loop.png'}")


if __name__ == "__main__":
    main()
