"""`flywheel up --users 0` with an outside client, shortened: the demo's rollout configuration for 45 minutes.

The controller runs with the configuration `flywheel up` gives it (`launcher.demo.DEMO`, rendered to the
environment as `flywheel up` renders it, read as the launched process reads it), real Redis, registry and
lake. An outside client's users (a few a minute, each with a handful of generations) send feedback that never
changes between arms. The controller's clock is a fake one stepped by three of the demo's ticks (30 s) for
32 minutes (just past one maximum duration: this traffic never reaches the planned size), so the test takes
seconds; each time an experiment ends a new candidate is approved, as the demo's auto-approval does. Not one
promotion as a win and not one guardrail rollback. (The seeded "demo, 40 users" case of
tests/test_rollout_decisions.py runs the same rules over 200 experiments.)
"""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path

import pytest

from deploy_gate.gate import DeployGate
from deploy_gate.rollout import RolloutConfig, RolloutController
from flywheel.settings import Settings
from model_registry import ModelRegistry
from tests.helpers import register
from tests.rollout_sim import Behaviour, write_batch
from tests.test_rollout import Clock, gate, registry, versions  # noqa: F401 - fixtures

# Repeatable: the users' ids come from the test's rng, and the experiment's salt (which splits them
# between arms) from `seeded_ids`.
pytestmark = pytest.mark.usefixtures("seeded_ids")

SAME = Behaviour(p_good=0.35, shown=0.85)


def test_the_demo_never_promotes_an_equal_challenger_as_a_win_nor_rolls_it_back_on_a_guardrail(
    gate: DeployGate,  # noqa: F811
    registry: ModelRegistry,  # noqa: F811
    settings: Settings,
    versions: tuple[str, str],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from launcher.demo import DEMO
    from launcher.up import rollout_line

    for k, v in DEMO.environment({}, trainer=False).items():
        monkeypatch.setenv(k, v)
    cfg = RolloutConfig(metrics_port=0)
    clock = Clock()
    controller = RolloutController(gate, cfg, clock=clock)
    rng = random.Random(31)
    ended: list[str] = []
    assert cfg.max_duration_s <= 30 * 60
    step = 3 * cfg.interval_s
    for _ in range(int(32 * 60 / step)):
        split = gate.splits.get()
        assert split is not None
        # about 2 new outside users a minute, 5 generations each
        write_batch(settings, split, {"champion": SAME, "challenger": SAME, "holdout": SAME}, users=1,
                    at=clock.now, rng=rng, generations=5)  # fmt: skip
        clock.now += timedelta(seconds=step)
        rec = controller.tick()
        if rec.state in ("promoted", "rolled_back"):
            ended.append(next(e.event for e in reversed(rec.timeline) if e.event.startswith(("promoted", "rolled"))))
            # Nothing showed it harmful: what it served stays eligible for training.
            assert rec.challenger is not None and registry.gate_state(rec.challenger) == "rolled_back"
            # and the registry's reason (what `flywheel registry list` shows) still says why it was rolled back
            assert "(rolled back: inconclusive at " in registry.gate_history(rec.challenger)[-1].reason
            champion = registry.alias("champion")
            ended_challenger = rec.challenger
            gate.approve(register(registry, tmp_path, parent=champion), by="demo", reason="auto-approve")
            # The console's rollout line names the experiment's own challenger, not the split's next one.
            line = rollout_line(gate)
            assert gate.splits.get().challenger_version != ended_challenger, line
            assert line.startswith(f"v{ended_challenger} {rec.state} at "), line
    assert ended, f"no experiment ended in 32 minutes: the maximum duration is {cfg.max_duration_s:g} s"
    assert not [e for e in ended if "significant win" in e or "guardrail" in e], ended
    assert all("inconclusive" in e for e in ended), ended
