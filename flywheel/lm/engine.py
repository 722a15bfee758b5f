"""Generation engines: what samples completions for serving, the trainer's own samples and the offline gate.

Routing (the traffic split), logging (the signed `generation` event) and the registry never see
the model itself; they hand a `Generator` a batch of `GenerationRequest`s and get one `Generation`
back per request, in order. The embedded default is the in-process Hugging Face back end,
`flywheel.lm.Policy`, which satisfies this protocol as it is. A production inference server plugs in
as another implementation: flywheel.lm.vllm is vLLM's (`serving_backend="vllm"`); docs/serving.md,
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

The same engines do the generation work outside serving (`sampling_backend`, docs/serving.md): the trainer's
own samples of the champion (`Engine.sample_token_ids`: its samples carry token ids, not text) and the offline
gate's completions of logged prompts for its direct-method term. `open_engine` gives the version's engine for
that work: the loaded `Policy` itself (the in-process loop, the default) or vLLM, which samples other tokens
for the same seeds (its own RNG and kernels) from the same distribution, with behaviour log-probs within its
`LOGPROB_ATOL` of the trainer's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

from flywheel.lm.policy import CheckpointError, Generation, GenerationRequest, Policy
from flywheel.lm.vllm import (
    EngineError,
    ServerOptions,
    VLLMBackend,
    VLLMGenerator,
    adapter_base,
    is_adapter,
    served_names,
)

if TYPE_CHECKING:
    from flywheel.settings import Settings

log = logging.getLogger(__name__)

Backend = Literal["hf", "vllm"]


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


@runtime_checkable
class Engine(Generator, Protocol):
    """A `Generator` that also samples already-tokenised prompts (`Policy.sample_token_ids`' rules: seeded, one
    line at most, end-of-text kept): the trainer's own samples, whose prompts are token ids."""

    def sample_token_ids(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int], temperature: float = 1.0
    ) -> list[list[int]]: ...


@dataclass(frozen=True)
class EngineChoice:
    """Which engine runs generation work outside serving: `backend` "hf" (the loaded policy, in process) or
    "vllm" (`vllm_url`'s server when it serves the version, else a server started on its checkpoint)."""

    backend: Backend = "hf"
    vllm_url: str = ""
    options: ServerOptions = field(default_factory=ServerOptions)

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineChoice:
        """`sampling_backend`, on the vLLM server settings serving uses (`vllm_url`, `vllm_python`, ...); a server
        started for the work runs in one process (it starts faster, and serves no one else)."""
        options = ServerOptions(python=settings.vllm_python, kv_cache_gb=settings.vllm_kv_cache_gb,
                                single_process=True)  # fmt: skip
        return cls(settings.sampling_backend, settings.vllm_url, options)


@dataclass(frozen=True)
class Opened:
    """The engine a piece of work runs on, and what to say of it: `name` ("hf" or "vllm"), `detail` (the server,
    or why vLLM was asked for and not used) and `start_s`, the seconds it took to be ready."""

    engine: Engine
    name: Backend
    detail: str
    start_s: float

    def describe(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name


@contextlib.contextmanager
def open_engine(choice: EngineChoice, version: str, checkpoint: str | Path, policy: Policy) -> Iterator[Opened]:
    """The engine of `version` (checkpoint at `checkpoint`, loaded in process as `policy`) for the duration.

    "vllm": the server named by `choice.vllm_url` when it serves `version` (or can load it as an adapter), else a
    managed server started on `checkpoint` (an adapter on its base) and stopped on exit. When vLLM cannot load it,
    the work runs on `policy` and `detail` says why: generation work is never lost to an engine that is down.
    """
    if choice.backend == "hf":
        yield Opened(policy, "hf", "", 0.0)
        return
    started = time.monotonic()
    backend = VLLMBackend(choice.vllm_url, choice.options, release_grace_s=0.0)
    borrowed: VLLMGenerator | None = None  # a client of serving's own version on the operator's server
    try:
        try:
            if choice.vllm_url and version in served_names(choice.vllm_url):
                # Serving's own (an operator's server already answering for it): used, never unloaded here.
                tokens = adapter_base(checkpoint)[1] if is_adapter(checkpoint) else Path(checkpoint)
                if tokens is None:
                    raise CheckpointError(f"no local copy of the base of adapter {version} to read its tokenizer from")
                borrowed = VLLMGenerator(choice.vllm_url, version, tokens)
                generator: Engine = borrowed
            else:
                generator = backend.load(version, checkpoint)
        except (CheckpointError, EngineError) as exc:
            log.warning("generation work on version %s runs in process: %s", version, exc)
            yield Opened(policy, "hf", f"vllm asked for, not used: {exc}", time.monotonic() - started)
            return
        where = f"at {choice.vllm_url}" if choice.vllm_url else "a server started for it"
        yield Opened(generator, "vllm", where, time.monotonic() - started)
    finally:
        if borrowed is not None:
            borrowed.close()
        backend.close()


__all__ = ["Backend", "Engine", "EngineChoice", "Generation", "GenerationRequest", "Generator", "Opened",
           "open_engine"]  # fmt: skip
