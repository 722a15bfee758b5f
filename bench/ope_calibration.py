"""Off-policy estimates against the simulator's ground truth, over many candidates of several populations.

For each population the champion (a tiny bootstrapped model) serves that population's users: its
seeded completions of held-out contexts, with behaviour log-probs, and the users' reactions turned into
Cursor's reward (+0.75 accepted and kept, -0.25 shown and not, 0 when nothing is shown). The first
half of that traffic trains candidates; the second half, which no candidate saw, is the "fresh"
logged traffic every estimate is made from. Candidates, so that harmed and improved ones both exist:

- trained (the trainer's `pg` objective) on the users' rewards, at several learning rates and epochs;
- trained on the negated rewards (harmed), on pure noise, and on another population's rewards;
- the champion with seeded weight noise.

For each candidate: the ground truth (`simulator.closed_loop.evaluate_policy`: expected reward per
request on fixed held-out contexts, fixed seeds, the champion on the same seeds), and the offline
estimates of d = candidate - champion from the fresh traffic: SNIPS, DR as the gate makes it
(`deploy_gate.offline.offpolicy`: per-token ratios, the logged-data reward model, its
direct-method term on every logged prompt, paired), and the variants it was chosen among on the
tuning populations (the earlier DR: unclipped sequence ratios, a reward model on emptiness and
length only, 128 unpaired DM prompts; sequence ratios clipped at 20; the DM term unpaired; the
direct method alone). Printed: Pearson r and a calibration fit
(truth = a + b * estimate) per estimator, over all candidates and per population set (tuning /
reporting, `simulator.populations`), the offline gate's verdict against the ground truth as a
confusion matrix (ground truth 5% or more worse than the champion's reward must not pass), and a
scatter plot next to the table (`--out`/ope_calibration.{md,png}).

What this bench does not run: serving, ingest, signals. The reward here is the reaction's Cursor
reward, not `signals`' learned reward, so it measures the estimator, not the reward model of signals.

    python bench/ope_calibration.py [--populations tuning|reporting|all|name,...] [--logged 1200]
        [--eval-contexts 120] [--repeats 3] [--seed 0] [--out bench/results]
    python bench/ope_calibration.py --rows bench/results/ope_calibration.json   # re-report, no re-run
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from deploy_gate.offline import ope
from deploy_gate.offline.config import OfflineGateConfig
from deploy_gate.offline.offpolicy import EstimatorSettings, features, log_ratios, target_records
from flywheel.contract import GenerationRecord
from flywheel.lm import Policy, bootstrap_model, load_policy
from flywheel.lm.policy import GenerationRequest
from simulator.closed_loop import evaluate_policy
from simulator.contexts import ContextPool, fit_prompts, held_out_contexts
from simulator.populations import (
    ACCEPT_REWARD,
    REJECT_REWARD,
    Population,
    reporting_populations,
    tuning_populations,
)
from trainer.config import TrainerConfig
from trainer.data import Sample
from trainer.loop import score_samples, train_policy
from trainer.scoring import scorer_for

MAX_TOKENS = 16
GATE = "DR (gate: per-token ratios, logged-data reward model, paired DM)"
EARLIER_DM_PROMPTS = 128
BEFORE = "DR before (unclipped, empty+length reward model, 128 unpaired DM prompts)"
HARMED_SHARE = 0.05  # a candidate 5% or more below the champion's ground-truth reward must not pass


@dataclass(frozen=True)
class Logged:
    record: GenerationRecord
    reward: float


@dataclass
class Row:
    population: str
    split: str  # tuning or reporting
    candidate: str
    truth_champion: float
    truth_diff: float
    estimates: dict[str, ope.Estimate]  # estimator -> estimate of candidate - champion
    ess: float
    verdict: str


def log_traffic(policy: Policy, pop: Population, pool: ContextPool, n: int, seed: int) -> list[Logged]:
    """`n` seeded champion generations for `pop`'s users, with Cursor's reward of their reactions."""
    rng = random.Random(seed)
    contexts = [pool.draw(rng, pop.comment_share) for _ in range(n)]
    requests = [GenerationRequest(c.prompt, MAX_TOKENS, 1.0, seed=seed * 100_000 + i) for i, c in enumerate(contexts)]
    gens = [g for i in range(0, n, 32) for g in policy.generate_batch(requests[i : i + 32])]
    out = []
    for ctx, g in zip(contexts, gens, strict=True):
        truth = pop.truth(ctx, g.completion, g.finish_reason)
        reaction = pop.react(truth, rng)
        reward = (ACCEPT_REWARD if reaction.kept else REJECT_REWARD) if reaction.shown else 0.0
        rec = GenerationRecord(prompt=ctx.prompt, prompt_token_ids=g.prompt_token_ids, completion=g.completion,
                               completion_token_ids=g.completion_token_ids, behaviour_logprobs=g.logprobs,
                               model_version="1", finish_reason=g.finish_reason)  # fmt: skip
        out.append(Logged(rec, reward))
    return out


def train(champion_dir: Path, logged: list[Logged], rewards: list[float], lr: float, epochs: int, seed: int) -> Policy:
    policy = load_policy(champion_dir)
    now = datetime.now(UTC)
    samples = [Sample(f"g{i:05d}", "u", x.record.prompt_token_ids or [], x.record.completion_token_ids or [],
                      x.record.behaviour_logprobs, r, "1", now)
               for i, (x, r) in enumerate(zip(logged, rewards, strict=True))]  # fmt: skip
    config = TrainerConfig(learning_rate=lr, batch_size=16, epochs=epochs, baseline="batch_mean", seed=seed)
    scorer = scorer_for(False)
    reference = score_samples(policy.model, samples, scorer, policy.pad_id, config.batch_size)
    torch.manual_seed(seed)
    train_policy(policy.model, samples, reference, config, scorer, policy.pad_id, stop_ids=policy.stop_ids)
    return policy


def harmed(champion_dir: Path, scale: float, seed: int) -> Policy:
    policy = load_policy(champion_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale * float(p.std()))
    return policy


def candidates(champion_dir: Path, train_half: list[Logged], other: list[float], seed: int):  # type: ignore[no-untyped-def]
    """(name, policy) of every candidate of one population, made from its training half."""
    r = [x.reward for x in train_half]
    noise = np.random.default_rng(seed).choice([ACCEPT_REWARD, REJECT_REWARD], len(r)).tolist()
    yield "rewards lr 3e-3", train(champion_dir, train_half, r, 3e-3, 1, seed)
    yield "rewards lr 1e-2", train(champion_dir, train_half, r, 1e-2, 1, seed)
    yield "inverted lr 3e-3", train(champion_dir, train_half, [-x for x in r], 3e-3, 1, seed)
    yield "inverted lr 1e-2", train(champion_dir, train_half, [-x for x in r], 1e-2, 1, seed)
    yield "inverted lr 3e-2", train(champion_dir, train_half, [-x for x in r], 3e-2, 1, seed)
    yield "noise rewards lr 1e-2", train(champion_dir, train_half, noise, 1e-2, 1, seed)
    yield "other population's rewards lr 1e-2", train(champion_dir, train_half, other, 1e-2, 2, seed)
    yield "weight noise 0.05", harmed(champion_dir, 0.05, seed)
    yield "weight noise 0.2", harmed(champion_dir, 0.2, seed)


def old_features(completions: list[str]) -> np.ndarray:
    """The reward model's features before this bench: emptiness and length."""
    return np.array([[float(not t.strip()), min(len(t), 200) / 100] for t in completions])


