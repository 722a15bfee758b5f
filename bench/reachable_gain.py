"""How much accept rate the offline gate's KL bound lets any trainer reach: the KL-optimal frontier.

Every promotion must pass `deploy_gate.offline`'s KL bound (`max_kl`, 0.1 nats per token: mean per-token
KL(candidate || champion) over the candidate's own completions). The closed loop's target is +28% accept
within 5 promotions. This bench asks whether that is reachable at all under the bound, i.e. whether the
trainer or the gate is the limit, without training anything:

1. On held-out contexts (the closed loop's evaluation seed, never trained on), sample N completions per
   context from the base policy as serving does (`Policy.generate_batch`, temperature 1, max 16 tokens,
   declines included: a decline is shown nothing, as the simulator treats it), with their token counts.
2. Judge each with the population's ground truth (`Population.truth`): shown, p_accept, and Cursor's
   expected reward r = shown * (p_accept - 0.25), what the trainer's reward stands for.
3. The KL-regularised optimum is the reward tilt pi_lam ∝ pi_0 exp(lam r). Restricted to the samples,
   context c's sample i gets w_ci = softmax_i(lam r_ci) (self-normalised: the samples are pi_0's draws).
   Its accept rate is the shown-weighted mean p_accept; its per-token KL to pi_0 is
   sum_c sum_i w_ci log(N w_ci) / sum_c sum_i w_ci len_ci (total KL over total tokens, as the gate does).

Reported per population: (a) the frontier, accept vs per-token KL, and the accept at KL 0.1 (one
promotion); (b) a chain of promotions, each tilt's per-token KL to the previous one at most 0.1 (each lam_k
by bisection), the accept after each: the best any trainer can do within 5 gated promotions; (c) the
best-of-N cap (every context takes its highest-reward sample: lam = inf), beyond which N samples show
nothing. Gains are relative to the base accept rate, as the target is. Where `bench/results/closed_loop_
<population>_defaults.md` exists, its measured candidates (ground truth) are set beside the frontier.

What it does not say: the sample-restricted tilt can only reweight what pi_0 already writes, and its KL
saturates at log N nats a context, so at large KL it understates what a policy could reach; at 0.1 nats
per token (about 1 nat a completion) it is far from that limit. Different models and evaluation contexts
make the comparison with measured candidates approximate.

    python bench/reachable_gain.py [--model DIR] [--populations content,...] [--contexts 200] [--samples 64]
        [--max-kl 0.1] [--promotions 5] [--save-samples PATH | --from-samples PATH] [--out bench/results]

Without --model a default-preset model is bootstrapped for --bootstrap-seconds (240), as bench/closed_loop.py does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from scipy.special import logsumexp

if TYPE_CHECKING:
    from simulator.contexts import Context
    from simulator.populations import Population

TARGET = 0.28  # the closed loop's target: +28% accept within `--promotions` promotions
RESULTS = Path(__file__).parent / "results"  # where the closed loop's measured runs are
REJECT_COST = 0.25  # Cursor's reward for a shown suggestion is p_accept - 0.25 in expectation; silence pays 0


# ---- the tilt on a sample: pure functions of (contexts, samples) arrays --------------------------------


def log_tilt(reward: np.ndarray, lam: float) -> np.ndarray:
    """(C, N) log-weights of pi_lam ∝ pi_0 exp(lam * reward) over each context's N samples of pi_0.

    lam = 0 is pi_0 (uniform); lam = inf puts equal weight on each context's highest-reward samples."""
    if np.isinf(lam):
        best = reward >= reward.max(axis=1, keepdims=True)
        return np.where(best, -np.log(best.sum(axis=1, keepdims=True)), -np.inf)
    z = lam * reward
    return z - logsumexp(z, axis=1, keepdims=True)


