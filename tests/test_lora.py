"""LoRA adapters end to end: a cycle trains one, the registry stores it with its base, serving answers with it.

Real parts throughout: the tiny model, peft, the SQLite MLflow registry, the lake with simulated feedback
(simulator.lake_feedback: the model's own samples and log-probs, rewards from a rule), serving's pool and
batcher. Serving's HF back end is held to the trainer's log-probs bit for bit (`atol=0`, as
tests/test_generator_conformance.py holds full weights): an adapter's view on the shared base computes the
same unmerged LoRA forward as the trainer's base + adapter.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from flywheel.contract import ModelLineage, TrafficSplit
from flywheel.lm import Generation, Policy, load_policy, token_logprobs, write_adapter_info
from flywheel.lm.adapters import AdapterInfo, PolicyLoader, share_storage
from flywheel.settings import Settings
from model_registry import ArtifactIntegrityError, ModelRegistry
from serving.batching import Batcher
from serving.conformance import Check, Harness, generator_checks
from serving.generator import GenerationRequest
from serving.pool import PolicyPool
from simulator.lake_feedback import consent_events, simulate_feedback
from simulator.telemetry import write_events
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle

PROMPTS = ["def add(a, b):\n    return", "import os\n", "for i in range(", "x = ", "class Foo:\n    def", "print("]
USERS = ("u0", "u1", "u2", "u3")
LORA = TrainerConfig(update="lora", lora_rank=4, learning_rate=5e-3, batch_size=8, epochs=1, kl_coef=0.05)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ends_early(g: Generation) -> float:
    return 1.0 if g.finish_reason != "length" else -1.0


def _trainer_logprobs(policy: Policy, g: Generation) -> list[float]:
    """What the trainer computes for a served completion: `token_logprobs` on the version loaded alone."""
    logprobs, mask = token_logprobs(policy.model, [g.prompt_token_ids], [g.completion_token_ids], policy.pad_id)
    return logprobs[0][mask[0].bool()].tolist()


def _split(champion: str, challenger: str | None = None) -> TrafficSplit:
    return TrafficSplit(champion_version=champion, challenger_version=challenger,
                        challenger_share=0.5 if challenger else 0.0, salt="lora")  # fmt: skip


def _users_by_arm(split: TrafficSplit) -> dict[str, str]:
    users: dict[str, str] = {}
    for i in range(200):
        users.setdefault(split.arm_for(f"user{i}"), f"user{i}")
    return users


def _served_as_trained(pool: PolicyPool, split: TrafficSplit, registry: ModelRegistry) -> dict[str, Generation]:
    """Route a user of each arm, answer through the pool's batcher and check the answer against the trainer's
    log-probs of that version: each request is answered by the weights it was routed to, bit for bit."""
    batcher = Batcher(max_batch=4, max_wait_s=0.0)
    out = {}
    try:
        for arm, user in sorted(_users_by_arm(split).items()):
            route = pool.route(user)
            request = GenerationRequest("def add(a, b):\n    return", max_tokens=6, seed=7)
            served = batcher.submit(route.policy, [request])[0].result(timeout=60)
            alone = load_policy(registry.fetch(route.version))
            assert served.logprobs == _trainer_logprobs(alone, served), f"{arm} (v{route.version})"
            assert served == alone.generate_batch([request])[0]
            out[route.version] = served
    finally:
        batcher.stop()
    return out


def test_a_lora_cycle_trains_registers_and_serves_an_adapter_then_continues_it(
    settings: Settings, tiny_model_dir: Path
) -> None:
    registry = ModelRegistry(settings)
    base = registry.register(tiny_model_dir, ModelLineage(base=str(tiny_model_dir)))
    registry.set_alias("champion", base)
    write_events(settings, consent_events(USERS))
    simulate_feedback(settings, load_policy(registry.fetch(base)), PROMPTS, _ends_early, model_version=base, n=24,
                      seed=1, users=USERS)  # fmt: skip

    first = run_cycle(settings, LORA, progress=False)
    assert first.status == "registered" and first.parent_version == base
    adapter = first.version
    assert adapter is not None
    # Registered: an adapter naming its base by version and content hash, with its lineage.
    assert registry.adapter(adapter) == AdapterInfo(base, registry.client.get_model_version(
        settings.registered_model_name, base).tags["flywheel.manifest_sha256"], str(tiny_model_dir))  # fmt: skip
    assert registry.adapter(base) is None and registry.lineage(adapter).parent_version == base
    fetched = registry.fetch(adapter)
    names = {p.name for p in fetched.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "flywheel_adapter.json"} <= names
    assert "model.safetensors" not in names and (fetched.parent / base / "config.json").is_file()
    registry.verify(adapter)  # every stored file and tensor against the manifest
    assert (registry.artifact(adapter).kind, registry.artifact(adapter).parent) == ("adapter", base)
    stored, full = registry.artifact(adapter).stored_bytes, registry.artifact(base).checkpoint_bytes
    assert stored < full / 2, (stored, full)
    # A fresh adapter starts as the champion exactly (B = 0): serving's logged log-probs reproduced bit for bit.
    metrics = registry.lineage(adapter).metrics
    assert metrics["exact_mismatch_max_abs"] == 0.0 and metrics["exact_mismatch_tokens"] > 0
    assert metrics["kl_to_champion"] > 0  # the adapter moved the policy

    # Serving: base (champion) and adapter (challenger) on one copy of the base weights.
    split = _split(base, adapter)
    pool = PolicyPool(lambda: split, lambda v: str(registry.fetch(v)))
    assert pool.refresh()
    views = {v: pool.route(u).policy for u in _users_by_arm(split).values() for v in [pool.route(u).version]}
    base_view, challenger_view = views[base], views[adapter]
    assert isinstance(base_view, Policy) and isinstance(challenger_view, Policy)
    assert share_storage(base_view, challenger_view)
    answers = _served_as_trained(pool, split, registry)
    assert set(answers) == {base, adapter}

    # The next cycle continues the champion's adapter on the same base.
    registry.set_alias("champion", adapter)
    simulate_feedback(settings, load_policy(registry.fetch(adapter)), PROMPTS, lambda g: -_ends_early(g),
                      model_version=adapter, n=24, seed=2, users=USERS)  # fmt: skip
    second = run_cycle(settings, LORA, progress=False)
    assert second.status == "registered" and second.version is not None
    assert registry.adapter(second.version).base_version == base  # type: ignore[union-attr]
    assert registry.lineage(second.version).parent_version == adapter
    assert registry.lineage(second.version).metrics["exact_mismatch_max_abs"] == 0.0

    # Champion and challenger both adapters on the one base; each request answered by its own adapter.
    split = _split(adapter, second.version)
    assert pool.refresh()
    loader = pool._loader
    assert isinstance(loader, PolicyLoader)
    assert loader.adapters == {adapter: base, second.version: base}
    one, two = (pool.route(u).policy for u in _users_by_arm(split).values())
    assert isinstance(one, Policy) and isinstance(two, Policy)
    assert share_storage(one, two)
    answers = _served_as_trained(pool, split, registry)
    assert answers[adapter].logprobs != answers[second.version].logprobs or (
        answers[adapter].completion_token_ids != answers[second.version].completion_token_ids
    ), "two adapters answered alike"
    # The requests are done: nothing but the pool holds the first adapter's view.
    del one, two, answers, views, base_view, challenger_view

    # The first adapter leaves the split: it is freed (no request holds it), the other stays on the base.
    split = _split(second.version)
    assert pool.refresh()
    assert loader.adapters == {second.version: base}
    assert pool.loaded_versions == [second.version]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A registry-cache layout without the registry: base "1", adapters "2" and "3" on it (different seeded
    weights), and adapter "6" on another base "5"."""
    from peft import get_peft_model

    root = tmp_path_factory.mktemp("lora-cache")
    shutil.copytree(tiny_model_dir, root / "1")
    shutil.copytree(tiny_model_dir, root / "5")
    for version, base, seed in (("2", "1", 2), ("3", "1", 3), ("6", "5", 6)):
        policy = load_policy(root / base)
        model = get_peft_model(policy.model, TrainerConfig(lora_rank=4).lora_config())  # type: ignore[arg-type]
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
        model.save_pretrained(root / version)
        write_adapter_info(root / version, AdapterInfo(base, f"{base * 64}"[:64], "tiny"))
    return root


