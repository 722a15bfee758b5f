"""SRM against the shares actually in force: a manual ramp, a failed first ramp, a freeze and a resume.

Real registry (MLflow on SQLite), real Redis, a real lake; users routed by the split in Redis as
serving routes them (`tests/rollout_sim.py`). The controller's clock is a fake one.
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from deploy_gate.errors import GateError
from deploy_gate.gate import DeployGate
from deploy_gate.rollout import RolloutController
from deploy_gate.rollout.controller import ExperimentRecord
from flywheel.settings import Settings
from tests.rollout_sim import Drop, write_batch
from tests.test_rollout import CHAMPION, Clock, config, gate, registry, versions  # noqa: F401 - fixtures

# Repeatable: the users' ids come from the test's rng, and the experiment's salt (which splits them
# between arms) from `seeded_ids`.
pytestmark = pytest.mark.usefixtures("seeded_ids")


def _feed(
    controller: RolloutController,
    gate: DeployGate,  # noqa: F811
    settings: Settings,
    clock: Clock,
    batches: int,
    *,
    rng: random.Random,
    drop: Drop | None = None,
) -> ExperimentRecord:
    rec = controller.record()
    for _ in range(batches):
        split = gate.splits.get()
        assert split is not None
        write_batch(settings, split, {"champion": CHAMPION, "challenger": CHAMPION, "holdout": CHAMPION},
                    users=400, at=clock.now, rng=rng, drop=drop)  # fmt: skip
        clock.now += timedelta(seconds=60)
        rec = controller.tick()
    return rec


def test_a_manual_ramp_is_tested_against_the_share_a_person_set(
    gate: DeployGate, settings: Settings, versions: tuple[str, str]  # noqa: F811
) -> None:
    clock = Clock()
    controller = RolloutController(gate, config(), clock=clock)
    rng = random.Random(1)
    _feed(controller, gate, settings, clock, 1, rng=rng)
    gate.apply(gate.plan_ramp(0.4, by="ana", reason="more traffic for the test"))
    rec = _feed(controller, gate, settings, clock, 3, rng=rng)  # within the step's minimum time: no ramp
    assert rec.state == "ramping", rec.timeline[-1]
    assert [round(p.share, 2) for p in rec.srm_periods][-1] == 0.4
    assert rec.analysis is not None and rec.analysis.srm.expected_shares == pytest.approx([0.6, 0.4])
    assert not rec.analysis.srm.alarm and rec.analysis.srm.periods == len(rec.srm_periods)


def test_a_failed_first_ramp_is_tested_against_the_share_left_in_force(
    gate: DeployGate, settings: Settings, versions: tuple[str, str], monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    # The gate refuses the controller's first ramp (to 5%): a person changed the split meanwhile, or
    # Redis's lock timed out. Simulated by refusing the apply once: that refusal cannot be provoked here
    # without racing two processes.
    real_apply = gate.apply
    calls = {"n": 0}

    def refuse_once(plan, **kw):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise GateError("busy: another change is being applied")
        return real_apply(plan, **kw)

    monkeypatch.setattr(gate, "apply", refuse_once)
    clock = Clock()
    controller = RolloutController(gate, config(), clock=clock)
    rec = _feed(controller, gate, settings, clock, 4, rng=random.Random(2))  # within the minimum time
    split = gate.splits.get()
    assert split is not None and split.challenger_share == pytest.approx(settings.challenger_share)
    assert rec.state == "ramping", rec.timeline[-1]
    assert rec.analysis is not None
    assert rec.analysis.srm.expected_shares == pytest.approx([1 - settings.challenger_share, settings.challenger_share])
    assert not rec.analysis.srm.alarm


def test_after_a_freeze_and_a_resume_the_srm_test_starts_afresh(
    gate: DeployGate, settings: Settings, versions: tuple[str, str]  # noqa: F811
) -> None:
    clock = Clock()
    controller = RolloutController(gate, config(), clock=clock)
    rng = random.Random(3)
    broken: Drop = lambda arm, user: arm == "challenger" and user[-1] in "01234567"  # noqa: E731
    rec = _feed(controller, gate, settings, clock, 12, rng=rng, drop=broken)
    assert rec.state == "frozen" and rec.analysis is not None and rec.analysis.srm.alarm
    split = gate.splits.get()
    assert split is not None and split.state == "paused"
    # Someone fixes the logging path and resumes at the same share.
    gate.apply(gate.plan_ramp(split.challenger_share, by="ana", reason="logging fixed"))
    rec = _feed(controller, gate, settings, clock, 4, rng=rng)
    assert rec.state == "ramping", rec.timeline[-1]
    assert rec.timeline[-1].event.startswith(("resumed", "ramp to")) or "frozen" not in rec.timeline[-1].event
    assert len(rec.srm_periods) >= 1 and rec.srm_periods[0].since > rec.started_at  # type: ignore[operator]
    assert rec.analysis is not None and not rec.analysis.srm.alarm
