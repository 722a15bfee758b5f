"""The generator conformance suite (serving.conformance) over every serving back end that runs here.

The HF back end is held to `atol=0`: its behaviour log-probs are the trainer's `token_logprobs`, bit for
bit, and a seeded request gives the same tokens whether it is sampled alone or in any batch (CPU, fp32).
The vLLM back end (flywheel.lm.vllm) runs one managed vLLM server for this module, from .venv-vllm
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

from deploy_gate.offline.offpolicy import EstimatorSettings, estimate_candidate
from flywheel.contract import GenerationRecord, TrafficSplit
from flywheel.lm import CheckpointError, Generation, Policy, load_policy, token_logprobs
from flywheel.lm.engine import EngineChoice, open_engine
from flywheel.lm.vllm import (
    LOGPROB_ATOL,
    ServerOptions,
    VLLMBackend,
    VLLMGenerator,
    VLLMServer,
    adapter_base,
    served_names,
    vllm_unavailable,
)
from flywheel.settings import Settings
from serving.conformance import Check, Harness, generator_checks
from serving.generator import GenerationRequest, Generator, hf_generator
from serving.pool import PolicyPool
from tests.helpers import bench_module, read_events
from trainer.data import Sample
from trainer.loop import mismatch_report
from trainer.reward_model import sample_own
from trainer.scoring import scorer_for


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
    # One engine for the module (minutes to start on CPU). It also answers to "1", as an operator's server serving
    # a registry's first version does (the trainer's cycle below samples its champion there).
    server = VLLMServer(vllm_model, "tiny", ServerOptions(extra_args=("--served-model-name", "tiny", "1"))).start()
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
        if "v-b" not in served_names(vllm_server.url):
            break
        time.sleep(0.05)
    assert "v-b" not in served_names(vllm_server.url), "the dropped adapter is unloaded"
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
        assert record.prompt_token_ids and record.completion_token_ids and record.behaviour_logprobs
        want = score(record.prompt_token_ids, record.completion_token_ids)
        assert max(abs(a - b) for a, b in zip(want, record.behaviour_logprobs, strict=True)) <= LOGPROB_ATOL
    backend.release_now("tiny")


# -- generation work on the engine: the trainer's own samples and the offline gate's completions --------------------

OWN_PROMPTS = ("def ", "x = ", "import os\n", "class Foo:\n    def", "for i in range(", "    return ")


class _Recording:
    """An engine that records what it was asked (prompt ids, seeds) and what it answered, with its log-probs."""

    def __init__(self, sample: Callable[..., list[Generation]], engine: object) -> None:
        self._sample, self._engine = sample, engine
        self.asked: list[tuple[tuple[int, ...], int]] = []
        self.answered: list[Generation] = []

    def __getattr__(self, name: str) -> object:  # the rest of the Engine protocol
        return getattr(self._engine, name)

    def sample_token_ids(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int], temperature: float = 1.0
    ) -> list[list[int]]:
        gens = self._sample(prompts, max_tokens, seeds, temperature)
        self.asked += [(tuple(p), s) for p, s in zip(prompts, seeds, strict=True)]
        self.answered += gens
        return [g.completion_token_ids for g in gens]


def _policy_from_ids(policy: Policy) -> Callable[..., list[Generation]]:
    """The in-process loop's own sampling (`Policy.sample_token_ids`), as Generations without log-probs."""

    def sample(prompts: Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int], t: float) -> list[Generation]:
        ids = policy.sample_token_ids(prompts, max_tokens, seeds, t)
        return [Generation(list(p), c, "", [], "stop") for p, c in zip(prompts, ids, strict=True)]

    return sample


def _logged(policy: Policy) -> list[Sample]:
    """One logged sample per prompt (their completions and rewards do not matter to the draw)."""
    return [
        Sample(f"g{i}", "u", policy.encode_prompt(p, max_tokens=8), [0], [0.0], 1.0, "tiny", datetime.now(UTC))
        for i, p in enumerate(OWN_PROMPTS)
    ]


