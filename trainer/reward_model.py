"""A reward model fitted on a cycle's logged rewards, and the policy's own samples scored by it.

One logged reaction per request is a noisy, single-sample signal: the policy gradient on it moves the policy
mostly along noise (`bench/trainer_efficiency.py`: 4-10% of the reachable gain on most populations). What users
reward is usually a property of the text that recurs across requests (its length, its quotes, its brackets), so
a model fitted on all of a cycle's rewards at once averages the noise away; scored by it, several fresh samples
of each logged prompt from the champion give an on-policy group per prompt whose mean is the baseline (GRPO,
Shao et al. 2024), and the policy gradient on those moves toward what the fitted model rewards. This is the
reward-model step of RLHF (Ouyang et al. 2022) on implicit feedback.

The model is ridge regression (`numpy`) on text features any completion has: counts of each character, how its
identifiers are written (`aB`, `a_`, `a1` pairs), its length, its lines, whether it finished or was cut, and
the champion's mean log-prob of it. Its penalty is chosen by k-fold cross-validation, and the
cross-validated correlation r with the logged rewards is reported; when r x sqrt(rows) (its distance from zero
in standard errors when the text says nothing of the reward) is not above `TrainerConfig.reward_model_min_z`,
the cycle trains on the logged samples as before and says why.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from flywheel.lm.policy import Policy
from trainer.config import TrainerConfig
from trainer.data import Sample
from trainer.loop import score_samples
from trainer.scoring import Scorer

PRINTABLE = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
_CHAR_INDEX = {c: i for i, c in enumerate(PRINTABLE)}
IDENTIFIER_SHAPES = ("aA", "Aa", "AA", "a_", "_a", "a0")
"""Character-class pairs (a lower, A upper, 0 digit) whose presence says how identifiers are written."""
LAMBDAS = tuple(10.0**k for k in range(-1, 5))
"""Ridge penalties tried by cross-validation (features are standardised, so one scale fits all)."""


def _char_class(ch: str) -> str:
    if ch.islower():
        return "a"
    if ch.isupper():
        return "A"
    if ch.isdigit():
        return "0"
    return ch


def text_features(text: str, finish_reason: str, mean_logprob: float, tokens: int) -> np.ndarray:
    """One completion's feature vector (float64): what the reward model may use, nothing about the user.

    log(1 + count) of each character, whether each of `IDENTIFIER_SHAPES` occurs, and the completion's shape.
    (Hashed character-class bigrams of every kind were tried and fitted worse: `bench/results/reward_model_fit.md`.)
    """
    chars = np.zeros(len(PRINTABLE) + 1)
    for ch in text:
        chars[_CHAR_INDEX.get(ch, len(PRINTABLE))] += 1
    classes = "".join(_char_class(ch) for ch in text)
    shapes = np.array([float(pair in classes) for pair in IDENTIFIER_SHAPES])
    body = text.rstrip("\n")
    shape = np.array([
        math.log1p(len(body)), float(len(body) == 0), float(body.count("\n")), float(text.endswith("\n")),
        float(finish_reason == "stop"), float(finish_reason == "length"), float(finish_reason == "declined"),
        math.log1p(tokens), mean_logprob,
    ])  # fmt: skip
    return np.concatenate([np.log1p(chars), shapes, shape])


@dataclass(frozen=True)
class RewardModel:
    """Ridge regression of reward on `text_features`, standardised with the training rows' mean and std."""

    weights: np.ndarray
    intercept: float
    mean: np.ndarray
    scale: np.ndarray
    penalty: float
    cv_corr: float  # Pearson r between held-out-fold predictions and the logged rewards
    rows: int

    def predict(self, features: np.ndarray) -> np.ndarray:
        return ((features - self.mean) / self.scale) @ self.weights + self.intercept


