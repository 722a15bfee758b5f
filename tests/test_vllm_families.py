"""Each model family's tiny config on the vLLM back end: the serving conformance suite at vLLM's LOGPROB_ATOL.

One vLLM server serves one base model, so each family needs a server of its own: they are started one after
another (never two at once on CI's two cores) by `open_engine`, as the trainer and the offline gate start one for
their work, each in one process with its LoRA support off and the smallest context and batch the checks need,
and stopped before the next. Each start is printed; it is most of this file's time.

Which families run is `VLLM_FAMILIES` below, chosen by measurement on CI's two cores (docs/serving.md, "Model
families on vLLM"): a start costs one to two minutes there, so running all five would add ten minutes to a suite
near its limit. The families left out are skipped, saying so; `FLYWHEEL_VLLM_FAMILIES=all` (or a comma-separated
list) runs them, as the measurement did. vLLM's CPU attention has no kernel for the
16-wide heads of the families' default tiny configs, so these are the same configs with 32-wide heads
(`tiny_checkpoint(head_dim=32)`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from flywheel.lm import load_policy, token_logprobs
from flywheel.lm.engine import EngineChoice, open_engine
from flywheel.lm.families import FAMILIES, tiny_checkpoint
from flywheel.lm.vllm import LOGPROB_ATOL, ServerOptions, vllm_unavailable
from serving.conformance import Harness, generator_checks

VLLM_FAMILIES = ("llama", "qwen2")
"""Run in CI by default: the two cheapest measured, and the two tokenizer styles (a SentencePiece tokenizer that
adds BOS; a byte-level one that adds none, with a chat end-of-turn id and tied embeddings)."""
OPTIONS = ServerOptions(lora=False, single_process=True, extra_args=("--max-model-len", "256", "--max-num-seqs", "16"))


def _families() -> tuple[str, ...]:
    chosen = os.environ.get("FLYWHEEL_VLLM_FAMILIES", "")
    if chosen == "all":
        return FAMILIES
    return tuple(f for f in chosen.split(",") if f) or VLLM_FAMILIES


@pytest.fixture(scope="module")
def vllm_ready() -> None:
    reason = vllm_unavailable()
    if reason is not None and os.environ.get("FLYWHEEL_REQUIRE_VLLM") == "1":
        pytest.fail(f"FLYWHEEL_REQUIRE_VLLM=1 but the vLLM back end cannot run here: {reason}")
    if reason is not None:
        pytest.skip(f"the vLLM back end cannot run here: {reason}")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_conforms_on_vllm(family: str, vllm_ready: None, tmp_path: Path) -> None:
    if family not in _families():
        pytest.skip(f"{family} on vLLM is not in this run (FLYWHEEL_VLLM_FAMILIES=all runs every family: each is a "
                    "vLLM server start, one to two minutes on two cores)")  # fmt: skip
    checkpoint = tiny_checkpoint(family, tmp_path / family, seed=0, head_dim=32)
    policy = load_policy(checkpoint, dtype="float32")

    def score(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        logprobs, mask = token_logprobs(policy.model, [prompt_ids], [completion_ids], policy.pad_id)
        return logprobs[0][mask[0].bool()].tolist()

    # As the trainer and the offline gate open an engine for their work: a managed server on the checkpoint,
    # stopped on exit (in process, saying why, if vLLM could not load it: that fails here).
    with open_engine(EngineChoice("vllm", options=OPTIONS), family, checkpoint, policy) as opened:
        assert opened.name == "vllm", opened.detail
        print(f"\nvLLM server for {family} started in {opened.start_s:.1f} s")
        harness = Harness(opened.engine, score=score, atol=LOGPROB_ATOL)
        for check in generator_checks():
            check(harness)
        # the family's prompt rules (BOS added or not; an empty prompt is one token) are serving's, not vLLM's
        for prompt in ("x = 1", ""):
            assert opened.engine.count_prompt_tokens(prompt) == policy.count_prompt_tokens(prompt)
