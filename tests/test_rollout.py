"""The rollout controller end to end: real registry (MLflow on SQLite), real Redis, a real lake.

Simulated users are routed by the split in Redis exactly as serving routes them
(`TrafficSplit.arm_for`); the controller's clock is a fake one, advanced per batch, so minimum
times are met without waiting.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deploy_gate.gate import DeployGate
from deploy_gate.rollout import CONTROLLER_ACTOR, RampStep, RolloutConfig, RolloutController
from deploy_gate.rollout.controller import ExperimentRecord
from flywheel.connections import redis_client
from flywheel.settings import Settings
from model_registry import ModelRegistry
from tests.helpers import register
from tests.rollout_sim import Behaviour, Drop, write_batch

# Repeatable: the users' ids come from the test's rng, and the experiment's salt (which splits them
# between arms) from `seeded_ids`.
pytestmark = pytest.mark.usefixtures("seeded_ids")

CHAMPION = Behaviour(p_good=0.5)




@pytest.fixture
def registry(settings: Settings) -> ModelRegistry:
    return ModelRegistry(settings)


@pytest.fixture
def gate(registry: ModelRegistry, settings: Settings) -> DeployGate:
    return DeployGate(registry, redis_client(settings), settings)


@pytest.fixture
def versions(registry: ModelRegistry, gate: DeployGate, tmp_path: Path) -> tuple[str, str]:
    """(champion, candidate approved as the challenger)."""
    champion = register(registry, tmp_path)
    registry.set_gate_state(champion, "champion", by="bootstrap", reason="first model")
    registry.set_alias("champion", champion)
    candidate = register(registry, tmp_path, parent=champion)
    gate.approve(candidate, by="ana", reason="offline gates pass")
    return champion, candidate


def config(**overrides: object) -> RolloutConfig:
    ramp = [RampStep(share=s, min_users=40, min_seconds=300) for s in (0.05, 0.25, 0.5)]
    fields: dict[str, object] = {"ramp": ramp, "srm_min_users": 100, "latency_min_generations": 50, **overrides}
    return RolloutConfig(**fields)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 11, 25, 10, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def run(
    gate: DeployGate,
    settings: Settings,
    challenger: Behaviour,
    *,
    cfg: RolloutConfig | None = None,
    batches: int = 40,
    users: int = 400,
    drop: Drop | None = None,
    seed: int = 0,
) -> tuple[ExperimentRecord, list[ExperimentRecord]]:
    clock = Clock()
    controller = RolloutController(gate, cfg or config(), clock=clock)
    rng = random.Random(seed)
    seen = []
    rec = controller.tick()
    for _ in range(batches):
        split = gate.splits.get()
        assert split is not None
        write_batch(settings, split, {"champion": CHAMPION, "challenger": challenger, "holdout": CHAMPION},
                    users=users, at=clock.now, rng=rng, drop=drop)  # fmt: skip
        clock.now += timedelta(seconds=120)
        rec = controller.tick()
        seen.append(rec)
        if rec.state in ("promoted", "rolled_back", "frozen", "holding"):
            break
    return rec, seen


def test_config_refuses_an_unknown_or_renamed_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    monkeypatch.setenv("FLYWHEEL_ROLLOUT_SHOWN_RATE_FALL", "0.2")  # the bound before declining was allowed
    with pytest.raises(ValidationError, match=r"unknown settings \['FLYWHEEL_ROLLOUT_SHOWN_RATE_FALL'\]"):
        RolloutConfig()
    monkeypatch.delenv("FLYWHEEL_ROLLOUT_SHOWN_RATE_FALL")
    monkeypatch.setenv("FLYWHEEL_ROLLOUT_ACCEPTED_RATE_FALL", "0.02")
    assert RolloutConfig().accepted_rate_fall == 0.02


def _no_data_alarm() -> float | None:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("flywheel_rollout_no_data")


def test_a_challenger_with_no_rewarded_users_is_rolled_back_at_the_maximum_duration_and_the_alarm_fires(
    gate: DeployGate, settings: Settings, registry: ModelRegistry, versions: tuple[str, str]
) -> None:
    _, candidate = versions
    clock = Clock()
    controller = RolloutController(gate, config(max_duration_s=3600), clock=clock)
    rng = random.Random(3)
    rec = controller.tick()
    assert rec.state == "ramping" and rec.analysis is not None and rec.analysis.no_data
    assert _no_data_alarm() == 0.0  # not before the first step's minimum time
    lost: Drop = lambda arm, _user: arm == "challenger"  # noqa: E731 - its events never reach the lake
    while clock.now < datetime(2026, 11, 25, 11, 0, tzinfo=UTC):
        split = gate.splits.get()
        assert split is not None
        # Few users: the champion's never make 20 challenger users expected, so only the maximum duration ends it.
        write_batch(settings, split, {"champion": CHAMPION, "challenger": CHAMPION}, users=6, at=clock.now, rng=rng,
                    drop=lost)  # fmt: skip
        clock.now += timedelta(seconds=600)
        rec = controller.tick()
        if clock.now < datetime(2026, 11, 25, 11, 0, tzinfo=UTC):
            assert rec.state == "ramping" and rec.analysis is not None
            assert any(f.startswith("no_data") for f in rec.analysis.flags) and _no_data_alarm() == 1.0
            assert controller.view().plan is not None  # what the traffic could resolve, from the champion's users
    assert rec.state == "rolled_back" and rec.analysis is not None
    assert rec.analysis.decision.why == "no_data" and "by the maximum duration" in rec.analysis.decision.reason
    assert not rec.analysis.decision.inconclusive and registry.gate_state(candidate) == "quarantined"
    assert _no_data_alarm() == 0.0  # ended: the alarm clears


def test_a_challenger_whose_events_never_arrive_is_rolled_back_once_its_absence_cannot_be_chance(
    gate: DeployGate, settings: Settings, versions: tuple[str, str]
) -> None:
    rec, seen = run(gate, settings, CHAMPION, drop=lambda arm, _user: arm == "challenger", users=200)
    assert rec.state == "rolled_back" and rec.analysis is not None and rec.analysis.decision.why == "no_data"
    assert len(seen) <= 3  # 20 expected at 5% takes about 380 champion users: the second batch
    assert "expected from the champion's" in rec.analysis.decision.reason


def test_a_worse_challenger_is_rolled_back_within_its_first_step(
    gate: DeployGate, settings: Settings, registry: ModelRegistry, versions: tuple[str, str]
) -> None:
    champion, candidate = versions
    rec, _ = run(gate, settings, Behaviour(p_good=0.1))
    assert rec.state == "rolled_back" and rec.step == 0
    assert rec.analysis is not None and rec.analysis.decision.action == "rollback"
    split = gate.splits.get()
    assert split is not None and split.challenger_version is None and split.champion_version == champion
    assert registry.gate_state(candidate) == "quarantined"  # its served data leaves training
    assert any(c.by == CONTROLLER_ACTOR and c.state == "rolled_back" for c in registry.gate_history(candidate))


@pytest.mark.parametrize(
    ("challenger", "why"),
    [(Behaviour(latency_ms=100.0), {"guardrail"}), (Behaviour(p_good=0.15), {"guardrail", "worse"})],
    ids=["twice the latency", "much worse reward"],
)
def test_a_harmful_challenger_is_rolled_back_before_its_step_minimum(
    gate: DeployGate, settings: Settings, registry: ModelRegistry, versions: tuple[str, str],
    challenger: Behaviour, why: set[str],
) -> None:
    _, candidate = versions
    ramp = [RampStep(share=s, min_users=200, min_seconds=3600) for s in (0.05, 0.25, 0.5)]
    rec, _ = run(gate, settings, challenger, cfg=config(ramp=ramp), users=300, batches=20)
    assert rec.state == "rolled_back" and rec.step == 0 and rec.analysis is not None
    assert rec.analysis.decision.why in why, rec.analysis.decision.reason
    assert rec.analysis.arms["challenger"].users < 200  # the step's minimum was not waited for
    assert registry.gate_state(candidate) == "quarantined"  # shown harmful: its data leaves training at once


def test_a_better_challenger_is_promoted_after_the_whole_ramp(
    gate: DeployGate, settings: Settings, registry: ModelRegistry, versions: tuple[str, str]
) -> None:
    _, candidate = versions
    rec, seen = run(gate, settings, Behaviour(p_good=0.75))
    assert rec.state == "promoted", rec.timeline[-1]
    events = [t.event for t in rec.timeline]
    assert [e.split(":")[0] for e in events if e.startswith("ramp to")] == ["ramp to 5%", "ramp to 25%", "ramp to 50%"]
    assert events[-1].startswith(f"promoted {candidate}: significant win")
    assert all(r.analysis is None or r.analysis.decision.action != "promote" for r in seen[:-1])
    assert registry.alias("champion") == candidate and registry.gate_state(candidate) == "champion"
    assert rec.ramp[2].entered_at is not None and rec.ramp[2].left_at is not None
    diff = rec.analysis.difference if rec.analysis else None
    assert diff is not None and diff.sequential_ci[0] > 0 and diff.ci[0] >= diff.sequential_ci[0]


def test_a_sample_ratio_mismatch_freezes_the_ramp(
    gate: DeployGate, settings: Settings, versions: tuple[str, str]
) -> None:
    # Half of the challenger's users never reach the lake (a broken logging path on one arm).
    rec, _ = run(gate, settings, CHAMPION, drop=lambda arm, user: arm == "challenger" and user[-1] in "01234567")
    assert rec.state == "frozen"
    assert rec.analysis is not None and rec.analysis.srm.alarm and rec.analysis.srm.p_value < 0.001
    split = gate.splits.get()
    assert split is not None and split.state == "paused" and split.challenger_share in (0.05, 0.25)
    frozen_share = split.challenger_share
    # Frozen stays frozen within the maximum duration: time changes nothing until a person resumes ...
    controller = RolloutController(gate, config(), clock=lambda: datetime(2026, 12, 1, tzinfo=UTC))
    assert controller.tick().state == "frozen"
    after = gate.splits.get()
    assert after is not None and (after.state, after.challenger_share) == ("paused", frozen_share)
    # ... and every experiment ends: nobody resumed it by the maximum duration, so it is rolled back.
    controller = RolloutController(gate, config(), clock=lambda: datetime(2027, 1, 1, tzinfo=UTC))
    ended = controller.tick()
    assert ended.state == "rolled_back" and "frozen at the maximum duration" in ended.timeline[-1].event
    after = gate.splits.get()
    assert after is not None and after.challenger_version is None


def test_a_challenger_that_declines_where_users_reject_and_keeps_its_accepts_is_promoted(
    gate: DeployGate, settings: Settings, registry: ModelRegistry, versions: tuple[str, str]
) -> None:
    # Suggests 40% less, and what it drops is what users reject: accepts per generation hold
    # (0.6 x 0.85 against 0.5), the reward rises (no -0.25 for the rejects it no longer earns).
    _, candidate = versions
    rec, _ = run(gate, settings, Behaviour(p_good=0.85, shown=0.6))
    assert rec.state == "promoted", rec.timeline[-1]
    assert registry.alias("champion") == candidate
    assert rec.analysis is not None
    rails = {g.name: g for g in rec.analysis.guardrails}
    assert all(g.ok for g in rails.values())
    # Its declines are reported beside the guardrails, for information.
    shown, declined = rails["shown_rate"], rails["declined_rate"]
    assert shown.kind == declined.kind == "info"
    assert declined.champion == 0.0 and declined.challenger is not None and declined.challenger > 0.3
    assert shown.champion == 1.0 and shown.challenger is not None and shown.challenger < 0.7
    assert rails["accepted_rate"].kind == "reward_hacking"


def test_a_challenger_that_declines_and_loses_accepts_is_rolled_back_though_its_reward_is_higher(
    gate: DeployGate, settings: Settings, registry: ModelRegistry, versions: tuple[str, str]
) -> None:
    # Suggests 55% less: its reward per generation is higher (the rejects it drops cost more than
    # the accepts it loses earn under +0.75/-0.25), but users get fewer accepted suggestions
    # (0.45 x 0.85 against 0.5 per generation). That is reward hacking.
    _, candidate = versions
    rec, _ = run(gate, settings, Behaviour(p_good=0.85, shown=0.45))
    assert rec.state == "rolled_back" and rec.analysis is not None
    # Fewer shown suggestions also get fewer explicit thumbs up per generation: that guardrail may trip too,
    # depending on how the salt splits the users.
    tripped = rec.analysis.decision.reason.removeprefix("guardrail tripped: ").split(", ")
    assert rec.analysis.decision.reason.startswith("guardrail tripped: ") and "accepted_rate" in tripped
    assert set(tripped) <= {"accepted_rate", "explicit_up_rate"}, tripped
    assert rec.analysis.difference is not None and rec.analysis.difference.estimate > 0
    accepted = next(g for g in rec.analysis.guardrails if g.name == "accepted_rate")
    assert accepted.champion is not None and accepted.challenger is not None
    assert accepted.challenger < accepted.champion - 0.05
    assert registry.gate_state(candidate) == "quarantined"


@pytest.mark.parametrize(
    ("hacker", "tripped"),
    [
        # Keeps its accepts like the promoted decliner above, but where it suggests nothing it shows a
        # blank output instead of declining: a defect, or a reject dodged.
        (Behaviour(p_good=0.85, shown=0.6, blank=True), "empty_rate"),
        # Users undo much more of what it suggests.
        (Behaviour(p_good=0.5, undo=0.6), "undo_rate"),
    ],
)
def test_reward_hacking_trips_a_guardrail(
    gate: DeployGate, settings: Settings, versions: tuple[str, str], hacker: Behaviour, tripped: str
) -> None:
    rec, _ = run(gate, settings, hacker)
    assert rec.state == "rolled_back"
    assert rec.analysis is not None
    broken = {g.name for g in rec.analysis.guardrails if not g.ok}
    # A challenger that shows less also gets fewer explicit thumbs up per generation, which may trip as well.
    assert tripped in broken and broken <= {tripped, "explicit_up_rate"}, rec.analysis.decision.reason
    reason = rec.analysis.decision.reason
    assert reason.startswith("guardrail tripped: ")
    assert set(reason.removeprefix("guardrail tripped: ").split(", ")) == broken


def test_a_person_can_end_the_experiment_and_the_controller_records_it(
    gate: DeployGate, settings: Settings, versions: tuple[str, str]
) -> None:
    controller = RolloutController(gate, config(), clock=Clock())
    controller.tick()
    gate.rollback(by="ana", reason="looks wrong")
    rec = controller.tick()
    assert rec.state == "rolled_back" and rec.timeline[-1].by == "ana"
    assert controller.view().state == "rolled_back"


def test_the_controller_runs_as_a_process_with_the_ops_endpoints(
    gate: DeployGate, settings: Settings, versions: tuple[str, str]
) -> None:
    import threading

    import httpx

    from launcher.embedded import free_port

    port = free_port()
    stop = threading.Event()
    controller = RolloutController(gate, config(interval_s=0.2), clock=Clock())
    worker = threading.Thread(target=controller.run, args=(stop,), kwargs={"port": port}, daemon=True)
    worker.start()
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            stop.wait(0.1)
        assert httpx.get(f"{base}/healthz", timeout=1).status_code == 200
        ready = httpx.get(f"{base}/readyz", timeout=1).json()
        assert ready["status"] == "ready"
        for _ in range(100):
            if "flywheel_rollout_ticks_total" in (metrics := httpx.get(f"{base}/metrics", timeout=1).text):
                break
            stop.wait(0.1)
        assert "flywheel_rollout_ticks_total" in metrics
        split = gate.splits.get()
        assert split is not None and split.challenger_share == 0.05  # the process took the first ramp step
    finally:
        stop.set()
        worker.join(timeout=10)
