"""The language-model gate's decisions over many trained candidates, against their ground truth.

For each candidate (trained from the base on one population's rewarded samples, at a range of learning
rates, with the population's rewards or their inverse, so some are better and some worse):

- the old gate: perplexity ratio on 16 held-out texts <= 1.05, no interval (what refused v3 and v4);
- the new gate: `lm_vs_champion` as the product runs it (`deploy_gate.offline.gates._language_model` with the
  default `OfflineGateConfig`, general held-out text only: there is no lake here), passed / failed / undecided;
- ground truth for users: the population's expected reward, shown * (p_accept - 0.25) (Cursor's reward),
  of the candidate's seeded completions of held-out evaluation contexts, against the base's on the same
  contexts and seeds (better / worse when the difference passes +-`--tie`);
- ground truth for the language model: the mean token log-loss difference on 400 other held-out windows
  (another seed), against the gate's margin.

Printed: each candidate's row, then the counts: refused-but-better and passed-but-worse (users' truth), and
refused-but-within-the-margin / passed-but-beyond-it (the language model's truth), for both gates. The bare
baseline of the same work: one forward pass per window of the base alone (the gate's cost is a multiple of it).

    .venv/bin/python bench/lm_gate_decisions.py [--model DIR | --preset test] [--populations content,brackets,noisy]
        [--lrs 3e-4,1e-3,3e-3,1e-2,3e-2] [--contexts 120] [--eval-contexts 80]

Without --model a model of `--preset` (default "test", seconds to bootstrap) is bootstrapped; `--preset default`
for the product's model (minutes).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

OLD_RATIO = 1.05
OLD_TEXTS = 16
REJECT_COST = 0.25


@dataclass
class Row:
    population: str
    lr: float
    sign: int
    reward_diff: float  # candidate - base, users' ground truth
    true_lm_diff: float  # nats/token, on other windows
    old_ratio: float
    old_verdict: str
    new_verdict: str
    new_mean: float
    new_ci: tuple[float, float]
    new_windows: int


def sample(policy, prompts: list[str], n: int, seed: int, max_tokens: int = 16):  # noqa: ANN001, ANN201
    from flywheel.lm.policy import GenerationRequest

    requests = [GenerationRequest(p, max_tokens, 1.0, seed=seed + j * n + i) for j, p in enumerate(prompts)
                for i in range(n)]  # fmt: skip
    return [g for k in range(0, len(requests), 32) for g in policy.generate_batch(requests[k : k + 32])]


def expected_reward(policy, pop, contexts, n: int, seed: int) -> float:  # noqa: ANN001
    gens = sample(policy, [c.prompt for c in contexts], n, seed)
    total = 0.0
    for j, g in enumerate(gens):
        t = pop.truth(contexts[j // n], g.completion, g.finish_reason)
        total += float(t.shown) * (t.p_accept - REJECT_COST)
    return total / len(gens)


def train(base_dir: Path, pop, contexts, lr: float, sign: int, seed: int, out: Path) -> Path:  # noqa: ANN001
    """The base after one epoch on 2 seeded samples a context, rewarded +0.75 / -0.25 by simulated accepts."""
    from flywheel.lm import load_policy
    from trainer.config import TrainerConfig
    from trainer.data import Sample
    from trainer.loop import score_samples, train_policy
    from trainer.scoring import scorer_for

    policy = load_policy(base_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    gens = sample(policy, [c.prompt for c in contexts], 2, seed)
    now = datetime.now(UTC)
    samples = []
    for j, g in enumerate(gens):
        t = pop.truth(contexts[j // 2], g.completion, g.finish_reason)
        reward = (0.75 if rng.random() < t.p_accept else -0.25) if t.shown else 0.0
        samples.append(Sample(f"g{j}", f"u{j % 50}", g.prompt_token_ids, g.completion_token_ids, g.logprobs,
                              sign * reward, "1", now))  # fmt: skip
    config = TrainerConfig(learning_rate=lr, batch_size=16, epochs=1, baseline=0.0, seed=seed)
    scorer = scorer_for(False)
    reference = score_samples(policy.model, samples, scorer, policy.pad_id, 16)
    policy.model.train()
    train_policy(policy.model, samples, reference, config, scorer, policy.pad_id, stop_ids=policy.stop_ids)
    policy.model.eval()
    return policy.save(out)


def old_gate(candidate, champion, texts: list[str], window: int) -> tuple[float, str]:  # noqa: ANN001
    """The replaced gate: perplexity over the first `OLD_TEXTS` texts, candidate / champion <= 1.05."""

    def ppl(policy) -> float:  # noqa: ANN001
        nll, tokens = 0.0, 0
        for text in texts[:OLD_TEXTS]:
            ids = list(policy.tokenizer(text, truncation=True, max_length=window)["input_ids"])
            with torch.inference_mode():
                inputs = torch.tensor([ids])
                lp = torch.log_softmax(policy.model(input_ids=inputs).logits[0, :-1].float(), -1)
                nll -= float(lp.gather(-1, inputs[0, 1:, None]).sum())
            tokens += len(ids) - 1
        return math.exp(nll / tokens)

    ratio = ppl(candidate) / ppl(champion)
    return ratio, "passed" if ratio <= OLD_RATIO else "failed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--preset", default="test")
    ap.add_argument("--bootstrap-seconds", type=float, default=240.0)
    ap.add_argument("--populations", default="content,brackets,noisy")
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3,1e-2,3e-2")
    ap.add_argument("--contexts", type=int, default=120)
    ap.add_argument("--eval-contexts", type=int, default=80)
    ap.add_argument("--tie", type=float, default=0.01, help="|reward difference| below this is a tie")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from deploy_gate.offline import OfflineGateConfig, lm
    from deploy_gate.offline.heldout import held_out
    from flywheel.lm import bootstrap_model, load_policy
    from simulator.contexts import held_out_contexts
    from simulator.populations import populations_named

    tmp = Path(tempfile.mkdtemp(prefix="lm-gate-bench-"))
    base_dir = args.model or bootstrap_model(tmp / "base", preset=args.preset, seed=0,
                                             max_seconds=args.bootstrap_seconds, progress=False)  # fmt: skip
    preset = args.preset if args.model is None else "default"
    base = load_policy(base_dir)
    cfg = OfflineGateConfig()
    chars = cfg.text_window_tokens * 4
    gate_texts = held_out(base_dir, 0, cfg.n_text_windows, chars, cfg.seed).texts
    gate_items = lm.windows(base, gate_texts, "general", cfg.text_window_tokens)
    truth_windows = lm.windows(base, held_out(base_dir, 0, 400, chars, cfg.seed + 1).texts, "general",
                               cfg.text_window_tokens)  # fmt: skip
    started = time.process_time()
    base_truth = np.array([lm.mean_loss(base, w.ids) for w in truth_windows])
    bare_s = time.process_time() - started
    train_ctx = list(held_out_contexts(args.contexts, 1, preset=preset).code)
    eval_ctx = list(held_out_contexts(args.eval_contexts, 2, preset=preset).code)
    rows: list[Row] = []
    gate_cpu = 0.0
    for pop in populations_named(args.populations.split(",")):
        base_reward = expected_reward(base, pop, eval_ctx, 2, seed=7)
        for lr in (float(x) for x in args.lrs.split(",")):
            for sign in (1, -1):
                out = train(base_dir, pop, train_ctx, lr, sign, seed=len(rows), out=tmp / f"c{len(rows)}")
                cand = load_policy(out)
                t0 = time.process_time()
                # What `lm_vs_champion` runs (`deploy_gate.offline.gates._language_model`), without a reference.
                scored = lm.score(cand, {"champion": base}, gate_items, lm.Budget(cfg.lm_cpu_budget_s), cfg.seed)
                cmp = lm.non_inferiority(scored.candidate - scored.others["champion"], cfg.lm_margin, cfg.confidence,
                                         cfg.lm_min_windows)  # fmt: skip
                gate_cpu += time.process_time() - t0
                ratio, old = old_gate(cand, base, gate_texts, cfg.text_window_tokens)
                true_lm = float(np.mean([lm.mean_loss(cand, w.ids) for w in truth_windows]) - base_truth.mean())
                reward_diff = expected_reward(cand, pop, eval_ctx, 2, seed=7) - base_reward
                row = Row(pop.name, lr, sign, reward_diff, true_lm, ratio, old, cmp.verdict, cmp.mean, cmp.ci, scored.n)
                rows.append(row)
                print(f"{row.population:>12} lr {lr:<7g} {'+' if sign > 0 else '-'}reward  truth "
                      f"{row.reward_diff:+.3f} lm {row.true_lm_diff:+.4f}  old {ratio:.3f} {old:<6}  new "
                      f"{row.new_verdict:<9} {row.new_mean:+.4f} [{row.new_ci[0]:+.4f}, {row.new_ci[1]:+.4f}] "
                      f"n={row.new_windows}", flush=True)  # fmt: skip
    report(rows, cfg.lm_margin, args.tie, bare_s / len(truth_windows), gate_cpu / max(1, len(rows)))


def report(rows: list[Row], margin: float, tie: float, bare_s: float, gate_s: float) -> None:
    better = [r.reward_diff > tie for r in rows]
    worse = [r.reward_diff < -tie for r in rows]
    print(f"\n{len(rows)} candidates: {sum(better)} better, {sum(worse)} worse, "
          f"{len(rows) - sum(better) - sum(worse)} tied (|reward difference| <= {tie}) in users' ground truth")
    gates = (("old (ppl ratio <= 1.05 on 16 texts)", [r.old_verdict for r in rows]),
             ("new (lm_vs_champion)", [r.new_verdict for r in rows]))  # fmt: skip
    for name, verdicts in gates:
        counts = {s: verdicts.count(s) for s in ("passed", "failed", "undecided")}
        refused_better = sum(v == "failed" and b for v, b in zip(verdicts, better, strict=True))
        passed_worse = sum(v == "passed" and w for v, w in zip(verdicts, worse, strict=True))
        within = sum(v == "failed" and r.true_lm_diff < margin for v, r in zip(verdicts, rows, strict=True))
        beyond = sum(v == "passed" and r.true_lm_diff > margin for v, r in zip(verdicts, rows, strict=True))
        print(f"{name}: {counts}; refused-but-better {refused_better}, passed-but-worse {passed_worse}; in the "
              f"LM's own truth (margin {margin}): refused-but-within {within}, passed-but-beyond {beyond}")
    print(f"cost: the new gate {gate_s:.2f} CPU-s a candidate; bare baseline (one policy, one pass per window) "
          f"{bare_s * 1000:.1f} ms a window; machine load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
