"""Training cycles end to end: lake -> eligible samples -> trained candidate in the registry.

Feedback is simulated (simulator.lake_feedback): completions sampled from the real tiny model with
their real behaviour log-probs, rewards from a rule, both written to the lake in the agreed
column layout. MLflow is the real SQLite store.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from flywheel.contract import DataWindow, Event, GenerationRecord, ModelLineage, RewardRecord
from flywheel.holdout import in_holdout
from flywheel.lake.tables import REWARDS
from flywheel.lm import Generation, Policy, load_policy
from flywheel.settings import Settings
from flywheel.signing import sign_generation
from launcher.lake import pinned_versions
from model_registry import ModelRegistry
from simulator.lake_feedback import consent_events, simulate_feedback, write_rewards
from simulator.telemetry import write_events
from trainer.config import TrainerConfig
from trainer.cycle import rounding_seed, run_cycle, watermark
from trainer.data import load_selection
from trainer.loop import kl_to_reference, score_samples, train_policy
from trainer.reward_model import sample_own
from trainer.scoring import scorer_for

PROMPTS = [
    "def add(a, b):\n    return", "import os\n", "for i in range(", "x = ", "class Foo:\n    def",
    "print(", "if x is None:\n    ", "return ", "y = [", "while True:\n    ",
]  # fmt: skip
USERS = ("u0", "u1", "u2", "u3")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # The tiny model is faster on one thread, and the machine is shared with other test runs.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tsettings(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """`settings` whose SQLite MLflow store starts as a copy of an already-migrated empty one
    (creating the schema takes ~8 s; copying takes milliseconds)."""
    template = tmp_path_factory.getbasetemp() / "mlflow-template.db"
    if not template.exists():
        ModelRegistry(settings.model_copy(update={"mlflow_tracking_uri": f"sqlite:///{template}"})).versions()
    shutil.copy(template, settings.mlflow_tracking_uri.removeprefix("sqlite:///"))
    return settings


@pytest.fixture
def champion(tsettings: Settings, tiny_model_dir: Path) -> str:
    registry = ModelRegistry(tsettings)
    version = registry.register(tiny_model_dir, ModelLineage(base=str(tiny_model_dir)))
    registry.set_alias("champion", version)
    write_events(tsettings, consent_events(USERS))
    return version


def _ends_early(g: Generation) -> float:
    return 1.0 if g.finish_reason != "length" else -1.0


def _stop_rate(policy: Policy, n: int = 60) -> float:
    """Share of sampled completions (fixed seeds) that end the line before max_tokens."""
    gens = [policy.generate(PROMPTS[i % len(PROMPTS)], max_tokens=8, seed=10_000 + i) for i in range(n)]
    return sum(g.finish_reason != "length" for g in gens) / n


def test_a_cycle_moves_the_policy_toward_the_rewarded_behaviour_and_back(
    tsettings: Settings, champion: str
) -> None:
    registry = ModelRegistry(tsettings)
    config = TrainerConfig(learning_rate=2e-3, batch_size=8, epochs=2, kl_coef=0.05)
    v1 = load_policy(registry.fetch(champion))
    simulate_feedback(tsettings, v1, PROMPTS, _ends_early, model_version=champion, n=48, seed=1, users=USERS)

    first = run_cycle(tsettings, config, progress=False)
    assert first.status == "registered" and first.parent_version == champion and first.sample_count == 48
    v2 = load_policy(registry.fetch(first.version))
    before, after = _stop_rate(v1), _stop_rate(v2)
    assert after > before + 0.1, f"ending the line early was rewarded: {before:.2f} -> {after:.2f}"

    # The gate promotes the candidate; new feedback on it now rewards the opposite.
    registry.set_alias("champion", first.version)
    opposite = lambda g: -_ends_early(g)  # noqa: E731
    simulate_feedback(
        tsettings, v2, PROMPTS, opposite, model_version=first.version, n=48, seed=2, users=USERS
    )
    second = run_cycle(tsettings, config, progress=False)
    assert second.status == "registered" and second.parent_version == first.version
    back = _stop_rate(load_policy(registry.fetch(second.version)))
    assert back < after - 0.1, f"long completions were rewarded: {after:.2f} -> {back:.2f}"

    lineage = registry.lineage(second.version)
    assert lineage.parent_version == first.version and lineage.sample_count == 48
    assert lineage.trainer_config["learning_rate"] == 2e-3 and lineage.data_window is not None
    assert lineage.data_window.start == registry.lineage(first.version).data_window.end
    # Same device and dtype (the candidate stored in bfloat16, both sides upcast it to float32): serving's
    # scoring function reproduces the logged log-probs exactly, and the batched training scorer stays
    # within float32 rounding of them.
    assert lineage.metrics["exact_mismatch_max_abs"] == 0.0 and lineage.metrics["exact_mismatch_tokens"] > 0
    assert lineage.metrics["mismatch_max_abs"] < 1e-4 and lineage.metrics["mismatch_tokens"] > 0
    run = MlflowClient(tsettings.resolved_mlflow_uri).get_run(second.run_id)
    assert run.info.status == "FINISHED" and run.data.params["objective"] == "pg"
    for key in ("loss", "kl", "ratio_mean", "clip_fraction", "mean_reward", "mismatch_mean_abs"):
        assert key in run.data.metrics, key
    steps = MlflowClient(tsettings.resolved_mlflow_uri).get_metric_history(second.run_id, "loss")
    assert len(steps) == 12  # 48 samples / batch 8 * 2 epochs, one point per step
    # The candidate is stored as a delta against the champion it was trained from, rebuilt exactly above.
    artifact = registry.artifact(second.version)
    assert artifact.kind == "delta" and artifact.parent == first.version and artifact.chain_length == 2
    assert run.data.metrics["artifact_stored_bytes"] == artifact.stored_bytes < artifact.checkpoint_bytes


def _weight_dtypes(registry: ModelRegistry, version: str) -> set[str]:
    return {t["dtype"] for t in registry.manifest(version)["tensors"]["model.safetensors"].values()}


def test_a_default_cycle_stores_bfloat16_weights_as_a_small_delta_against_the_bfloat16_champion(
    tsettings: Settings, champion: str
) -> None:
    registry = ModelRegistry(tsettings)
    simulate_feedback(tsettings, load_policy(registry.fetch(champion)), PROMPTS, _ends_early,
                      model_version=champion, n=16, seed=6, users=USERS)  # fmt: skip
    result = run_cycle(tsettings, TrainerConfig(), progress=False)
    assert result.version is not None
    assert _weight_dtypes(registry, champion) == _weight_dtypes(registry, result.version) == {"BF16"}
    artifact = registry.artifact(result.version)
    assert (artifact.kind, artifact.parent, artifact.chain_length) == ("delta", champion, 1)
    assert artifact.stored_bytes * 4 < artifact.checkpoint_bytes
    # Updates far below a bfloat16 step (lr 1e-5) still moved some weights: stochastic rounding kept them.
    changed = sum(d.changed for d in registry.diff(champion, result.version))
    assert 0 < changed < 0.5 * sum(d.elements for d in registry.diff(champion, result.version))


def test_a_float32_champion_gets_a_full_bfloat16_candidate_then_deltas(
    tsettings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    registry = ModelRegistry(tsettings)
    own = load_policy(tiny_model_dir).save(tmp_path / "own")  # a user's own float32 checkpoint
    versions = [registry.register(own, ModelLineage(base="own"))]
    write_events(tsettings, consent_events(USERS))
    for i, config in enumerate([TrainerConfig(), TrainerConfig(), TrainerConfig(save_dtype="float32")]):
        registry.set_alias("champion", versions[-1])
        simulate_feedback(tsettings, load_policy(registry.fetch(versions[-1])), PROMPTS, _ends_early,
                          model_version=versions[-1], n=8, seed=20 + i, users=USERS)  # fmt: skip
        result = run_cycle(tsettings, config, progress=False)
        assert result.version is not None
        versions.append(result.version)
    kinds = [(registry.artifact(v).kind, registry.artifact(v).chain_length) for v in versions]
    # The dtype changes at the first candidate and at the float32 one: nothing to encode against the parent.
    assert kinds == [("full", 0), ("full", 0), ("delta", 1), ("full", 0)]
    assert [_weight_dtypes(registry, v) for v in versions] == [{"F32"}, {"BF16"}, {"BF16"}, {"F32"}]
    assert registry.lineage(versions[3]).metrics["exact_mismatch_max_abs"] == 0.0


def test_each_cycle_rounds_with_its_own_reproducible_draws() -> None:
    window = DataWindow(end=datetime(2026, 1, 1, tzinfo=UTC), generation_ids_sha256="a" * 64)
    other = window.model_copy(update={"generation_ids_sha256": "b" * 64})
    seed = rounding_seed(TrainerConfig(), "3", window)
    assert seed == rounding_seed(TrainerConfig(), "3", window)
    assert len({seed, rounding_seed(TrainerConfig(seed=1), "3", window), rounding_seed(TrainerConfig(), "4", window),
                rounding_seed(TrainerConfig(), "3", other)}) == 4  # fmt: skip


def test_larger_kl_coefficient_keeps_the_policy_closer_to_the_champion(
    tsettings: Settings, champion: str
) -> None:
    registry = ModelRegistry(tsettings)
    path = registry.fetch(champion)
    policy = load_policy(path)
    simulate_feedback(
        tsettings, policy, PROMPTS, _ends_early, model_version=champion, n=32, seed=3, users=USERS
    )
    kls = []
    for kl_coef in (0.0, 2.0):
        config = TrainerConfig(learning_rate=2e-3, batch_size=8, epochs=3, kl_coef=kl_coef)
        policy = load_policy(path)  # both start from the same champion weights
        samples = load_selection(tsettings, config, watermark=None, quarantined=set(),
                                 encode_prompt=lambda t, p=policy: p.encode_prompt(t, 1)).samples  # fmt: skip
        scorer = scorer_for(True)
        reference = score_samples(policy.model, samples, scorer, policy.pad_id, 8)
        assert train_policy(policy.model, samples, reference, config, scorer, policy.pad_id).stopped_at == ""
        kls.append(kl_to_reference(policy.model, samples, reference, scorer, policy.pad_id, 8))
    assert kls[1] < 0.7 * kls[0], f"KL to the champion: coef 0 -> {kls[0]:.4f}, coef 2 -> {kls[1]:.4f}"
    # and a run cut short says so, by its own rule
    capped = train_policy(policy.model, samples, reference, config.replace(max_steps=2), scorer,
                          policy.pad_id)  # fmt: skip
    assert (len(capped.history), capped.samples_reached, capped.stopped_at) == (2, 2 * config.batch_size, "max_steps")


def test_a_crash_mid_cycle_registers_nothing_and_keeps_the_watermark(
    tsettings: Settings, champion: str
) -> None:
    registry = ModelRegistry(tsettings)
    simulate_feedback(tsettings, load_policy(registry.fetch(champion)), PROMPTS, _ends_early,
                      model_version=champion, n=16, seed=4, users=USERS)  # fmt: skip

    def crash(stats) -> None:
        if stats.step == 1:
            raise RuntimeError("worker killed")

    with pytest.raises(RuntimeError, match="worker killed"):
        run_cycle(tsettings, TrainerConfig(batch_size=4), progress=False, on_step=crash)
    assert [v.version for v in registry.versions()] == [champion]
    assert watermark(registry, champion) is None
    runs = MlflowClient(tsettings.resolved_mlflow_uri).search_runs(
        [MlflowClient(tsettings.resolved_mlflow_uri).get_experiment_by_name("flywheel-trainer").experiment_id]
    )
    assert [r.info.status for r in runs] == ["FAILED"]

    retry = run_cycle(tsettings, TrainerConfig(batch_size=4), progress=False)  # the same data is still there
    assert retry.status == "registered" and retry.sample_count == 16
    assert watermark(registry, retry.version) == registry.lineage(retry.version).data_window.end


def test_learning_accumulates_from_the_parent_champions_window(tsettings: Settings, champion: str) -> None:
    """A candidate not (yet) promoted throws nothing away: the next one trains on its data too, plus what
    came since; once a candidate is champion, its successor starts after the champion's window."""
    registry = ModelRegistry(tsettings)
    policy = load_policy(registry.fetch(champion))
    config = TrainerConfig(batch_size=8, min_samples=4)
    simulate_feedback(tsettings, policy, PROMPTS, _ends_early, model_version=champion, n=16, seed=6, users=USERS)
    first = run_cycle(tsettings, config, progress=False)
    assert first.status == "registered" and first.sample_count == 16

    simulate_feedback(tsettings, policy, PROMPTS, _ends_early, model_version=champion, n=8, seed=7, users=USERS)
    second = run_cycle(tsettings, config, progress=False)  # `first` was never promoted
    assert second.status == "registered" and second.parent_version == champion and second.sample_count == 24
    assert registry.lineage(second.version).data_window.start is None

    registry.set_alias("champion", second.version)
    simulate_feedback(tsettings, policy, PROMPTS, _ends_early, model_version=champion, n=6, seed=8, users=USERS)
    third = run_cycle(tsettings, config, progress=False)
    assert third.status == "registered" and third.parent_version == second.version and third.sample_count == 6
    assert registry.lineage(third.version).data_window.start == registry.lineage(second.version).data_window.end

    # Time travel: the second candidate's lineage names the lake's table versions it read. With more data in the
    # lake since, a selection at those versions picks exactly its samples again, and the rewards table at its
    # version holds exactly the rows it trained on.
    window = registry.lineage(second.version).data_window
    assert window is not None and set(window.lake_versions) == {"events", "rewards"}
    again = load_selection(tsettings, config, watermark=None, quarantined=set(), lake_versions=window.lake_versions,
                           encode_prompt=lambda text: policy.encode_prompt(text, max_tokens=1))  # fmt: skip
    assert again.window is not None and again.window.generation_ids_sha256 == window.generation_ids_sha256
    assert len(again.samples) == 24
    rows = REWARDS.read(REWARDS.at(tsettings.lake_root), window.lake_versions["rewards"])
    assert sorted(rows["generation_id"].to_list()) == sorted(s.generation_id for s in again.samples)
    assert REWARDS.read(REWARDS.at(tsettings.lake_root)).height == 30  # the newest version holds the third's too
    # The lake's vacuum keeps the versions every registered model trained on.
    pinned = pinned_versions(tsettings)
    assert window.lake_versions["rewards"] in pinned["rewards"] and window.lake_versions["events"] in pinned["events"]


