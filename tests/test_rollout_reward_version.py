"""The rollout decides on the reward versions it recorded at its start, each surface on its own.

Real registry, Redis and lake (`tests/conftest.py`); the controller's clock is a fake one. The reward
pointer is written as `flywheel signals activate` writes it (`flywheel.reward_versions.write_active`), and a
backfill is what `flywheel signals recompute` leaves in the lake: rows of another version, stamped later.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest

from deploy_gate.gate import DeployGate
from deploy_gate.rollout import RampStep, RolloutConfig, RolloutController
from deploy_gate.rollout.api import get_series
from deploy_gate.rollout.models import AnalysisView
from flywheel.connections import redis_client
from flywheel.contract import TrafficSplit
from flywheel.lake.tables import REWARDS
from flywheel.reward_versions import write_active
from flywheel.settings import Settings
from model_registry import ModelRegistry
from tests.helpers import register
from tests.rollout_sim import Behaviour, write_batch

# Repeatable: the users' ids come from the test's rng, and the experiment's salt (which splits them
# between arms) from `seeded_ids`.
pytestmark = pytest.mark.usefixtures("seeded_ids")

T0 = datetime(2026, 11, 25, 10, 0, tzinfo=UTC)
POINTER = {"code-completion": "rules-v1", "chat": "chat-rules-v1"}


@pytest.fixture
def gate(settings: Settings, tmp_path: Path) -> DeployGate:
    registry = ModelRegistry(settings)
    gate = DeployGate(registry, redis_client(settings), settings)
    champion = register(registry, tmp_path)
    registry.set_gate_state(champion, "champion", by="bootstrap", reason="first model")
    registry.set_alias("champion", champion)
    candidate = register(registry, tmp_path, parent=champion)
    gate.approve(candidate, by="ana", reason="offline gates pass")
    return gate


def _config() -> RolloutConfig:
    # One step at half the users, with a day's minimum time: the looks below decide nothing by themselves,
    # so the analysis is all that can change between them.
    return RolloutConfig(ramp=[RampStep(share=0.5, min_users=40, min_seconds=86400)], srm_min_users=100,
                         latency_min_generations=50)  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


def _seen(analysis: AnalysisView | None) -> dict[str, object]:
    assert analysis is not None
    return analysis.model_dump(exclude={"decision": {"reason"}})


def _backfill(settings: Settings, version: str, at: datetime) -> int:
    """Every current reward again under `version`, the arms' order reversed, emitted at `at` (after all others)."""
    rewards = REWARDS.scan(REWARDS.at(settings.lake_root))
    assert rewards is not None
    df = rewards.collect().with_columns(
        pl.lit(version).alias("reward_version"),
        pl.when(pl.col("arm") == "challenger").then(-1.0).otherwise(1.0).alias("reward"),
        pl.lit(at).cast(pl.Datetime("us", "UTC")).alias("emitted_at"),
    )
    REWARDS.write(REWARDS.at(settings.lake_root), df, f"backfill-{version}")
    return df.height


