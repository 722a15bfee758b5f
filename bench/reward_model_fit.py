"""How well the trainer's reward model (`trainer.reward_model`) predicts what users really think, per feature set.

On `bench/trainer_efficiency.py`'s logged data (the base serves `--samples` requests of a population, simulated
users react, the default reward definition scores their events; cached under `--cache`), each feature set's
ridge model is fitted as a cycle fits it (penalty by 5-fold cross-validation on the rewards), and its
out-of-fold predictions are compared with the ground truth the rewards are noisy draws of: the population's
expected reward of each completion (shown x (p_accept - 0.25)). "cv r (rewards)" is what a cycle can see and
report; "cv r (truth)" is what matters, and only a simulator knows it.

The product's feature set was chosen on the tuning populations (length, style); the others are reported. The last
two sets (the policy's hidden states, which see the prompt) were tried, not adopted: see its results file.

    python bench/reward_model_fit.py --model DIR --cache DIR [--populations length,style,brackets] [--samples 800]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from trainer_efficiency import log_requests, training_samples  # noqa: E402

FOLDS = 5


def hashed_class_bigrams(text: str, buckets: int = 256) -> np.ndarray:
    """The feature the product tried first: log(1 + count) of every character-class bigram, hashed."""
    from trainer.reward_model import _char_class

    out = np.zeros(buckets)
    classes = [_char_class(ch) for ch in text]
    for a, b in zip(classes, classes[1:], strict=False):
        out[zlib.crc32((a + b).encode()) % buckets] += 1
    return np.log1p(out)


def policy_hidden_states(policy, samples) -> np.ndarray:  # noqa: ANN001 - Policy, Sequence[Sample]
    """The policy's own representation of each sample, seeing its prompt: the last layer's hidden state averaged over
    the completion's tokens, and at its last token (the prompt's last token for a declined one)."""
    import torch

    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([[*s.prompt_token_ids, *s.completion_token_ids]], device=policy.device)
            hidden = policy.model(ids, output_hidden_states=True).hidden_states[-1][0]
            # the state that predicts each completion token is the one before it
            start = len(s.prompt_token_ids) - 1
            span = hidden[start : max(start + 1, hidden.shape[0] - 1)]
            out.append(torch.cat([span.mean(0), hidden[-1]]).float().cpu().numpy())
    return np.stack(out)


def out_of_fold(features: np.ndarray, rewards: np.ndarray, seed: int) -> tuple[np.ndarray, float]:
    """Out-of-fold predictions (each fold's model fitted as a cycle fits one) and the full fit's cv r."""
    from trainer.reward_model import fit_reward_model

    fold = np.array(random.Random(seed).choices(range(FOLDS), k=len(rewards)))
    predicted = np.zeros(len(rewards))
    for k in range(FOLDS):
        train, test = fold != k, fold == k
        predicted[test] = fit_reward_model(features[train], rewards[train], seed=seed).predict(features[test])
    return predicted, fit_reward_model(features, rewards, seed=seed).cv_corr


def main() -> None:
    from flywheel.lm import load_policy
    from simulator.contexts import fit_prompts, held_out_contexts
    from simulator.populations import populations_named
    from trainer.reward_model import IDENTIFIER_SHAPES, PRINTABLE, completion_features

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True, help="trainer_efficiency.py's logged-data cache")
    ap.add_argument("--populations", default="length,style,brackets,style-mirror")
    ap.add_argument("--samples", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    policy = load_policy(args.model)
    contexts = fit_prompts(held_out_contexts(300, args.seed), policy.context - 16)
    chars = len(PRINTABLE) + 1
    shapes = slice(chars, chars + len(IDENTIFIER_SHAPES))
    variants: dict[str, Callable[[np.ndarray, list[str]], np.ndarray]] = {
        "product": lambda x, _: x,
        "without identifier shapes": lambda x, _: np.delete(x, np.arange(x.shape[1])[shapes], axis=1),
        "without the mean log-prob": lambda x, _: x[:, :-1],
        "characters present, not counted": lambda x, _: np.concatenate([(x[:, :chars] > 0), x[:, chars:]], axis=1),
        "plus hashed class bigrams (tried first)": lambda x, texts: np.concatenate(
            [x, np.stack([hashed_class_bigrams(t) for t in texts])], axis=1
        ),
    }
    print("| population | features | rows | cv r (rewards) | cv r (truth) |\n|---|---|---|---|---|")
    args.cache.mkdir(parents=True, exist_ok=True)
    for pop in populations_named(args.populations.split(",")):
        path = args.cache / f"{args.model.name}-{pop.name}-{args.samples}-s{args.seed}-t16.json"
        if path.exists():
            rows = json.loads(path.read_text())
        else:
            rows = log_requests(policy, pop, contexts, args.samples, args.seed, 16, 64)
            path.write_text(json.dumps(rows))
        samples = training_samples(rows, 0.0)  # every row (no hold-out), in order
        base = completion_features(policy, samples, [s.behaviour_logprobs or [] for s in samples])
        texts = [str(policy.tokenizer.decode(s.completion_token_ids, skip_special_tokens=True)) for s in samples]
        rewards = np.array([s.reward for s in samples])
        truth = np.array([r["shown"] * (r["p_accept"] - 0.25) for r in rows])
        hidden = policy_hidden_states(policy, samples)
        variants["plus the policy's hidden states"] = lambda x, _, h=hidden: np.concatenate([x, h], axis=1)
        variants["the policy's hidden states alone"] = lambda x, _, h=hidden: h
        for name, make in variants.items():
            predicted, cv_r = out_of_fold(make(base, texts).astype(float), rewards, args.seed)
            print(f"| {pop.name} | {name} | {len(rewards)} | {cv_r:.3f} | {np.corrcoef(predicted, truth)[0, 1]:.3f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
