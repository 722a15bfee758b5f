"""`flywheel config show` and `flywheel config check`, through the real `flywheel` command (nothing started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from launcher.cli import app


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what each test sets: the shell's own FLYWHEEL_* variables would otherwise be in force."""
    for name in list(os.environ):
        if name.upper().startswith("FLYWHEEL_"):
            monkeypatch.delenv(name)


def _flywheel(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["config", *args])
    return result.exit_code, result.output


def test_check_passes_the_defaults_and_refuses_a_bad_value_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    code, out = _flywheel("check")
    assert code == 0 and out.startswith("ok: Settings, SignalsConfig, RolloutConfig, TrainerConfig"), out

    monkeypatch.setenv("FLYWHEEL_ROLLOUT_ALPHA", "0.7")  # above its bound
    monkeypatch.setenv("FLYWHEEL_ROLLOUT_INTERVAL_S", "-1")  # bad too, but not the first
    code, out = _flywheel("check")
    assert code == 1 and "bad setting FLYWHEEL_ROLLOUT_ALPHA (RolloutConfig)" in out, out
    assert "INTERVAL_S" not in out
    assert _flywheel("check", "--component", "settings")[0] == 0  # only the object asked about

    monkeypatch.delenv("FLYWHEEL_ROLLOUT_ALPHA")
    monkeypatch.delenv("FLYWHEEL_ROLLOUT_INTERVAL_S")
    monkeypatch.setenv("FLYWHEEL_ROLLOUT_SHOWN_RATE_FALL", "0.2")  # a retired name: refused, and said
    code, out = _flywheel("check")
    assert code == 1 and "FLYWHEEL_ROLLOUT_SHOWN_RATE_FALL" in out, out

    monkeypatch.delenv("FLYWHEEL_ROLLOUT_SHOWN_RATE_FALL")
    monkeypatch.setenv("FLYWHEEL_ROLLOUT_RAMP", json.dumps([{"share": 0.5}]))  # a step without its minimums
    code, out = _flywheel("check")
    assert code == 1 and "bad setting FLYWHEEL_ROLLOUT_RAMP (RolloutConfig): 0.min_users" in out, out


def test_check_refuses_a_bad_trainer_file_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "trainer.json"
    bad.write_text(json.dumps({"epochs": 2, "clip_eps": 2.0}))
    code, out = _flywheel("check", "--trainer-config", str(bad))
    assert code == 1 and "bad setting clip_eps (TrainerConfig)" in out, out
    bad.write_text(json.dumps({"epocs": 2}))
    code, out = _flywheel("check", "--component", "trainer", "--trainer-config", str(bad))
    assert code == 1 and "epocs" in out, out


def test_trainer_settings_come_from_the_environment_under_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FLYWHEEL_TRAINER_LEARNING_RATE", "0.0003")
    monkeypatch.setenv("FLYWHEEL_TRAINER_EPOCHS", "2")
    trainer = tmp_path / "trainer.json"
    trainer.write_text(json.dumps({"epochs": 3}))  # the file wins over the environment
    code, out = _flywheel("show", "--component", "trainer", "--trainer-config", str(trainer))
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert code == 0, out
    assert rows["FLYWHEEL_TRAINER_LEARNING_RATE"] == ["0.0003", "[environment]"]
    assert rows["FLYWHEEL_TRAINER_EPOCHS"] == ["3", "[file", f"{trainer}]"]
    assert rows["FLYWHEEL_TRAINER_KTO_BETA"] == ["0.1", "[default]"]

    monkeypatch.setenv("FLYWHEEL_TRAINER_KTO_BETA", "0")  # a bound of the KTO part
    code, out = _flywheel("check", "--component", "trainer")
    assert code == 1 and "bad setting FLYWHEEL_TRAINER_KTO_BETA (TrainerConfig): Input should be greater than 0" in out
    monkeypatch.delenv("FLYWHEEL_TRAINER_KTO_BETA")
    monkeypatch.setenv("FLYWHEEL_OFFLINE_LM_MARGIN", "0.5")  # above lm_reference_margin: a cross-field check
    code, out = _flywheel("check", "--component", "offline")
    assert code == 1 and "lm_reference_margin" in out and "OfflineGateConfig" in out, out


