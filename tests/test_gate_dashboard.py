"""The dashboard in a real browser (Debian's Chromium through Playwright) against a real gate.

The gate serves on a real port with the real registry (MLflow on SQLite), Redis, token store and
rewards in the lake. Screenshots land in `test-artifacts/` (gitignored) for a person to look at.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr

from deploy_gate.app import create_app
from deploy_gate.gate import DeployGate
from flywheel.connections import redis_client
from flywheel.identity import TokenStore
from flywheel.settings import Settings
from launcher.embedded import free_port
from model_registry import ModelRegistry
from tests.test_gate_api import register
from tests.test_gate_metrics import rewards_written  # noqa: F401  (a fixture: rewards for v1 and v2)

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
TOKEN = "bootstrap-admin-token-for-the-browser-tests"
HOSTILE = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no /usr/bin/chromium on this machine (and no internet to fetch a browser)",
)


@pytest.fixture
def gate_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"approval_token": SecretStr(TOKEN)})


@pytest.fixture
def versions(gate_settings: Settings, tmp_path: Path) -> tuple[str, str]:
    """(champion "1", pending candidate "2"): the versions the written rewards name."""
    registry = ModelRegistry(gate_settings)
    champion = register(registry, tmp_path)
    registry.set_gate_state(champion, "champion", by="bootstrap", reason="first model")
    registry.set_alias("champion", champion)
    return champion, register(registry, tmp_path, parent=champion)


@pytest.fixture
def app(gate_settings: Settings, versions: tuple[str, str]) -> FastAPI:
    gate = DeployGate(ModelRegistry(gate_settings), redis_client(gate_settings), gate_settings)
    return create_app(gate_settings, gate=gate)


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=str(CHROMIUM),
            args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )  # fmt: skip
        yield b
        b.close()


def open_dashboard(browser: Any, base: str) -> tuple[Any, list[str]]:
    """A page on the dashboard once its first refresh is drawn, and the list its console errors go to."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    for _ in range(50):  # the server thread may still be binding its port
        try:
            page.goto(f"{base}/")
            break
        except Exception:
            page.wait_for_timeout(100)
    page.wait_for_selector("body[data-loaded=true]", timeout=15_000)
    return page, errors


def real_errors(errors: list[str]) -> list[str]:
    # The browser logs every 4xx fetch; those the page expects (no experiment yet, refused actions) are fine.
    return [e for e in errors if "the server responded with a status of 4" not in e]


