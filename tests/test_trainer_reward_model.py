"""The reward model fitted on a cycle's logged rewards (`trainer.reward_model`).

The texts are made here, with rewards drawn from a known rule so the fit can be checked against it; cycles that
train on the champion's own samples scored by it are in tests/test_trainer_cycle.py.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime

import numpy as np

from trainer.data import Sample
from trainer.reward_model import distinct_prompts, fit_reward_model, group_advantages, text_features

WORDS = ["x", "value", "name", "items", "count", "self.data", "path", "0", "1", "None"]


def _texts(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        quote = rng.choice(["'", '"'])
        words = rng.sample(WORDS, rng.randint(1, 3))
        out.append(f"{words[0]}({quote}{' '.join(words[1:])}{quote})" if rng.random() < 0.7 else " + ".join(words))
    return out


def _features(texts: list[str]) -> np.ndarray:
    return np.stack([text_features(t, "stop", -2.0, len(t) // 3 + 1) for t in texts])


def test_the_reward_model_learns_a_preference_from_one_noisy_reaction_per_text() -> None:
    rng = random.Random(0)
    texts = _texts(rng, 600)
    # users accept a double-quoted suggestion 80% of the time, any other 25%: Cursor's +0.75 / -0.25 rewards
    rewards = np.array([0.75 if rng.random() < (0.8 if '"' in t else 0.25) else -0.25 for t in texts])
    model = fit_reward_model(_features(texts), rewards, seed=1)
    assert model.cv_corr > 0.3 and model.rows == 600
    liked, disliked = _features(['print("x")', "items + 0"]), _features(["print('x')", "items + 0 + 1"])
    assert (model.predict(liked) > model.predict(disliked)).all()
    # rewards unrelated to the text: nothing to learn, and the cross-validation says so
    noise = np.array([rng.choice([0.75, -0.25]) for _ in texts])
    assert fit_reward_model(_features(texts), noise, seed=1).cv_corr < 0.1


def test_advantages_are_scores_less_their_prompts_mean() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    samples = [Sample(f"g{i}", "u", prompt, [7], [], 0.0, "1", at)
               for i, prompt in enumerate([[1, 2], [3], [1, 2], [3]])]  # fmt: skip
    assert group_advantages(samples, np.array([1.0, 3.0, 2.0, 6.0])) == [-0.5, -1.5, 0.5, 1.5]


def test_own_samples_are_drawn_for_at_most_own_max_prompts_prompts_a_seeded_uniform_choice() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    # 30 distinct prompts, each served twice: the first sample of each prompt stands for it
    samples = [Sample(f"g{i}", "u", [i % 30], [7], [], 0.0, "1", at) for i in range(60)]
    every = distinct_prompts(samples, 0, seed=0)
    assert list(every) == [(i,) for i in range(30)] and [s.generation_id for s in every.values()][:2] == ["g0", "g1"]
    assert distinct_prompts(samples, 30, seed=0) == every  # a cap the traffic does not reach changes nothing
    ten = distinct_prompts(samples, 10, seed=0)
    assert len(ten) == 10 and set(ten) < set(every) and list(ten) == sorted(ten)  # still in order of appearance
    assert distinct_prompts(samples, 10, seed=0) == ten  # seeded
    # uniform: over many seeds every prompt is chosen about a third of the time
    counts = {p: 0 for p in every}
    for seed in range(600):
        for p in distinct_prompts(samples, 10, seed=seed):
            counts[p] += 1
    assert all(150 < c < 250 for c in counts.values()), counts