def test_the_offline_gates_judge_an_adapter_as_base_plus_adapter(cache: Path) -> None:
    """The gates load a fetched adapter with `load_policy` like any checkpoint: a small adapter step passes
    every gate with a KL above 0, and its held-out data is its base's (the bootstrap's training sample)."""
    from peft import get_peft_model

    from deploy_gate.offline import GATES, OfflineGateConfig
    from deploy_gate.offline.gates import run_gates
    from deploy_gate.offline.heldout import held_out
    from deploy_gate.offline.logged import LoggedTraffic

    config = OfflineGateConfig(n_prompts=8, logged_prompts=4, n_text_windows=40, lm_min_windows=20,
                               ope_min_samples=20, ope_min_ess=5, bootstrap_samples=200, num_threads=1)  # fmt: skip
    champion = load_policy(cache / "1")
    model = get_peft_model(load_policy(cache / "1").model, TrainerConfig(lora_rank=4).lora_config())  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 1e-3)
    step = cache / "small-step"
    model.save_pretrained(step)
    write_adapter_info(step, AdapterInfo("1", "1" * 64, "tiny"))
    data = held_out(step, config.n_prompts, config.n_text_windows, config.text_window_tokens * 4, 0)
    assert data == held_out(cache / "1", config.n_prompts, config.n_text_windows, config.text_window_tokens * 4, 0)
    results = {r.name: r for r in run_gates(step, champion, data.prompts, data.texts, LoggedTraffic([], None, 0),
                                            config)}  # fmt: skip
    for name in GATES[:-1]:
        assert results[name].status == "passed", results[name]
    assert 0 < results["kl_to_champion"].value < config.max_kl  # type: ignore[operator]


