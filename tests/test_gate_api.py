"""The gate's HTTP API and dashboard, on the real registry (MLflow on SQLite) and Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deploy_gate.app import create_app
from deploy_gate.gate import DeployGate
from flywheel.connections import redis_client
from flywheel.contract import ModelLineage
from flywheel.settings import Settings
from model_registry import ModelRegistry

TOKEN = "s3cret-approval-token"


@pytest.fixture
def gate_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"approval_token": TOKEN})


@pytest.fixture
def registry(gate_settings: Settings) -> ModelRegistry:
    return ModelRegistry(gate_settings)


def register(registry: ModelRegistry, tmp_path: Path, parent: str | None = None) -> str:
    ckpt = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "fake"}')
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    return registry.register(ckpt, ModelLineage(base="fake", parent_version=parent, sample_count=8))


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


WHO = {"by": "ana", "reason": "offline checks pass"}


def test_start_creates_the_split_with_the_champion(client: TestClient, versions: tuple[str, str]) -> None:
    body = client.get("/api/split").json()
    assert body["split"]["champion_version"] == versions[0]
    assert body["split"]["challenger_version"] is None
    assert [v["version"] for v in client.get("/api/versions").json()] == [versions[1], versions[0]]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        auth("wrong-token"),
        auth(TOKEN + "x"),
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
    ],
    ids=["missing", "wrong", "longer", "no-scheme", "basic"],
)
def test_a_bad_approval_token_is_refused_and_nothing_changes(
    client: TestClient,
    gate: DeployGate,
    registry: ModelRegistry,
    versions: tuple[str, str],
    headers: dict[str, str],
) -> None:
    before = client.get("/api/split").json()
    for path in (
        f"/api/versions/{versions[1]}/approve",
        f"/api/versions/{versions[1]}/reject",
        "/api/promote",
        "/api/rollback",
    ):
        r = client.post(path, json=WHO, headers=headers)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in r.text
    assert registry.gate_state(versions[1]) == "pending"
    assert registry.alias("challenger") is None
    assert client.get("/api/split").json() == before


def test_approve_over_http_makes_the_challenger(
    client: TestClient, registry: ModelRegistry, versions: tuple[str, str], gate_settings: Settings
) -> None:
    champion, candidate = versions
    dry = client.post(f"/api/versions/{candidate}/approve?dry_run=true", json=WHO, headers=auth())
    assert dry.status_code == 200 and dry.json()["applied"] is False
    assert any("becomes the challenger" in s for s in dry.json()["plan"]["steps"])
    assert registry.gate_state(candidate) == "pending"  # a dry run changes nothing

    r = client.post(f"/api/versions/{candidate}/approve", json=WHO, headers=auth())
    assert r.status_code == 200, r.text
    split = client.get("/api/split").json()["split"]
    assert (split["champion_version"], split["challenger_version"]) == (champion, candidate)
    assert split["challenger_share"] == gate_settings.challenger_share and split["changed_by"] == "ana"
    assert registry.gate_state(candidate) == "approved" and registry.alias("challenger") == candidate
    detail = client.get(f"/api/versions/{candidate}").json()
    assert [(h["state"], h["by"]) for h in detail["history"]] == [
        ("pending", "registry"),
        ("approved", "ana"),
    ]

    again = client.post(f"/api/versions/{candidate}/approve", json=WHO, headers=auth())
    assert again.status_code == 409 and again.json()["error"] == "not_pending"

    back = client.post("/api/rollback", json={"by": "oncall", "reason": "guardrail"}, headers=auth())
    assert back.status_code == 200
    split = client.get("/api/split").json()["split"]
    assert (split["challenger_share"], split["state"]) == (0.0, "rolled_back")


def test_errors_are_mapped_and_requests_validated(client: TestClient) -> None:
    assert client.post("/api/versions/999/approve", json=WHO, headers=auth()).status_code == 404
    assert client.post("/api/promote", json=WHO, headers=auth()).json()["error"] == "no_challenger"
    assert client.post("/api/promote", json={"by": "ana"}, headers=auth()).status_code == 422  # no reason
    assert client.get("/api/metrics/arms?bucket=drop table").status_code == 422


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


def test_dashboard_page_shows_split_arms_and_pending_candidates(
    client: TestClient, gate: DeployGate, versions: tuple[str, str], tmp_path: Path, registry: ModelRegistry
) -> None:
    champion, candidate = versions
    gate.approve(candidate, by="ana", reason="<script>alert(1)</script>")
    waiting = register(registry, tmp_path, parent=candidate)

    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "Satisfaction per arm" in page and "running" in page
    assert f"champion <b>v{champion}</b>" in page and f"challenger <b>v{candidate}</b> 20%" in page
    assert f"api/versions/{waiting}/approve" in page  # the pending candidate, with its buttons
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "http://" not in page and "https://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