def test_dashboard_shows_both_arms_approves_from_the_page_and_shows_markup_as_text(
    browser: Any,
    app: FastAPI,
    gate_settings: Settings,
    versions: tuple[str, str],
    rewards_written: dict,  # noqa: F811
    tmp_path: Path,
) -> None:
    from playwright.sync_api import expect  # the browser fixture skipped the test without playwright

    champion, candidate = versions
    ARTIFACTS.mkdir(exist_ok=True)
    alice = TokenStore.from_settings(gate_settings).issue("alice", "approver")
    victor = TokenStore.from_settings(gate_settings).issue("victor", "viewer")
    api = TestClient(app)  # the same app, read without a browser, for the figures to compare

    with serve(app) as base:
        page, errors = open_dashboard(browser, base)
        arms = api.get("/api/metrics/arms").json()["arms"]
        assert {a["arm"] for a in arms} == {"champion", "challenger"}
        for arm in arms:
            row = page.locator(f'#arms tr[data-arm="{arm["arm"]}"]')
            assert row.locator('[data-field="n"]').inner_text() == str(arm["n"])
            assert row.locator('[data-field="mean"]').inner_text() == f"{arm['mean']:.3f}"
            assert row.locator('[data-field="ci"]').inner_text() == f"[{arm['ci_low']:.3f}, {arm['ci_high']:.3f}]"
            assert row.locator('[data-field="version"]').inner_text() == f"v{arm['model_version']}"
        assert page.locator("#chart canvas").count() > 0  # uPlot drew the series
        legend = page.locator("#chart-legend").inner_text()
        assert "champion v1" in legend and "challenger v2" in legend
        assert "No experiment analysis yet" in page.locator("#rollout").inner_text()
        assert page.locator(f'#pending tr[data-version="{candidate}"]').count() == 1
        page.screenshot(path=str(ARTIFACTS / "dashboard-loaded.png"), full_page=True)

        # Without an approver's token the buttons are disabled, and the page says whose token it has.
        approve = page.locator(f'#pending button[data-action$="/{candidate}/approve"]')
        assert approve.is_disabled()
        page.fill("#token", victor)
        expect(page.locator("#whoami")).to_contain_text("victor (viewer)")
        assert approve.is_disabled() and "cannot approve" in page.locator("#whoami").inner_text()
        # Were the button enabled, the gate would still refuse the viewer, and audit the refusal.
        viewer_try = api.post(f"/api/versions/{candidate}/approve", json={"reason": HOSTILE},
                           headers={"Authorization": f"Bearer {victor}"})  # fmt: skip
        assert viewer_try.status_code == 403
        assert api.get(f"/api/versions/{candidate}").json()["gate_state"] == "pending"
        page.fill("#reason", HOSTILE)

        # An approver's token, kept in the tab's sessionStorage, approves it.
        page.fill("#token", alice)
        assert page.evaluate("sessionStorage.getItem('flywheel.gate.token')") == alice
        expect(page.locator("#whoami")).to_contain_text("alice (approver)")
        assert approve.is_enabled()
        page.click(f'#pending button[data-action$="/{candidate}/approve"]')
        page.wait_for_selector("#msg.okmsg")
        assert api.get(f"/api/versions/{candidate}").json()["gate_state"] == "approved"
        assert api.get("/api/split").json()["split"]["challenger_version"] == candidate
        expect(page.locator("#pending")).to_contain_text("No candidate waits")

        # The audit trail shows both attempts, the hostile reason as text that never ran.
        audit = page.locator("#audit tbody tr")
        assert audit.count() == 2
        newest, refused = audit.nth(0), audit.nth(1)
        assert newest.locator('[data-field="who"]').inner_text() == "alice"
        assert newest.locator('[data-field="role"]').inner_text() == "approver"
        assert newest.locator('[data-field="outcome"]').inner_text() == "allowed"
        assert refused.locator('[data-field="who"]').inner_text() == "victor"
        assert refused.locator('[data-field="outcome"]').inner_text() == "refused"
        assert newest.locator('[data-field="reason"]').inner_text() == HOSTILE
        assert page.locator("#audit script, #audit img, #rollout script, #rollout img").count() == 0
        assert page.evaluate("window.pwned") is None
        assert f"challenger v{candidate}" in page.locator("#rollout").inner_text()
        # The token stays in this tab across a reload, and the page refreshes itself.
        page.reload()
        page.wait_for_selector("body[data-loaded=true]")
        assert page.input_value("#token") == alice
        # A candidate registered meanwhile appears without a reload: the page refreshes itself.
        newer = register(ModelRegistry(gate_settings), tmp_path, parent=candidate)
        expect(page.locator(f'#pending tr[data-version="{newer}"]')).to_have_count(1, timeout=20_000)
        page.screenshot(path=str(ARTIFACTS / "dashboard-approved.png"), full_page=True)
        assert real_errors(errors) == []
    assert (ARTIFACTS / "dashboard-approved.png").stat().st_size > 10_000