def test_a_cycle_starts_from_exactly_its_champion_whichever_update_it_makes(cache: Path) -> None:
    """"lora" on full weights adds a zero adapter (the policy unchanged, bit for bit, only the adapter trains);
    "full" on an adapter merges it (every weight trains; the policy within float32 rounding of base + adapter)."""
    from trainer.cycle import prepare_update

    request = GenerationRequest("def add(a, b):\n    return", max_tokens=6, seed=3)
    full = load_policy(cache / "1")
    served = full.generate_batch([request])[0]
    prepare_update(full, TrainerConfig(update="lora", lora_rank=4))
    assert full.generate_batch([request])[0] == served
    trainable = [n for n, p in full.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)

    adapter = load_policy(cache / "2")
    served = adapter.generate_batch([request])[0]
    prepare_update(adapter, TrainerConfig(update="full"))
    assert adapter.adapter is None and all(p.requires_grad for p in adapter.model.parameters())
    assert not any("lora_" in n for n, _ in adapter.model.named_parameters())
    merged = _trainer_logprobs(adapter, served)
    assert max(abs(a - b) for a, b in zip(merged, served.logprobs, strict=True)) < 1e-4


def _pool(cache: Path, split: list[TrafficSplit]) -> PolicyPool:
    return PolicyPool(lambda: split[0], lambda v: str(cache / v))


