"""Benchmark: the rollout test's error rates under continuous monitoring, and its power.

A/A: `--experiments` simulated experiments with no true difference, each looked at after every
batch of users. Prints the share that ever declares a winner with the controller's confidence
sequence, beside the naive repeated fixed-sample test's share on the same experiments.

Power: the same with a true +0.05 effect on mean satisfaction (reward per generation): the share
the sequential test promotes (a significant win) and the median users it needed, against the
fixed-sample test with the same alpha run once at the planned end (all users).

    python bench/rollout_stats.py [--experiments 1000] [--looks 30] [--users-per-look 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from deploy_gate.rollout.calibration import run_many


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experiments", type=int, default=1000)
    ap.add_argument("--looks", type=int, default=30)
    ap.add_argument("--users-per-look", type=int, default=200)
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--effect", type=float, default=0.05)
    args = ap.parse_args()
    n, looks, per = args.experiments, args.looks, args.users_per_look

    t0 = time.perf_counter()
    aa = run_many(n, effect=0.0, looks=looks, users_per_look=per, alpha=args.alpha, seed=1)
    seq_fp = sum(o.sequential_look is not None for o in aa) / n
    naive_fp = sum(o.naive_look is not None for o in aa) / n
    fixed_fp = sum(o.final_fixed_significant for o in aa) / n
    print(f"A/A, {n} experiments x {looks} looks x {per} users (alpha {args.alpha}), {time.perf_counter() - t0:.1f}s")
    print(f"  confidence sequence, looked at after every batch: {seq_fp:.3f} declared a winner")
    print(f"  naive fixed-sample test, looked at after every batch: {naive_fp:.3f} "
          f"({naive_fp / max(seq_fp, 1e-9):.1f}x)")
    print(f"  fixed-sample test, looked at once at the end:    {fixed_fp:.3f}")

    t0 = time.perf_counter()
    ab = run_many(n, effect=args.effect, looks=looks, users_per_look=per, alpha=args.alpha, seed=2)
    wins = [o for o in ab if o.sequential_sign > 0]
    users = [o.sequential_look * per for o in wins if o.sequential_look is not None]
    fixed = sum(o.final_fixed_significant and o.final_fixed_sign > 0 for o in ab) / n
    print(f"power, true effect +{args.effect} ({time.perf_counter() - t0:.1f}s)")
    print(f"  sequential: {len(wins) / n:.3f} promoted, median users needed "
          f"{statistics.median(users) if users else float('nan'):.0f} (of {looks * per})")
    print(f"  fixed-sample at the planned end: {fixed:.3f} significant, users needed {looks * per} (always all)")


if __name__ == "__main__":
    main()
