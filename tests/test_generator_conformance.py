"""The generator conformance suite (serving.conformance) over every serving back end that runs here.

The HF back end is held to `atol=0`: its behaviour log-probs are the trainer's `token_logprobs`, bit for
bit, and a seeded request gives the same tokens whether it is sampled alone or in any batch (CPU, fp32).
The vLLM back end (serving.vllm_backend) runs one managed vLLM server for this module, from .venv-vllm
(scripts/install_vllm.sh), and is held to its declared `LOGPROB_ATOL`; where it cannot run (no .venv-vllm)
its tests skip and say why. Its seeded sampling is vLLM's own: the same seed gives the same completion
within vLLM, not HF's completion for that seed, so the suite compares each back end with itself and with
the trainer's scorer, never the two back ends' samples with each other.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flywheel.contract import TrafficSplit
from flywheel.lm import CheckpointError, Policy, load_policy, token_logprobs
from flywheel.settings import Settings
from serving.conformance import Check, Harness, generator_checks
from serving.generator import GenerationRequest, Generator, hf_generator
from serving.pool import PolicyPool
from serving.vllm_backend import (
    LOGPROB_ATOL,
    VLLMBackend,
    VLLMGenerator,
    VLLMServer,
    adapter_base,
    vllm_unavailable,
)
from tests.helpers import bench_module, read_events
from trainer.data import Sample
from trainer.loop import mismatch_report


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return load_policy(tiny_model_dir, dtype="float32")


def trainer_scorer(policy: Policy) -> Callable[[Sequence[int], Sequence[int]], list[float]]:
    """The trainer's log-probs of a completion (`token_logprobs` on the checkpoint, fp32)."""

    def score(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        logprobs, mask = token_logprobs(policy.model, [prompt_ids], [completion_ids], policy.pad_id)
        return logprobs[0][mask[0].bool()].tolist()

    return score


@pytest.fixture(scope="module")
def hf(policy: Policy) -> Harness:
    return Harness(hf_generator(policy), score=trainer_scorer(policy), atol=0.0)


@pytest.fixture(scope="module")
def vllm_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # vLLM's CPU attention has no kernel for the tiny model's 16-wide heads: the same weights as 32-wide heads.
    return bench_module("serving_backends").vllm_shaped(tiny_model_dir, tmp_path_factory.mktemp("vllm") / "tiny")


@pytest.fixture(scope="module")
def vllm_server(vllm_model: Path) -> Iterator[VLLMServer]:
    reason = vllm_unavailable()
    if reason is not None and os.environ.get("FLYWHEEL_REQUIRE_VLLM") == "1":  # CI installs it: never skip there
        pytest.fail(f"FLYWHEEL_REQUIRE_VLLM=1 but the vLLM back end cannot run here: {reason}")
    if reason is not None:
        pytest.skip(f"the vLLM back end cannot run here: {reason}")
    server = VLLMServer(vllm_model, "tiny").start()  # one engine for the module (minutes to start on CPU)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm(vllm_server: VLLMServer, vllm_model: Path) -> Harness:
    scorer = trainer_scorer(load_policy(vllm_model, dtype="float32"))
    return Harness(VLLMGenerator(vllm_server.url, "tiny", vllm_model), score=scorer, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("check", list(generator_checks()), ids=lambda c: c.__name__)
def test_hf_back_end_conforms(hf: Harness, check: Check) -> None:
    check(hf)


@pytest.mark.parametrize("check", list(generator_checks()), ids=lambda c: c.__name__)
def test_vllm_back_end_conforms(vllm: Harness, check: Check) -> None:
    check(vllm)


def test_vllm_prompts_are_tokenised_as_the_hf_back_end_does(vllm: Harness, vllm_model: Path) -> None:
    policy = load_policy(vllm_model)
    for prompt in ("def ", "", "x" * 600):  # plain, empty (one BOS/EOS), cut from the left to fit
        request = GenerationRequest(prompt, max_tokens=8, seed=3)
        assert vllm.generator.generate_batch([request])[0].prompt_token_ids == policy.encode_prompt(prompt, 8)
        assert vllm.generator.count_prompt_tokens(prompt) == policy.count_prompt_tokens(prompt)


def test_the_mismatch_report_measures_vllm_against_the_trainer(vllm: Harness, vllm_model: Path) -> None:
    # The trainer's own report (trainer.loop.mismatch_report) over samples vLLM served: within the declared
    # tolerance, and the measured figure printed (bench/serving_backends.py records it too).
    gens = vllm.generator.generate_batch([GenerationRequest("def ", max_tokens=16, seed=s) for s in range(16)])
    samples = [
        Sample(f"g{i}", "u", g.prompt_token_ids, g.completion_token_ids, g.logprobs, 0.0, "tiny", datetime.now(UTC))
        for i, g in enumerate(gens)
    ]
    recomputed = [vllm.score(s.prompt_token_ids, s.completion_token_ids) for s in samples]
    report = mismatch_report(samples, recomputed, "tiny", threshold=1e-5)
    print(f"vLLM vs trainer: {report.tokens} tokens, mean {report.mean_abs:.2e}, max {report.max_abs:.2e}")
    assert report.tokens == sum(len(g.completion_token_ids) for g in gens)
    assert report.max_abs <= LOGPROB_ATOL


def test_vllm_answers_only_for_versions_it_serves(vllm_server: VLLMServer, vllm_model: Path) -> None:
    # An operator's server (by URL): a version it serves loads; another is refused, never answered by "tiny".
    backend = VLLMBackend(vllm_server.url)
    assert backend.load("tiny", vllm_model).generate_batch([GenerationRequest("def ", seed=1)])[0].logprobs
    with pytest.raises(CheckpointError, match="does not serve 7"):
        backend.load("7", vllm_model)


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


@pytest.fixture(scope="module")
def adapters(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two LoRA adapters (peft directories) of the vLLM test model, randomly initialised so each changes it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for name, seed in (("v-a", 1), ("v-b", 2)):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(vllm_model, dtype=torch.float32)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        out[name] = tmp_path_factory.mktemp("adapters") / name
        get_peft_model(base, config).save_pretrained(str(out[name]))
    return out


def adapter_scorer(vllm_model: Path, adapter: Path) -> Callable[[Sequence[int], Sequence[int]], list[float]]:
    """The trainer's log-probs under base + adapter (peft, merged, fp32)."""
    from peft import PeftModel

    policy = load_policy(vllm_model, dtype="float32")
    policy.model = PeftModel.from_pretrained(policy.model, adapter).merge_and_unload()  # type: ignore[assignment]
    return trainer_scorer(policy)


def test_two_adapters_on_one_engine_each_answer_with_their_own_weights(
    vllm_server: VLLMServer, vllm_model: Path, adapters: dict[str, Path]
) -> None:
    # Champion and challenger as two adapters on one base: the pool loads both before adopting the split
    # (vLLM's runtime LoRA API), each user's request is answered by the adapter it was routed to (its
    # log-probs are that adapter's, as the trainer computes them, and not the other's), and an adapter the
    # split drops is unloaded from the engine.
    backend = VLLMBackend(vllm_server.url, release_grace_s=0.0)
    split = TrafficSplit(champion_version="v-a", challenger_version="v-b", challenger_share=0.5, experiment="e")
    current = [split]
    pool = PolicyPool(lambda: current[0], lambda v: str(adapters[v]), loader=backend.load, release=backend.release)
    assert pool.refresh() and pool.loaded_versions == ["v-a", "v-b"]
    scorers = {v: adapter_scorer(vllm_model, path) for v, path in adapters.items()}
    seen = set()
    for i in range(12):
        route = pool.route(f"user-{i}")
        seen.add(route.version)
        g = route.policy.generate_batch([GenerationRequest("def ", max_tokens=8, seed=i)])[0]
        other = "v-b" if route.version == "v-a" else "v-a"
        own = scorers[route.version](g.prompt_token_ids, g.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(own, g.logprobs, strict=True)) <= LOGPROB_ATOL
        theirs = scorers[other](g.prompt_token_ids, g.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(theirs, g.logprobs, strict=True)) > 10 * LOGPROB_ATOL
    assert seen == {"v-a", "v-b"}, "both arms were routed to"

    current[0] = TrafficSplit(champion_version="v-a", experiment="e2")
    assert pool.refresh() and pool.loaded_versions == ["v-a"]
    for _ in range(100):  # the release runs after its grace (0 here) on a timer thread
        if "v-b" not in backend._served_names(vllm_server.url):
            break
        time.sleep(0.05)
    assert "v-b" not in backend._served_names(vllm_server.url), "the dropped adapter is unloaded"
    backend.release_now("v-a")


def test_without_its_venv_the_vllm_back_end_says_why(tmp_path: Path) -> None:
    # What the vLLM fixture's skip reports where scripts/install_vllm.sh has not run.
    reason = vllm_unavailable(str(tmp_path / "no-venv" / "python"))
    assert reason is not None and "scripts/install_vllm.sh" in reason


def test_a_registry_adapter_names_its_base_beside_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    # As the registry fetches an adapter: its base version's directory beside it, named in flywheel_adapter.json;
    # that base (not peft's training-time path) is the engine it goes onto and the tokenizer it reads.
    import json
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "3")
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/elsewhere"}))
    (tmp_path / "4" / "flywheel_adapter.json").write_text(
        json.dumps({"base_version": "3", "base_manifest_sha256": "ab" * 32})
    )
    assert adapter_base(tmp_path / "4") == ("3", (tmp_path / "3").resolve())
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/elsewhere"}))
    assert adapter_base(tmp_path / "5") == ("/elsewhere", None)


def test_serving_on_vllm_routes_signs_and_logs_as_on_hf(
    settings: Settings, vllm_server: VLLMServer, vllm_model: Path
) -> None:
    # The real app (routing by the split in Redis, signing, logging to the broker) with the pool's loader on
    # vLLM: `n` choices, each logged with the version that answered and log-probs within the tolerance, and a
    # stream that joins to the same text. Nothing in the app knows which back end answered.
    from fastapi.testclient import TestClient

    from flywheel.bus import ensure_topics, make_producer
    from flywheel.connections import redis_client
    from flywheel.contract import EventType
    from flywheel.traffic import TrafficSplitStore
    from serving.app import create_app

    ensure_topics(settings)
    store = TrafficSplitStore(redis_client(settings), settings)
    backend = VLLMBackend(vllm_server.url)
    pool = PolicyPool(store.get, {"tiny": str(vllm_model)}.__getitem__, loader=backend.load, release=backend.release)
    producer = make_producer(settings)
    app = create_app(pool, producer, settings.events_topic, refresh_interval_s=0.2, on_shutdown=producer.close,
                     max_batch_wait_s=0.0, batch_workers=4, signing_key=settings.serving_key.get_secret_value())
    store.put(TrafficSplit(champion_version="tiny"))
    body = {"prompt": "def ", "user": "u1", "max_tokens": 8, "seed": 5, "n": 2, "logprobs": 1}
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json=body).json()
        stream = client.post("/v1/completions", json={**body, "n": 1, "stream": True}).text
    assert answer["model"] == "tiny" and len(answer["choices"]) == 2
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"], "choice 0 = seed 5"
    events = read_events(settings, 3)
    assert {e.type for e in events} == {EventType.GENERATION}
    score = trainer_scorer(load_policy(vllm_model, dtype="float32"))
    for event in events:
        record = event.generation()
        assert record.model_version == "tiny" and record.signature
        want = score(record.prompt_token_ids, record.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(want, record.behaviour_logprobs, strict=True)) <= LOGPROB_ATOL
    backend.release_now("tiny")
