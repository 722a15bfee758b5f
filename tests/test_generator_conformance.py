"""The generator conformance suite (serving.conformance) over the in-process Hugging Face back end.

A new back end (vLLM, SGLang) gets a fixture like `hf` below and the same parametrized test. The HF
back end is held to `atol=0`: its behaviour log-probs are the trainer's `token_logprobs`, bit for bit,
and a seeded request gives the same tokens whether it is sampled alone or in any batch (CPU, fp32).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from flywheel.lm import Policy, load_policy, token_logprobs
from serving.conformance import Check, Harness, generator_checks
from serving.generator import GenerationRequest, Generator, hf_generator


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return load_policy(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf(policy: Policy) -> Harness:
    def score(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        logprobs, mask = token_logprobs(policy.model, [prompt_ids], [completion_ids], policy.pad_id)
        return logprobs[0][mask[0].bool()].tolist()

    return Harness(hf_generator(policy), score=score, atol=0.0)


@pytest.mark.parametrize("check", list(generator_checks()), ids=lambda c: c.__name__)
def test_hf_back_end_conforms(hf: Harness, check: Check) -> None:
    check(hf)


def test_a_policy_is_a_generator(policy: Policy) -> None:
    assert isinstance(policy, Generator)


def test_batched_and_unbatched_generation_agree_exactly_for_the_same_seed(policy: Policy) -> None:
    # The issue's own test, stated directly: ten seeded requests (prompts of different lengths, so
    # left padding; sampled and greedy; different max_tokens) in one batch and one at a time.
    prompts = ["def ", "x = ", "import os\n\nclass Config:\n    def __init__(self", "", "    return "]
    requests = [
        GenerationRequest(prompts[i % 5], max_tokens=4 + i % 7, temperature=(0.0, 1.0, 0.8, 1.5)[i % 4], seed=i)
        for i in range(10)
    ]
    batched = policy.generate_batch(requests)
    for request, together in zip(requests, batched, strict=True):
        alone = policy.generate(request.prompt, request.max_tokens, request.temperature, seed=request.seed)
        assert together.completion_token_ids == alone.completion_token_ids
        assert together.logprobs == alone.logprobs  # bit for bit
        assert together == alone
    assert len({tuple(g.completion_token_ids) for g in batched}) > 5, "the requests sampled different things"


def test_a_request_out_of_range_is_refused_before_sampling(policy: Policy) -> None:
    with pytest.raises(ValueError, match="stop sequence"):
        policy.generate_batch([GenerationRequest("x", stop=("",))])
    with pytest.raises(ValueError, match="max_tokens"):
        policy.generate_batch([GenerationRequest("x"), GenerationRequest("x", max_tokens=0)])
