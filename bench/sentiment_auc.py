"""How well each registered follow-up sentiment predicts the thumbs given to the same answer (ROC AUC).

    python bench/sentiment_auc.py [--data bench/data/followup_thumbs.tsv] [--resamples 2000]

The labelled set is self-made (bench/data/followup_thumbs.tsv says how); no sentiment here was fitted or
tuned on it, so all of it is held out. AUC is the chance that a thumbs-up follow-up scores above a
thumbs-down one (ties count half); the 95% interval is a stratified percentile bootstrap. Printed per
sentiment, with its ratio to the old 55-word lexicon ("lexicon-v1") measured in the same run, and the
share of follow-ups it scores exactly 0 (no opinion).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from signals.sentiment import SENTIMENTS

DATA = Path(__file__).parent / "data" / "followup_thumbs.tsv"


def load(path: Path) -> list[tuple[str, bool]]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            label, text = line.split("\t", 1)
            rows.append((text, label == "up"))
    return rows


def auc(positive: list[float], negative: list[float]) -> float:
    """Mann-Whitney U / (n_pos * n_neg), ties counted half."""
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def interval(positive: list[float], negative: list[float], resamples: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    values = sorted(
        auc(rng.choices(positive, k=len(positive)), rng.choices(negative, k=len(negative))) for _ in range(resamples)
    )
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = load(args.data)
    print(f"{len(rows)} follow-ups ({sum(up for _, up in rows)} thumbs up) from {args.data.name}")
    results = {}
    for name, sentiment in SENTIMENTS.items():
        scored = [(sentiment(text), up) for text, up in rows]
        pos = [s for s, up in scored if up]
        neg = [s for s, up in scored if not up]
        results[name] = auc(pos, neg)
        lo, hi = interval(pos, neg, args.resamples, args.seed)
        zeros = sum(s == 0.0 for s, _ in scored) / len(scored)
        print(f"  {name:16s} AUC {results[name]:.3f} (95% {lo:.3f}-{hi:.3f}), scores exactly 0: {zeros:.0%}")
    base = results["lexicon-v1"]
    for name, value in results.items():
        if name != "lexicon-v1":
            print(f"  {name} / lexicon-v1 AUC ratio: {value / base:.2f}")


if __name__ == "__main__":
    main()
