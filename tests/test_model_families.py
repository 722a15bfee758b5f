"""Every Hugging Face model family Flywheel supports goes through the loop: Llama, Qwen2, Mistral, Phi-3, GPT-2.

Each family is a tiny randomly initialised checkpoint of its own architecture with a tokenizer trained here
that has the real one's quirks (flywheel.lm.families: BOS added or not, EOS and pad tokens, padding side,
chat templates and their end-of-turn tokens, tied embeddings). For each: load it, pass serving's conformance
suite at atol 0, train a full-weights cycle on logged samples (real lake, Redis, MLflow), register it, fetch
the delta-built artifact (verified) and have serving's pool swap to it and answer with its weights; then a
LoRA cycle (peft) on the same champion, served beside it from one copy of the base. One test per family
runs both cycles, so registration, feedback and the stores are set up once (the file must stay fast).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from flywheel.contract import ModelLineage, TrafficSplit
from flywheel.lm import Generation, Policy, load_policy, token_logprobs
from flywheel.lm.families import FAMILIES, tiny_checkpoint
from flywheel.settings import Settings
from model_registry import ModelRegistry
from serving.conformance import Check, Harness, generator_checks
from serving.generator import GenerationRequest, hf_generator
from serving.pool import PolicyPool
from simulator.lake_feedback import consent_events, simulate_feedback
from simulator.telemetry import write_events
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle
from trainer.retokenize import text_encoder

PROMPTS = ["def add(a, b):\n    return", "import os\n", "x =", "for i in range(", "", "class Foo:\n    def"]
USERS = ("u0", "u1", "u2", "u3")
ADDS_BOS = {"llama": True, "mistral": True, "qwen2": False, "phi3": False, "gpt2": False}
END_OF_TURN = {"qwen2": "<|im_end|>", "phi3": "<|end|>", "mistral": "</s>"}  # the families with a chat template


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny models run faster on one thread, and the machine is shared with other test runs.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    name = str(request.param)
    return name, tiny_checkpoint(name, tmp_path_factory.mktemp(name) / "model", seed=0)


@pytest.fixture(scope="module")
def policy(family: tuple[str, Path]) -> Policy:
    return load_policy(family[1])


def _score(policy: Policy, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
    logprobs, mask = token_logprobs(policy.model, [prompt_ids], [completion_ids], policy.pad_id)
    return logprobs[0][mask[0].bool()].tolist()


@pytest.mark.parametrize("check", list(generator_checks()), ids=lambda c: c.__name__)
def test_each_family_passes_serving_conformance(policy: Policy, check: Check) -> None:
    check(Harness(hf_generator(policy), score=lambda p, c: _score(policy, p, c), atol=0.0))


def test_prompts_start_with_bos_only_where_the_family_adds_one(family: tuple[str, Path], policy: Policy) -> None:
    name = family[0]
    bos = policy.tokenizer.bos_token_id
    ids = policy.encode_prompt("x = 1", max_tokens=4)
    assert (ids[0] == bos) is ADDS_BOS[name], ids
    # An empty prompt still has a token to condition on: the BOS the tokenizer names (Phi-3 names one it does not
    # add), or the end-of-text that starts a document.
    assert policy.encode_prompt("", max_tokens=4) == [bos if bos is not None else policy.stop_ids[0]]
    assert policy.count_prompt_tokens("") == 1
    if name in END_OF_TURN and name != "mistral":  # the turn's end ends generation too (its generation config)
        assert policy.tokenizer.convert_tokens_to_ids(END_OF_TURN[name]) in policy.stop_ids


def test_a_completion_is_the_text_its_tokens_add_to_the_prompt(policy: Policy) -> None:
    # SentencePiece-style decoders drop a leading space of the first token decoded: the completion shown (and
    # logged, and retokenised by the trainer) must keep the space the model wrote after the prompt.
    def text(ids: Sequence[int]) -> str:
        return str(policy.tokenizer.decode(list(ids), skip_special_tokens=True))

    prompts = ["x =", "def f(a,", "return"]
    gens = policy.generate_batch([GenerationRequest(prompts[i % 3], max_tokens=6, seed=i) for i in range(24)])
    for g in gens:
        assert text(g.prompt_token_ids) + g.completion == text(g.prompt_token_ids + g.completion_token_ids)
    assert any(g.completion.startswith(" ") for g in gens), "some completion starts with a space"


def test_a_chat_turn_is_retokenised_through_the_familys_template(family: tuple[str, Path], policy: Policy) -> None:
    name = family[0]
    encode = text_encoder(policy)
    encoded = encode("How do I sort a dict?", "Use sorted(d.items())", "stop", "chat")
    assert encoded is not None
    prompt_ids, completion_ids = encoded
    tokenizer = policy.tokenizer
    reply = str(tokenizer.decode(completion_ids, skip_special_tokens=True))
    assert reply.strip() == "Use sorted(d.items())"
    if name not in END_OF_TURN:  # no template: the chat text is plain text, as on every other surface
        assert encoded == encode("How do I sort a dict?", "Use sorted(d.items())", "stop", "code-completion")
        assert completion_ids[-1] == policy.stop_ids[0]
        return
    opened = tokenizer.apply_chat_template([{"role": "user", "content": "How do I sort a dict?"}],
                                           add_generation_prompt=True, tokenize=False)  # fmt: skip
    assert prompt_ids == tokenizer(opened, add_special_tokens=False)["input_ids"]  # the assistant's turn opened
    assert tokenizer.convert_ids_to_tokens(completion_ids[-1]) == END_OF_TURN[name]  # stopping is ending the turn
    assert completion_ids[-1] in policy.stop_ids
    cut = encode("How do I sort a dict?", "Use sorted(d.items())", "length", "chat")
    assert cut == (prompt_ids, completion_ids[:-1])  # a reply cut by its length did not end the turn


def test_flywheel_model_tiny_writes_a_loadable_checkpoint_and_names_the_families_it_knows(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from launcher.cli import app

    made = CliRunner().invoke(app, ["model", "tiny", "--family", "gpt2", "--out", str(tmp_path / "m")])
    assert made.exit_code == 0, made.output
    assert load_policy(tmp_path / "m").generate("x", max_tokens=2, seed=0).completion_token_ids
    unknown = CliRunner().invoke(app, ["model", "tiny", "--family", "bert", "--out", str(tmp_path / "b")])
    assert unknown.exit_code == 2 and "llama, qwen2, mistral, phi3, gpt2" in unknown.output


def _even_first_token(g: Generation) -> float:
    # A rule that splits a random model's samples (few of them end early), so the advantages are not all zero.
    return 1.0 if g.completion_token_ids[0] % 2 == 0 else -1.0


def test_each_family_trains_full_and_lora_cycles_registers_them_and_serving_swaps_to_them(
    family: tuple[str, Path], settings: Settings, tmp_path: Path
) -> None:
    name, path = family
    registry = ModelRegistry(settings)
    # Stored as hub checkpoints usually are (bfloat16), so the default cycle's candidate is a delta against it.
    champion = registry.register(load_policy(path, dtype="bfloat16").save(tmp_path / "own"), ModelLineage(base=name))
    registry.set_alias("champion", champion)
    write_events(settings, consent_events(USERS))
    old = load_policy(registry.fetch(champion))
    simulate_feedback(settings, old, PROMPTS, _even_first_token, model_version=champion, n=8, seed=1, users=USERS)

    # Full weights: a candidate stored as a delta against the champion.
    full = run_cycle(settings, TrainerConfig(learning_rate=1e-3, batch_size=4, exact_check_samples=4),
                     progress=False)  # fmt: skip
    assert full.status == "registered" and full.parent_version == champion and full.sample_count == 8, full
    assert full.version is not None
    metrics = registry.lineage(full.version).metrics
    # Serving's log-probs are reproduced exactly by the trainer on every architecture.
    assert metrics["exact_mismatch_max_abs"] == 0.0 and metrics["exact_mismatch_tokens"] > 0
    artifact = registry.artifact(full.version)
    assert (artifact.kind, artifact.parent) == ("delta", champion)
    assert artifact.stored_bytes < artifact.checkpoint_bytes
    assert sum(d.changed for d in registry.diff(champion, full.version)) > 0, "training moved some weights"

    shutil.rmtree(settings.data_dir / "models")  # serving rebuilds the candidate from the store, verified
    split = [TrafficSplit(champion_version=champion)]
    pool = PolicyPool(lambda: split[0], lambda v: str(registry.fetch(v)))
    assert pool.refresh() and pool.route("u0").version == champion
    split[0] = TrafficSplit(champion_version=full.version)
    assert pool.refresh() and pool.loaded_versions == [full.version]
    route = pool.route("u0")
    answer = route.policy.generate("def add(a, b):\n    return", max_tokens=6, seed=3)
    assert route.version == full.version and len(answer.completion_token_ids) >= 1
    # It answers with the candidate's weights: its log-probs are the registered candidate's, not the champion's.
    candidate = load_policy(registry.fetch(full.version))
    assert answer.logprobs == _score(candidate, answer.prompt_token_ids, answer.completion_token_ids)
    assert answer.logprobs != _score(old, answer.prompt_token_ids, answer.completion_token_ids)

    # A LoRA adapter on the same champion, from the same feedback (the full candidate was never promoted).
    config = TrainerConfig(update="lora", lora_rank=2, learning_rate=5e-3, batch_size=4, exact_check_samples=4)
    lora = run_cycle(settings, config, progress=False)
    assert lora.status == "registered" and lora.parent_version == champion and lora.version is not None, lora
    adapter = registry.adapter(lora.version)
    assert adapter is not None and adapter.base_version == champion
    metrics = registry.lineage(lora.version).metrics
    assert metrics["exact_mismatch_max_abs"] == 0.0 and metrics["kl_to_champion"] > 0
    # Champion and adapter served at once on one copy of the base; each answers with its own weights, bit for bit.
    split[0] = TrafficSplit(champion_version=champion, challenger_version=lora.version, challenger_share=0.5)
    assert pool.refresh() and pool.loaded_versions == sorted([champion, lora.version])
    weights = {champion: old, lora.version: load_policy(registry.fetch(lora.version))}
    answers = {}
    for user in {split[0].arm_for(f"user{i}"): f"user{i}" for i in range(100)}.values():
        route = pool.route(user)
        answer = route.policy.generate("def add(a, b):\n    return", max_tokens=6, seed=3)
        scored = _score(weights[route.version], answer.prompt_token_ids, answer.completion_token_ids)
        assert answer.logprobs == scored, route.version
        answers[route.version] = answer.logprobs
    assert set(answers) == {champion, lora.version} and answers[champion] != answers[lora.version]