def estimates(
    candidate: Policy, fresh: list[Logged], cfg: OfflineGateConfig
) -> tuple[dict[str, ope.Estimate], float, str]:
    """Every estimator's candidate - champion (with its interval), the gate's ESS and the gate's verdict."""
    records = [x.record for x in fresh]
    r = np.array([x.reward for x in fresh])
    seq = log_ratios(candidate, records, "sequence")
    tok = log_ratios(candidate, records, "per_token")
    assert cfg.ope_ratio == "per_token", "the GATE variant below is the per-token one"
    settings = EstimatorSettings(dm_prompts=cfg.ope_dm_prompts, max_tokens=MAX_TOKENS, seed=cfg.seed)
    target = target_records(candidate, records, settings)  # every fresh prompt: paired with the logged term
    logged = [(x.prompt, x.completion, x.finish_reason) for x in records]
    new_logged, new_target = features(logged), features(target)
    coef_new = ope.fit_reward_model(new_logged, r, cfg.ope_ridge)
    coef_old = ope.fit_reward_model(old_features([x.completion for x in records]), r)
    q_new, qt_new = ope.predict_reward(coef_new, new_logged), ope.predict_reward(coef_new, new_target)
    q_old = ope.predict_reward(coef_old, old_features([x.completion for x in records]))
    # The earlier direct-method term: 128 prompts, drawn independently of the logged ones.
    qt_old = ope.predict_reward(coef_old, old_features([c for _, c, _ in target[:EARLIER_DM_PROMPTS]]))
    qt_unpaired = qt_new[:EARLIER_DM_PROMPTS]
    clip = np.log(cfg.ope_clip)

    def run(log_w: np.ndarray, q: np.ndarray, qt: np.ndarray) -> ope.OffPolicyEstimate:
        return ope.estimate(r, log_w, q, qt, bootstrap_samples=cfg.bootstrap_samples, confidence=cfg.confidence,
                            seed=cfg.seed, paired=qt.size == r.size)  # fmt: skip

    gate, before = run(np.minimum(tok, clip), q_new, qt_new), run(seq, q_old, qt_old)
    sequence = run(np.minimum(seq, clip), q_new, qt_new)
    dm = ope.estimate(r, np.zeros_like(r), np.zeros_like(r), qt_new - q_new, bootstrap_samples=cfg.bootstrap_samples,
                      confidence=cfg.confidence, seed=cfg.seed, paired=True)  # fmt: skip
    variants = {
        GATE: gate.dr_minus_behaviour,
        "SNIPS, per-token ratios": _minus(gate.snips, gate.behaviour_mean),
        "DR, sequence ratios clipped at 20": sequence.dr_minus_behaviour,
        "SNIPS, sequence ratios clipped at 20": _minus(sequence.snips, sequence.behaviour_mean),
        "DR, per-token ratios, DM on 128 prompts unpaired": run(np.minimum(tok, clip), q_new,
                                                               qt_unpaired).dr_minus_behaviour,
        BEFORE: before.dr_minus_behaviour,
        "SNIPS before (unclipped)": _minus(before.snips, before.behaviour_mean),
        # DM alone: mean over prompts of qhat(candidate's completion) - qhat(logged completion), paired.
        "DM only (logged-data reward model)": _minus(dm.dr, 0.0),
    }
    return variants, gate.ess, gate_verdict(gate.dr_minus_behaviour, gate.ess, cfg)


