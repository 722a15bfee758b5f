"""Roles and the audit log: who may act, and every attempt recorded (real registry, Redis, token store)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from deploy_gate.app import create_app
from deploy_gate.audit import POLICY_ACTOR, AuditLog
from deploy_gate.gate import DeployGate
from deploy_gate.policy import AutoApprove
from flywheel.connections import redis_client
from flywheel.identity import BOOTSTRAP_NAME, TokenStore
from flywheel.settings import Settings
from model_registry import ModelRegistry
from tests.helpers import register

TOKEN = "bootstrap-admin-token-for-the-audit-tests"
WHY = {"reason": "offline checks pass"}


@pytest.fixture
def gate_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"approval_token": SecretStr(TOKEN)})


@pytest.fixture
def tokens(gate_settings: Settings) -> dict[str, str]:
    store = TokenStore.from_settings(gate_settings)
    issued = {name: store.issue(name, role) for name, role in
              (("alice", "approver"), ("victor", "viewer"), ("rita", "approver"))}  # fmt: skip
    store.revoke("rita")
    return issued


@pytest.fixture
def registry(gate_settings: Settings) -> ModelRegistry:
    return ModelRegistry(gate_settings)


@pytest.fixture
def versions(registry: ModelRegistry, tmp_path: Path) -> tuple[str, str]:
    champion = register(registry, tmp_path)
    registry.set_gate_state(champion, "champion", by="bootstrap", reason="first model")
    registry.set_alias("champion", champion)
    return champion, register(registry, tmp_path, parent=champion)


@pytest.fixture
def gate(registry: ModelRegistry, gate_settings: Settings) -> DeployGate:
    return DeployGate(registry, redis_client(gate_settings), gate_settings)


@pytest.fixture
def client(gate: DeployGate, gate_settings: Settings, versions: tuple[str, str]) -> Iterator[TestClient]:
    with TestClient(create_app(gate_settings, gate=gate)) as c:
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_no_viewer_or_revoked_token_is_refused_and_each_refusal_is_audited(
    client: TestClient, registry: ModelRegistry, versions: tuple[str, str], tokens: dict[str, str]
) -> None:
    candidate = versions[1]
    split_before = client.get("/api/split").json()
    cases = [
        ({}, 401, "anonymous", "none"),
        (bearer(tokens["victor"]), 403, "victor", "viewer"),
        (bearer(tokens["rita"]), 401, "rita", "revoked"),
        (bearer("fwt_made-up"), 401, "unknown token", "none"),
    ]
    for headers, status, _, _ in cases:
        r = client.post(f"/api/versions/{candidate}/approve", json={"reason": "let me"}, headers=headers)
        assert r.status_code == status, r.text
    assert registry.gate_state(candidate) == "pending" and client.get("/api/split").json() == split_before

    entries = client.get("/api/audit").json()["entries"][::-1]  # oldest first
    # no token, or one nobody was given: not anyone's action, so not in the durable audit (counted instead)
    audited = [c for c in cases if c[2] not in ("anonymous", "unknown token")]
    assert [(e["who"], e["role"], e["action"], e["allowed"]) for e in entries] == [
        (who, role, "approve", False) for _, _, who, role in audited
    ]
    for e, (_, status, _, _) in zip(entries, audited, strict=True):
        assert e["target"] == f"version {candidate}" and e["reason"] == "let me"
        assert ("unauthorized" if status == 401 else "forbidden") in e["detail"]
        assert e["after"] is None  # nothing changed
    assert set(entries[0]) >= {"at", "who", "role", "action", "allowed", "reason", "target", "before", "after"}
    text = client.get("/api/audit").text
    assert all(t not in text for t in tokens.values()) and "fwt_made-up" not in text


def test_an_approvers_token_works_and_is_audited_with_identity_role_before_and_after(
    client: TestClient, registry: ModelRegistry, versions: tuple[str, str], tokens: dict[str, str]
) -> None:
    champion, candidate = versions
    r = client.post(f"/api/versions/{candidate}/approve", json=WHY, headers=bearer(tokens["alice"]))
    assert r.status_code == 200, r.text
    assert registry.gate_state(candidate) == "approved"

    [entry] = client.get("/api/audit").json()["entries"]
    assert (entry["who"], entry["role"], entry["action"], entry["allowed"]) == ("alice", "approver", "approve", True)
    assert entry["reason"] == WHY["reason"] and entry["target"] == f"version {candidate}"
    assert entry["before"]["gate_state"] == "pending" and entry["after"]["gate_state"] == "approved"
    assert entry["before"]["split"]["challenger"] is None
    assert entry["after"]["split"] == {
        "state": "running", "champion": champion, "challenger": candidate, "challenger_share": 0.2,
    }  # fmt: skip

    # A refusal by the gate's own rules (not pending any more) is recorded as well, as is a dry run.
    again = client.post(f"/api/versions/{candidate}/approve", json=WHY, headers=bearer(tokens["alice"]))
    assert again.status_code == 409
    dry = client.post("/api/rollback?dry_run=true", json=WHY, headers=bearer(TOKEN))
    assert dry.status_code == 200 and dry.json()["applied"] is False
    back = client.post("/api/rollback", json={"reason": "guardrail"}, headers=bearer(TOKEN))
    assert back.status_code == 200
    entries = client.get("/api/audit?limit=3").json()["entries"]
    assert [(e["action"], e["who"], e["role"], e["allowed"]) for e in entries] == [
        ("rollback", BOOTSTRAP_NAME, "admin", True),
        ("rollback (dry run)", BOOTSTRAP_NAME, "admin", True),
        ("approve", "alice", "approver", False),
    ]
    assert "not_pending" in entries[2]["detail"] and entries[1]["detail"].startswith("planned, not applied")
    assert entries[0]["after"]["split"]["state"] == "rolled_back"
    assert client.get("/api/audit?limit=0").status_code == 422
    # The version's own page lists every attempt on it, the rollback of it included.
    on_version = client.get(f"/api/versions/{candidate}").json()["audit"]
    assert [(e["action"], e["allowed"]) for e in on_version] == [
        ("rollback", True), ("rollback (dry run)", True), ("approve", False), ("approve", True),
    ]  # fmt: skip


def test_me_says_whose_token_it_is_and_whether_it_may_approve(
    client: TestClient, tokens: dict[str, str]
) -> None:
    assert client.get("/api/me", headers=bearer(tokens["alice"])).json() == {
        "name": "alice", "role": "approver", "can_approve": True,
    }  # fmt: skip
    assert client.get("/api/me", headers=bearer(tokens["victor"])).json()["can_approve"] is False
    assert client.get("/api/me", headers=bearer(tokens["rita"])).status_code == 401
    assert client.get("/api/me").status_code == 401
    assert client.get("/api/audit").json()["entries"] == []  # reading is not an action


def test_the_audit_log_survives_a_restart_and_cannot_be_rewritten(gate_settings: Settings) -> None:
    log = AuditLog.from_settings(gate_settings)
    log.record(who="ana", role="approver", action="approve", allowed=True, target="version 3", reason="<ok>")
    reopened = AuditLog.from_settings(gate_settings)  # a new process would build exactly this
    [entry] = reopened.entries()
    assert (entry.who, entry.reason, entry.allowed) == ("ana", "<ok>", True)

    db = sqlite3.connect(gate_settings.data_dir / "tokens.db")
    for sql in ("UPDATE flywheel_audit SET who = 'mallory'", "DELETE FROM flywheel_audit"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            db.execute(sql)
    db.close()
    assert [e.who for e in reopened.entries()] == ["ana"]


def test_auto_approve_is_off_by_default_and_audited_when_on(
    gate: DeployGate, gate_settings: Settings, registry: ModelRegistry, versions: tuple[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    champion, candidate = versions
    assert gate_settings.auto_approve is False
    assert AutoApprove(gate).tick() is None
    assert registry.gate_state(candidate) == "pending" and gate.audit.entries() == []

    on = gate_settings.model_copy(update={"auto_approve": True})
    policy = AutoApprove(DeployGate(registry, redis_client(on), on))
    assert policy.tick() == candidate
    assert registry.gate_state(candidate) == "approved"
    [entry] = gate.audit.entries()
    assert (entry.who, entry.role, entry.action, entry.allowed) == (POLICY_ACTOR, "policy", "approve", True)
    assert entry.after is not None and entry.after["split"]["challenger"] == candidate

    # One experiment at a time: the next candidate waits, and waiting is not an attempt.
    later = register(registry, tmp_path, parent=champion)
    assert policy.tick() is None and len(gate.audit.entries()) == 1
    assert registry.gate_state(later) == "pending"


def test_unauthenticated_release_requests_never_grow_the_audit_table(
    client: TestClient, gate: DeployGate, versions: tuple[str, str], caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prometheus_client import REGISTRY

    from deploy_gate import api
    from flywheel.ops.rate_limit import ThrottledLog

    monkeypatch.setattr(api, "_unauthenticated_log", ThrottledLog(api.log, every_s=3600))  # this test's lines only

    def counted() -> float:
        return REGISTRY.get_sample_value("flywheel_gate_unauthenticated_total", {"action": "approve"}) or 0.0

    before = counted()
    long_reason = "x" * 2000
    for i in range(40):
        headers = {} if i % 2 else bearer(f"fwt_guess-{i}")
        r = client.post(f"/api/versions/{versions[1]}/approve", json={"reason": long_reason}, headers=headers)
        assert r.status_code in (401, 429), r.text
        assert r.headers.get("Content-Security-Policy"), "a 429 carries the security headers too"
    assert gate.audit.entries(1000) == []
    assert counted() - before >= 20  # every one that reached the route (the rest were rate-limited)
    lines = [r for r in caplog.records if r.getMessage() == "unauthenticated release attempt refused"]
    assert len(lines) == 1, "logged, throttled"


def test_a_gate_client_past_its_rate_gets_429_with_the_security_headers_and_health_still_answers(
    gate: DeployGate, gate_settings: Settings, versions: tuple[str, str], tokens: dict[str, str]
) -> None:
    limited = gate_settings.model_copy(update={"gate_rate_limit": "3/minute"})
    with TestClient(create_app(limited, gate=gate)) as client:
        codes = [client.get("/api/me", headers=bearer(tokens["alice"])).status_code for _ in range(5)]
        assert codes == [200, 200, 200, 429, 429]
        r = client.post(f"/api/versions/{versions[1]}/approve", json=WHY, headers=bearer(tokens["alice"]))
        assert r.status_code == 429 and r.json()["error"] == "rate_limited" and int(r.headers["retry-after"]) > 0
        assert r.headers.get("Content-Security-Policy"), "the 429 passes through the security headers"
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code in (200, 503)
    # refused before the route: nothing approved, nothing audited
    assert gate.registry.gate_state(versions[1]) == "pending" and gate.audit.entries(1000) == []


def test_viewer_and_revoked_tokens_are_audited_once_per_window_and_counted_beyond(
    client: TestClient, versions: tuple[str, str], tokens: dict[str, str]
) -> None:
    """A viewer's and a revoked token's attempts, 30 each: each is refused every time (403, 401), audited once in
    the window, and the rest counted, so a held token cannot grow the audit without bound."""
    from prometheus_client import REGISTRY

    def counted(role: str) -> float:
        labels = {"action": "reject", "role": role}
        return REGISTRY.get_sample_value("flywheel_gate_refusals_not_audited_total", labels) or 0.0

    before = {role: counted(role) for role in ("viewer", "revoked")}
    for _ in range(30):
        for name, status in (("victor", 403), ("rita", 401)):
            r = client.post(f"/api/versions/{versions[1]}/reject", json={"reason": "no"}, headers=bearer(tokens[name]))
            assert r.status_code == status, r.text
    entries = client.get("/api/audit").json()["entries"]
    assert sorted((e["who"], e["role"], e["allowed"]) for e in entries) == [
        ("rita", "revoked", False), ("victor", "viewer", False)
    ]
    assert all(counted(role) - before[role] == 29 for role in ("viewer", "revoked"))


def test_a_forged_forwarded_for_does_not_escape_the_rate_limit_and_a_trusted_proxys_does_name_the_client(
    gate: DeployGate, gate_settings: Settings, versions: tuple[str, str], tokens: dict[str, str]
) -> None:
    """From an address that is no trusted proxy, a new X-Forwarded-For per request changes nothing: the peer is
    limited, and an approver's token is counted on its own. Behind a trusted proxy, clients are told apart by the
    hop the proxy appended, whatever they wrote to its left."""
    from flywheel.ops.rate_limit import client_address, networks

    limited = gate_settings.model_copy(update={"gate_rate_limit": "3/minute"})
    with TestClient(create_app(limited, gate=gate)) as client:
        codes = [client.get("/api/split", headers={"X-Forwarded-For": f"198.51.100.{i}"}).status_code
                 for i in range(5)]  # fmt: skip
        assert codes == [200, 200, 200, 429, 429]
        assert client.get("/api/me", headers=bearer(tokens["alice"])).status_code == 200, "a token: its own count"
        assert client.get("/api/me", headers=bearer("fwt_made-up")).status_code == 429, "a made-up one: the address"

    proxies = networks(["10.0.0.0/8"])
    via_proxy = {"client": ("10.0.0.5", 1)}
    forged = [client_address({**via_proxy, "headers": [(b"x-forwarded-for", f"1.2.3.{i}, 203.0.113.7".encode())]},
                             proxies) for i in range(5)]  # fmt: skip
    assert forged == ["203.0.113.7"] * 5, "what a client writes left of the proxy's hop is not read"
    direct = {"client": ("203.0.113.8", 1), "headers": [(b"x-forwarded-for", b"10.1.1.1")]}
    assert client_address(direct, proxies) == "203.0.113.8", "a header from an untrusted peer is not read"
    with pytest.raises(ValueError, match="not an address"):
        Settings.model_validate({**gate_settings.model_dump(), "trusted_proxies": ["the-ingress"]})