def test_own_samples_through_the_hf_engine_are_the_in_process_draw_exactly(
    policy: Policy, tiny_model_dir: Path
) -> None:
    # The default engine (open_engine's "hf": the loaded policy) is the Python loop the trainer ran before it could
    # use an engine: the same prompts, seeds, tokens and log-probs, bit for bit.
    before = sample_own(policy, _logged(policy), 2, 6, seed=7, scorer=scorer_for(False), score_batch=16)
    with open_engine(EngineChoice("hf"), "tiny", tiny_model_dir, policy) as opened:
        assert opened.engine is policy and opened.describe() == "hf"
        through = sample_own(policy, _logged(policy), 2, 6, seed=7, scorer=scorer_for(False), score_batch=16,
                             engine=opened.engine)  # fmt: skip
    assert [s.completion_token_ids for s in through.samples] == [s.completion_token_ids for s in before.samples]
    assert through.reference == before.reference and len(before.samples) == 2 * len(OWN_PROMPTS)


def test_own_samples_on_vllm_are_the_same_draw_with_the_engines_tokens(vllm: Harness, vllm_model: Path) -> None:
    # Through vLLM the trainer asks for the same thing as in process: the same prompts, in the same seeded order,
    # with the same seeds, as many of each. Token identity is NOT expected: vLLM's seeded sampling is its own RNG
    # and kernels, so a seed gives another completion from the same distribution (each is reproducible within its
    # engine). What must agree is the distribution: vLLM's log-prob of every token it sampled is the trainer's
    # (which the draw records as the reference) within the back end's declared LOGPROB_ATOL.
    policy = load_policy(vllm_model, dtype="float32")
    assert isinstance(vllm.generator, VLLMGenerator)
    in_process = _Recording(_policy_from_ids(policy), policy)
    on_vllm = _Recording(vllm.generator.generate_from_ids, vllm.generator)
    hf_draw = sample_own(policy, _logged(policy), 3, 8, seed=7, scorer=scorer_for(False), score_batch=16,
                         engine=in_process)  # type: ignore[arg-type]  # fmt: skip
    vllm_draw = sample_own(policy, _logged(policy), 3, 8, seed=7, scorer=scorer_for(False), score_batch=16,
                           engine=on_vllm)  # type: ignore[arg-type]  # fmt: skip
    assert on_vllm.asked == in_process.asked and len(on_vllm.asked) == 3 * len(OWN_PROMPTS)
    assert [s.generation_id for s in vllm_draw.samples] == [s.generation_id for s in hf_draw.samples]
    assert (vllm_draw.prompts_covered, vllm_draw.prompts_total) == (hf_draw.prompts_covered, hf_draw.prompts_total)
    diffs = []
    for g, reference, sample in zip(on_vllm.answered, vllm_draw.reference, vllm_draw.samples, strict=True):
        assert sample.completion_token_ids == g.completion_token_ids and 1 <= len(g.completion_token_ids) <= 8
        assert sample.behaviour_logprobs == reference  # the champion's own samples: behaviour = the trainer's
        diffs += [abs(a - b) for a, b in zip(g.logprobs, reference, strict=True)]
    print(f"own samples on vLLM vs the trainer: {len(diffs)} tokens, max |diff| {max(diffs):.2e}")
    assert max(diffs) <= LOGPROB_ATOL
    pairs = zip(vllm_draw.samples, hf_draw.samples, strict=True)
    same = sum(a.completion_token_ids == b.completion_token_ids for a, b in pairs)
    print(f"completions identical to the in-process draw's: {same} of {len(hf_draw.samples)} (not expected)")


def test_open_engine_uses_an_operators_server_for_a_version_it_serves_and_says_why_not_otherwise(
    vllm_server: VLLMServer, vllm_model: Path
) -> None:
    policy = load_policy(vllm_model, dtype="float32")
    choice = EngineChoice("vllm", vllm_server.url)
    with open_engine(choice, "tiny", vllm_model, policy) as opened:
        assert opened.name == "vllm" and isinstance(opened.engine, VLLMGenerator)
        assert opened.engine.sample_token_ids([[1, 2]], 4, [0]) == opened.engine.sample_token_ids([[1, 2]], 4, [0])
    assert "tiny" in served_names(vllm_server.url), "serving's own version is left loaded"
    with open_engine(choice, "9", vllm_model, policy) as opened:  # full weights it does not serve: in process
        assert opened.engine is policy and opened.name == "hf" and "does not serve 9" in opened.detail


