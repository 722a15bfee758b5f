"""`flywheel gate ramp|rollout|experiment|unquarantine|holdout`: plan shown, applied when confirmed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy_gate.cli import app
from flywheel.connections import redis_client
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from model_registry import ModelRegistry
from tests.helpers import cli_settings, offline_gates_passed, register


@pytest.fixture
def env_settings(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    """The CLI reads its settings from the environment, as a user's shell would give them."""
    ramp = json.dumps([{"share": 0.1, "min_users": 5, "min_seconds": 0}])
    yield from cli_settings(settings, monkeypatch, {"FLYWHEEL_ROLLOUT_RAMP": ramp})




def test_rollout_commands(env_settings: Settings, tmp_path: Path) -> None:
    registry = ModelRegistry(env_settings)
    champion = register(registry, tmp_path)
    registry.set_alias("champion", champion)
    candidate = register(registry, tmp_path)
    splits = TrafficSplitStore(redis_client(env_settings), env_settings)
    runner = CliRunner()
    ok = ["--by", "ana", "--reason", "test", "--yes"]
    offline_gates_passed(env_settings, registry, candidate, champion)
    assert runner.invoke(app, ["approve", candidate, *ok]).exit_code == 0

    once = runner.invoke(app, ["rollout", "--once"])
    assert once.exit_code == 0, once.output
    assert json.loads(once.stdout)["state"] == "ramping"
    assert splits.get().challenger_share == 0.1  # type: ignore[union-attr]

    frozen = runner.invoke(app, ["ramp", "0.1", "--freeze", *ok])
    assert frozen.exit_code == 0 and "freeze at 10%" in frozen.output
    assert splits.get().state == "paused"  # type: ignore[union-attr]
    shown = json.loads(runner.invoke(app, ["experiment"]).stdout)
    assert (shown["challenger"], shown["share"]) == (candidate, 0.1)

    bad = runner.invoke(app, ["ramp", "1.5", *ok])
    assert bad.exit_code == 1 and "a ramp share must be in (0, 1]" in bad.output

    assert runner.invoke(app, ["rollback", *ok]).exit_code == 0
    assert registry.gate_state(candidate) == "quarantined"
    lifted = runner.invoke(app, ["unquarantine", candidate, *ok])
    assert lifted.exit_code == 0, lifted.output
    assert registry.gate_state(candidate) == "rolled_back"
    again = runner.invoke(app, ["unquarantine", candidate, *ok])
    assert again.exit_code == 1 and "not quarantined" in again.output

    held = runner.invoke(app, ["holdout", champion, "--share", "0.05", *ok])
    assert held.exit_code == 0, held.output
    split = splits.get()
    assert split is not None and (split.holdout_version, split.holdout_share) == (champion, 0.05)


def test_plan_says_how_long_each_ramp_step_needs_and_fails_when_the_ramp_does_not_fit() -> None:
    runner = CliRunner()
    fits = runner.invoke(app, ["plan", "--users-per-day", "143", "--accept-rate", "0.3", "--per-user-sd", "0.43"])
    assert fits.exit_code == 0, fits.output
    # 30 challenger users at 5% of 143 a day: about 4.2 days for the first step; 2,000 users by day 14.
    assert "step 1: 5% of users, from day 0.0: 30 challenger users" in fits.output and "-> 4.2 days" in fits.output
    assert "fits" in fits.output and "decision rule: expected_loss" in fits.output
    assert "promoted at the end if worse by the margin" in fits.output
    small = runner.invoke(app, ["plan", "--users-per-day", "20", "--per-user-sd", "0.43"])
    assert small.exit_code == 1 and "does NOT fit" in small.output
