"""Generations from another model (text and model_version only): scored, kept, trained on only without
behaviour log-probs.

Real parts: the lake (ingest's writer), signals' batch recompute (the stream's scoring code), the tiny
policy's tokenizer and weights, the trainer's selection and loop.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch

from deploy_gate.metrics import arm_metrics
from flywheel.contract import Event, GenerationRecord, RewardRecord
from flywheel.lake.tables import EVENTS
from flywheel.lm import load_policy
from flywheel.settings import Settings
from flywheel.signing import Untrusted
from signals.recompute import recompute_records
from signals.reward import DEFAULT_DEFINITION
from simulator.lake_feedback import consent_events, write_rewards
from simulator.telemetry import feedback_event, write_events
from trainer.config import TrainerConfig
from trainer.data import TEXT_KEPT, TEXT_ONLY, Sample, load_selection
from trainer.loop import score_samples, train_policy
from trainer.objectives import reward_weighted_likelihood_loss
from trainer.retokenize import text_encoder
from trainer.scoring import scorer_for

USERS = ("alice", "bob")


def text_generation(gid: str, user: str, completion: str, ts: datetime) -> Event:
    """What a product with its own inference server sends: text and its model's version, nothing else."""
    props = {"prompt": "def add(a, b):\n    return", "completion": completion, "model_version": "acme-coder-7b"}
    return Event(type="generation", generation_id=gid, user_id=user, ts=ts, received_at=ts, properties=props)


def unsigned_with_tokens(gid: str, user: str, ts: datetime) -> Event:
    """Token ids and log-probs nobody vouches for (no serving signature)."""
    record = GenerationRecord(
        prompt="x = ", prompt_token_ids=[5, 6], completion=" 1\n", completion_token_ids=[7, 8],
        behaviour_logprobs=[-0.01, -0.01], model_version="acme-coder-7b",
    )  # fmt: skip
    return Event(type="generation", generation_id=gid, user_id=user, ts=ts, received_at=ts,
                 properties=record.model_dump())  # fmt: skip


def test_token_fields_come_together_or_not_at_all() -> None:
    assert GenerationRecord(prompt="p", completion="c", model_version="m").text_only
    with pytest.raises(ValueError, match="come together"):
        GenerationRecord(prompt="p", completion="c", model_version="m", completion_token_ids=[1])


@pytest.fixture
def lake(settings: Settings) -> Settings:
    """Four text-only generations (two accepted, two rejected) and one unsigned with token ids, rewarded."""
    t0 = datetime.now(UTC) - timedelta(hours=1)
    events = [*consent_events(USERS)]
    for i, (user, taken) in enumerate([("alice", True), ("bob", False), ("alice", True), ("bob", False)]):
        gid = f"text-{i}"
        events.append(text_generation(gid, user, " a + b" if taken else " a - b", t0 + timedelta(seconds=i)))
        events.append(feedback_event(gid, "shown", t0 + timedelta(seconds=i, milliseconds=100), user_id=user))
        verdict = "accepted" if taken else "rejected"
        events.append(feedback_event(gid, verdict, t0 + timedelta(seconds=i, milliseconds=500), user_id=user))
    events.append(unsigned_with_tokens("unsigned-0", "alice", t0))
    write_events(settings, events, at=[(settings.events_topic, 0, i) for i in range(len(events))])
    return settings


def test_text_only_generation_is_kept_in_the_lake_and_scored(lake: Settings) -> None:
    rows = EVENTS.read(EVENTS.at(lake.lake_root))
    kept = rows.filter(rows["type"] == "generation")
    assert sorted(kept["generation_id"].to_list()) == ["text-0", "text-1", "text-2", "text-3", "unsigned-0"]
    records = {r.generation_id: r for r in recompute_records(lake, DEFAULT_DEFINITION)}
    assert {"text-0", "text-1", "text-2", "text-3"} <= records.keys()
    assert all(records[f"text-{i}"].model_version == "acme-coder-7b" for i in range(4))
    assert records["text-0"].label_source == "implicit" and records["text-0"].reward > records["text-1"].reward
    # The dashboard shows them under their model's version (the unsigned one sent arm "champion").
    write_rewards(lake, list(records.values()))
    arms = {(a.arm, a.model_version): a.n for a in arm_metrics(lake).arms}
    # Not an arm of Flywheel's experiment unless it says so: its own row, never mixed into the champion's.
    assert arms[("unknown", "acme-coder-7b")] == 4