def test_show_with_demo_names_what_flywheel_up_sets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLYWHEEL_ROLLOUT_INTERVAL_S", "12")  # the environment wins over the demo
    code, out = _flywheel("show", "--demo")
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert code == 0, out
    assert rows["FLYWHEEL_TRAINER_LEARNING_RATE"] == ["0.0001", "[demo]"]
    assert rows["FLYWHEEL_ROLLOUT_MAX_DURATION_S"] == ["1800.0", "[demo]"]
    assert rows["FLYWHEEL_ROLLOUT_INTERVAL_S"] == ["12.0", "[environment]"]
    assert rows["FLYWHEEL_TRAINER_KL_COEF"][-1] == "[default]"
    assert rows["FLYWHEEL_REWARD_WINDOW_S"] == ["60.0", "[demo]"]
    assert _flywheel("check", "--demo")[0] == 0

    trainer = tmp_path / "trainer.json"  # a trainer file replaces the demo's trainer fields
    trainer.write_text(json.dumps({"epochs": 3}))
    code, out = _flywheel("show", "--demo", "--component", "trainer", "--trainer-config", str(trainer))
    assert code == 0 and "[demo]" not in out, out


def test_show_names_each_values_source_and_hides_secrets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FLYWHEEL_ROLLOUT_INTERVAL_S", "12")
    monkeypatch.setenv("FLYWHEEL_REDIS_URL", "redis://:hunter2@127.0.0.1:6390/0")
    monkeypatch.setenv("FLYWHEEL_APPROVAL_TOKEN", "a-long-and-private-approval-token")
    trainer = tmp_path / "trainer.json"
    trainer.write_text(json.dumps({"epochs": 3}))
    code, out = _flywheel("show", "--trainer-config", str(trainer))
    assert code == 0, out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert rows["FLYWHEEL_ROLLOUT_INTERVAL_S"][1:] == ["12.0", "[environment]"]
    assert rows["FLYWHEEL_ROLLOUT_ALPHA"][-1] == "[default]"
    assert rows["FLYWHEEL_TRAINER_EPOCHS"][1:] == ["3", "[file", f"{trainer}]"]
    assert rows["FLYWHEEL_TRAINER_LEARNING_RATE"][-1] == "[default]"
    assert rows["FLYWHEEL_OFFLINE_MAX_KL"][1:] == ["0.1", "[default]"]
    assert rows["FLYWHEEL_REDIS_URL"][1:] == ["redis://:***@127.0.0.1:6390/0", "[environment]"]
    assert "hunter2" not in out and "a-long-and-private-approval-token" not in out
    assert {"Settings:", "SignalsConfig:", "RolloutConfig:", "TrainerConfig:", "OfflineGateConfig:"} <= set(
        out.splitlines()
    )

    code, out = _flywheel("show", "--component", "rollout")
    assert code == 0 and out.splitlines()[0] == "RolloutConfig:" and "TrainerConfig:" not in out
    code, out = _flywheel("show", "--component", "nope")
    assert code == 2 and "nope" in out  # a usage error, naming what was asked for


def test_the_flywheel_command_imports_only_the_component_it_runs() -> None:
    """`flywheel gate plan` needs deploy_gate.cli, not torch through the trainer's and serving's: the command
    imports the named component alone, and the others are listed in the help but never run."""
    from launcher.cli import _needed

    assert _needed(["/venv/bin/flywheel", "-v", "gate", "plan", "--users-per-day", "9"]) == {"gate"}
    assert _needed(["/venv/bin/flywheel", "--help"]) == set() and _needed(["/venv/bin/flywheel", "up"]) == {"up"}
    assert _needed(["/repo/launcher/__main__.py", "ingest", "worker"]) == {"ingest"}  # as `flywheel up` starts it
    assert _needed(["/venv/bin/pytest", "tests"]) is None  # a CliRunner's app mounts every component
    out = subprocess.run([str(Path(sys.executable).parent / "flywheel"), "ingest", "--help"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0 and "worker" in out.stdout, out.stderr