def kl_per_token(logw: np.ndarray, logw_ref: np.ndarray, lengths: np.ndarray) -> float:
    """KL(pi || pi_ref) summed over contexts, over pi's expected tokens summed over contexts (the gate's mean
    per-token KL over pi's own completions: by the chain rule a sequence's KL is its tokens' KLs summed)."""
    w = np.exp(logw)
    kept = w > 0  # a sample pi never draws adds nothing, whatever pi_ref gives it
    return float((w[kept] * (logw[kept] - logw_ref[kept])).sum() / (w * lengths).sum())


def accept_rate(logw: np.ndarray, p_accept: np.ndarray, shown: np.ndarray) -> float:
    """Mean accept probability of shown suggestions under pi (the closed loop's accept rate)."""
    w = np.exp(logw) * shown
    return float((w * p_accept).sum() / w.sum()) if w.sum() > 0 else 0.0


def mean_reward(logw: np.ndarray, reward: np.ndarray) -> float:
    """Expected reward per request under pi."""
    return float((np.exp(logw) * reward).sum(axis=1).mean())


def next_lam(reward: np.ndarray, lengths: np.ndarray, lam_prev: float, bound: float,
             lam_cap: float = 1e8, iters: int = 60) -> float:  # fmt: skip
    """The largest lam >= lam_prev whose tilt is within `bound` nats per token of the tilt at lam_prev.

    Bisection in log lam: along the tilt the KL from a fixed earlier tilt grows with lam (its derivative is
    a variance of the reward). inf when even best-of-N is within the bound."""
    ref = log_tilt(reward, lam_prev)

    def kl(lam: float) -> float:
        return kl_per_token(log_tilt(reward, lam), ref, lengths)

    if np.isinf(lam_prev) or kl(np.inf) <= bound:
        return np.inf
    lo, hi = lam_prev, max(2 * lam_prev, lam_prev + 1.0)
    while kl(hi) <= bound:
        if hi > lam_cap:  # near-ties keep the KL just under the bound far out; lam_cap is best-of-N in effect
            return hi
        lo, hi = hi, 2 * hi
    for _ in range(iters):
        mid = np.sqrt(lo * hi) if lo > 0 else hi / 2
        lo, hi = (mid, hi) if kl(mid) <= bound else (lo, mid)
    return lo


def lam_for_accept(reward: np.ndarray, p_accept: np.ndarray, shown: np.ndarray, target: float,
                   iters: int = 60) -> float | None:  # fmt: skip
    """The smallest lam whose tilt's accept rate reaches `target` (None: not even best-of-N does), by
    bisection: the accept rate rises along the reward tilt on these samples (checked by the frontier)."""

    def accept(lam: float) -> float:
        return accept_rate(log_tilt(reward, lam), p_accept, shown)

    if accept(np.inf) < target:
        return None
    if accept(0.0) >= target:
        return 0.0
    lo, hi = 0.0, 1.0
    while accept(hi) < target:
        if hi > 1e8:
            return np.inf
        lo, hi = hi, 2 * hi
    for _ in range(iters):
        mid = np.sqrt(lo * hi) if lo > 0 else hi / 2
        lo, hi = (lo, mid) if accept(mid) >= target else (mid, hi)
    return hi


def promotion_chain(reward: np.ndarray, lengths: np.ndarray, bound: float, steps: int) -> list[float]:
    """lam_1 < ... < lam_steps: each promotion as far along the tilt as its KL to the previous one allows."""
    lams = [0.0]
    for _ in range(steps):
        lams.append(next_lam(reward, lengths, lams[-1], bound))
    return lams[1:]


# ---- sampling and judging ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Judged:
    """One population's judgment of the samples of its contexts: (C, N) arrays."""

    reward: np.ndarray
    p_accept: np.ndarray
    shown: np.ndarray
    lengths: np.ndarray  # tokens the policy chose, end-of-text included (what the gate's KL averages over)