def gate_verdict(d: ope.Estimate, ess: float, cfg: OfflineGateConfig) -> str:
    """`ope_satisfaction`'s rule (deploy_gate/offline/gates.py) on d = DR - the champion's logged mean."""
    if d.ci[1] < -cfg.ope_refuse_margin:
        return "failed"
    if ess < cfg.ope_min_ess or d.ci[0] < -cfg.ope_margin:
        return "insufficient_evidence"
    return "passed"


def load_rows(path: Path, cfg: OfflineGateConfig) -> list[Row]:
    """Rows saved by an earlier run, their verdicts re-read under `cfg`."""
    rows = []
    for raw in json.loads(path.read_text()):
        raw["estimates"] = {k: ope.Estimate(v["value"], tuple(v["ci"])) for k, v in raw["estimates"].items()}
        row = Row(**raw)
        row.verdict = gate_verdict(row.estimates[GATE], row.ess, cfg)
        rows.append(row)
    return rows


def _minus(e: ope.Estimate, mean: float) -> ope.Estimate:
    return ope.Estimate(e.value - mean, (e.ci[0] - mean, e.ci[1] - mean))




def calibration(rows: list[Row], name: str) -> tuple[float, float, float, float]:
    """(Pearson r, slope b and intercept a of truth = a + b * estimate, coverage of the 95% intervals)."""
    x = np.array([r.estimates[name].value for r in rows])
    y = np.array([r.truth_diff for r in rows])
    corr = float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else float("nan")
    b, a = np.polyfit(x, y, 1)
    cover = [r.estimates[name].ci[0] <= r.truth_diff <= r.estimates[name].ci[1] for r in rows
             if not np.isnan(r.estimates[name].ci[0])]  # fmt: skip
    return corr, float(b), float(a), (sum(cover) / len(cover)) if cover else float("nan")


