"""How much of the KL-optimal frontier's gain one training cycle of a `TrainerConfig` reaches, offline.

The closed loop (`bench/closed_loop.py`, ~45 min a run) is too slow to tune the trainer with; this bench
asks only its trainer's question, from logged reactions only, as production trains:

1. Logged data (cached per population under `--cache`, so every config trains on the same): the base policy
   serves `--samples` requests drawn as `SimulatedProduct.step` draws them (the closed loop's training
   contexts, `held_out_contexts(300, seed)`, fitted to the prompt room; a context by the population's
   comment share, then a request seed, then the user's reaction, all from one seeded rng), sampled as
   serving samples (temperature 1, max 16 tokens, declines included). Each reaction becomes the events the
   product sends (`segment_messages`) and the default reward definition (`signals.reward.RewardDefinition()`,
   rules-v1) scores them, so the reward is the signals' own: thumbs +-1, accepted and kept +0.75 (times the
   retention factor when a retention check came, 1.0 here), accepted then undone -0.10, shown and rejected
   -0.25, declined 0. Approximations: every event is in the reward window (the closed loop stamps one time
   per request too) and nothing is late; the behaviour log-probs are the trainer's batched scorer's
   (`trainer.scoring.scorer_for(False)`, what the default trainer trains with) instead of serving's exact
   ones (they differ by ~1e-3); a fifth of prompts is held out by `flywheel.holdout.in_holdout` when the
   config's `ope_holdout_share` says so, as `trainer.data` does.
2. Train as `trainer.cycle` does: load the base, time from before the reference scoring, the reference is the
   base's log-probs by the training scorer, `train_policy` with the config's deadline (`time_budget_s` from
   the first step, after the scoring and any own-sample sampling),
   then bfloat16 rounding when `save_dtype` says so. `{"update": "lora"}` trains a fresh adapter on the frozen
   base (`trainer.cycle.prepare_update`), as a LoRA cycle from a full-weights champion does. Not done: the
   exact-scorer mismatch check (64 samples; a few seconds of the budget in production) and registering the
   candidate.
3. Measure on the closed loop's evaluation contexts (`held_out_contexts(100, seed + 10_000)`, the
   population's `eval_set`, `repeats` fixed seeds each: `simulator.closed_loop.eval_generations`, what
   `evaluate_policy` judges): the candidate's accept rate against the base's (the same seeds, so paired;
   95% interval by a seeded bootstrap over contexts), the offline gate's KL (`deploy_gate.offline.measure.
   mean_kl`: per-token KL(candidate || base) over the candidate's own completions of the first
   `--kl-repeats` repeats), and the frontier (`bench/reachable_gain.py`'s reward tilt over the base's
   `repeats` samples of each context): its accept at the candidate's KL, and at the gate's bound.
   "share" = the candidate's relative gain / the frontier's relative gain at the candidate's KL;
   "share@bound" = the same over the frontier's gain at the bound (one promotion's reach).

The frontier knows each sample's true accept probability, so it is an upper bound for any trainer; with
`repeats` samples a context it understates the 64-sample frontier a little (bench/results/reachable_gain.md).

    python bench/trainer_efficiency.py --model DIR --populations length,style --cache DIR \\
        --grid '[{}, {"learning_rate": 1e-3}]' [--samples 3000] [--repeats 8] [--out bench/results/x.md]

Each grid entry is JSON overrides of the product's trainer config (`launcher.up.demo_trainer_config`, as
`bench/closed_loop.py` builds it); `{}` is the product's config.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from reachable_gain import REJECT_COST, accept_rate, log_tilt, next_lam  # noqa: E402

if TYPE_CHECKING:
    from flywheel.lm.policy import Generation, Policy
    from simulator.contexts import Context, ContextPool
    from simulator.populations import Population, Reaction
    from trainer.config import TrainerConfig
    from trainer.data import Sample

BOOTSTRAP = 2000  # resamples of the contexts for the interval


# ---- 1. logged data ---------------------------------------------------------------------------------------


def signals_reward(reaction: Reaction, text: str, finish: str) -> float:
    """The default reward definition's reward of the events a product sends for `reaction`."""
    from signals.events import FeedbackEvent, GenerationInfo
    from signals.reward import RewardDefinition
    from simulator.product import segment_messages

    now = datetime(2026, 1, 1, tzinfo=UTC)
    ts = int(now.timestamp() * 1e6)
    events = [FeedbackEvent(m["messageId"], m["event"], ts, m["properties"])
              for m in segment_messages("g", "u", text, reaction, now=now)]  # fmt: skip
    gen = GenerationInfo("g", ts, finish_reason=finish, completion_chars=len(text))
    return RewardDefinition().score(gen, events).reward