def test_too_little_new_data_skips_and_says_why(tsettings: Settings, champion: str) -> None:
    simulate_feedback(tsettings, load_policy(ModelRegistry(tsettings).fetch(champion)), PROMPTS, _ends_early,
                      model_version=champion, n=3, seed=5, users=USERS)  # fmt: skip
    result = run_cycle(tsettings, TrainerConfig(), progress=False)
    assert result.status == "skipped" and result.version is None
    assert "too little new data: 3 eligible samples" in result.reason and "need 4" in result.reason
    assert [v.version for v in ModelRegistry(tsettings).versions()] == [champion]


def test_a_cycle_with_more_eligible_data_than_its_budget_reports_what_it_left_out_and_why(
    tsettings: Settings, champion: str
) -> None:
    """Nothing is left out silently: over `max_samples` a seeded uniform sample is kept (old data as likely as
    new, not the newest N), and past `time_budget_s` training stops; each says how many and by what rule."""
    registry = ModelRegistry(tsettings)
    policy = load_policy(registry.fetch(champion))
    simulate_feedback(tsettings, policy, PROMPTS, _ends_early, model_version=champion, n=40, seed=9, users=USERS)
    capped = TrainerConfig(batch_size=4, min_samples=4, max_samples=16)
    selection = load_selection(tsettings, capped, watermark=None, quarantined=set(),
                               encode_prompt=lambda text: policy.encode_prompt(text, max_tokens=1))  # fmt: skip
    everything = load_selection(tsettings, TrainerConfig(), watermark=None, quarantined=set(),
                                encode_prompt=lambda text: policy.encode_prompt(text, max_tokens=1))  # fmt: skip
    by_age = [s.generation_id for s in sorted(everything.samples, key=lambda s: s.emitted_at)]
    kept = {s.generation_id for s in selection.samples}
    assert len(kept) == 16 and kept < set(by_age)
    assert kept & set(by_age[:20]) and kept & set(by_age[20:])  # both halves of the window keep a share
    result = run_cycle(tsettings, capped, progress=False)
    assert result.status == "registered"
    assert "24 over max_samples=16, left out by seeded reservoir sampling" in result.reason, result.reason
    assert result.metrics["samples_eligible"] == 40 and result.metrics["samples_trained"] == 16
    assert any(k.startswith("left_out_over_max_samples") and v == 24 for k, v in result.metrics.items())

    # A budget too short for more than the first step: it trains on one batch and says what it did not reach.
    budget = TrainerConfig(batch_size=4, min_samples=4, time_budget_s=1e-6)
    result = run_cycle(tsettings, budget, progress=False)
    assert result.status == "registered" and result.metrics["steps"] == 1
    assert result.metrics["samples_trained"] == 4 and result.metrics["samples_eligible"] == 40
    assert "36 not reached within time_budget_s=1e-06 (visited in a seeded random order" in result.reason

    # Early stopping at target_kl: the first step starts at the champion (KL 0), the second measures the
    # first update's KL, which passes a tiny target, so no third step starts; what it left out is said.
    stop = TrainerConfig(batch_size=4, min_samples=4, learning_rate=1e-2, target_kl=1e-9)
    result = run_cycle(tsettings, stop, progress=False)
    assert result.status == "registered" and result.metrics["steps"] == 2, result.metrics
    assert "32 not reached: stopped at target_kl=1e-09 nats to the champion" in result.reason, result.reason


