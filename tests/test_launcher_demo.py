"""The demo's overrides (`launcher.demo.DEMO`): typed, checked on load, and rendered to the components'
environment in one place, which the components read back as the values the demo meant."""

from __future__ import annotations

import os

import pytest

from deploy_gate.rollout.config import RolloutConfig
from launcher.demo import DEMO, DemoOverrides
from trainer.config import TrainerConfig


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("FLYWHEEL_"):
            monkeypatch.delenv(name)


def test_the_rendered_environment_reads_back_as_the_demos_values(monkeypatch: pytest.MonkeyPatch) -> None:
    env = DEMO.environment({})
    assert env["FLYWHEEL_TRAINER_LEARNING_RATE"] == "0.0001"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert TrainerConfig().to_dict() == TrainerConfig.model_validate(DEMO.trainer).to_dict()
    rollout = RolloutConfig(metrics_port=0)
    assert rollout.ramp == DEMO.rollout["ramp"] and rollout.max_duration_s == DEMO.rollout["max_duration_s"]
    assert rollout.planned_change == DEMO.rollout["planned_change"]


def test_the_environment_wins_and_a_trainer_file_replaces_the_demos_trainer() -> None:
    env = DEMO.environment({"FLYWHEEL_ROLLOUT_TUNING_N": "5", "FLYWHEEL_TRAINER_EPOCHS": "2"})
    assert "FLYWHEEL_ROLLOUT_TUNING_N" not in env and "FLYWHEEL_TRAINER_EPOCHS" not in env
    assert "FLYWHEEL_TRAINER_LEARNING_RATE" in env
    assert not any(k.startswith("FLYWHEEL_TRAINER_") for k in DEMO.environment({}, trainer=False))
    assert DEMO.of("Settings", {"FLYWHEEL_REWARD_WINDOW_S": "30"}) == {}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"trainer": {"clip_eps": 3}}, r"TrainerConfig\.clip_eps=3: Input should be less than 1"),
        ({"trainer": {"lr": 1e-4}}, r"not fields of TrainerConfig: \['lr'\]"),
        ({"trainer": {"text_generations": True}}, "text_generations=True with objective='pg'"),
        ({"rollout": {"alpha": 0.9}}, r"RolloutConfig\.alpha=0\.9"),
    ],
)
def test_a_bad_override_fails_on_load_naming_it(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DemoOverrides(**overrides)