def log_requests(policy: Policy, pop: Population, pool: ContextPool, n: int, seed: int, max_tokens: int,
                 batch: int) -> list[dict[str, Any]]:  # fmt: skip
    """`n` requests of `pop`'s users served by `policy`, with their reactions and rewards (JSON-able rows)."""
    from flywheel.lm.policy import GenerationRequest
    from trainer.loop import score_samples
    from trainer.scoring import scorer_for

    rng = random.Random(seed)
    drawn: list[tuple[Context, int]] = []
    for _ in range(n):
        ctx = pool.draw(rng, pop.comment_share)
        drawn.append((ctx, rng.randrange(2**31)))
    gens: list[Generation] = []
    with progress("logging " + pop.name, n) as advance:
        for k in range(0, n, batch):
            chunk = [GenerationRequest(c.prompt, max_tokens, 1.0, seed=s) for c, s in drawn[k : k + batch]]
            gens += policy.generate_batch(chunk, behaviour_logprobs=False)
            advance(len(chunk))
    rows = []
    react_rng = random.Random(seed + 1)
    for (ctx, _), g in zip(drawn, gens, strict=True):
        truth = pop.truth(ctx, g.completion, g.finish_reason)
        reaction = pop.react(truth, react_rng)
        rows.append({"prompt": ctx.prompt, "prompt_ids": g.prompt_token_ids, "completion_ids": g.completion_token_ids,
                     "reward": signals_reward(reaction, g.completion, g.finish_reason),
                     "p_accept": truth.p_accept, "shown": truth.shown})  # fmt: skip
    samples = to_samples(rows, [None] * len(rows))
    behaviour = score_samples(policy.model, samples, scorer_for(False), policy.pad_id, 16)
    for row, lp in zip(rows, behaviour, strict=True):
        row["logprobs"] = lp
    return rows


def to_samples(rows: Sequence[dict[str, Any]], logprobs: Sequence[list[float] | None]) -> list[Sample]:
    from trainer.data import Sample

    at = datetime(2026, 1, 1, tzinfo=UTC)
    return [Sample(f"g{k}", f"u{k}", r["prompt_ids"], r["completion_ids"], lp, r["reward"], "base", at)
            for k, (r, lp) in enumerate(zip(rows, logprobs, strict=True))]  # fmt: skip


def training_samples(rows: Sequence[dict[str, Any]], holdout_share: float) -> list[Sample]:
    """The rows a cycle would train on: all but the offline estimate's held-out prompts."""
    from flywheel.holdout import in_holdout

    kept = [r for r in rows if not in_holdout(r["prompt"], holdout_share)]
    return to_samples(kept, [r["logprobs"] for r in kept])


# ---- 2. one training cycle --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trained:
    policy: Policy
    seconds: float
    steps: int
    samples: int
    trained_on: int
    stopped_at: str
    prepare_cpu: float  # CPU-seconds (this process) from the reference scoring to the first step
    own_note: str = ""
    train_cpu: float = 0.0  # CPU-seconds (this process) from the first step to the last