def test_the_off_policy_holdout_is_left_out_of_training_and_said(tsettings: Settings, champion: str) -> None:
    """Generations of prompts in the holdout (`flywheel.holdout`) never reach the trainer, and the cycle says
    how many."""
    policy = load_policy(ModelRegistry(tsettings).fetch(champion))
    simulate_feedback(tsettings, policy, PROMPTS, _ends_early, model_version=champion, n=40, seed=11, users=USERS)
    config = TrainerConfig(batch_size=8, min_samples=4, ope_holdout_share=0.5)
    selection = load_selection(tsettings, config, watermark=None, quarantined=set(),
                               encode_prompt=lambda text: policy.encode_prompt(text, max_tokens=1))  # fmt: skip
    held = [n for why, n in selection.dropped.items() if why.startswith("held out for the offline gate")]
    assert held and held[0] + len(selection.samples) == 40 and 0 < held[0] < 40
    # Held out by prompt: no prompt in the holdout reaches training, and every other prompt does.
    held_prompts = {p for p in PROMPTS if in_holdout(p, 0.5)}
    assert 0 < len(held_prompts) < len(PROMPTS)
    encode = {p: tuple(policy.encode_prompt(p, max_tokens=16)) for p in PROMPTS}
    trained = {tuple(s.prompt_token_ids) for s in selection.samples}
    assert trained and trained <= {encode[p] for p in PROMPTS if p not in held_prompts}