def sample_completions(model: Path, prompts: list[str], n: int, max_tokens: int, seed: int,
                       batch: int) -> list[list[tuple[str, str, int]]]:  # fmt: skip
    """N seeded completions (text, finish_reason, tokens) of each prompt, sampled as serving samples (the same
    draws; their behaviour log-probs, which only the trainer reads, are not recomputed)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flywheel.lm import load_policy
    from flywheel.lm.policy import GenerationRequest

    policy = load_policy(model)
    requests = [GenerationRequest(p, max_tokens, 1.0, seed=seed + j * n + i)
                for j, p in enumerate(prompts) for i in range(n)]  # fmt: skip
    out: list[tuple[str, str, int]] = []
    columns = (TextColumn("[bold]sampling[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("sample", total=len(requests))
        for k in range(0, len(requests), batch):
            gens = policy.generate_batch(requests[k : k + batch], behaviour_logprobs=False)
            out += [(g.completion, g.finish_reason, len(g.completion_token_ids)) for g in gens]
            bar.update(task, advance=len(gens))
    return [out[j * n : (j + 1) * n] for j in range(len(prompts))]


def judge(pop: Population, contexts: list[Context], samples: list[list[tuple[str, str, int]]]) -> Judged:
    """The population's ground truth of every sample of `contexts` (`samples[j]` are context j's)."""
    truths = [[pop.truth(c, text, finish) for text, finish, _ in row]
              for c, row in zip(contexts, samples, strict=True)]  # fmt: skip
    shown = np.array([[t.shown for t in row] for row in truths], dtype=float)
    p = np.array([[t.p_accept for t in row] for row in truths])
    lengths = np.array([[n for *_, n in row] for row in samples], dtype=float)
    return Judged(shown * (p - REJECT_COST), p, shown, lengths)


# ---- the measured candidates ------------------------------------------------------------------------------


def measured_candidates(results: Path, pop: str) -> tuple[float, list[float], int] | None:
    """(base accept, candidates' accept in order, how many were trained from the base) from
    `closed_loop_<pop>_defaults.md`, the closed loop with the product's defaults; None when there is none."""
    path = results / f"closed_loop_{pop}_defaults.md"
    if not path.exists():
        return None
    text = path.read_text()
    base = re.search(rf"^\| {re.escape(pop)} \| ([0-9]+\.[0-9]+) \|", text, re.M)  # the summary row
    cands = [float(x) for x in re.findall(rf"candidate, {re.escape(pop)}: accept ([0-9.]+)", text)]
    decisions = re.findall(rf"^\| {re.escape(pop)} \| \d+ \| v\d+ \([^)]*\) \| (\w+):", text, re.M)
    if base is None or not cands:
        return None
    # Candidates up to and including the first promoted one were trained from the base model.
    from_base = decisions.index("promoted") + 1 if "promoted" in decisions else len(cands)
    return float(base.group(1)), cands, from_base


# ---- the report -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    population: str
    tuning: bool
    contexts: int
    base_accept: float
    base_shown: float
    base_tokens: float
    chain_accept: list[float]  # after each promotion
    chain_shown: list[float]
    chain_kl_base: list[float]  # each chain policy's per-token KL to the base
    best_accept: float  # best-of-N
    best_kl: float
    kl_for_target: float | None  # per-token KL to the base the tilt needs for +28% (None: beyond best-of-N)
    frontier: list[tuple[float, float]]  # (per-token KL to the base, accept)
    measured: tuple[float, list[float], int] | None


def analyse(name: str, tuning: bool, j: Judged, bound: float, steps: int, results: Path) -> Row:
    base = log_tilt(j.reward, 0.0)
    lams = promotion_chain(j.reward, j.lengths, bound, steps)
    chain = [log_tilt(j.reward, lam) for lam in lams]
    best = log_tilt(j.reward, np.inf)
    grid = [0.0, *np.logspace(-1, 3, 50), np.inf]
    base_accept = accept_rate(base, j.p_accept, j.shown)
    lam_target = lam_for_accept(j.reward, j.p_accept, j.shown, (1 + TARGET) * base_accept)
    frontier = [(kl_per_token(log_tilt(j.reward, lam), base, j.lengths),
                 accept_rate(log_tilt(j.reward, lam), j.p_accept, j.shown)) for lam in grid]  # fmt: skip
    return Row(
        population=name, tuning=tuning, contexts=j.reward.shape[0],
        base_accept=base_accept, base_shown=float(j.shown.mean()),
        base_tokens=float(j.lengths.mean()),
        chain_accept=[accept_rate(w, j.p_accept, j.shown) for w in chain],
        chain_shown=[float((np.exp(w) * j.shown).sum(axis=1).mean()) for w in chain],
        chain_kl_base=[kl_per_token(w, base, j.lengths) for w in chain],
        best_accept=accept_rate(best, j.p_accept, j.shown), best_kl=kl_per_token(best, base, j.lengths),
        kl_for_target=None if lam_target is None else kl_per_token(log_tilt(j.reward, lam_target), base, j.lengths),
        frontier=frontier, measured=measured_candidates(results, name),
    )  # fmt: skip


def rel(x: float, base: float) -> str:
    return f"{x / base - 1:+.0%}" if base else "-"


def table(rows: list[Row], bound: float, steps: int) -> list[str]:
    head = (f"| population | base accept (shown) | one promotion, KL <= {bound} | after 1..{steps} promotions"
            f" (accept, relative) | +{TARGET:.0%} in {steps}? | KL for +{TARGET:.0%} | KL to base after {steps}"
            " | best-of-N (accept; KL)"
            " | measured default candidates | their share of the one-promotion gain |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r.base_accept
        one = r.chain_accept[0]
        reached = next((k + 1 for k, a in enumerate(r.chain_accept) if a / b - 1 >= TARGET), None) if b else None
        verdict = f"**yes** (at {reached})" if reached else "no"
        chain = ", ".join(f"{a:.3f}" for a in r.chain_accept) + " (" + ", ".join(
            rel(a, b) for a in r.chain_accept) + ")"  # fmt: skip
        measured, share = "-", "-"
        if r.measured is not None:
            mb, cands, from_base = r.measured
            measured = ", ".join(f"{c:.3f} ({rel(c, mb)})" for c in cands) + f" on base {mb:.3f}"
            gain = one / b - 1
            best_from_base = max(c / mb - 1 for c in cands[:from_base])
            share = f"{best_from_base / gain:.0%}" if gain > 0 else "-"
        name = f"{r.population}{' (tuning)' if r.tuning else ''}"
        needed = "beyond best-of-N" if r.kl_for_target is None else f"{r.kl_for_target:.3f}"
        best = f"{r.best_accept:.3f} ({rel(r.best_accept, b)}; {r.best_kl:.2f})"
        lines.append(f"| {name} | {b:.3f} ({r.base_shown:.2f}) | {one:.3f} ({rel(one, b)}) | {chain} | {verdict}"
                     f" | {needed} | {r.chain_kl_base[-1]:.2f} | {best} | {measured} | {share} |")  # fmt: skip
    return lines


def plot(rows: list[Row], bound: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for r in rows:
        kls, accs = zip(*r.frontier, strict=True)
        line = ax.plot(kls, [a / r.base_accept - 1 for a in accs], label=r.population)[0]
        ax.plot(r.chain_kl_base, [a / r.base_accept - 1 for a in r.chain_accept], "o", color=line.get_color())
    ax.axvline(bound, color="grey", ls=":", label=f"one promotion's bound ({bound})")
    ax.axhline(TARGET, color="black", ls="--", lw=0.8, label=f"target +{TARGET:.0%}")
    ax.set_xscale("symlog", linthresh=0.05)
    ax.set_xlim(left=0)
    ax.set_xlabel("per-token KL to the base policy (nats)")
    ax.set_ylabel("accept rate, relative to the base")
    ax.set_title("Reward-tilted frontier on the base's samples (dots: gated promotions)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from simulator.closed_loop import eval_set
    from simulator.contexts import fit_prompts, held_out_contexts
    from simulator.populations import populations_named, reporting_populations, tuning_populations

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--bootstrap-seconds", type=float, default=240.0)
    names = [p.name for p in reporting_populations() + tuning_populations()]
    ap.add_argument("--populations", default=",".join(names))
    ap.add_argument("--contexts", type=int, default=200, help="held-out code contexts (and up to half as many comment)")
    ap.add_argument("--context-seed", type=int, default=10_000, help="the closed loop's evaluation seed")
    ap.add_argument("--samples", type=int, default=64, help="completions per context")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-kl", type=float, help="per-token KL bound (default: OfflineGateConfig().max_kl)")
    ap.add_argument("--promotions", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-samples", type=Path, help="write the completions here (JSON) to re-report later")
    ap.add_argument("--from-samples", type=Path, help="judge the completions an earlier run saved; no sampling")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--report", default="reachable_gain", help="file name (no suffix) of the table and PNG")
    args = ap.parse_args()
    if args.max_kl is None:
        from deploy_gate.offline.config import OfflineGateConfig

        args.max_kl = OfflineGateConfig().max_kl
    pops = populations_named(args.populations.split(","))
    tuning = {p.name for p in tuning_populations()}
    pool = held_out_contexts(args.contexts, args.context_seed, preset=args.preset)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if args.from_samples:
            saved = json.loads(args.from_samples.read_text())
            model_desc, samples = saved["model"], saved["samples"]
            pool = fit_prompts(pool, saved["room"])
        else:
            from flywheel.lm import bootstrap_model, load_policy

            model = args.model or bootstrap_model(Path(tmp) / "model", preset=args.preset, seed=0,
                                                  max_seconds=args.bootstrap_seconds, progress=False)  # fmt: skip
            room = load_policy(model).context - args.max_tokens
            pool = fit_prompts(pool, room)  # as the closed loop fits its evaluation prompts
            prompts = [c.prompt for c in pool.code + pool.comment]
            samples = sample_completions(model, prompts, args.samples, args.max_tokens, args.seed * 10**7, args.batch)
            model_desc = str(args.model or f"bootstrapped {args.bootstrap_seconds:.0f}s")
            if args.save_samples:
                args.save_samples.write_text(json.dumps({"model": model_desc, "room": room, "samples": samples}))
    contexts = list(pool.code + pool.comment)
    if len(samples) != len(contexts):
        sys.exit(f"{len(samples)} saved sample rows for {len(contexts)} contexts: other --contexts/--context-seed?")
    index = {c: k for k, c in enumerate(contexts)}
    rows = []
    for pop in pops:
        chosen = eval_set(pool, pop)
        judged = judge(pop, chosen, [samples[index[c]] for c in chosen])
        rows.append(analyse(pop.name, pop.name in tuning, judged, args.max_kl, args.promotions, RESULTS))
    n = len(samples[0])
    header = [f"# bench/reachable_gain.py {' '.join(sys.argv[1:])}", "",
              f"model {model_desc}; {len(contexts)} held-out contexts (seed {args.context_seed}), {n} samples each,"
              f" temperature 1, max {args.max_tokens} tokens; bound {args.max_kl} nats/token per promotion;"
              f" {time.perf_counter() - started:.0f}s", ""]  # fmt: skip
    lines = header + table(rows, args.max_kl, args.promotions)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.report}.md").write_text("\n".join(lines) + "\n")
    plot(rows, args.max_kl, args.out / f"{args.report}.png")
    print(f"wrote {args.out / args.report}.md and .png")


if __name__ == "__main__":
    main()