def train(model: Path, samples: list[Sample], config: TrainerConfig) -> Trained:
    """One cycle's training from the base, as `trainer.phases` (prepare, optimise) trains."""
    import math

    import torch

    from flywheel.lm import load_policy
    from flywheel.lm.precision import round_parameters_to_bfloat16_
    from trainer.cycle import prepare_update
    from trainer.loop import score_samples, train_policy
    from trainer.scoring import scorer_for

    torch.manual_seed(config.seed)
    policy = load_policy(model, device=config.device, dtype=config.dtype)
    prepare_update(policy, config)  # "lora": a fresh adapter on the frozen base, as a cycle from full weights
    scorer = scorer_for(config.exact_logprobs)
    started, cpu_started = time.monotonic(), time.process_time()
    reference = score_samples(policy.model, samples, scorer, policy.pad_id, config.batch_size)
    own_note = ""
    if config.own_samples:
        from trainer.reward_model import CpuBudget, own_samples

        # as trainer.cycle: the CPU budget counts from the logged samples' scoring
        own = own_samples(policy, samples, reference, config, scorer,
                          budget=CpuBudget(config.own_cpu_budget_s, cpu_started))  # fmt: skip
        samples, reference, own_note = own.samples, own.reference, own.note
        print(own.note, flush=True)
    prepare_cpu = time.process_time() - cpu_started
    cpu_training = time.process_time()
    deadline = time.monotonic() + config.time_budget_s if config.time_budget_s else None  # as trainer.cycle
    with progress("training", math.ceil(len(samples) / config.batch_size) * config.epochs) as advance:
        training = train_policy(policy.model, samples, reference, config, scorer, policy.pad_id,
                                on_step=lambda _: advance(1), stop_ids=policy.stop_ids, deadline=deadline)  # fmt: skip
    seconds = time.monotonic() - started
    train_cpu = time.process_time() - cpu_training
    if config.save_dtype == "bfloat16":
        round_parameters_to_bfloat16_(policy.model, config.seed)
    return Trained(policy, seconds, len(training.history), len(samples), training.samples_reached, training.stopped_at,
                   prepare_cpu, own_note, train_cpu)  # fmt: skip


def text_log_losses(policy: Policy, texts: Sequence[Sequence[int]], batch: int = 16) -> np.ndarray:
    """Each text's mean next-token log-loss (nats per token) under `policy`: what a language-model gate reads."""
    import torch

    from trainer.scoring import batched_token_logprobs

    out = []
    with torch.no_grad():
        for k in range(0, len(texts), batch):
            chunk = [list(t) for t in texts[k : k + batch]]
            lp, mask = batched_token_logprobs(policy.model, [t[:1] for t in chunk], [t[1:] for t in chunk],
                                              policy.pad_id)  # fmt: skip
            out.extend((-(lp * mask).sum(1) / mask.sum(1).clamp(min=1)).tolist())
    return np.array(out)


def paired_delta(cand: np.ndarray, base: np.ndarray) -> str:
    """Mean per-text log-loss difference with a 95% normal interval (paired over the same texts)."""
    d = cand - base
    half = 1.96 * d.std(ddof=1) / np.sqrt(len(d))
    return f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]"


def general_texts(policy: Policy, n: int, chars: int, seed: int) -> list[list[int]]:
    """`n` windows of `chars` characters from standard-library files the default preset's bootstrap never trained on
    (`flywheel.lm.corpus.held_out_files`, as the offline gate's held-out text), tokenised, seeded."""
    from flywheel.lm import PRESETS
    from flywheel.lm.corpus import held_out_files

    rng = random.Random(seed)
    files = held_out_files(PRESETS["default"].n_files, 0)
    out: list[list[int]] = []
    for f in rng.sample(files, len(files)):
        text = f.read_text(encoding="utf-8", errors="replace")
        if len(text) < 2 * chars:
            continue
        start = rng.randrange(len(text) - chars)
        out.append(policy.encode_prompt(text[start : start + chars], max_tokens=1))
        if len(out) == n:
            break
    return out


# ---- 3. measurement ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Judged:
    """A policy's evaluation samples, (contexts, repeats) arrays."""

    p_accept: np.ndarray
    shown: np.ndarray
    lengths: np.ndarray  # tokens chosen, end-of-text included

    @property
    def reward(self) -> np.ndarray:
        return self.shown * (self.p_accept - REJECT_COST)

    def accept(self) -> float:
        return accept_rate(np.zeros_like(self.p_accept), self.p_accept, self.shown)

    def to_json(self) -> dict[str, list[list[float]]]:
        return {k: getattr(self, k).tolist() for k in ("p_accept", "shown", "lengths")}


def judge(pop: Population, judged: list[tuple[Context, Generation]], repeats: int) -> Judged:
    """`eval_generations`' repeat-major list as (contexts, repeats) arrays of the population's truth."""
    truths = [pop.truth(c, g.completion, g.finish_reason) for c, g in judged]
    n = len(judged) // repeats

    def grid(values: list[float]) -> np.ndarray:
        return np.array(values, dtype=float).reshape(repeats, n).T

    return Judged(grid([t.p_accept for t in truths]), grid([float(t.shown) for t in truths]),
                  grid([float(len(g.completion_token_ids)) for _, g in judged]))  # fmt: skip


