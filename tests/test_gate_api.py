"""The gate's HTTP API and dashboard, on the real registry (MLflow on SQLite), Redis and token store."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import SecretStr

from deploy_gate.app import create_app
from deploy_gate.gate import DeployGate
from deploy_gate.security import SECURITY_HEADERS
from flywheel.connections import redis_client
from flywheel.identity import BOOTSTRAP_NAME, TokenStore
from flywheel.settings import Settings
from launcher.embedded import free_port
from model_registry import ModelRegistry
from tests.helpers import register

TOKEN = "s3cret-approval-token-of-the-admin"


@pytest.fixture
def gate_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"approval_token": SecretStr(TOKEN)})


@pytest.fixture
def tokens(gate_settings: Settings) -> dict[str, str]:
    """Issued tokens by holder: an approver, a viewer, and an approver whose token was revoked."""
    store = TokenStore.from_settings(gate_settings)
    issued = {
        "alice": store.issue("alice", "approver"),
        "victor": store.issue("victor", "viewer"),
        "rita": store.issue("rita", "approver"),
    }
    store.revoke("rita")
    return issued


@pytest.fixture
def registry(gate_settings: Settings) -> ModelRegistry:
    return ModelRegistry(gate_settings)




@pytest.fixture
def versions(registry: ModelRegistry, tmp_path: Path) -> tuple[str, str]:
    """(champion, pending candidate)."""
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


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


WHY = {"reason": "offline checks pass"}


def test_start_creates_the_split_with_the_champion(client: TestClient, versions: tuple[str, str]) -> None:
    body = client.get("/api/split").json()
    assert body["split"]["champion_version"] == versions[0]
    assert body["split"]["challenger_version"] is None
    assert [v["version"] for v in client.get("/api/versions").json()] == [versions[1], versions[0]]


REFUSED: dict[str, tuple[dict[str, str] | str, int]] = {
    "missing": ({}, 401),
    "empty": ({"Authorization": "Bearer "}, 401),
    "scheme-only": ({"Authorization": "Bearer"}, 401),
    "wrong": (auth("wrong-token"), 401),
    "longer": (auth(TOKEN + "x"), 401),
    "no-scheme": ({"Authorization": TOKEN}, 401),
    "basic": ({"Authorization": f"Basic {TOKEN}"}, 401),
    "revoked": ("rita", 401),
    "viewer": ("victor", 403),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_or_insufficient_token_is_refused_and_nothing_changes(
    client: TestClient,
    registry: ModelRegistry,
    versions: tuple[str, str],
    tokens: dict[str, str],
    case: str,
) -> None:
    given, status = REFUSED[case]
    headers = auth(tokens[given]) if isinstance(given, str) else given
    before = client.get("/api/split").json()
    for path in (
        f"/api/versions/{versions[1]}/approve",
        f"/api/versions/{versions[1]}/reject",
        "/api/promote",
        "/api/rollback",
    ):
        r = client.post(path, json=WHY, headers=headers)
        assert r.status_code == status, (path, r.text)
        assert r.json()["error"] == ("unauthorized" if status == 401 else "forbidden")
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in r.text and all(t not in r.text for t in tokens.values())
    assert registry.gate_state(versions[1]) == "pending"
    assert registry.alias("challenger") is None
    assert client.get("/api/split").json() == before


def test_an_approval_records_the_identity_behind_the_token_not_a_typed_name(
    client: TestClient, registry: ModelRegistry, versions: tuple[str, str], tokens: dict[str, str]
) -> None:
    candidate = versions[1]
    claimed = client.post(
        f"/api/versions/{candidate}/approve", json={"by": "mallory", **WHY}, headers=auth(tokens["alice"])
    )
    assert claimed.status_code == 422  # no client-chosen name any more
    r = client.post(f"/api/versions/{candidate}/approve", json=WHY, headers=auth(tokens["alice"]))
    assert r.status_code == 200, r.text
    assert r.json()["plan"]["by"] == "alice"
    assert registry.gate_history(candidate)[-1].by == "alice"
    assert client.get("/api/split").json()["split"]["changed_by"] == "alice"
    # The bootstrap token acts as the admin identity named after the setting.
    back = client.post("/api/rollback", json={"reason": "guardrail"}, headers=auth())
    assert back.status_code == 200
    assert registry.gate_history(candidate)[-1].by == BOOTSTRAP_NAME


def test_approve_over_http_makes_the_challenger(
    client: TestClient, registry: ModelRegistry, versions: tuple[str, str], gate_settings: Settings
) -> None:
    champion, candidate = versions
    dry = client.post(f"/api/versions/{candidate}/approve?dry_run=true", json=WHY, headers=auth())
    assert dry.status_code == 200 and dry.json()["applied"] is False
    assert any("becomes the challenger" in s for s in dry.json()["plan"]["steps"])
    assert registry.gate_state(candidate) == "pending"  # a dry run changes nothing

    r = client.post(f"/api/versions/{candidate}/approve", json=WHY, headers=auth())
    assert r.status_code == 200, r.text
    split = client.get("/api/split").json()["split"]
    assert (split["champion_version"], split["challenger_version"]) == (champion, candidate)
    assert split["challenger_share"] == gate_settings.challenger_share
    assert split["changed_by"] == BOOTSTRAP_NAME
    assert registry.gate_state(candidate) == "approved" and registry.alias("challenger") == candidate
    detail = client.get(f"/api/versions/{candidate}").json()
    assert [(h["state"], h["by"]) for h in detail["history"]] == [
        ("pending", "registry"),
        ("approved", BOOTSTRAP_NAME),
    ]

    again = client.post(f"/api/versions/{candidate}/approve", json=WHY, headers=auth())
    assert again.status_code == 409 and again.json()["error"] == "not_pending"

    back = client.post("/api/rollback", json={"reason": "guardrail"}, headers=auth())
    assert back.status_code == 200
    split = client.get("/api/split").json()["split"]
    assert (split["challenger_share"], split["state"]) == (0.0, "rolled_back")


def test_errors_are_mapped_and_requests_validated(client: TestClient) -> None:
    for version in ("999", "abc", "1" * 30, "-1"):
        r = client.post(f"/api/versions/{version}/approve", json=WHY, headers=auth())
        assert (r.status_code, r.json()["error"]) == (404, "unknown_version"), version
        assert client.get(f"/api/versions/{version}").status_code == 404
    assert client.post("/api/promote", json=WHY, headers=auth()).json()["error"] == "no_challenger"
    assert client.post("/api/promote", json={}, headers=auth()).status_code == 422  # no reason
    assert client.get("/api/metrics/arms?bucket=drop table").status_code == 422
    # A body that is not UTF-8 is a 422 saying where, without echoing what was sent.
    r = client.post("/api/promote", content=b"\x80secret", headers={**auth(), "Content-Type": "text/plain"})
    assert (r.status_code, r.json()["error"]) == (422, "invalid_request") and "secret" not in r.text


def test_unknown_errors_are_not_echoed(gate_settings: Settings, gate: DeployGate) -> None:
    # A registry that fails the way a broken backend would; a stand-in because the point is
    # what the client is told, whatever the failure.
    class BrokenRegistry:
        def __getattr__(self, name: str) -> object:
            def fail(*args: object, **kwargs: object) -> None:
                raise RuntimeError("postgresql://admin:hunter2@db/mlflow is down")

            return fail

    broken = DeployGate(BrokenRegistry(), redis_client(gate_settings), gate_settings)  # type: ignore[arg-type]
    # The gate still starts (a backend down at start must not take the dashboard down) ...
    with TestClient(create_app(gate_settings, gate=broken), raise_server_exceptions=False) as c:
        r = c.get("/api/versions")
    # ... and a failure is reported without its text.
    assert r.status_code == 500
    assert r.json() == {"error": "internal", "detail": "internal error; see the gate's log"}
    assert "hunter2" not in r.text
    assert all(r.headers.get(name) == value for name, value in SECURITY_HEADERS.items())


def test_dashboard_page_is_a_template_with_its_code_and_chart_library_served_by_the_gate(
    client: TestClient,
) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    for section in ("rollout", "chart", "arms", "difference", "srm", "guardrails", "holdout", "ramp",
                    "pending", "versions", "audit"):  # fmt: skip
        assert f'id="{section}"' in page
    # Nothing from another origin, no inline script or style: the CSP forbids them.
    assert "http://" not in page and "https://" not in page
    assert "<script>" not in page and "onclick" not in page and "<style>" not in page and "style=" not in page
    for path, kind, needle in (
        ("static/dashboard.js", "text/javascript", "Authorization"),
        ("static/gate.css", "text/css", "badge"),
        ("static/vendor/uplot/uPlot.iife.min.js", "text/javascript", "uPlot"),
        ("static/vendor/uplot/uPlot.min.css", "text/css", ".uplot"),
        ("static/vendor/uplot/LICENSE", "", "MIT License"),
    ):
        assert f'"{path}"' in page or path.endswith("LICENSE")
        got = client.get("/" + path)
        assert got.status_code == 200 and got.headers["content-type"].startswith(kind) and needle in got.text
    assert client.get("/?bucket=<b>").status_code == 422


def test_the_template_escapes_what_it_is_given() -> None:
    from deploy_gate.dashboard import render_dashboard

    page = render_dashboard(experiment='<script>alert("x")</script>', bucket='1h"><b>')
    assert "<script>alert" not in page and "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;" in page
    assert 'data-bucket="1h&#34;&gt;&lt;b&gt;"' in page


def test_every_response_carries_the_security_headers(
    client: TestClient, versions: tuple[str, str]
) -> None:
    responses = [
        client.get("/"),
        client.get("/static/dashboard.js"),
        client.get("/api/versions"),
        client.get("/api/versions/999"),  # 404 from the error handler
        client.post("/api/promote", json=WHY),  # 401
        client.get("/api/split?limit=0"),  # 422 from validation
        client.get("/no-such-page"),
    ]
    for r in responses:
        for name, value in SECURITY_HEADERS.items():
            assert r.headers.get(name) == value, (r.request.url, name)
    csp = SECURITY_HEADERS["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert client.get("/docs").status_code == 404  # Swagger UI would need a CDN script


def corrupt_stored_weights(settings: Settings, registry: ModelRegistry, version: str) -> None:
    """Flip bytes of `version`'s stored model.safetensors in the artifact store (bit rot, tampering)."""
    run_id = registry.lineage(version).run_id
    stored = next(p for p in (settings.data_dir / "mlflow" / "artifacts").rglob("model.safetensors")
                  if run_id in p.parts)  # fmt: skip
    stored.write_bytes(b"\xff" * 8 + stored.read_bytes()[8:])


