"""The generator interface as serving names it: `flywheel.lm.engine.Generator` states the contract every back end
keeps (serving.conformance checks it), since the trainer and the offline gate run generation work on the same
engines. The embedded default is the in-process Hugging Face back end, `flywheel.lm.Policy`; flywheel.lm.vllm is
vLLM's (`serving_backend="vllm"`); docs/serving.md, "Serving back ends", says how to run it and what differs.
"""

from __future__ import annotations

from flywheel.lm.engine import Generator
from flywheel.lm.policy import MAX_TOP_LOGPROBS, Generation, GenerationRequest, Policy


def hf_generator(policy: Policy) -> Generator:
    """The embedded back end: a loaded `Policy` is a `Generator` as it is (this states it to mypy)."""
    return policy


__all__ = ["MAX_TOP_LOGPROBS", "Generation", "GenerationRequest", "Generator", "hf_generator"]
