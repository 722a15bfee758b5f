"""Quarantine on rollback (the trainer never sees the data), its undo by an admin, the long-term
holdout through serving's routing, and the experiment API."""

from __future__ import annotations

import random
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from deploy_gate.app import create_app
from deploy_gate.gate import DeployGate
from deploy_gate.rollout import RampStep, RolloutConfig, RolloutController
from flywheel.connections import redis_client
from flywheel.contract import Event, GenerationRecord, RewardRecord
from flywheel.identity import TokenStore
from flywheel.settings import Settings
from flywheel.signing import sign_generation
from model_registry import ModelRegistry
from serving.pool import PolicyPool
from simulator.lake_feedback import consent_events, write_rewards
from simulator.telemetry import write_events
from tests.helpers import register
from tests.rollout_sim import Behaviour, write_batch
from trainer.config import TrainerConfig
from trainer.data import load_selection, quarantined_versions

# Repeatable: the users' ids come from the test's rng, and the experiment's salt (which splits them
# between arms) from `seeded_ids`.
pytestmark = pytest.mark.usefixtures("seeded_ids")

ADMIN = "admin-token-for-the-quarantine-test"




@pytest.fixture
def gsettings(settings: Settings) -> Settings:
    return settings.model_copy(update={"approval_token": SecretStr(ADMIN)})


@pytest.fixture
def registry(gsettings: Settings) -> ModelRegistry:
    return ModelRegistry(gsettings)


@pytest.fixture
def gate(registry: ModelRegistry, gsettings: Settings) -> DeployGate:
    return DeployGate(registry, redis_client(gsettings), gsettings)


@pytest.fixture
def champion(registry: ModelRegistry, tmp_path: Path) -> str:
    v = register(registry, tmp_path)
    registry.set_gate_state(v, "champion", by="bootstrap", reason="first model")
    registry.set_alias("champion", v)
    return v


@pytest.fixture
def client(gate: DeployGate, gsettings: Settings, champion: str) -> Iterator[TestClient]:
    with TestClient(create_app(gsettings, gate=gate)) as c:
        yield c


def _generation(settings: Settings, gid: str, user: str, version: str) -> Event:
    record = GenerationRecord(prompt="x = ", prompt_token_ids=[5, 6], completion=" 1\n", completion_token_ids=[7, 8],
                              behaviour_logprobs=[-1.0, -2.0], model_version=version)  # fmt: skip
    record.signature = sign_generation(settings.serving_key.get_secret_value(), gid, user, record)
    return Event(type="generation", generation_id=gid, user_id=user, properties=record.model_dump())


def test_a_rolled_back_versions_data_never_reaches_the_trainer_until_an_admin_lifts_it(
    gate: DeployGate, gsettings: Settings, registry: ModelRegistry, champion: str, tmp_path: Path,
    client: TestClient,
) -> None:
    candidate = register(registry, tmp_path, parent=champion)
    gate.approve(candidate, by="ana", reason="offline gates pass")
    write_events(gsettings, [_generation(gsettings, "g-champ", "alice", champion),
                             _generation(gsettings, "g-chall", "bob", candidate),
                             *consent_events(["alice", "bob"])])  # fmt: skip
    now = datetime.now(UTC)
    write_rewards(gsettings, [
        RewardRecord(generation_id=g, reward_version="r1", reward=0.5, confidence=1, label_source="implicit",
                     window_start=now, window_end=now, model_version=v)
        for g, v in (("g-champ", champion), ("g-chall", candidate))
    ])  # fmt: skip

    def trained_on() -> list[str]:
        sel = load_selection(gsettings, TrainerConfig(), watermark=None, quarantined=quarantined_versions(registry),
                             encode_prompt=lambda t: [1])  # fmt: skip
        return sorted(s.generation_id for s in sel.samples)

    assert trained_on() == ["g-chall", "g-champ"]
    gate.rollback(by="rollout-controller", reason="guardrail tripped: undo_rate")
    assert registry.gate_state(candidate) == "quarantined"
    assert trained_on() == ["g-champ"]
    shown = client.get(f"/api/versions/{candidate}").json()
    assert shown["gate_state"] == "quarantined"

    # Lifting it needs an admin: an approver is refused, the admin's token works.
    approver = TokenStore.from_settings(gsettings).issue("alice", "approver")
    why = {"reason": "the guardrail misfired: a logging bug"}
    refused = client.post(f"/api/versions/{candidate}/unquarantine", json=why,
                          headers={"Authorization": f"Bearer {approver}"})  # fmt: skip
    assert refused.status_code == 403 and registry.gate_state(candidate) == "quarantined"
    assert client.post(f"/api/versions/{candidate}/unquarantine", json=why).status_code == 401
    ok = client.post(f"/api/versions/{candidate}/unquarantine", json=why, headers={"Authorization": f"Bearer {ADMIN}"})
    assert ok.status_code == 200, ok.text
    assert registry.gate_state(candidate) == "rolled_back"
    assert trained_on() == ["g-chall", "g-champ"]


