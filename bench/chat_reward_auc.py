"""The learned chat reward against held-out judgements: ROC AUC with intervals, calibration, and throughput.

    .venv/bin/python bench/chat_reward_auc.py [--resamples 1000] [--out bench/results/chat_reward.md]

On each shared collection (`../shared/chat-feedback`, read in place; bench/chat_feedback_data.py says how a
judged turn becomes a label), five folds split by dialogue: the learned reward is fitted on four folds' turns
exactly as a product's reactions would be (`signals.chat_reward.fit_chat_reward`: each turn a text-only
chat generation, its user's next message a `followup`, its judgement a thumbs) and scores the fifth fold's
turns with the judgement removed. Next to it, on the same turns: the current rule-based chat reward
(`builtin_definition("chat")`, VADER on the follow-up), VADER alone, the old 55-word lexicon, and the learned
model reading the reply too (an ablation: the reply is the policy's, so the reward does not read it).
AUC intervals are percentile bootstraps over dialogues (turns of one dialogue move together). Calibration:
ECE (10 equal-width bins) and the reliability table of the learned reward's P(good).

Then: transfer (fitted on one collection, scored on the other, and on bench/data/followup_thumbs.tsv), a
simulated chat population not used to choose the model (simulator/chat_users.py: half its users fit, the
other half are scored), and scoring throughput of the learned follow-up model against the current chat
scorer's (VADER) on the same texts in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chat_feedback_data import SHARED, JudgedTurn, ab_redial, eurtad  # noqa: E402

from flywheel.sycophancy import ArmReply, sycophancy_check  # noqa: E402
from signals.chat_reward import Reacted, fit_chat_reward, implicit_proba  # noqa: E402
from signals.events import FeedbackEvent, GenerationInfo  # noqa: E402
from signals.logistic import expected_calibration_error, roc_auc  # noqa: E402
from signals.reward import builtin_definition  # noqa: E402
from signals.sentiment import lexicon_sentiment, vader_sentiment  # noqa: E402
from signals.text_features import TextModel  # noqa: E402
from simulator.chat_users import ChatPopulation  # noqa: E402

CHAT = builtin_definition("chat")
FOLDS = 5


def as_reacted(turns: Sequence[JudgedTurn], *, with_reply: bool = False) -> list[Reacted]:
    """Each judged turn as a chat generation with its follow-up and its judgement as a thumbs vote."""
    out = []
    for n, t in enumerate(turns):
        gid = f"t{n:05d}"
        text = t.followup + (" || " + " ".join("R_" + w for w in t.reply.lower().split()) if with_reply else "")
        evs = (
            FeedbackEvent(f"{gid}-fu", "followup", 1_000_000, {"text": text}),
            FeedbackEvent(f"{gid}-th", "thumbs", 2_000_000, {"value": "up" if t.good else "down"}),
        )
        out.append(Reacted(GenerationInfo(gid, 0, completion_chars=len(t.reply), surface="chat"), evs, t.dialogue))
    return out


def fold_of(groups: Sequence[str], seed: int = 0) -> np.ndarray:
    order = sorted(set(groups))
    perm = np.random.default_rng(seed).permutation(len(order))
    fold = {g: int(perm[i]) % FOLDS for i, g in enumerate(order)}
    return np.array([fold[g] for g in groups])


def cross_fitted(items: list[Reacted]) -> np.ndarray:
    """P(good) of every item from the learned reward fitted on the other folds' dialogues."""
    fold = fold_of([i.group for i in items])
    p = np.zeros(len(items))
    for k in range(FOLDS):
        train = [i for i, f in zip(items, fold, strict=True) if f != k]
        definition = fit_chat_reward(train, CHAT, holdout_share=0.0).definition
        for j in np.flatnonzero(fold == k):
            p[j] = implicit_proba(definition, items[j])
    return p