def test_a_corrupted_artifact_cannot_be_approved_or_promoted(
    client: TestClient, gate_settings: Settings, registry: ModelRegistry, versions: tuple[str, str],
    tmp_path: Path,
) -> None:  # fmt: skip
    champion, candidate = versions
    corrupt_stored_weights(gate_settings, registry, candidate)
    for path in (f"/api/versions/{candidate}/approve?dry_run=true", f"/api/versions/{candidate}/approve"):
        r = client.post(path, json=WHY, headers=auth())
        assert r.status_code == 409, r.text
        assert r.json()["error"] == "artifact_corrupt" and "model.safetensors" in r.json()["detail"]
    assert registry.gate_state(candidate) == "pending" and registry.alias("challenger") is None
    assert client.get("/api/split").json()["split"]["challenger_version"] is None

    # A challenger whose artifact went bad after its approval is not promoted either.
    healthy = register(registry, tmp_path, parent=champion)
    assert client.post(f"/api/versions/{healthy}/approve", json=WHY, headers=auth()).status_code == 200
    corrupt_stored_weights(gate_settings, registry, healthy)
    r = client.post("/api/promote", json=WHY, headers=auth())
    assert (r.status_code, r.json()["error"]) == (409, "artifact_corrupt")
    assert registry.alias("champion") == champion
    assert client.get("/api/split").json()["split"]["challenger_version"] == healthy
    # Rolling it back is always possible.
    assert client.post("/api/rollback", json=WHY, headers=auth()).status_code == 200