# The contract's example answer (the rollout controller's endpoints are built apart; this stands
# in for them where they are not mounted, so the rendering of every field is checked).
EXPERIMENT = {
    "experiment": "default", "state": "ramping", "champion": "1", "challenger": "2", "holdout_version": "1",
    "share": 0.25, "step": 1,
    "ramp": [
        {"share": 0.05, "min_users": 200, "min_seconds": 600, "entered_at": "2026-01-05T10:00:00Z",
         "left_at": "2026-01-05T11:00:00Z"},
        {"share": 0.25, "min_users": 400, "min_seconds": 3600, "entered_at": "2026-01-05T11:00:00Z",
         "left_at": None},
        {"share": 0.5, "min_users": 800, "min_seconds": 3600, "entered_at": None, "left_at": None},
    ],
    "analysis": {
        "unit": "user", "metric": "satisfaction", "reward_version": "r1",
        "arms": {"champion": {"users": 812, "generations": 5120, "mean": 0.41, "ci": [0.38, 0.44]},
                 "challenger": {"users": 270, "generations": 1733, "mean": 0.46, "ci": [0.41, 0.51]}},
        "difference": {"estimate": 0.05, "ci": [0.01, 0.09], "sequential_ci": [-0.01, 0.11], "alpha": 0.05,
                       "method": "delta-method over per-user means; confidence sequence (Howard et al. 2021)"},
        "srm": {"observed": [812, 270], "expected_shares": [0.75, 0.25], "p_value": 0.41, "alarm": False},
        "guardrails": [
            {"name": "latency_p95_ms", "champion": 80.0, "challenger": 83.0,
             "bound": "challenger <= 1.2 x champion", "ok": True},
            {"name": "undo_rate", "champion": 0.05, "challenger": 0.09,
             "bound": "challenger <= champion + 0.02", "ok": False},
        ],
        "decision": {"action": "continue", "reason": "sequential interval still covers 0",
                     "at": "2026-01-05T11:30:00Z"},
    },
    "timeline": [{"at": "2026-01-05T10:00:00Z", "event": "ramp to 5%", "by": "controller"},
                 {"at": "2026-01-05T11:00:00Z", "event": "ramp to 25%", "by": "controller"}],
    "holdout": {"share": 0.02, "version": "1", "users": 40, "mean": 0.35,
                "cumulative_effect": {"estimate": 0.06, "ci": [0.0, 0.12]}},
}  # fmt: skip
SERIES = {
    "buckets": [
        {"start": f"2026-01-05T{10 + h:02d}:00:00Z", "arm": arm, "users": 50 + 10 * h,
         "mean": base + 0.01 * h, "ci": [base + 0.01 * h - 0.04, base + 0.01 * h + 0.04]}
        for h in range(4) for arm, base in (("champion", 0.40), ("challenger", 0.44))
    ]
}  # fmt: skip


def test_dashboard_renders_the_experiment_analysis(
    browser: Any, app: FastAPI, versions: tuple[str, str]
) -> None:
    if any(getattr(r, "path", None) == "/api/experiment" for r in app.routes):
        pytest.skip("the rollout controller's /api/experiment is mounted; its own tests drive this page")

    @app.get("/api/experiment")
    def experiment() -> dict:
        return EXPERIMENT

    @app.get("/api/experiment/series")
    def series(bucket: str = "1h") -> dict:
        return SERIES

    ARTIFACTS.mkdir(exist_ok=True)
    with serve(app) as base:
        page, errors = open_dashboard(browser, base)
        assert page.locator('[data-field="experiment-state"]').inner_text() == "ramping"
        champion = page.locator('#arms tr[data-arm="champion"]')
        assert champion.locator('[data-field="users"]').inner_text() == "812"
        assert champion.locator('[data-field="ci"]').inner_text() == "[0.380, 0.440]"
        assert page.locator('[data-field="diff-estimate"]').inner_text() == "0.050"
        assert "[-0.010, 0.110]" in page.locator('[data-field="diff-sequential"]').inner_text()
        assert "not yet decided" in page.locator("#difference").inner_text()
        assert "no mismatch" in page.locator("#srm").inner_text()
        guardrails = page.locator("#guardrails").inner_text()
        assert "breached" in guardrails and "challenger <= champion + 0.02" in guardrails
        assert page.locator("#ramp tr.current").inner_text().startswith("25%")
        assert "ramp to 25%" in page.locator("#timeline").inner_text()
        assert "0.060 [0.000, 0.120]" in page.locator("#holdout").inner_text()
        assert page.locator("#chart canvas").count() > 0
        # The legend shows the newest bucket until the cursor picks another: 1 pm, champion 0.43 of 80 users.
        assert "0.430 [0.390, 0.470] (users 80)" in page.locator('#chart-legend [data-arm="champion"]').inner_text()
        page.screenshot(path=str(ARTIFACTS / "dashboard-experiment.png"), full_page=True)
        assert real_errors(errors) == []
