"""The embedded model's base accept rate per population, and what longer pretraining buys.

Each model is measured as the closed-loop benchmark measures its champion (`simulator.closed_loop.
evaluate_policy`: held-out contexts, fixed seeds, the simulator's ground truth, no events), so the numbers
are the "base accept" of `bench/closed_loop.py`. The first model is the baseline; each other one is
reported as a ratio of its accept rate to the baseline's, per population, beside the absolute rates.

    python bench/base_model.py --model DIR [--model DIR2 ...] [--eval-contexts 100] [--repeats 2]

To compare pretraining budgets, bootstrap a model, copy it, and resume the copy:

    flywheel model bootstrap --out A --seconds 240
    cp -r A B && cp A.pretrain-state.pt B.pretrain-state.pt
    flywheel model bootstrap --out B --resume --seconds 360
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flywheel.lm import METADATA_FILE, load_policy
from simulator.closed_loop import evaluate_policy
from simulator.contexts import held_out_contexts
from simulator.populations import default_populations


def describe(model: Path) -> str:
    meta_file = model / METADATA_FILE
    if not meta_file.exists():
        return str(model)
    meta = json.loads(meta_file.read_text())
    corpus = meta["corpus"]
    return (f"{model.name}: {meta['steps']} steps, {meta['tokens_seen']:,} tokens seen of a {corpus['tokens']:,}"
            f"-token corpus ({corpus['source']}), loss {meta['final_loss']:.3f}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, action="append", required=True, help="repeat; the first is the baseline")
    ap.add_argument("--eval-contexts", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2, help="samples per context (fixed seeds)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    pops = default_populations()
    # The closed-loop benchmark's evaluation contexts (same seed offset), from the default preset's held-out files.
    contexts = held_out_contexts(args.eval_contexts, args.seed + 10_000, preset="default")
    results = []
    for model in args.model:
        started = time.perf_counter()
        truths = evaluate_policy(load_policy(model), pops, contexts, args.max_tokens, args.repeats)
        results.append(truths)
        print(f"{describe(model)}; measured in {time.perf_counter() - started:.0f}s", flush=True)
    names = [m.name for m in args.model]
    print("\n| population | " + " | ".join(f"{n} accept / shown / reward" for n in names)
          + "".join(f" | {n} accept over {names[0]}" for n in names[1:]) + " |")  # fmt: skip
    print("|---" * (1 + len(names) + len(names) - 1) + "|")
    for pop in pops:
        base = results[0][pop.name]
        cells = [f"{r[pop.name].accept_rate:.3f} / {r[pop.name].shown_rate:.2f} / {r[pop.name].reward:+.3f}"
                 for r in results]  # fmt: skip
        ratios = [f"{r[pop.name].accept_rate / base.accept_rate:.2f}x" if base.accept_rate else "-"
                  for r in results[1:]]  # fmt: skip
        print(f"| {pop.name} | " + " | ".join(cells + ratios) + " |")


if __name__ == "__main__":
    main()