def test_a_cycle_on_its_own_samples_learns_what_the_logged_rewards_prefer(tsettings: Settings, champion: str) -> None:
    registry = ModelRegistry(tsettings)
    v1 = load_policy(registry.fetch(champion))
    simulate_feedback(tsettings, v1, PROMPTS, _ends_early, model_version=champion, n=48, seed=1, users=USERS)
    config = TrainerConfig(learning_rate=2e-3, batch_size=8, epochs=2, own_samples=4, own_max_tokens=8)
    result = run_cycle(tsettings, config, progress=False)
    assert result.status == "registered" and result.sample_count == 48  # the logged data behind it
    assert "trained on 40 of 40 own samples; left out: none;" in result.reason
    assert "own samples for 10 of 10 distinct prompts: 40, 4 a prompt, in " in result.reason, result.reason
    assert "scored by a reward model fitted on all 48 logged rewards" in result.reason
    metrics = MlflowClient(tsettings.resolved_mlflow_uri).get_run(result.run_id).data.metrics
    assert metrics["own_samples"] == 4 * len(PROMPTS) and metrics["reward_model_cv_corr"] > 0.2
    assert metrics["samples_eligible"] == 48 and metrics["samples_trained"] == 4 * len(PROMPTS)
    # the scoring and sampling before the first step are timed apart: the time budget counts from that step
    assert 0 < metrics["prepare_seconds"] < metrics["train_seconds"]
    before, after = _stop_rate(v1), _stop_rate(load_policy(registry.fetch(result.version)))
    assert after > before + 0.1, f"ending the line early was rewarded: {before:.2f} -> {after:.2f}"