def test_redis_down_answers_503_with_a_reason(
    gate_settings: Settings, registry: ModelRegistry, versions: tuple[str, str]
) -> None:
    # A real Redis client pointed at a port where nothing listens: Redis is down.
    down = redis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    gate = DeployGate(registry, down, gate_settings)
    with TestClient(create_app(gate_settings, gate=gate)) as c:
        answers = [
            c.get("/api/split"),
            c.post(f"/api/versions/{versions[1]}/approve", json=WHY, headers=auth()),
            c.post("/api/rollback", json=WHY, headers=auth()),
        ]
        # The page itself still loads; its figures say what they could not fetch.
        assert c.get("/").status_code == 200
        audit = c.get("/api/audit").json()["entries"]
    for r in answers:
        assert r.status_code == 503, (r.request.url, r.text)
        assert r.json()["error"] == "dependency_unavailable" and "Redis" in r.json()["detail"]
        assert r.headers["x-frame-options"] == "DENY"
    assert registry.gate_state(versions[1]) == "pending"
    # Both refused actions are in the audit log, with the outage as their reason.
    assert [(e["action"], e["who"], e["allowed"]) for e in audit] == [
        ("rollback", BOOTSTRAP_NAME, False),
        ("approve", BOOTSTRAP_NAME, False),
    ]
    assert all("dependency_unavailable" in e["detail"] for e in audit)


def test_mlflow_down_answers_503(
    gate_settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A tracking server that does not answer; no retries, so the test does not wait for backoff.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    secret_uri = f"http://mlflow-user:mlflow-password@127.0.0.1:{free_port()}"
    down = gate_settings.model_copy(update={"mlflow_tracking_uri": secret_uri})
    gate = DeployGate(ModelRegistry(down), redis_client(down), down)
    with TestClient(create_app(down, gate=gate)) as c:
        answers = [c.get("/api/versions"), c.post("/api/versions/1/approve", json=WHY, headers=auth())]
    for r in answers:
        assert r.status_code == 503, r.text
        assert r.json()["error"] == "dependency_unavailable" and "MLflow" in r.json()["detail"]
        assert "mlflow-password" not in r.text
    ours = [rec for rec in caplog.records if rec.name.startswith(("deploy_gate", "model_registry"))]
    assert ours  # the outage is logged ...
    formatter = logging.Formatter()
    assert all("mlflow-password" not in formatter.format(rec) for rec in ours)  # ... without the password