def test_holdout_users_never_see_a_challenger_through_serving_routing(
    gate: DeployGate, gsettings: Settings, registry: ModelRegistry, champion: str, tmp_path: Path,
    tiny_model_dir: Path,
) -> None:
    cfg = RolloutConfig(holdout_share=0.1, ramp=[RampStep(share=0.5, min_users=10, min_seconds=0)])
    clock = [datetime(2026, 11, 25, 10, 0, tzinfo=UTC)]
    controller = RolloutController(gate, cfg, clock=lambda: clock[0])
    gate.ensure_split()
    controller.tick()  # sets up the holdout on today's champion
    split = gate.splits.get()
    assert split is not None and (split.holdout_version, split.holdout_share) == (champion, 0.1)

    pool = PolicyPool(gate.splits.get, lambda version: str(tiny_model_dir))
    users = [f"user-{i}" for i in range(2000)]
    seen: dict[str, set[str]] = {u: set() for u in users}
    held_out = {u for u in users if split.in_holdout(u)}
    assert 120 < len(held_out) < 280

    # Two releases: each candidate is approved, served, and promoted; held-out users stay on `champion`.
    for _ in range(2):
        candidate = register(registry, tmp_path)
        gate.approve(candidate, by="ana", reason="offline gates pass")
        controller.tick()
        pool.refresh()
        for u in users:
            route = pool.route(u)
            seen[u].add(route.version)
            if u in held_out:
                assert (route.arm, route.version) == ("holdout", champion)
        assert {pool.route(u).version for u in users if u not in held_out} >= {candidate}
        gate.promote(by="ana", reason="win")
        clock[0] += timedelta(hours=1)
        controller.tick()
    assert all(seen[u] == {champion} for u in held_out)

    # The holdout's cumulative effect: held-out users against today's champion (the last promoted).
    split = gate.splits.get()
    assert split is not None and split.holdout_version == champion
    write_batch(gsettings, split, {"champion": Behaviour(p_good=0.8), "holdout": Behaviour(p_good=0.4),
                                   "challenger": Behaviour()},
                users=0, at=clock[0], rng=random.Random(1), user_ids=users)  # fmt: skip
    rec = controller.tick()
    assert rec.holdout is not None and rec.holdout.users == len(held_out)
    effect = rec.holdout.cumulative_effect
    assert effect is not None and effect.ci[0] > 0


def test_experiment_api_answers_the_contract(
    gate: DeployGate, gsettings: Settings, registry: ModelRegistry, champion: str, tmp_path: Path,
    client: TestClient,
) -> None:
    idle = client.get("/api/experiment").json()
    assert idle["state"] == "idle" and idle["analysis"] is None and idle["holdout"] is None
    candidate = register(registry, tmp_path, parent=champion)
    gate.approve(candidate, by="ana", reason="offline gates pass")
    # Ten minutes past an hour: each user's generations (seconds apart) fall in one hourly bucket of the series.
    clock = [(datetime.now(UTC) - timedelta(hours=2)).replace(minute=10, second=0, microsecond=0)]
    cfg = RolloutConfig(ramp=[RampStep(share=0.5, min_users=10_000, min_seconds=0)])
    controller = RolloutController(gate, cfg, clock=lambda: clock[0])
    controller.tick()
    split = gate.splits.get()
    assert split is not None
    write_batch(gsettings, split, {"champion": Behaviour(), "challenger": Behaviour(), "holdout": Behaviour()},
                users=300, at=clock[0], rng=random.Random(2))  # fmt: skip
    clock[0] += timedelta(minutes=5)
    controller.tick()
    body = client.get("/api/experiment").json()
    assert set(body) == {"experiment", "state", "champion", "challenger", "holdout_version", "share", "ramp", "step",
                         "analysis", "timeline", "holdout", "srm_periods", "plan", "bucket"}  # fmt: skip
    assert body["bucket"] == "1m" and [p["share"] for p in body["srm_periods"]] == [0.5]  # a 5-minute experiment
    assert (body["state"], body["champion"], body["challenger"], body["share"]) == ("ramping", champion, candidate, 0.5)
    a = body["analysis"]
    assert a["unit"] == "user" and a["reward_version"] == "rules-v1"
    assert a["arms"]["champion"]["users"] + a["arms"]["challenger"]["users"] == 300
    assert a["decision"]["action"] == "continue" and "challenger users so far" in a["decision"]["reason"]
    assert a["srm"]["expected_shares"] == [0.5, 0.5]
    assert a["power"]["min_arm_users"] > 0 and a["power"]["note"]  # what this traffic can resolve, stated
    assert {g["name"] for g in a["guardrails"]} >= {"latency_ms", "truncated_rate", "undo_rate", "thumbs_down_rate",
                                                     "accepted_rate", "empty_rate", "mean_length_chars"}  # fmt: skip
    info = {g["name"]: g for g in a["guardrails"] if g["kind"] == "info"}
    assert set(info) == {"shown_rate", "declined_rate", "truncated_rate"} and all(g["ok"] for g in info.values())
    series = client.get("/api/experiment/series?bucket=1h").json()["buckets"]
    assert {b["arm"] for b in series} == {"champion", "challenger"}
    assert sum(b["users"] for b in series) == 300
    assert client.get("/api/experiment/series?bucket=1x").status_code == 422
    # A manual freeze is plan-then-apply and needs an approver.
    r = client.post("/api/experiment/ramp?dry_run=true", json={"share": 0.5, "state": "paused", "reason": "look"})
    assert r.status_code == 401
    r = client.post("/api/experiment/ramp", json={"share": 0.5, "state": "paused", "reason": "look"},
                    headers={"Authorization": f"Bearer {ADMIN}"})  # fmt: skip
    assert r.status_code == 200 and r.json()["split"]["state"] == "paused"
    assert controller.tick().state == "frozen"