def _ridge(x: np.ndarray, y: np.ndarray, penalty: float) -> np.ndarray:
    d = x.shape[1]
    return np.linalg.solve(x.T @ x + penalty * np.eye(d), x.T @ y)


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])


def fit_reward_model(features: np.ndarray, rewards: np.ndarray, *, folds: int = 5, seed: int = 0) -> RewardModel:
    """Fit ridge regression, its penalty chosen by `folds`-fold cross-validated squared error (seeded folds)."""
    n = len(rewards)
    if n < 2 * folds:
        raise ValueError(f"{n} rewards are too few to cross-validate a reward model over {folds} folds")
    mean = features.mean(axis=0)
    scale = features.std(axis=0)
    scale[scale == 0] = 1.0
    x = (features - mean) / scale
    fold = np.array(random.Random(seed).choices(range(folds), k=n))
    best: tuple[float, float, np.ndarray] | None = None
    for penalty in LAMBDAS:
        predicted = np.zeros(n)
        for k in range(folds):
            train, test = fold != k, fold == k
            if not test.any():
                continue
            y_mean = rewards[train].mean()
            w = _ridge(x[train], rewards[train] - y_mean, penalty)
            predicted[test] = x[test] @ w + y_mean
        error = float(np.mean((predicted - rewards) ** 2))
        if best is None or error < best[0]:
            best = (error, penalty, predicted)
    assert best is not None
    _, penalty, predicted = best
    y_mean = float(rewards.mean())
    weights = _ridge(x, rewards - y_mean, penalty)
    return RewardModel(weights, y_mean, mean, scale, penalty, _corr(predicted, rewards), n)


def completion_features(policy: Policy, samples: Sequence[Sample], logprobs: Sequence[Sequence[float]]) -> np.ndarray:
    """`text_features` of each sample's completion (`logprobs`: the champion's, for its mean log-prob)."""
    rows = []
    for s, lp in zip(samples, logprobs, strict=True):
        ids = s.completion_token_ids
        text = str(policy.tokenizer.decode(ids, skip_special_tokens=True))
        finish = policy.finish_reason(ids) if ids else "length"
        rows.append(text_features(text, finish, float(np.mean(lp)) if len(lp) else 0.0, len(ids)))
    return np.stack(rows)


def distinct_prompts(samples: Sequence[Sample], at_most: int, seed: int) -> dict[tuple[int, ...], Sample]:
    """The first logged sample of each distinct prompt, in order of first appearance; when there are more than
    `at_most` (> 0), a seeded uniform choice of `at_most` of them, still in that order."""
    prompts: dict[tuple[int, ...], Sample] = {}
    for s in samples:
        prompts.setdefault(tuple(s.prompt_token_ids), s)
    if 0 < at_most < len(prompts):
        keep = set(random.Random(seed).sample(range(len(prompts)), at_most))
        prompts = {p: s for i, (p, s) in enumerate(prompts.items()) if i in keep}
    return prompts


@torch.no_grad()
def sample_own(
    policy: Policy,
    samples: Sequence[Sample],
    per_prompt: int,
    max_tokens: int,
    seed: int,
    batch: int = 64,
    max_prompts: int = 0,
) -> list[Sample]:
    """`per_prompt` fresh completions of each distinct logged prompt (at most `max_prompts` of them, chosen by
    `distinct_prompts`; 0 = all) from `policy`, seeded, rewards unset (0).

    Behaviour log-probs are left empty: the caller sets them to the champion's, which these samples are from.
    """
    prompts = distinct_prompts(samples, max_prompts, seed)
    requests = [(p, k) for p in prompts for k in range(per_prompt)]
    out: list[Sample] = []
    for start in range(0, len(requests), batch):
        chunk = requests[start : start + batch]
        seeds = [zlib.crc32(repr((seed, p, k)).encode()) for p, k in chunk]
        gens = policy.sample_token_ids([list(p) for p, _ in chunk], max_tokens, seeds)
        for (p, k), ids in zip(chunk, gens, strict=True):
            logged = prompts[p]
            out.append(replace(logged, generation_id=f"{logged.generation_id}/own{k}", completion_token_ids=ids,
                               behaviour_logprobs=[], reward=0.0, replay=False))  # fmt: skip
    return out