def within_auc(y: np.ndarray, score: np.ndarray, strata: Sequence[str]) -> float:
    """AUC over pairs from the same stratum only (a good and a bad turn of one source): the per-stratum AUCs
    weighted by their pairs. A reward that only tells the sources apart scores 0.5 here."""
    total = pairs = 0.0
    arr = np.asarray(strata)
    for s in set(strata):
        m = arr == s
        n = float(y[m].sum() * (1 - y[m]).sum())
        if n:
            total += roc_auc(y[m], score[m]) * n
            pairs += n
    return total / pairs if pairs else float("nan")


def auc_interval(  # noqa: ANN201
    y: np.ndarray, score: np.ndarray, groups: Sequence[str], resamples: int, seed: int = 0,
    strata: Sequence[str] | None = None,
):  # fmt: skip
    """AUC (within `strata` when given) and its 95% percentile-bootstrap interval, resampling dialogues."""
    rows: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        rows[g].append(i)
    keys = sorted(rows)
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        ix = np.concatenate([rows[keys[j]] for j in rng.integers(0, len(keys), len(keys))])
        a = roc_auc(y[ix], score[ix]) if strata is None else within_auc(y[ix], score[ix], [strata[i] for i in ix])
        if np.isfinite(a):
            draws.append(a)
    point = roc_auc(y, score) if strata is None else within_auc(y, score, strata)
    return point, float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def reliability(y: np.ndarray, p: np.ndarray, bins: int = 10) -> list[tuple[str, int, float, float]]:
    idx = np.minimum((p * bins).astype(int), bins - 1)
    return [(f"{b / bins:.1f}-{(b + 1) / bins:.1f}", int((idx == b).sum()), float(p[idx == b].mean()),
             float(y[idx == b].mean())) for b in range(bins) if (idx == b).any()]  # fmt: skip


def fmt(a: tuple[float, float, float]) -> str:
    return f"{a[0]:.3f} [{a[1]:.3f}, {a[2]:.3f}]"


def collection_rows(name: str, turns: list[JudgedTurn], resamples: int, out: list[str]) -> dict[str, np.ndarray]:
    items = as_reacted(turns)
    y = np.array([t.good for t in turns], dtype=np.float64)
    groups = [t.dialogue for t in turns]
    learned = cross_fitted(items)
    scores: dict[str, np.ndarray] = {
        "learned chat reward (follow-up)": learned,
        "learned, reading the reply too (ablation)": cross_fitted(as_reacted(turns, with_reply=True)),
        "current rules `chat-rules-v1` (VADER on the follow-up)": np.array([implicit_proba(CHAT, i) for i in items]),
        "VADER on the follow-up": np.array([vader_sentiment(t.followup) for t in turns]),
        "old lexicon `lexicon-v1` on the follow-up": np.array([lexicon_sentiment(t.followup) for t in turns]),
    }
    dialogues = len(set(groups))
    out.append(f"\n### {name}: {len(turns)} judged turns of {dialogues} dialogues, {int(y.sum())} good, "
               f"{int((1 - y).sum())} bad\n")  # fmt: skip
    sources = [t.source for t in turns]
    several = len(set(sources)) > 1
    out.append("| reward | AUROC [95% CI, dialogue bootstrap] | within-source AUROC [95% CI] | ECE of P(good) |")
    out.append("| --- | --- | --- | --- |")
    for label, s in scores.items():
        is_proba = label.startswith(("learned", "current"))
        ece = f"{expected_calibration_error(y, s):.3f}" if is_proba else "(not a probability)"
        within = fmt(auc_interval(y, s, groups, resamples, strata=sources)) if several else "(one source)"
        out.append(f"| {label} | {fmt(auc_interval(y, s, groups, resamples))} | {within} | {ece} |")
    out.append("\nReliability of the learned reward (bin of P(good): turns, mean P(good), share judged good):\n")
    out.append("| bin | turns | mean P(good) | judged good |")
    out.append("| --- | --- | --- | --- |")
    out.extend(f"| {b} | {n} | {mp:.3f} | {fy:.3f} |" for b, n, mp, fy in reliability(y, learned))
    if several:
        out.append("\nWithin one source (the learned reward's cross-fitted scores; under 5 bad turns: left out):\n")
        out.append("| source | turns (bad) | AUROC [95% CI] |")
        out.append("| --- | --- | --- |")
        for part in (*sorted(set(sources)), "all but SelfFeeding"):
            mask = np.array([t.source != "eurtad/SelfFeeding" if part == "all but SelfFeeding" else t.source == part
                             for t in turns])  # fmt: skip
            if len(np.unique(y[mask])) < 2 or (1 - y[mask]).sum() < 5:
                continue
            g = [x for x, m in zip(groups, mask, strict=True) if m]
            out.append(f"| {part} | {int(mask.sum())} ({int((1 - y[mask]).sum())}) | "
                       f"{fmt(auc_interval(y[mask], learned[mask], g, resamples))} |")  # fmt: skip
    return scores