def report(rows: list[Row], args: argparse.Namespace, took: str) -> list[str]:
    names = list(rows[0].estimates)
    out = [f"# Offline estimates against ground truth: {len(rows)} candidates, "
           f"{len({r.population for r in rows})} populations", "",
           f"Command: `python bench/ope_calibration.py --populations {args.populations} --logged {args.logged} "
           f"--eval-contexts {args.eval_contexts} --repeats {args.repeats} --seed {args.seed}` ({took}, "
           "tiny model, one thread).", "",
           "Estimand: candidate - champion expected Cursor reward per request. Truth: `evaluate_policy` on fixed "
           "held-out contexts and seeds. Estimates: from the champion's fresh logged traffic (half the traffic, "
           "not trained on).", "",
           "| estimator | set | Pearson r | truth = a + b * estimate (b, a) | 95% interval holds truth |",
           "| --- | --- | --- | --- | --- |"]  # fmt: skip
    sets = [("all", rows)] + [(s, [r for r in rows if r.split == s]) for s in ("tuning", "reporting")]
    for name in names:
        for label, subset in sets:
            if len(subset) < 3:
                continue
            corr, b, a, cover = calibration(subset, name)
            held = "-" if np.isnan(cover) else f"{cover:.0%}"
            out.append(f"| {name} | {label} ({len(subset)}) | {corr:.3f} | {b:.2f}, {a:+.3f} | {held} |")
    out += ["", f"Offline gate (`ope_satisfaction`) against ground truth; harmed = truth <= -{HARMED_SHARE:.0%} of "
            "the champion's |reward| (and at least 0.005):", "",
            "| ground truth | passed | insufficient evidence | failed (refused) |",
            "| --- | --- | --- | --- |"]  # fmt: skip
    groups = (("harmed", harmed_truth), ("not harmed, not better", lambda r: not harmed_truth(r) and r.truth_diff <= 0),
              ("better", lambda r: r.truth_diff > 0))  # fmt: skip
    for label, test in groups:
        picked = [r for r in rows if test(r)]
        counts = [sum(r.verdict == v for r in picked) for v in ("passed", "insufficient_evidence", "failed")]
        out.append(f"| {label} ({len(picked)}) | {counts[0]} | {counts[1]} | {counts[2]} |")
    out += ["", "| population | set | candidate | truth champion | truth d | gate DR d [95%] | SNIPS d | old DR d "
            "| ESS | verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        g, s, o = r.estimates[GATE], r.estimates["SNIPS, per-token ratios"], r.estimates[BEFORE]
        out.append(f"| {r.population} | {r.split} | {r.candidate} | {r.truth_champion:.3f} | {r.truth_diff:+.3f} | "
                   f"{g.value:+.3f} [{g.ci[0]:+.3f}, {g.ci[1]:+.3f}] | {s.value:+.3f} | {o.value:+.3f} | {r.ess:.0f} | "
                   f"{r.verdict} |")  # fmt: skip
    return out


def harmed_truth(r: Row) -> bool:
    return r.truth_diff <= -max(0.005, HARMED_SHARE * abs(r.truth_champion))


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharey=True)
    for ax, name, title in ((axes[0], GATE, "DR as the gate makes it"), (axes[1], BEFORE, "DR before")):
        for split, marker in (("tuning", "o"), ("reporting", "^")):
            sub = [r for r in rows if r.split == split]
            x = [r.estimates[name].value for r in sub]
            y = [r.truth_diff for r in sub]
            ax.scatter(x, y, marker=marker, label=f"{split} populations", alpha=0.8)
        lim = max(abs(v) for r in rows for v in (r.truth_diff, r.estimates[name].value)) * 1.1
        ax.plot([-lim, lim], [-lim, lim], "k--", lw=0.8, label="estimate = truth")
        corr = calibration(rows, name)[0]
        ax.set_title(f"{title} (r = {corr:.2f})")
        ax.set_xlabel("offline estimate of candidate - champion reward")
        ax.axhline(0, color="grey", lw=0.5)
        ax.axvline(0, color="grey", lw=0.5)
    axes[0].set_ylabel("ground truth: candidate - champion reward")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--populations", default="all", help="tuning, reporting, all, or names (comma-separated)")
    parser.add_argument("--logged", type=int, default=1200, help="champion generations per population (half train)")
    parser.add_argument("--eval-contexts", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", type=Path, default=None, help="a bootstrapped model (default: the tiny one)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--rows", type=Path, default=None,
                        help="report the rows an earlier run saved (its ope_calibration.json) under today's gate "
                             "config, without running the candidates again")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    cfg = OfflineGateConfig()
    if args.rows is not None:
        write(load_rows(args.rows, cfg), args, f"rows of {args.rows.name}, verdicts under today's gate config")
        return
    tuning, reporting = tuning_populations(), reporting_populations()
    chosen = {"tuning": tuning, "reporting": reporting, "all": tuning + reporting}.get(args.populations)
    if chosen is None:
        by_name = {p.name: p for p in tuning + reporting}
        chosen = [by_name[n] for n in args.populations.split(",")]
    split_of = {p.name: "tuning" for p in tuning} | {p.name: "reporting" for p in reporting}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or bootstrap_model(Path(tmp) / "tiny", preset="test", seed=0, progress=False)
        champion = load_policy(model)
        room = champion.context - MAX_TOKENS
        pool = fit_prompts(held_out_contexts(300, args.seed + 1, preset="test"), room)
        eval_pool = fit_prompts(held_out_contexts(args.eval_contexts, args.seed + 2, preset="test"), room)
        rows: list[Row] = []
        traffic = {p.name: log_traffic(champion, p, pool, args.logged, args.seed + k) for k, p in enumerate(chosen)}
        for k, pop in enumerate(chosen):
            logged = traffic[pop.name]
            half = len(logged) // 2
            train_half, fresh = logged[:half], logged[half:]
            other_pop = chosen[(k + 1) % len(chosen)]
            other = [x.reward for x in traffic[other_pop.name][:half]]
            base = evaluate_policy(champion, [pop], eval_pool, MAX_TOKENS, args.repeats)[pop.name].reward
            for name, cand in candidates(model, train_half, other, args.seed):
                truth = evaluate_policy(cand, [pop], eval_pool, MAX_TOKENS, args.repeats)[pop.name].reward
                est, ess, verdict = estimates(cand, fresh, cfg)
                row = Row(pop.name, split_of[pop.name], name, base, truth - base, est, ess, verdict)
                rows.append(row)
                g = est[GATE]
                print(f"{pop.name:10s} {name:36s} truth {truth - base:+.3f}  DR {g.value:+.3f} "
                      f"[{g.ci[0]:+.3f}, {g.ci[1]:+.3f}] ESS {ess:6.1f} {verdict}", flush=True)  # fmt: skip
    write(rows, args, f"{time.perf_counter() - started:.0f} s")


def write(rows: list[Row], args: argparse.Namespace, took: str) -> None:
    lines = report(rows, args, took)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ope_calibration.md").write_text("\n".join(lines) + "\n")
    # Every row, to re-read the verdicts under other gate settings without re-running the candidates.
    (args.out / "ope_calibration.json").write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    plot(rows, args.out / "ope_calibration.png")


if __name__ == "__main__":
    main()