def test_own_sample_generation_stops_when_its_cpu_budget_is_spent_and_says_what_it_covered(
    tsettings: Settings, champion: str
) -> None:
    """`own_cpu_budget_s` counts from the logged samples' scoring, which alone takes more than a millisecond of
    CPU: only the first group of prompts (64 requests // 4 a prompt = 16) is sampled, a seeded uniform choice
    of the 40, and the reason and metrics say how many of how many, and under which budget."""
    prompts = [f"value_{i} = " for i in range(40)]
    registry = ModelRegistry(tsettings)
    policy = load_policy(registry.fetch(champion))
    simulate_feedback(tsettings, policy, prompts, _ends_early, model_version=champion, n=48, seed=4, users=USERS)
    config = TrainerConfig(batch_size=16, own_samples=4, own_max_tokens=8, reward_model_min_z=0,
                           own_cpu_budget_s=0.001)  # fmt: skip
    result = run_cycle(tsettings, config, progress=False)
    assert result.status == "registered", result.reason
    assert ("own samples for 16 of 40 distinct prompts (all the 0.001 CPU-s own_cpu_budget_s allowed; a seeded"
            " uniform choice): 64, 4 a prompt") in result.reason, result.reason  # fmt: skip
    assert "trained on 64 of 64 own samples" in result.reason
    metrics = MlflowClient(tsettings.resolved_mlflow_uri).get_run(result.run_id).data.metrics
    assert metrics["own_prompts_covered"] == 16 and metrics["own_prompts_total"] == 40
    assert metrics["own_cpu_seconds"] >= 0.001 and metrics["prepare_cpu_seconds"] >= metrics["own_cpu_seconds"]
    assert metrics["samples_trained"] == 64 and metrics["samples_eligible"] == 48
    # uniform, not the first prompts served: the 16 covered are spread over the 40
    logged = load_selection(tsettings, config, watermark=None, quarantined=set(),
                            encode_prompt=lambda text: policy.encode_prompt(text, max_tokens=1)).samples  # fmt: skip
    own = sample_own(policy, logged, 4, 8, config.seed, scorer=scorer_for(False), score_batch=16, stop=lambda: True)
    index = {tuple(policy.encode_prompt(p, max_tokens=1)): i for i, p in enumerate(prompts)}
    covered = sorted(index[tuple(s.prompt_token_ids)] for s in own.samples[::4])
    assert own.prompts_covered == 16 and own.prompts_total == 40 and len(own.samples) == 64
    assert covered != list(range(16)) and max(covered) >= 30, covered
    assert all(s.behaviour_logprobs == r for s, r in zip(own.samples, own.reference, strict=True))