def test_a_backfill_of_an_unactivated_reward_changes_nothing_and_its_activation_is_said(
    gate: DeployGate, settings: Settings
) -> None:
    write_active(settings.lake_root, POINTER)
    clock = Clock()
    controller = RolloutController(gate, _config(), clock=clock)
    assert controller.tick().reward.decides_on == POINTER  # recorded at the start
    rng = random.Random(7)
    for _ in range(3):
        split = gate.splits.get()
        assert split is not None
        write_batch(settings, split, {"champion": Behaviour(p_good=0.5), "challenger": Behaviour(p_good=0.75)},
                    users=200, at=clock.now, rng=rng)  # fmt: skip
        clock.now += timedelta(seconds=120)
        before = controller.tick()
    assert before.state == "ramping" and before.analysis is not None
    assert before.analysis.reward_version == "chat-rules-v1,rules-v1"
    assert before.analysis.arms["challenger"].mean > before.analysis.arms["champion"].mean  # type: ignore[operator]
    chart = get_series(gate, _config(), "1h")  # the dashboard's chart of the same experiment
    assert chart.buckets

    # A recompute of a version nobody activated, whose rows are the newest and rank the arms the other way.
    assert _backfill(settings, "rules-v2", clock.now + timedelta(hours=1)) > 0
    after = controller.tick()
    assert _seen(after.analysis) == _seen(before.analysis)
    assert after.analysis is not None and after.analysis.decision.reason == before.analysis.decision.reason
    assert [t.event for t in after.timeline] == [t.event for t in before.timeline]  # nothing to say
    assert get_series(gate, _config(), "1h") == chart

    # Activating it is said on the dashboard's experiment view and in the reason, and still not switched in.
    write_active(settings.lake_root, {**POINTER, "code-completion": "rules-v2"})
    clock.now += timedelta(seconds=60)
    activated = controller.tick()
    assert activated.analysis is not None
    assert _seen(activated.analysis)["arms"] == _seen(before.analysis)["arms"]
    assert activated.analysis.decision.action == before.analysis.decision.action
    assert "rules-v2" in activated.analysis.decision.reason and "next experiment" in activated.analysis.decision.reason
    view = controller.view()
    said = [t.event for t in view.timeline if "rules-v2" in t.event]
    assert len(said) == 1 and said[0].startswith("reward rules-v2 activated for code-completion")
    assert view.analysis is not None and "rules-v2" in view.analysis.decision.reason
    assert get_series(gate, _config(), "1h") == chart  # the chart keeps the experiment's version too
    controller.tick()  # said once on the timeline, in the reason at every look
    assert [t.event for t in controller.view().timeline if "rules-v2" in t.event] == said


def _two_surfaces(settings: Settings, split: TrafficSplit, users: int, rng: random.Random) -> dict[str, float]:
    """Each user: one code-completion and one chat generation, rewarded under the active and an inactive
    version of their surface (the inactive one written later); returns the mean active reward per arm."""
    rows, active = [], {"champion": [0.0, 0], "challenger": [0.0, 0]}
    base = {"champion": {"rules-v1": 0.1, "chat-v2": 0.5}, "challenger": {"rules-v1": 0.3, "chat-v2": 0.2}}
    for i in range(users):
        user = f"user-{i:04d}"
        arm = split.arm_for(user)
        for j, (current, stale) in enumerate((("rules-v1", "rules-v0"), ("chat-v2", "chat-v1"))):
            gid = f"gen-{i}-{j}"
            reward = base[arm][current] + rng.uniform(-0.1, 0.1)
            active[arm][0] += reward
            active[arm][1] += 1
            for version, value, emitted in ((current, reward, T0), (stale, -1.0, T0 + timedelta(hours=1))):
                rows.append({"generation_id": gid, "reward_version": version, "revision": 0, "reward": value,
                             "confidence": 1.0, "label_source": "implicit", "signals": json.dumps({"shown": 1.0}),
                             "user_id": user, "model_version": split.version_for(arm), "arm": arm,
                             "experiment": split.experiment, "window_start": T0 + timedelta(seconds=j),
                             "window_end": T0, "late_events": 0, "emitted_at": emitted})  # fmt: skip
    REWARDS.write(REWARDS.at(settings.lake_root), pl.DataFrame(rows, schema=REWARDS.schema), "two-surfaces")
    return {arm: total / n for arm, (total, n) in active.items()}


def test_two_surfaces_served_at_once_are_each_read_on_their_active_version(
    gate: DeployGate, settings: Settings
) -> None:
    write_active(settings.lake_root, {"code-completion": "rules-v1", "chat": "chat-v2"})
    clock = Clock()
    controller = RolloutController(gate, _config(), clock=clock)
    controller.tick()
    split = gate.splits.get()
    assert split is not None and split.challenger_share == 0.5
    expected = _two_surfaces(settings, split, 300, random.Random(3))
    clock.now += timedelta(seconds=120)
    rec = controller.tick()
    assert rec.analysis is not None and rec.analysis.reward_version == "chat-v2,rules-v1"
    for arm, mean in expected.items():
        assert rec.analysis.arms[arm].mean == pytest.approx(mean, abs=1e-9), arm