def relative_gain_interval(cand: Judged, base: Judged, seed: int = 0) -> tuple[float, float, float]:
    """Candidate accept / base accept - 1 and its 95% bootstrap interval, resampling contexts (paired: the
    same contexts and seeds on both sides)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, cand.p_accept.shape[0], size=(BOOTSTRAP, cand.p_accept.shape[0]))

    def rate(j: Judged, rows: np.ndarray) -> np.ndarray:
        shown = j.shown[rows].sum(axis=(-1, -2))
        return (j.shown * j.p_accept)[rows].sum(axis=(-1, -2)) / np.maximum(shown, 1e-12)

    point = cand.accept() / base.accept() - 1
    boot = rate(cand, idx) / rate(base, idx) - 1
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(point), float(lo), float(hi)


def frontier_accept(base: Judged, kl: float) -> float:
    """The reward tilt's accept rate at per-token KL `kl` to the base, over the base's samples."""
    if kl <= 0:
        return base.accept()
    lam = next_lam(base.reward, base.lengths, 0.0, kl)
    return accept_rate(log_tilt(base.reward, lam), base.p_accept, base.shown)


def share(gain: float, frontier_gain: float) -> float | None:
    """The candidate's relative gain as a share of the frontier's (None when the frontier gains nothing)."""
    return gain / frontier_gain if frontier_gain > 1e-9 else None


def gate_kl(candidate: Policy, base: Policy, judged: list[tuple[Context, Generation]]) -> float:
    from deploy_gate.offline.measure import Sampled, mean_kl

    return mean_kl(candidate, base, Sampled([g for _, g in judged]))


# ---- the report -------------------------------------------------------------------------------------------


def progress(label: str, total: int) -> Any:
    """A rich progress bar as the other benches show; the context manager yields `advance(n)`."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    @contextmanager
    def bar() -> Any:
        columns = (TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, transient=True) as p:
            task = p.add_task(label, total=total)
            yield lambda n: p.update(task, advance=n)

    return bar()