def transfer_rows(collections: dict[str, list[JudgedTurn]], resamples: int, out: list[str]) -> None:
    out.append("\n### Transfer: fitted on one collection, scored on another (no turn of the scored set seen)\n")
    out.append("| fitted on | scored on | learned AUROC [95% CI] | VADER AUROC on the same |")
    out.append("| --- | --- | --- | --- |")
    thumbs = Path(__file__).parent / "data" / "followup_thumbs.tsv"
    targets = dict(collections)
    if thumbs.exists():
        rows = [ln.split("\t", 1) for ln in thumbs.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        targets["followup_thumbs.tsv (self-made)"] = [
            JudgedTurn(f"self/{n}", "", "", text, label == "up") for n, (label, text) in enumerate(rows)
        ]
    for src, train in collections.items():
        definition = fit_chat_reward(as_reacted(train), CHAT, holdout_share=0.0).definition
        for dst, test in targets.items():
            if dst.split()[0].rstrip(",") == src.split()[0].rstrip(","):
                continue  # the same collection's turns, labelled another way: not a transfer
            y = np.array([t.good for t in test], dtype=np.float64)
            p = np.array([implicit_proba(definition, i) for i in as_reacted(test)])
            v = np.array([vader_sentiment(t.followup) for t in test])
            g = [t.dialogue for t in test]
            out.append(f"| {src} | {dst} | {fmt(auc_interval(y, p, g, resamples))} | "
                       f"{fmt(auc_interval(y, v, g, resamples))} |")  # fmt: skip


def simulated_rows(resamples: int, out: list[str]) -> None:
    items = ChatPopulation(users=200, seed=100).reacted()
    fit = fit_chat_reward(items, CHAT, holdout_share=0.5)
    y, groups = fit.test_labels, [i.group for i in fit.test_items]
    rules = np.array([implicit_proba(CHAT, i) for i in fit.test_items])
    no_fu = np.array([i.followup is None for i in fit.test_items])
    out.append(f"\n### Simulated chat users (simulator/chat_users.py, seed 100, not used to choose the model): "
               f"{fit.n_train} reactions fit, {fit.n_test} held-out users' reactions scored without them\n")
    out.append("| reward | AUROC [95% CI, user bootstrap] | ECE |")
    out.append("| --- | --- | --- |")
    for label, s in (("learned chat reward", fit.test_proba), ("current rules `chat-rules-v1`", rules)):
        ece = expected_calibration_error(y, s)
        out.append(f"| {label} | {fmt(auc_interval(y, s, groups, resamples))} | {ece:.3f} |")
    out.append(f"\n({int(no_fu.sum())} of the held-out replies had no follow-up: both rewards give them their "
               "no-signal value.)")


def throughput_rows(texts: list[str], definition_sentiment: Callable[[str], float], out: list[str]) -> None:
    texts = (texts * (20_000 // len(texts) + 1))[:20_000]
    timings = {}
    for name, fn in (("current chat scorer (VADER, `chat-rules-v1`)", vader_sentiment),
                     ("learned follow-up model", definition_sentiment)):  # fmt: skip
        fn(texts[0])  # loaded
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for t in texts:
                fn(t)
            best = min(best, time.perf_counter() - t0)
        timings[name] = best
    base = timings["current chat scorer (VADER, `chat-rules-v1`)"]
    out.append(f"\n### Scoring throughput: {len(texts)} real follow-ups, one process, best of 3\n")
    out.append("| scorer | follow-ups/s | µs each | ratio to the current scorer |")
    out.append("| --- | --- | --- | --- |")
    for name, s in timings.items():
        out.append(f"| {name} | {len(texts) / s:,.0f} | {1e6 * s / len(texts):.1f} | {base / s:.2f}x |")


def sycophancy_rows(pairs: int, out: list[str]) -> None:
    """How often the sycophancy check flags: A/A (two draws of the same plain policy), a candidate that only
    lengthens and flatters, and one that flatters but whose replies are better (users approve more)."""

    def arm(seed: int, style: str, shift: float = 0.0) -> list[ArmReply]:
        return [ArmReply(i.generation.user_id, reply, i.label)
                for i, reply in ChatPopulation(seed=seed).replies(style=style, quality_shift=shift)]  # fmt: skip

    cases = {
        "A/A: plain against plain (other users)": ("plain", 0.0),
        "flatters and lengthens, same quality": ("sycophantic", 0.0),
        "flatters and lengthens, replies better (quality +1.5)": ("sycophantic", 1.5),
    }
    out.append(f"\n### Sycophancy check (flywheel/sycophancy.py): share of {pairs} simulated experiments flagged "
               "(40 users an arm, 10 replies each, half voted)\n")  # fmt: skip
    out.append("| candidate | flagged |")
    out.append("| --- | --- |")
    for label, (style, shift) in cases.items():
        flagged = sum(
            sycophancy_check(arm(1000 + 2 * k, "plain"), arm(1001 + 2 * k, style, shift), samples=200, seed=k).flagged
            for k in range(pairs)
        )
        out.append(f"| {label} | {flagged}/{pairs} |")


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--experiments", type=int, default=100, help="simulated experiments a sycophancy row")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "chat_reward.md")
    args = parser.parse_args()
    if not SHARED.exists():
        sys.exit(f"no shared chat-feedback collections at {SHARED}")
    started = time.perf_counter()
    collections = {
        "ab-redial (overall >= 4 good, <= 2 bad)": ab_redial(),
        "eurtad (error E1-E10 bad, none good)": eurtad(),
        "eurtad, errors the user reacted to (UR2-UR5) bad, none good": eurtad(reacted=True),
    }
    out = [
        "# Learned chat reward: held-out AUROC, calibration, throughput",
        "",
        f"Command: `.venv/bin/python bench/chat_reward_auc.py --resamples {args.resamples} "
        f"--experiments {args.experiments}`  ",
        f"Date: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}  ",
        f"Machine: {os.cpu_count()} CPUs; load at start: `{uptime()}`",
        "",
        "Five folds split by dialogue; every turn scored by a reward fitted without its dialogue, with its "
        "judgement removed (as a reply nobody reacted to). bench/chat_reward_auc.py's docstring says how.",
    ]
    for name, turns in collections.items():
        collection_rows(name, turns, args.resamples, out)
    transfer_rows(collections, args.resamples, out)
    simulated_rows(args.resamples, out)
    sycophancy_rows(args.experiments, out)
    everything = [t for turns in collections.values() for t in turns]
    model = fit_chat_reward(as_reacted(everything), CHAT, holdout_share=0.0).definition.followup_model
    assert isinstance(model, TextModel)
    throughput_rows([t.followup for t in everything], model.sentiment, out)
    out.append(f"\nLoad at the end: `{uptime()}`; "
               f"{time.perf_counter() - started:.0f} s in all.")  # fmt: skip
    text = "\n".join(out) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
