"""The conformance suite every serving back end must pass (serving.generator states the contract).

River-style: `generator_checks()` yields plain check functions; run each over a `Harness` that holds
the back end and a reference scorer for its log-probs:

    for check in generator_checks():
        check(Harness(my_generator, score=reference_score, atol=0.0))

`score(prompt_ids, completion_ids)` must give the log-probs the *trainer* computes for those tokens
(`flywheel.lm.token_logprobs` on the same checkpoint). The in-process HF back end is held to `atol=0`:
its log-probs are the trainer's, bit for bit. A remote back end (vLLM, SGLang) computes them with its
own kernels and declares the tolerance it meets; the trainer's importance ratio sees that difference.
Each check raises AssertionError naming the rule broken. tests/test_generator_conformance.py runs
them over the HF back end and the vLLM one (flywheel.lm.vllm, `LOGPROB_ATOL`). The checks compare a
back end with itself and with the trainer's scorer, never two back ends' samples: seeded sampling is each
engine's own (the same seed gives the same completion within vLLM, not the one HF gives for that seed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from serving.generator import Generation, GenerationRequest, Generator

Scorer = Callable[[Sequence[int], Sequence[int]], list[float]]

# How far a completion's log-probs may move when it is cut short (scored as a shorter sequence).
PREFIX_ATOL = 1e-5
PROMPTS = ("def ", "import os\n\nclass Config:\n    def __init__(self", "x = ", "    for key, value in ", "")


@dataclass(frozen=True)
class Harness:
    generator: Generator
    score: Scorer
    atol: float = 0.0


Check = Callable[[Harness], None]


def generator_checks() -> Iterator[Check]:
    """Every check, in a stable order."""
    yield check_one_result_per_request_in_order
    yield check_batch_composition_does_not_change_a_seeded_request
    yield check_same_seed_same_completion
    yield check_logprobs_are_those_of_the_sampled_tokens
    yield check_greedy_ignores_the_seed
    yield check_max_tokens_bounds_the_completion
    yield check_a_completion_is_one_line
    yield check_stop_sequences_cut_the_text
    yield check_top_logprobs
    yield check_empty_batch
    yield check_context_accounting


def _close(a: Sequence[float], b: Sequence[float], atol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= atol for x, y in zip(a, b, strict=True))


def _same(a: Generation, b: Generation, atol: float) -> bool:
    return (
        a.completion_token_ids == b.completion_token_ids
        and a.completion == b.completion
        and a.finish_reason == b.finish_reason
        and _close(a.logprobs, b.logprobs, atol)
    )


def _mixed_batch(max_tokens: int = 12) -> list[GenerationRequest]:
    """Prompts of different lengths (so padding), temperatures and seeds."""
    temperatures = (1.0, 0.0, 0.7, 1.3)
    return [
        GenerationRequest(p, max_tokens=max_tokens - i, temperature=temperatures[i % 4], seed=100 + i)
        for i, p in enumerate(PROMPTS)
    ]


def check_one_result_per_request_in_order(h: Harness) -> None:
    requests = _mixed_batch()
    results = h.generator.generate_batch(requests)
    assert len(results) == len(requests), f"{len(results)} results for {len(requests)} requests"
    alone = [h.generator.generate_batch([r])[0] for r in requests]
    for i, (got, want) in enumerate(zip(results, alone, strict=True)):
        assert got.prompt_token_ids == want.prompt_token_ids, f"result {i} answers another request's prompt"


def check_batch_composition_does_not_change_a_seeded_request(h: Harness) -> None:
    requests = _mixed_batch()
    together = h.generator.generate_batch(requests)
    alone = [h.generator.generate_batch([r])[0] for r in requests]
    reversed_ = h.generator.generate_batch(requests[::-1])[::-1]
    for i, r in enumerate(requests):
        assert _same(together[i], alone[i], h.atol), f"request {i} batched differs from alone: {r}"
        assert _same(reversed_[i], alone[i], h.atol), f"request {i} differs when the batch is reordered"


def check_same_seed_same_completion(h: Harness) -> None:
    r = GenerationRequest(PROMPTS[1], max_tokens=10, temperature=1.0, seed=7)
    first, second = h.generator.generate_batch([r, r])
    assert _same(first, second, h.atol), "the same seeded request twice in one batch gave two completions"
    assert _same(first, h.generator.generate_batch([r])[0], h.atol), "the same seed gave another completion"


def check_logprobs_are_those_of_the_sampled_tokens(h: Harness) -> None:
    for g in h.generator.generate_batch(_mixed_batch()):
        assert len(g.logprobs) == len(g.completion_token_ids) >= 1, "one log-prob per sampled token"
        assert all(math.isfinite(v) and v <= 0 for v in g.logprobs), "log-probs are finite and <= 0"
        want = h.score(g.prompt_token_ids, g.completion_token_ids)
        assert _close(g.logprobs, want, h.atol), f"log-probs differ from the trainer's by more than {h.atol}"


def check_greedy_ignores_the_seed(h: Harness) -> None:
    results = h.generator.generate_batch(
        [GenerationRequest(PROMPTS[0], max_tokens=8, temperature=0.0, seed=s) for s in (1, 2, 3)]
    )
    assert all(_same(r, results[0], h.atol) for r in results), "greedy decoding depends on the seed"


def check_max_tokens_bounds_the_completion(h: Harness) -> None:
    for n in (1, 3):
        for g in h.generator.generate_batch([replace(r, max_tokens=n) for r in _mixed_batch()]):
            assert 1 <= len(g.completion_token_ids) <= n, f"max_tokens={n} gave {len(g.completion_token_ids)}"
            if len(g.completion_token_ids) < n:
                assert g.finish_reason in ("stop", "declined"), "a completion short of max_tokens stopped"
            elif g.finish_reason == "length":
                assert len(g.completion_token_ids) == n


def check_a_completion_is_one_line(h: Harness) -> None:
    for g in h.generator.generate_batch([replace(r, max_tokens=24) for r in _mixed_batch()]):
        texts = h.generator.token_texts(g.completion_token_ids)
        assert not any("\n" in t for t in texts[:-1]), "only the last token of a completion may end its line"


def check_stop_sequences_cut_the_text(h: Harness) -> None:
    # Find a seeded completion with some text, then stop it at its second character: the same draws
    # give the same tokens up to the stop, and the text shown ends before it.
    for seed in range(50):
        base = GenerationRequest(PROMPTS[1], max_tokens=12, temperature=1.0, seed=seed)
        free = h.generator.generate_batch([base])[0]
        if len(free.completion.strip()) >= 3:
            break
    else:
        raise AssertionError("no seed gave a completion of 3 characters to cut")
    stop = free.completion[1:3]
    cut = h.generator.generate_batch([replace(base, stop=("\x00never", stop))])[0]
    at = free.completion.find(stop)
    assert cut.completion == free.completion[:at], f"stop {stop!r} shows {cut.completion!r}"
    assert cut.finish_reason == "stop", "a stop sequence finishes with reason 'stop'"
    n = len(cut.completion_token_ids)
    assert cut.completion_token_ids == free.completion_token_ids[:n], "a stop changes no earlier token"
    # The kept tokens' log-probs are exactly the trainer's for the cut completion (what is logged), and those of
    # the longer one up to float rounding: a shorter forward pass is another matmul shape, which on some
    # architectures (GPT-2, Phi-3, Qwen2 on CPU: up to 5e-7) rounds the last bits differently.
    assert _close(cut.logprobs, h.score(cut.prompt_token_ids, cut.completion_token_ids), h.atol)
    assert _close(cut.logprobs, free.logprobs[:n], h.atol + PREFIX_ATOL), "the kept tokens keep their log-probs"


def check_top_logprobs(h: Harness) -> None:
    k = 3
    for g in h.generator.generate_batch([replace(r, top_logprobs=k) for r in _mixed_batch()]):
        assert g.top_logprobs is not None and len(g.top_logprobs) == len(g.completion_token_ids)
        for position, (token, logged) in enumerate(zip(g.completion_token_ids, g.logprobs, strict=True)):
            top = g.top_logprobs[position]
            values = [v for _, v in top]
            assert len(top) == k and values == sorted(values, reverse=True), "k entries, likeliest first"
            assert logged <= values[0] + h.atol, "no token is likelier than the likeliest"
            for t, v in top:
                if t == token:
                    assert abs(v - logged) <= h.atol, "the sampled token's top entry is its logged log-prob"
    plain = h.generator.generate_batch(_mixed_batch()[:1])[0]
    assert plain.top_logprobs is None, "top log-probs only when asked for"


def check_empty_batch(h: Harness) -> None:
    assert h.generator.generate_batch([]) == [], "an empty batch gives no results"


def check_context_accounting(h: Harness) -> None:
    assert h.generator.count_prompt_tokens("") >= 1, "an empty prompt still takes a token"
    g = h.generator.generate_batch([GenerationRequest(PROMPTS[1], max_tokens=2, seed=0)])[0]
    assert h.generator.count_prompt_tokens(PROMPTS[1]) == len(g.prompt_token_ids), "counted as generated"
    assert h.generator.context > h.generator.count_prompt_tokens(PROMPTS[1]) + 2
