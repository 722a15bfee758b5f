"""Deploy gate actions against the real registry (MLflow on SQLite) and real Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy_gate.errors import (
    ChallengerRunning,
    NoChallenger,
    NoChampion,
    NotPending,
    StalePlan,
)
from deploy_gate.gate import DeployGate
from flywheel.connections import redis_client
from flywheel.settings import Settings
from model_registry import ModelRegistry, UnknownVersion
from tests.helpers import register


@pytest.fixture
def gate_settings(settings: Settings) -> Settings:
    return settings  # each test has its own MLflow store and Redis prefix (conftest)


@pytest.fixture
def registry(gate_settings: Settings) -> ModelRegistry:
    return ModelRegistry(gate_settings)


@pytest.fixture
def gate(registry: ModelRegistry, gate_settings: Settings) -> DeployGate:
    return DeployGate(registry, redis_client(gate_settings), gate_settings)




@pytest.fixture
def champion(registry: ModelRegistry, tmp_path: Path) -> str:
    v = register(registry, tmp_path)
    registry.set_gate_state(v, "champion", by="bootstrap", reason="first model")
    registry.set_alias("champion", v)
    return v


def test_approval_makes_the_candidate_the_challenger_in_registry_and_split(
    gate: DeployGate, registry: ModelRegistry, gate_settings: Settings, champion: str, tmp_path: Path
) -> None:
    candidate = register(registry, tmp_path, parent=champion)
    assert gate.splits.get() is None

    split = gate.approve(candidate, by="ana", reason="offline checks pass")

    assert registry.gate_state(candidate) == "approved"
    assert registry.alias("challenger") == candidate
    last = registry.gate_history(candidate)[-1]
    assert (last.state, last.previous, last.by, last.reason) == (
        "approved",
        "pending",
        "ana",
        "offline checks pass",
    )
    stored = gate.splits.get()
    assert stored == split and stored is not None
    assert stored.champion_version == champion
    assert stored.challenger_version == candidate
    assert stored.challenger_share == gate_settings.challenger_share
    assert (stored.state, stored.changed_by) == ("running", "ana")
    # The split was initialised with the champion first, then changed by the approval.
    history = gate.history()
    assert [h.state for h in history] == ["running", "idle"]
    assert history[1].challenger_version is None and history[1].champion_version == champion
    users = [f"user-{i}" for i in range(400)]
    assert {stored.arm_for(u) for u in users} == {"champion", "challenger"}


def test_approving_or_rejecting_a_version_that_is_not_pending_is_refused(
    gate: DeployGate, registry: ModelRegistry, champion: str, tmp_path: Path
) -> None:
    candidate = register(registry, tmp_path, parent=champion)
    gate.approve(candidate, by="ana", reason="ok")
    before = gate.splits.get()

    with pytest.raises(NotPending, match=f"version {candidate} is approved"):
        gate.approve(candidate, by="bob", reason="again")
    with pytest.raises(NotPending):
        gate.reject(candidate, by="bob", reason="too late")
    with pytest.raises(NotPending, match="is champion"):
        gate.approve(champion, by="bob", reason="?")
    with pytest.raises(UnknownVersion):
        gate.approve("999", by="bob", reason="?")

    assert gate.splits.get() == before
    assert registry.gate_state(candidate) == "approved"
    assert len(gate.history()) == 2


def test_reject_marks_the_candidate_and_leaves_traffic_alone(
    gate: DeployGate, registry: ModelRegistry, champion: str, tmp_path: Path
) -> None:
    candidate = register(registry, tmp_path, parent=champion)
    gate.ensure_split()
    before = gate.splits.get()
    gate.reject(candidate, by="ana", reason="reward hacking in samples")
    assert registry.gate_state(candidate) == "rejected"
    assert registry.gate_history(candidate)[-1].reason == "reward hacking in samples"
    assert gate.splits.get() == before


def test_one_challenger_at_a_time(
    gate: DeployGate, registry: ModelRegistry, champion: str, tmp_path: Path
) -> None:
    first = register(registry, tmp_path, parent=champion)
    second = register(registry, tmp_path, parent=champion)
    gate.approve(first, by="ana", reason="ok")
    with pytest.raises(ChallengerRunning, match=f"version {first} is the challenger"):
        gate.approve(second, by="ana", reason="ok")
    assert registry.gate_state(second) == "pending"


def test_rollback_returns_all_traffic_to_the_champion(
    gate: DeployGate, registry: ModelRegistry, champion: str, tmp_path: Path
) -> None:
    candidate = register(registry, tmp_path, parent=champion)
    gate.approve(candidate, by="ana", reason="ok")

    split = gate.rollback(by="oncall", reason="dissatisfied follow-ups up")

    assert split is not None
    assert (split.state, split.challenger_share, split.challenger_version) == ("rolled_back", 0.0, None)
    assert split.champion_version == champion and split.changed_by == "oncall"
    assert {split.arm_for(f"user-{i}") for i in range(400)} == {"champion"}
    assert {split.version_for(split.arm_for(f"user-{i}")) for i in range(400)} == {champion}
    # Rolled back, then quarantined: what it served is left out of training.
    assert [c.state for c in registry.gate_history(candidate)][-2:] == ["rolled_back", "quarantined"]
    assert registry.gate_state(candidate) == "quarantined"
    assert registry.gate_history(candidate)[-1].by == "oncall"
    assert registry.alias("challenger") is None
    with pytest.raises(NoChallenger):
        gate.rollback(by="oncall", reason="twice")
    # After a rollback the next candidate can be approved.
    nxt = register(registry, tmp_path, parent=champion)
    assert gate.approve(nxt, by="ana", reason="retry").challenger_version == nxt  # type: ignore[union-attr]


def test_promote_makes_the_challenger_the_champion(
    gate: DeployGate, registry: ModelRegistry, champion: str, tmp_path: Path
) -> None:
    candidate = register(registry, tmp_path, parent=champion)
    gate.approve(candidate, by="ana", reason="ok")

    split = gate.promote(by="ana", reason="+3% accept rate, sequential test passed")

    assert split is not None
    assert (split.champion_version, split.challenger_version, split.challenger_share) == (
        candidate,
        None,
        0.0,
    )
    assert split.state == "promoted"
    assert registry.alias("champion") == candidate
    assert registry.alias("challenger") is None
    assert registry.gate_state(candidate) == "champion"
    assert registry.gate_state(champion) == "approved"


def test_a_plan_made_before_someone_else_changed_the_gate_is_refused(
    gate: DeployGate, registry: ModelRegistry, champion: str, tmp_path: Path
) -> None:
    first = register(registry, tmp_path, parent=champion)
    second = register(registry, tmp_path, parent=champion)
    gate.approve(first, by="ana", reason="ok")
    stale = gate.plan_promote(by="bob", reason="looks good")  # bob reviews a plan to promote `first` ...
    gate.rollback(by="ana", reason="guardrail")  # ... meanwhile ana rolls it back and approves another
    gate.approve(second, by="ana", reason="ok")

    with pytest.raises(StalePlan):
        gate.apply(stale)
    assert registry.alias("champion") == champion
    assert gate.splits.get().challenger_version == second  # type: ignore[union-attr]


def test_without_a_champion_the_gate_says_what_to_do(
    gate: DeployGate, registry: ModelRegistry, tmp_path: Path
) -> None:
    candidate = register(registry, tmp_path)
    with pytest.raises(NoChampion, match="champion"):
        gate.approve(candidate, by="ana", reason="ok")
    assert registry.gate_state(candidate) == "pending"
    assert gate.splits.get() is None
