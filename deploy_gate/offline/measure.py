"""Measurements of loaded policies on held-out prompts: generations and the KL between two policies (the
language-model gate's log-loss is `deploy_gate.offline.lm`).

Everything is seeded per prompt, so the candidate and the champion sample with the same random
numbers (common random numbers): a candidate close to the champion gives nearly the same
completions, and differences in rates come from the weights, not from the dice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flywheel.lm import Generation, Policy


@dataclass(frozen=True)
class Sampled:
    """A policy's completions of the held-out prompts.

    A declined generation (end-of-text first: the policy chose to suggest nothing) is not an empty
    one: `declined_rate` counts the first, `empty_rate` only outputs that were not declined yet show
    no visible text, and `mean_length` is over what was suggested.

    >>> g = lambda text, finish: Generation([1], [2], text, [-0.5], finish)
    >>> s = Sampled([g("", "declined"), g(" ", "stop"), g("x = 1", "stop"), g("return", "length")])
    >>> s.declined_rate, s.empty_rate, s.truncated_rate, s.mean_length
    (0.25, 0.25, 0.25, 4.0)
    """

    generations: list[Generation]

    @property
    def declined_rate(self) -> float:
        return sum(g.finish_reason == "declined" for g in self.generations) / max(1, len(self.generations))

    @property
    def empty_rate(self) -> float:
        blank = sum(g.finish_reason != "declined" and not g.completion.strip() for g in self.generations)
        return blank / max(1, len(self.generations))

    @property
    def truncated_rate(self) -> float:
        return sum(g.finish_reason == "length" for g in self.generations) / max(1, len(self.generations))

    @property
    def mean_length(self) -> float:
        """Mean completion length in characters of the suggestions (what the user is shown); 0 for none."""
        suggested = [len(g.completion) for g in self.generations if g.finish_reason != "declined"]
        return sum(suggested) / max(1, len(suggested))

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for g in self.generations for x in g.logprobs)


def sample(policy: Policy, prompts: list[str], max_tokens: int, seed: int) -> Sampled:
    return Sampled(
        [policy.generate(p, max_tokens=max_tokens, temperature=1.0, seed=seed + i) for i, p in enumerate(prompts)]
    )


@torch.inference_mode()
def _next_token_logprobs(policy: Policy, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """(len(completion), vocab) log-probs of each completion position's next-token distribution."""
    inputs = torch.tensor([prompt_ids + completion_ids[:-1]], device=policy.device)
    logits = policy.model(input_ids=inputs, use_cache=False).logits[0, len(prompt_ids) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)


def mean_kl(candidate: Policy, champion: Policy, sampled: Sampled) -> float:
    """Mean per-token KL(candidate || champion) in nats over the candidate's own completions."""
    total, tokens = 0.0, 0
    for g in sampled.generations:
        lp_cand = _next_token_logprobs(candidate, g.prompt_token_ids, g.completion_token_ids)
        lp_champ = _next_token_logprobs(champion, g.prompt_token_ids, g.completion_token_ids)
        kl = (lp_cand.exp() * (lp_cand - lp_champ)).sum(-1)  # (T,)
        total += float(kl.sum())
        tokens += kl.numel()
    return total / max(1, tokens)