def test_a_reward_model_that_predicts_nothing_leaves_the_cycle_on_its_logged_samples(
    tsettings: Settings, champion: str
) -> None:
    policy = load_policy(ModelRegistry(tsettings).fetch(champion))
    rng = random.Random(5)
    simulate_feedback(tsettings, policy, PROMPTS, lambda g: rng.choice([1.0, -1.0]), model_version=champion, n=40,
                      seed=3, users=USERS)  # fmt: skip
    config = TrainerConfig(batch_size=8, own_samples=4, reward_model_min_z=20)
    result = run_cycle(tsettings, config, progress=False)
    assert result.status == "registered" and "trained on 40 samples" in result.reason
    assert "trained on the logged samples: the reward model's cross-validated correlation" in result.reason
    assert "not above reward_model_min_z=20" in result.reason


def _row(
    gid: str, user: str, *, version: str = "1", prompt: str = "x = ", completion: str = " 1\n", temperature: float = 1.0
) -> Event:
    """A generation event as serving logs it, signed with the settings' (default) serving key."""
    record = GenerationRecord(
        temperature=temperature,
        prompt=prompt,
        prompt_token_ids=[5, 6],
        completion=completion,
        completion_token_ids=[7, 8],
        behaviour_logprobs=[-1.0, -2.0],
        model_version=version,
    )
    record.signature = sign_generation(Settings().serving_key.get_secret_value(), gid, user, record)
    return Event(type="generation", generation_id=gid, user_id=user, properties=record.model_dump())