def test_the_offline_gates_completions_on_vllm_change_only_the_direct_method_term(
    vllm: Harness, vllm_model: Path
) -> None:
    # The DM term completes logged prompts; on vLLM the completions are the engine's (other tokens), while the
    # importance-weighted terms are the candidate's log-probs here: SNIPS is unchanged, the coverage the same.
    policy = load_policy(vllm_model, dtype="float32")
    records, rewards = [], []
    for i in range(12):
        g = policy.generate(OWN_PROMPTS[i % len(OWN_PROMPTS)], max_tokens=8, seed=i)
        records.append(GenerationRecord(prompt=OWN_PROMPTS[i % len(OWN_PROMPTS)], prompt_token_ids=g.prompt_token_ids,
                                        completion=g.completion, completion_token_ids=g.completion_token_ids,
                                        behaviour_logprobs=g.logprobs, model_version="tiny",
                                        finish_reason=g.finish_reason))  # fmt: skip
        rewards.append(float(len(g.completion) > 3))
    estimator = EstimatorSettings(bootstrap_samples=50, seed=3)
    in_process = estimate_candidate(policy, records, rewards, estimator)
    on_vllm = estimate_candidate(policy, records, rewards, estimator, engine=vllm.generator)
    assert in_process.estimate is not None and on_vllm.estimate is not None
    assert (on_vllm.covered, on_vllm.available) == (in_process.covered, in_process.available) == (12, 12)
    assert on_vllm.estimate.snips.value == in_process.estimate.snips.value


def test_a_cycle_samples_its_own_samples_on_vllm_and_says_where_the_time_went(
    settings: Settings, vllm_server: VLLMServer, vllm_model: Path
) -> None:
    # The trainer with FLYWHEEL_SAMPLING_BACKEND=vllm and an operator's server that serves its champion: the
    # champion's own samples are drawn there, scored by the trainer, and the reason and metrics say so, with the
    # seconds spent sampling, scoring and training.
    from mlflow import MlflowClient

    from flywheel.contract import ModelLineage
    from model_registry import ModelRegistry
    from simulator.lake_feedback import consent_events, simulate_feedback
    from simulator.telemetry import write_events
    from trainer.config import TrainerConfig
    from trainer.cycle import run_cycle

    registry = ModelRegistry(settings)
    champion = registry.register(vllm_model, ModelLineage(base=str(vllm_model)))
    assert champion == "1", "the server answers to the registry's first version"
    registry.set_alias("champion", champion)
    users = ("u0", "u1", "u2")
    write_events(settings, consent_events(users))
    policy = load_policy(vllm_model, dtype="float32")
    simulate_feedback(settings, policy, list(OWN_PROMPTS), lambda g: 1.0 if g.finish_reason != "length" else -1.0,
                      model_version=champion, n=30, seed=1, users=users)  # fmt: skip
    on_vllm = settings.model_copy(update={"sampling_backend": "vllm", "vllm_url": vllm_server.url})
    config = TrainerConfig(batch_size=8, own_samples=2, own_max_tokens=8, reward_model_min_z=0.0, max_steps=2)
    result = run_cycle(on_vllm, config, progress=False)
    assert result.status == "registered", result.reason
    assert f"sampled on vllm (at {vllm_server.url}) in " in result.reason, result.reason
    assert "their log-probs by the trainer in " in result.reason
    assert result.run_id is not None
    metrics = MlflowClient(settings.resolved_mlflow_uri).get_run(result.run_id).data.metrics
    assert metrics["own_sampled_on_vllm"] == 1.0 and metrics["own_samples"] == 2 * len(OWN_PROMPTS)
    assert {"own_sampling_seconds", "own_scoring_seconds", "own_engine_start_seconds", "prepare_seconds",
            "train_seconds"} <= set(metrics)  # the seconds are reported (their values are the machine's)
    assert "1" in served_names(vllm_server.url), "the operator's model stays loaded"
