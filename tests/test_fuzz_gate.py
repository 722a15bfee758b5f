"""Hypothesis fuzz of the gate's HTTP API: whatever a client sends, never a 5xx while Redis,
MLflow and the token store answer, and every answer carries the security headers.

Seeded and bounded (a fixed number of examples, no example database), so it runs the same
requests every time in a few seconds. Real registry (MLflow on SQLite), Redis and token store.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, seed
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from pydantic import SecretStr

from deploy_gate.app import create_app
from deploy_gate.gate import DeployGate
from deploy_gate.security import SECURITY_HEADERS
from flywheel.connections import redis_client
from flywheel.contract import ModelLineage
from flywheel.identity import TokenStore
from flywheel.settings import Settings
from model_registry import ModelRegistry

ADMIN = "fuzz-bootstrap-admin-token-0123456789"


@pytest.fixture
def world(settings: Settings, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], list[str]]]:
    """(client, tokens by role, registered versions): a champion and three pending candidates."""
    # Far above what the fuzzer sends: this test is about answers, not about the per-client rate
    # (tests/test_gate_audit.py proves the 429 and its security headers).
    s = settings.model_copy(update={"approval_token": SecretStr(ADMIN), "gate_rate_limit": "100000/second"})
    registry = ModelRegistry(s)
    versions = []
    for i in range(4):
        ckpt = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
        ckpt.mkdir()
        (ckpt / "config.json").write_text('{"model_type": "fake"}')
        (ckpt / "model.safetensors").write_bytes(bytes([i]) * 64)
        versions.append(registry.register(ckpt, ModelLineage(base="fake", sample_count=i)))
    registry.set_gate_state(versions[0], "champion", by="bootstrap", reason="first model")
    registry.set_alias("champion", versions[0])
    store = TokenStore.from_settings(s)
    tokens = {"admin": ADMIN, "approver": store.issue("ana", "approver"), "viewer": store.issue("vic", "viewer")}
    gate = DeployGate(registry, redis_client(s), s)
    with TestClient(create_app(s, gate=gate), raise_server_exceptions=False) as client:
        yield client, tokens, versions


# Header values travel as latin-1 text without line breaks; anything else the client refuses itself.
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=60)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["reason", "by", "dry_run", "x"]) | st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@st.composite
def requests(draw: st.DrawFn, versions: list[str]) -> dict[str, Any]:
    version = draw(st.sampled_from(versions) | st.text(max_size=20) | st.integers().map(str))
    segment = quote(version, safe="") or "%20"
    method, path = draw(
        st.sampled_from(
            [
                ("POST", f"/api/versions/{segment}/approve"),
                ("POST", f"/api/versions/{segment}/reject"),
                ("POST", "/api/promote"),
                ("POST", "/api/rollback"),
                ("GET", f"/api/versions/{segment}"),
                ("GET", "/api/versions"),
                ("GET", "/api/split"),
                ("GET", "/api/metrics/arms"),
                ("GET", "/"),
            ]
        )
    )
    query = draw(
        st.dictionaries(
            st.sampled_from(["dry_run", "bucket", "limit", "since_hours", "reward_version"]),
            st.sampled_from(["true", "false", "1h", "5m", "0", "-1", "1e309", "nan"]) | header_text,
            max_size=3,
        )
    )
    auth = draw(
        st.sampled_from(["admin", "approver", "viewer", None])
        | header_text.map(lambda t: ("raw", t))
    )
    body = draw(
        st.one_of(
            st.just({"reason": "fuzz"}),
            json_values.map(lambda v: json.dumps(v).encode()),
            st.binary(max_size=40),
        )
    )
    content_type = draw(st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded"]))
    return {
        "method": method,
        "url": path + ("?" + urlencode(query) if query else ""),
        "auth": auth,
        "body": body,
        "content_type": content_type,
    }


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_no_request_gets_a_5xx_while_dependencies_are_up(
    world: tuple[TestClient, dict[str, str], list[str]],
) -> None:
    client, tokens, versions = world
    seen: set[int] = set()

    @seed(20261125)
    @hyp_settings(
        max_examples=120,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(requests(versions))
    def one(req: dict[str, Any]) -> None:
        headers = {"Content-Type": req["content_type"]}
        auth = req["auth"]
        if isinstance(auth, tuple):
            headers["Authorization"] = auth[1]
        elif auth is not None:
            headers["Authorization"] = f"Bearer {tokens[auth]}"
        body = req["body"]
        kwargs: dict[str, Any] = {"json": body} if isinstance(body, dict) else {"content": body}
        if isinstance(body, dict):
            headers.pop("Content-Type")
        r = client.request(req["method"], req["url"], headers=headers, **kwargs)
        seen.add(r.status_code)
        assert r.status_code < 500, (req, r.status_code, r.text)
        for name, value in SECURITY_HEADERS.items():
            assert r.headers.get(name) == value, (req, name)
        if r.status_code >= 400 and r.headers.get("content-type", "").startswith("application/json"):
            assert r.json().get("detail"), (req, r.text)  # every refusal says why

    one()
    # The fuzz reached past authentication and validation, not only the front door.
    assert {200, 401, 403, 404, 422} <= seen, seen
