"""`flywheel gate`: plan shown, then applied only when confirmed; refusals exit non-zero."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deploy_gate.audit import AuditLog
from deploy_gate.cli import app
from flywheel.connections import redis_client
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from model_registry import ModelRegistry
from tests.helpers import cli_settings, offline_gates_passed, register


@pytest.fixture
def env_settings(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    """The CLI reads its settings from the environment, as a user's shell would give them."""
    yield from cli_settings(settings, monkeypatch)





def test_approve_shows_the_plan_and_applies_only_when_confirmed(
    env_settings: Settings, tmp_path: Path
) -> None:
    registry = ModelRegistry(env_settings)
    champion = register(registry, tmp_path)
    registry.set_alias("champion", champion)
    candidate = register(registry, tmp_path)
    offline_gates_passed(env_settings, registry, candidate, champion)
    splits = TrafficSplitStore(redis_client(env_settings), env_settings)
    runner = CliRunner()

    declined = runner.invoke(app, ["approve", candidate, "--by", "ana", "--reason", "ok"], input="n\n")
    assert declined.exit_code == 1
    assert "Plan: approve" in declined.output and "becomes the challenger" in declined.output
    assert "Nothing changed" in declined.output
    assert registry.gate_state(candidate) == "pending" and splits.get() is None

    done = runner.invoke(app, ["approve", candidate, "--by", "ana", "--reason", "ok", "--yes"])
    assert done.exit_code == 0, done.output
    assert registry.gate_state(candidate) == "approved"
    assert splits.get().challenger_version == candidate  # type: ignore[union-attr]

    again = runner.invoke(app, ["approve", candidate, "--by", "ana", "--reason", "ok", "--yes"])
    assert again.exit_code == 1 and "only a pending candidate" in again.output

    status = runner.invoke(app, ["status"])
    assert status.exit_code == 0 and "running" in status.output

    back = runner.invoke(app, ["rollback", "--by", "oncall", "--reason", "guardrail", "--yes"])
    assert back.exit_code == 0, back.output
    assert splits.get().challenger_share == 0.0  # type: ignore[union-attr]

    # Every attempt is audited (the declined plan asked nothing of the gate, so it is not).
    entries = AuditLog.from_settings(env_settings).entries()
    assert [(e.action, e.who, e.role, e.allowed) for e in entries] == [
        ("rollback", "oncall (local CLI)", "operator", True),
        ("approve", "ana (local CLI)", "operator", False),
        ("approve", "ana (local CLI)", "operator", True),
    ]
    assert "not_pending" in entries[1].detail
    assert entries[2].before["gate_state"] == "pending" and entries[2].after["gate_state"] == "approved"
    shown = runner.invoke(app, ["audit", "--limit", "2"])
    assert shown.exit_code == 0 and "oncall (local CLI)" in shown.output and "refused" in shown.output


def test_tokens_are_issued_once_listed_without_their_value_and_revoked(env_settings: Settings) -> None:
    from flywheel.identity import Authenticator, NotAuthenticated, TokenStore

    runner = CliRunner()
    issued = runner.invoke(app, ["tokens", "issue", "--name", "alice", "--role", "approver"])
    assert issued.exit_code == 0, issued.output
    token = issued.output.strip().splitlines()[-1]
    assert len(token) >= 40
    auth = Authenticator(env_settings, TokenStore.from_settings(env_settings))
    assert auth.require(f"Bearer {token}", "approver").name == "alice"

    twice = runner.invoke(app, ["tokens", "issue", "--name", "alice"])
    assert twice.exit_code == 1 and "already has an active token" in twice.output
    bad_role = runner.invoke(app, ["tokens", "issue", "--name", "bob", "--role", "root"])
    assert bad_role.exit_code == 1 and "unknown role" in bad_role.output

    listed = runner.invoke(app, ["tokens", "list"])
    assert listed.exit_code == 0 and "alice" in listed.output and "approver" in listed.output
    assert token not in listed.output
    raw = (env_settings.data_dir / "tokens.db").read_bytes()
    assert token.encode() not in raw  # only the hash is stored

    revoked = runner.invoke(app, ["tokens", "revoke", "alice"])
    assert revoked.exit_code == 0, revoked.output
    with pytest.raises(NotAuthenticated):
        auth.require(f"Bearer {token}", "viewer")
    assert runner.invoke(app, ["tokens", "revoke", "alice"]).exit_code == 1
    # A revoked name can be given a new token.
    assert runner.invoke(app, ["tokens", "issue", "--name", "alice"]).exit_code == 0
    audited = [(e.action, e.target, e.allowed) for e in AuditLog.from_settings(env_settings).entries()]
    assert audited[::-1] == [
        ("issue token", "token of alice", True),
        ("issue token", "token of alice", False),
        ("issue token", "token of bob", False),
        ("revoke token", "token of alice", True),
        ("revoke token", "token of alice", False),
        ("issue token", "token of alice", True),
    ]
    assert all(token not in repr(e) for e in AuditLog.from_settings(env_settings).entries())


def test_the_cli_records_its_local_operator(env_settings: Settings, tmp_path: Path) -> None:
    registry = ModelRegistry(env_settings)
    champion = register(registry, tmp_path)
    registry.set_alias("champion", champion)
    candidate = register(registry, tmp_path)
    offline_gates_passed(env_settings, registry, candidate, champion)
    done = CliRunner().invoke(app, ["approve", candidate, "--by", "ana", "--reason", "ok", "--yes"])
    assert done.exit_code == 0, done.output
    assert registry.gate_history(candidate)[-1].by == "ana (local CLI)"