def group_advantages(samples: Sequence[Sample], scores: np.ndarray) -> list[float]:
    """Each sample's score minus the mean score of its prompt's group (GRPO's baseline, no std division)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(s.prompt_token_ids), []).append(i)
    out = np.zeros(len(samples))
    for members in groups.values():
        out[members] = scores[members] - scores[members].mean()
    return out.tolist()


@dataclass(frozen=True)
class OwnSamples:
    """What a cycle trains on when `TrainerConfig.own_samples` is set: the champion's own samples scored by the
    fitted reward model (advantages within each prompt's group), or the logged ones with the reason why not."""

    samples: list[Sample]
    reference: list[list[float]]
    model: RewardModel | None
    note: str
    fresh: bool = False  # the samples are the champion's own (False: the logged ones, `note` says why)

    def metrics(self) -> dict[str, float]:
        if self.model is None:
            return {}
        own = len(self.samples) if self.fresh else 0
        return {"reward_model_cv_corr": self.model.cv_corr, "reward_model_penalty": self.model.penalty,
                "reward_model_rows": float(self.model.rows), "own_samples": float(own)}  # fmt: skip


def own_samples(
    policy: Policy,
    logged: Sequence[Sample],
    reference: Sequence[Sequence[float]],
    config: TrainerConfig,
    scorer: Scorer,
) -> OwnSamples:
    """Fit the reward model on `logged` (their champion log-probs `reference`), then sample and score.

    Falls back to the logged samples, saying why, when the cross-validated
    correlation is not `config.reward_model_min_z` standard errors above zero, or there are too few rewards to
    cross-validate.
    """
    rewards = np.array([s.reward for s in logged])
    try:
        model = fit_reward_model(completion_features(policy, logged, reference), rewards, seed=config.seed)
    except ValueError as exc:
        return OwnSamples(list(logged), [list(r) for r in reference], None, f"trained on the logged samples: {exc}")
    z = model.cv_corr * math.sqrt(model.rows)
    if not z > config.reward_model_min_z:
        return OwnSamples(list(logged), [list(r) for r in reference], model,
                          f"trained on the logged samples: the reward model's cross-validated correlation with"
                          f" their rewards, {model.cv_corr:.3f} on {model.rows}, is {z:.1f} standard errors from"
                          f" zero, not above reward_model_min_z={config.reward_model_min_z:g}")  # fmt: skip
    fresh = sample_own(policy, logged, config.own_samples, config.own_max_tokens, config.seed,
                       max_prompts=config.own_max_prompts)  # fmt: skip
    fresh_reference = score_samples(policy.model, fresh, scorer, policy.pad_id, config.batch_size)
    scores = model.predict(completion_features(policy, fresh, fresh_reference))
    advantages = group_advantages(fresh, scores)
    trained = [replace(s, behaviour_logprobs=list(lp), reward=a)
               for s, lp, a in zip(fresh, fresh_reference, advantages, strict=True)]  # fmt: skip
    distinct = len({tuple(s.prompt_token_ids) for s in logged})
    sampled = len(trained) // config.own_samples
    of_prompts = f"of all {distinct} distinct prompts"
    if sampled < distinct:
        of_prompts = f"of {sampled} of {distinct} distinct prompts, a seeded uniform choice (own_max_prompts)"
    note = (
        f"{len(trained)} own samples ({config.own_samples} a prompt, {of_prompts}) scored by a reward model"
        f" fitted on all {model.rows} logged rewards (cross-validated r {model.cv_corr:.3f})"
    )
    return OwnSamples(trained, fresh_reference, model, note, fresh=True)
