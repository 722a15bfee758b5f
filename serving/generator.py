"""The generator interface: what serving needs from whatever runs the model.

Routing (the traffic split), logging (the signed `generation` event) and the registry never see
the model itself; they hand a `Generator` a batch of `GenerationRequest`s and get one `Generation`
back per request, in order. The embedded default is the in-process Hugging Face back end,
`flywheel.lm.Policy`, which satisfies this protocol as it is. A production inference server plugs in
as another implementation: serving.vllm_backend is vLLM's (`serving_backend="vllm"`); docs/serving.md,
"Serving back ends", says how to run it and what differs.

What every back end must guarantee (serving.conformance checks it; tests/test_generator_conformance.py
runs the checks over the HF and vLLM back ends):
- one `Generation` per request, in the order given; a batch never mixes weights: one `Generator`
  object is one model version, so a batch answered by it is answered by that version alone;
- `logprobs[i]` is the log-prob of `completion_token_ids[i]` at temperature 1 under that version,
  the number the trainer's importance ratio divides by; the tokens are exactly the sampled ones
  (the end-of-text token and the token that completed a stop sequence included);
- a request's seed decides its completion whatever else shares the batch;
- a completion ends at end-of-text, at `max_tokens`, after a token containing a newline (one line
  of completion), or at the token completing a `stop` string, and `completion` is cut before it;
- `generate_batch` is called from one thread at a time (serving.batching's worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from flywheel.lm.policy import MAX_TOP_LOGPROBS, Generation, GenerationRequest, Policy


@runtime_checkable
class Generator(Protocol):
    """One model version that samples completions with per-token behaviour log-probs."""

    @property
    def context(self) -> int:
        """Longest prompt + completion, in tokens."""
        ...

    def count_prompt_tokens(self, prompt: str) -> int:
        """Tokens `prompt` takes in the context (at least 1)."""
        ...

    def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (what the `logprobs` answer shows per token)."""
        ...

    def generate_batch(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Sample every request; one result per request, in order."""
        ...


def hf_generator(policy: Policy) -> Generator:
    """The embedded back end: a loaded `Policy` is a `Generator` as it is (this states it to mypy)."""
    return policy


__all__ = ["MAX_TOP_LOGPROBS", "Generation", "GenerationRequest", "Generator", "hf_generator"]