def frac(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def main() -> None:
    from flywheel.lm import load_policy
    from launcher.demo import DEMO
    from launcher.up import demo_trainer_config
    from simulator.closed_loop import eval_generations
    from simulator.contexts import fit_prompts, held_out_contexts
    from simulator.populations import populations_named, tuning_populations

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--preset", default="default")
    ap.add_argument("--populations", default=",".join(p.name for p in tuning_populations()[:2]))
    ap.add_argument("--grid", default="[{}]", help="JSON list of overrides of the product's trainer config")
    ap.add_argument("--samples", type=int, default=3000, help="logged requests per population")
    ap.add_argument("--repeats", type=int, default=8, help="fixed seeds per evaluation context")
    ap.add_argument("--kl-repeats", type=int, default=2, help="repeats whose candidate samples the gate's KL reads")
    ap.add_argument("--eval-contexts", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-kl", type=float, help="the gate's bound (default: OfflineGateConfig().max_kl)")
    ap.add_argument("--seed", type=int, default=0, help="the closed loop's --seed (its contexts)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cache", type=Path, required=True, help="logged data and base evaluations, per population")
    ap.add_argument("--out", type=Path, help="append the table to this markdown file")
    ap.add_argument("--lm-texts", type=int, default=64, help="held-out general texts the log-loss columns read")
    args = ap.parse_args()
    if args.max_kl is None:
        from deploy_gate.offline.config import OfflineGateConfig

        args.max_kl = OfflineGateConfig().max_kl
    grid = json.loads(args.grid)
    base_policy = load_policy(args.model)
    # the language model kept: log-loss on general held-out text and on the product's own (evaluation) contexts
    general = general_texts(base_policy, args.lm_texts, 600, args.seed)
    room = base_policy.context - args.max_tokens
    contexts = fit_prompts(held_out_contexts(300, args.seed, preset=args.preset), room)
    evals = fit_prompts(held_out_contexts(args.eval_contexts, args.seed + 10_000, preset=args.preset), room)
    args.cache.mkdir(parents=True, exist_ok=True)
    lines = [f"# bench/trainer_efficiency.py {' '.join(sys.argv[1:])}", "",
             f"model {args.model}; product config {DEMO.trainer} over TrainerConfig; {args.samples} logged"
             f" requests per population; {args.repeats} seeds per evaluation context; gate bound {args.max_kl}", "",
             "| population | config | trained on (steps, stop) | train s | gate KL | accept (base) | vs base [95%] "
             "| frontier at that KL | share | share@bound | prep CPU-s (own prompts) | train CPU-s "
             "| log-loss vs base, text [95%] | log-loss vs base, contexts [95%] |", "|---" * 14 + "|"]  # fmt: skip
    base_text = text_log_losses(base_policy, general)
    context_ids = [base_policy.encode_prompt(c.prompt, max_tokens=1) for c in (*evals.code, *evals.comment)]
    base_contexts = text_log_losses(base_policy, context_ids)
    print(f"base log-loss: {base_text.mean():.3f} on {len(general)} general texts, {base_contexts.mean():.3f} on"
          f" {len(context_ids)} evaluation contexts", flush=True)  # fmt: skip
    print("\n".join(lines), flush=True)
    for pop in populations_named(args.populations.split(",")):
        tag = f"{args.model.name}-{pop.name}-{args.samples}-s{args.seed}-t{args.max_tokens}"
        logged_path = args.cache / f"{tag}.json"
        if logged_path.exists():
            rows = json.loads(logged_path.read_text())
        else:
            rows = log_requests(base_policy, pop, contexts, args.samples, args.seed, args.max_tokens, args.batch)
            logged_path.write_text(json.dumps(rows))
        # the seed picks the evaluation contexts: a base evaluated on other contexts would not pair with the candidate
        evaluated = f"eval{args.eval_contexts}-r{args.repeats}-s{args.seed}"
        base_path = args.cache / f"{args.model.name}-{pop.name}-{evaluated}.json"
        if base_path.exists():
            raw = json.loads(base_path.read_text())
            base = Judged(*(np.array(raw[k]) for k in ("p_accept", "shown", "lengths")))
        else:
            with progress(f"evaluating the base on {pop.name}", 1):
                base = judge(pop, eval_generations(base_policy, pop, evals, args.max_tokens, args.repeats),
                             args.repeats)  # fmt: skip
            base_path.write_text(json.dumps(base.to_json()))
        bound_gain = frontier_accept(base, args.max_kl) / base.accept() - 1
        logged_accept = np.mean([r["p_accept"] for r in rows if r["shown"]])
        print(f"{pop.name}: {len(rows)} logged (mean reward {np.mean([r['reward'] for r in rows]):+.3f}, accept"
              f" {logged_accept:.3f}); base accept {base.accept():.3f} on {base.p_accept.shape[0]} contexts;"
              f" frontier at {args.max_kl}: {bound_gain:+.0%}", flush=True)  # fmt: skip
        for overrides in grid:
            config = demo_trainer_config(**{"seed": args.seed, **overrides})
            trained = train(args.model, training_samples(rows, config.ope_holdout_share), config)
            with progress(f"evaluating on {pop.name}", 1):
                judged = eval_generations(trained.policy, pop, evals, args.max_tokens, args.repeats)
            cand = judge(pop, judged, args.repeats)
            kl = gate_kl(trained.policy, base_policy, judged[: args.kl_repeats * base.p_accept.shape[0]])
            gain, lo, hi = relative_gain_interval(cand, base)
            at_kl = frontier_accept(base, kl) / base.accept() - 1
            name = json.dumps(overrides) if overrides else "product default"
            stop = f", {trained.stopped_at}" if trained.stopped_at else ""
            covered = "-"
            if trained.own_note.startswith("own samples for "):
                covered = trained.own_note.removeprefix("own samples for ").split(" distinct")[0]
            elif trained.own_note:
                covered = "none: logged samples"  # the reward model predicted nothing (its note says why)
            lm_text = paired_delta(text_log_losses(trained.policy, general), base_text)
            lm_contexts = paired_delta(text_log_losses(trained.policy, context_ids), base_contexts)
            line = (f"| {pop.name} | `{name}` | {trained.trained_on}/{trained.samples} ({trained.steps}{stop}) "
                    f"| {trained.seconds:.0f} | {kl:.3f}{'' if kl < args.max_kl else ' (over)'} "
                    f"| {cand.accept():.3f} ({base.accept():.3f}) | {gain:+.1%} [{lo:+.1%}, {hi:+.1%}] "
                    f"| {at_kl:+.1%} | {frac(share(gain, at_kl))} | {frac(share(gain, bound_gain))} "
                    f"| {trained.prepare_cpu:.0f} ({covered}) | {trained.train_cpu:.0f} | {lm_text} "
                    f"| {lm_contexts} |")  # fmt: skip
            lines.append(line)
            print(line, flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
        print(f"appended to {args.out}")


if __name__ == "__main__":
    main()