def _rewards(settings: Settings) -> None:
    now = datetime.now(UTC)
    records = [
        RewardRecord(generation_id=gid, reward_version="r1", reward=reward, confidence=1.0,
                     label_source="implicit", window_start=now, window_end=now, emitted_at=now)  # fmt: skip
        for gid, reward in [("text-0", 1.0), ("text-1", -1.0), ("text-2", 1.0), ("text-3", -1.0), ("unsigned-0", 1.0)]
    ]
    write_rewards(settings, records)


def test_off_policy_objective_never_sees_them_and_says_why(lake: Settings, tiny_model_dir: Path) -> None:
    _rewards(lake)
    policy = load_policy(tiny_model_dir)
    selection = load_selection(lake, TrainerConfig(objective="pg"), watermark=None, quarantined=set(),
                               encode_prompt=lambda t: [1], encode_text=text_encoder(policy))  # fmt: skip
    assert selection.samples == []
    assert selection.dropped == {TEXT_ONLY: 4, Untrusted.UNSIGNED.value: 1}
    assert "left_out_text_only_no_token_ids_or_log_probs_no_off_policy_ratio_without_serving_s_log_probs" in (
        selection.drop_metrics()
    )
    # Nor can a caller hand one to the off-policy loop directly.
    sample = Sample("g", "u", [1, 2], [3, 4], None, 1.0, "acme-coder-7b", datetime.now(UTC))
    with pytest.raises(ValueError, match="no behaviour log-probs"):
        train_policy(policy.model, [sample], [[0.0, 0.0]], TrainerConfig(objective="pg"), scorer_for(False),
                     policy.pad_id)  # fmt: skip
    with pytest.raises(ValueError, match="text_generations=True with objective='pg'"):
        TrainerConfig(objective="pg", text_generations=True)


@pytest.mark.parametrize("objective", ["rwl", "kto"])
def test_no_logprob_objective_learns_from_them_when_configured(
    lake: Settings, tiny_model_dir: Path, objective: str
) -> None:
    _rewards(lake)
    policy = load_policy(tiny_model_dir)
    off = load_selection(lake, TrainerConfig(objective=objective), watermark=None, quarantined=set(),
                         encode_prompt=lambda t: [1], encode_text=text_encoder(policy))  # fmt: skip
    assert off.samples == [] and off.dropped[TEXT_ONLY] == 4  # not unless asked for

    config = TrainerConfig(objective=objective, text_generations=True, learning_rate=1e-2, batch_size=5, seed=0)
    selection = load_selection(lake, config, watermark=None, quarantined=set(),
                               encode_prompt=lambda t: [1], encode_text=text_encoder(policy))  # fmt: skip
    by_id = {s.generation_id: s for s in selection.samples}
    assert sorted(by_id) == ["text-0", "text-1", "text-2", "text-3", "unsigned-0"]
    assert all(s.text_only for s in selection.samples) and selection.dropped[TEXT_KEPT] == 5
    # Tokenised by the policy's own tokenizer, ending with its end-of-text (the completion stopped).
    tokens = policy.tokenizer("def add(a, b):\n    return a + b")["input_ids"]
    assert by_id["text-0"].prompt_token_ids + by_id["text-0"].completion_token_ids[:-1] == tokens
    assert by_id["text-0"].completion_token_ids[-1] == policy.stop_ids[0]
    # The unsigned record's own token ids are ignored: only its text is used.
    assert by_id["unsigned-0"].completion_token_ids != [7, 8]

    before = [p.detach().clone() for p in policy.model.parameters()]
    scorer = scorer_for(False)
    reference = score_samples(policy.model, selection.samples, scorer, policy.pad_id, 8)
    history = train_policy(policy.model, selection.samples, reference, config, scorer, policy.pad_id).history
    assert history and all(torch.isfinite(torch.tensor(h.loss)) for h in history)
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.model.parameters(), strict=True))


def test_reward_weighted_likelihood_pulls_harder_on_better_samples() -> None:
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)  # (B, T): two equally likely samples
    mask = torch.ones(2, 3)
    loss, stats = reward_weighted_likelihood_loss(
        logprobs, logprobs.detach(), mask, torch.tensor([1.0, -1.0]), beta=1.0, max_weight=20.0, kl_coef=0.0,
        aggregation="sequence",
    )  # fmt: skip
    loss.backward()
    assert logprobs.grad is not None
    up, down = -logprobs.grad.sum(dim=1)  # how much each sample's likelihood is pushed up
    assert up > down > 0 and float(up / down) == pytest.approx(torch.e**2, rel=1e-5)
    assert stats.ratio_mean == 1.0  # no importance ratio is involved