def test_two_adapters_on_one_base_answer_concurrent_requests_each_with_its_own_weights(cache: Path) -> None:
    split = [_split("2", "3")]
    pool = _pool(cache, split)
    assert pool.refresh()
    views = {"2": pool.route("a").policy, "3": pool.route("a").policy}
    for user in (f"user{i}" for i in range(50)):
        route = pool.route(user)
        views[route.version] = route.policy
    alone = {v: load_policy(cache / v) for v in ("2", "3")}  # each base + adapter, loaded on its own
    two, three = views["2"], views["3"]
    assert isinstance(two, Policy) and isinstance(three, Policy) and share_storage(two, three)
    assert not share_storage(alone["2"], alone["3"])
    # Interleaved requests for both, batched per version by the one worker: every answer is its version's.
    batcher = Batcher(max_batch=3, max_wait_s=0.01)
    requests = [GenerationRequest(PROMPTS[i % len(PROMPTS)], max_tokens=5, seed=i) for i in range(12)]
    order = ["2" if i % 2 else "3" for i in range(12)]
    try:
        futures = [batcher.submit(views[v], [r])[0] for v, r in zip(order, requests, strict=True)]
        served = [f.result(timeout=120) for f in futures]
    finally:
        batcher.stop()
    for version, request, got in zip(order, requests, served, strict=True):
        assert got == alone[version].generate_batch([request])[0], f"v{version}, seed {request.seed}"
        assert got.logprobs == _trainer_logprobs(alone[version], got)
    other = {"2": "3", "3": "2"}
    assert any(g.logprobs != _trainer_logprobs(alone[other[v]], g) for v, g in zip(order, served, strict=True))


@pytest.fixture(scope="module")
def adapter_view(cache: Path) -> Harness:
    """Adapter "2" as serving's loader serves it (base "1" and adapter "3" on the same model), scored against
    the trainer's `token_logprobs` on "2" loaded alone."""
    loader = PolicyLoader()
    loader("1", cache / "1")
    view = loader("2", cache / "2")
    loader("3", cache / "3")  # another adapter on the same base, active in between
    alone = load_policy(cache / "2")

    def score(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
        logprobs, mask = token_logprobs(alone.model, [prompt_ids], [completion_ids], alone.pad_id)
        return logprobs[0][mask[0].bool()].tolist()

    return Harness(view, score=score, atol=0.0)


@pytest.mark.parametrize("check", list(generator_checks()), ids=lambda c: c.__name__)
def test_an_adapter_view_on_the_shared_base_conforms_at_atol_0(adapter_view: Harness, check: Check) -> None:
    check(adapter_view)


def test_an_adapter_on_another_base_is_refused_by_serving_with_both_bases_named(cache: Path) -> None:
    split = [_split("2")]
    pool = _pool(cache, split)
    assert pool.refresh()
    split[0] = _split("2", "6")
    assert pool.refresh() is False  # the split it has stays
    reason = pool.refused["6"].reason
    assert "version 6 is a LoRA adapter of base version 5" in reason and "base version 1" in reason
    assert pool.loaded_versions == ["2"]


def test_an_adapter_whose_base_does_not_match_is_refused_by_the_registry(
    settings: Settings, tiny_model_dir: Path, cache: Path, tmp_path: Path
) -> None:
    registry = ModelRegistry(settings)
    base = registry.register(tiny_model_dir, ModelLineage(base="tiny"))
    good = tmp_path / "good"
    shutil.copytree(cache / "2", good)
    version = registry.register_adapter(good, ModelLineage(parent_version=base, base="tiny"), base)
    assert load_policy(registry.fetch(version)).adapter == registry.adapter(version)
    # An adapter that claims this base but was trained on a base with another content hash.
    forged = tmp_path / "forged"
    shutil.copytree(cache / "2", forged)
    claimed = AdapterInfo(base, "0" * 64, "tiny")
    write_adapter_info(forged, claimed)
    bad = registry.register(forged, ModelLineage(parent_version=base, base="tiny"), full=True)
    with pytest.raises(ArtifactIntegrityError) as refused:
        registry.fetch(bad)
    with pytest.raises(ArtifactIntegrityError, match="its base does not match"):
        registry.verify(bad)
    held = registry.client.get_model_version(settings.registered_model_name, base).tags["flywheel.manifest_sha256"]
    assert f"trained on base version {base} (manifest sha256 000000000000...)" in str(refused.value)
    assert held[:12] in str(refused.value) and "refused" in str(refused.value)
    assert json.loads((forged / "flywheel_adapter.json").read_text())["base_version"] == base