def test_eligibility_consent_quarantine_scrubbing_and_latest_revision(tsettings: Settings) -> None:
    now = datetime.now(UTC)
    events = [
        _row("ok", "alice"),
        _row("no-consent", "bob"),
        _row("revoked", "carol"),
        _row("quarantined", "alice", version="7"),
        _row("secret", "alice", completion=" 'AKIAABCDEFGHIJKLMNOP'\n"),
        _row("pii-prompt", "alice", prompt="mail bob@example.com\nx = "),
        _row("hot", "alice", temperature=0.7),
        *consent_events(["alice", "carol"]),
    ]
    write_events(tsettings, events)
    later = Event(type="shown", generation_id="c", user_id="carol", ts=now + timedelta(seconds=1),
                  properties={"training_consent": False})  # fmt: skip
    write_events(tsettings, [later])

    def reward(gid: str, value: float, revision: int = 0) -> RewardRecord:
        return RewardRecord(
            generation_id=gid, reward_version="r1", revision=revision, reward=value, confidence=1,
            label_source="implicit", window_start=now, window_end=now,
            emitted_at=now + timedelta(seconds=revision),
        )  # fmt: skip

    gids = ["ok", "no-consent", "revoked", "quarantined", "secret", "pii-prompt", "hot", "no-event"]
    write_rewards(tsettings, [reward(g, 0.5) for g in gids] + [reward("ok", -1.0, revision=1)])
    selection = load_selection(tsettings, TrainerConfig(), watermark=None, quarantined={"7"},
                               encode_prompt=lambda text: [len(text)])  # fmt: skip
    by_id = {s.generation_id: s for s in selection.samples}
    assert sorted(by_id) == ["ok", "pii-prompt"]
    assert by_id["ok"].reward == -1.0  # the latest revision wins
    assert by_id["pii-prompt"].prompt_redacted and by_id["pii-prompt"].prompt_token_ids == [
        len("mail <EMAIL>\nx = ")
    ]
    assert selection.dropped == {
        "without consent": 2, "from quarantined versions": 1, "without a generation event": 1,
        "with secrets or personal data in the completion": 1, "prompts redacted (kept)": 1,
        "sampled at a temperature other than 1": 1,
    }  # fmt: skip
    assert selection.window and selection.window.end == now + timedelta(seconds=1)
    # Nothing new after the window's end.
    again = load_selection(tsettings, TrainerConfig(), watermark=selection.window.end, quarantined=set(),
                           encode_prompt=lambda text: [1])  # fmt: skip
    assert again.samples == [] and again.window is None
