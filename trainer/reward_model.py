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

import contextlib
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from flywheel.lm.engine import Engine, Opened
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


def cpu_seconds() -> float:
    """CPU-seconds this process has used, every thread counted (`time.process_time`): what a budget on a shared
    machine must count, since wall time there grows with everyone else's load."""
    return time.process_time()


@dataclass(frozen=True)
class CpuBudget:
    """`seconds` of this process's CPU from `started` (a `cpu_seconds()` value); 0 seconds is no budget."""

    seconds: float
    started: float

    def spent(self) -> float:
        return cpu_seconds() - self.started

    def exhausted(self) -> bool:
        return self.seconds > 0 and self.spent() >= self.seconds


@dataclass(frozen=True)
class OwnDraw:
    """The champion's own samples of the prompts a budget covered, with their log-probs under it."""

    samples: list[Sample]
    reference: list[list[float]]
    prompts_covered: int
    prompts_total: int  # distinct prompts eligible to be sampled (after `own_max_prompts`)
    prompts_distinct: int  # distinct logged prompts
    sampling_s: float = 0.0  # wall seconds in the engine's sampling
    scoring_s: float = 0.0  # wall seconds scoring the samples with the trainer's scorer (the reference)


@torch.no_grad()
def sample_own(
    policy: Policy,
    samples: Sequence[Sample],
    per_prompt: int,
    max_tokens: int,
    seed: int,
    *,
    scorer: Scorer,
    score_batch: int,
    batch: int = 64,
    max_prompts: int = 0,
    stop: Callable[[], bool] | None = None,
    engine: Engine | None = None,
) -> OwnDraw:
    """`per_prompt` fresh completions of distinct logged prompts (at most `max_prompts` of them, chosen by
    `distinct_prompts`; 0 = all) from `policy`, seeded, rewards unset (0), scored by `scorer` (the reference).

    `engine` samples them (default: `policy` itself, the in-process loop): the same version on another engine
    (flywheel.lm.engine.open_engine). The prompts, their order, the seeds and the counts are the same whichever
    samples; the tokens are the engine's (vLLM's RNG is not torch's), and they are always scored here.

    Prompts are visited in a seeded random order, about `batch` requests at a time (whole prompt groups), and
    no group of them starts once `stop()` says so (the first always runs): the prompts covered are a uniform
    sample of those eligible, however early it stops. Behaviour log-probs are set to the reference, since these
    samples are the champion's own.
    """
    prompts = distinct_prompts(samples, max_prompts, seed)
    distinct = len({tuple(s.prompt_token_ids) for s in samples})
    order = random.Random(seed).sample(list(prompts), len(prompts))
    per_chunk = max(1, batch // per_prompt)
    out: list[Sample] = []
    reference: list[list[float]] = []
    covered = 0
    sampling_s = scoring_s = 0.0
    sampler = engine or policy
    for start in range(0, len(order), per_chunk):
        if start and stop is not None and stop():
            break
        chunk = [(p, k) for p in order[start : start + per_chunk] for k in range(per_prompt)]
        seeds = [zlib.crc32(repr((seed, p, k)).encode()) for p, k in chunk]
        at = time.monotonic()
        gens = sampler.sample_token_ids([list(p) for p, _ in chunk], max_tokens, seeds)
        sampling_s += time.monotonic() - at
        fresh = []
        for (p, k), ids in zip(chunk, gens, strict=True):
            logged = prompts[p]
            fresh.append(replace(logged, generation_id=f"{logged.generation_id}/own{k}", completion_token_ids=ids,
                                 behaviour_logprobs=[], reward=0.0, replay=False))  # fmt: skip
        at = time.monotonic()
        lps = score_samples(policy.model, fresh, scorer, policy.pad_id, score_batch)
        scoring_s += time.monotonic() - at
        out.extend(replace(s, behaviour_logprobs=list(lp)) for s, lp in zip(fresh, lps, strict=True))
        reference.extend(lps)
        covered += len(chunk) // per_prompt
    return OwnDraw(out, reference, covered, len(prompts), distinct, sampling_s, scoring_s)


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
    prompts_covered: int = 0
    prompts_total: int = 0
    cpu_seconds: float = 0.0  # CPU spent from the budget's start: the logged samples' scoring, the fit, the sampling
    sampled_on: str = "hf"  # the engine that sampled them (flywheel.lm.engine)
    engine_start_s: float = 0.0  # seconds until that engine was ready (a vLLM server started for the cycle)
    sampling_s: float = 0.0  # wall seconds sampling, on that engine
    scoring_s: float = 0.0  # wall seconds scoring them with the trainer's scorer

    def metrics(self) -> dict[str, float]:
        if self.model is None:
            return {}
        own = len(self.samples) if self.fresh else 0
        return {"reward_model_cv_corr": self.model.cv_corr, "reward_model_penalty": self.model.penalty,
                "reward_model_rows": float(self.model.rows), "own_samples": float(own),
                "own_prompts_covered": float(self.prompts_covered), "own_prompts_total": float(self.prompts_total),
                "own_cpu_seconds": self.cpu_seconds, "own_engine_start_seconds": self.engine_start_s,
                "own_sampling_seconds": self.sampling_s, "own_scoring_seconds": self.scoring_s,
                "own_sampled_on_vllm": float(self.sampled_on.startswith("vllm"))}  # fmt: skip


def own_samples(
    policy: Policy,
    logged: Sequence[Sample],
    reference: Sequence[Sequence[float]],
    config: TrainerConfig,
    scorer: Scorer,
    *,
    budget: CpuBudget | None = None,
    stop: Callable[[], bool] | None = None,
    engine: Callable[[], contextlib.AbstractContextManager[Opened]] | None = None,
) -> OwnSamples:
    """Fit the reward model on `logged` (their champion log-probs `reference`), then sample and score.

    `budget` (default: `config.own_cpu_budget_s` from now) bounds the sampling: no group of prompts starts
    once it is spent, counted from its `started` (the cycle passes the start of its preparation, so the logged
    samples' scoring counts too), or once `stop()` says so (a distributed cycle: whether any process has spent
    it). `engine` opens the engine that samples (flywheel.lm.engine.open_engine; opened only once the reward model
    is kept; default: `policy`, the in-process loop); the note says which sampled, and the seconds it spent
    against those the trainer spent scoring. Falls back to the logged samples, saying why, when
    the cross-validated correlation is not `config.reward_model_min_z` standard errors above zero, or there are
    too few rewards to cross-validate.
    """
    budget = budget or CpuBudget(config.own_cpu_budget_s, cpu_seconds())
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
    with engine() if engine is not None else contextlib.nullcontext(None) as opened:
        draw = sample_own(policy, logged, config.own_samples, config.own_max_tokens, config.seed, scorer=scorer,
                          score_batch=config.batch_size, max_prompts=config.own_max_prompts,
                          stop=stop or budget.exhausted, engine=opened.engine if opened else None)  # fmt: skip
    scores = model.predict(completion_features(policy, draw.samples, draw.reference))
    advantages = group_advantages(draw.samples, scores)
    trained = [replace(s, reward=a) for s, a in zip(draw.samples, advantages, strict=True)]
    spent = budget.spent()
    covered = f"{draw.prompts_covered} of {draw.prompts_distinct} distinct prompts"
    rules = []
    if draw.prompts_total < draw.prompts_distinct:
        rules.append(f"own_max_prompts={config.own_max_prompts}")
    if draw.prompts_covered < draw.prompts_total:
        rules.append(f"all the {config.own_cpu_budget_s:g} CPU-s own_cpu_budget_s allowed")
    if rules:
        covered += f" ({', and '.join(rules)}; a seeded uniform choice)"
    sampled_on = opened.describe() if opened else "hf"
    on_vllm = opened is not None and opened.name == "vllm"
    started = f", {opened.start_s:.1f} s to start it" if opened and on_vllm else ""
    outside = "; the engine's own CPU is not counted" if on_vllm else ""
    note = (
        f"own samples for {covered}: {len(trained)}, {config.own_samples} a prompt, in {spent:.1f} CPU-s with the"
        f" logged samples' scoring{outside}; sampled on {sampled_on} in {draw.sampling_s:.1f} s{started}, their"
        f" log-probs by the trainer in {draw.scoring_s:.1f} s; scored by a reward model fitted on all {model.rows}"
        f" logged rewards (cross-validated r {model.cv_corr:.3f})"
    )
    return OwnSamples(trained, draw.reference, model, note, fresh=True, prompts_covered=draw.prompts_covered,
                      prompts_total=draw.prompts_distinct, cpu_seconds=spent, sampled_on=sampled_on,
                      engine_start_s=opened.start_s if opened else 0.0, sampling_s=draw.sampling_s,
                      scoring_s=draw.scoring_s)  # fmt: skip
