"""The dashboard in a real browser (Debian's Chromium through Playwright) against a real gate.

The gate serves on a real port with the real registry (MLflow on SQLite), Redis, token store and
rewards in the lake. Screenshots land in `test-artifacts/` (gitignored) for a person to look at.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr

from deploy_gate.app import create_app
from deploy_gate.gate import DeployGate
from deploy_gate.rollout import RampStep, RolloutConfig, RolloutController
from flywheel.connections import redis_client
from flywheel.contract import utcnow
from flywheel.identity import TokenStore
from flywheel.settings import Settings
from launcher.embedded import free_port
from model_registry import ModelRegistry
from tests.helpers import register
from tests.rollout_sim import Behaviour, write_batch
from tests.test_gate_metrics import rewards_written  # noqa: F401  (a fixture: rewards for v1 and v2)
from tests.test_rollout import CHAMPION, Clock

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


def js_pct(x: float) -> str:
    """The dashboard's `pct`: a share as a percentage to a tenth, trailing zeros dropped (JavaScript's Number)."""
    text = f"{100 * x:.1f}".rstrip("0").rstrip(".")
    return f"{text}%"


def real_errors(errors: list[str]) -> list[str]:
    # The browser logs every 4xx fetch; those the page expects (refused actions) are fine.
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
        # The controller has not analysed a challenger: the page says so and uses the metrics API.
        experiment = api.get("/api/experiment").json()
        assert (experiment["state"], experiment["analysis"]) == ("idle", None)
        assert page.locator('[data-field="experiment-state"]').inner_text() == "idle"
        assert "No experiment analysis yet" in page.locator("#rollout").inner_text()
        assert "No experiment analysis yet" in page.locator("#difference").inner_text()
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


def test_dashboard_renders_the_experiment_analysis(
    browser: Any, app: FastAPI, gate_settings: Settings, versions: tuple[str, str]
) -> None:
    """A real analysis: the candidate approved, simulated users in the lake, two controller ticks."""
    champion, candidate = versions
    gate: DeployGate = app.state.gate
    gate.approve(candidate, by="ana", reason="offline gates pass")
    # A 2% long-term holdout, and a challenger that suggests less, with too few users yet (about 30
    # of 200) for the controller to act on it, whatever the split's fresh salt puts in each arm.
    ramp = [RampStep(share=x, min_users=200, min_seconds=300) for x in (0.05, 0.25, 0.5)]
    cfg = RolloutConfig(ramp=ramp, srm_min_users=100, latency_min_generations=50, holdout_share=0.02)
    app.state.rollout_config = cfg  # the gate's endpoints read the controller's experiment
    clock = Clock()
    controller = RolloutController(gate, cfg, clock=clock)
    controller.tick()  # starts the experiment: holdout, then the challenger at the first ramp step
    split = gate.splits.get()
    assert split is not None and split.challenger_share == cfg.ramp[0].share
    write_batch(gate_settings, split, {"champion": CHAMPION, "challenger": Behaviour(p_good=0.6, shown=0.6),
                                       "holdout": CHAMPION},
                users=600, at=clock.now, rng=random.Random(7), user_ids=[f"user-{i}" for i in range(600)])  # fmt: skip
    clock.now += timedelta(seconds=120)
    assert controller.tick().analysis is not None

    api = TestClient(app)
    exp = api.get("/api/experiment").json()
    analysis = exp["analysis"]
    assert exp["state"] == "ramping" and analysis["decision"]["action"] == "continue"
    series = api.get("/api/experiment/series?bucket=1h").json()["buckets"]
    assert {b["arm"] for b in series} == {"champion", "challenger"}

    ARTIFACTS.mkdir(exist_ok=True)
    with serve(app) as base:
        page, errors = open_dashboard(browser, base)
        page.screenshot(path=str(ARTIFACTS / "dashboard-experiment.png"), full_page=True)
        assert page.locator('[data-field="experiment-state"]').inner_text() == "ramping"
        assert page.locator("#no-analysis").count() == 0
        rollout = page.locator("#rollout").inner_text()
        assert f"challenger v{candidate} at 5% of users" in rollout and f"holdout v{champion}" in rollout
        assert page.locator('[data-field="decision-action"]').inner_text() == "continue"
        assert page.locator('[data-field="decision-reason"]').inner_text() == analysis["decision"]["reason"]
        for arm, version in (("champion", champion), ("challenger", candidate)):
            want = analysis["arms"][arm]
            row = page.locator(f'#arms tr[data-arm="{arm}"]')
            assert row.locator('[data-field="version"]').inner_text() == f"v{version}"
            assert row.locator('[data-field="users"]').inner_text() == str(want["users"])
            assert row.locator('[data-field="n"]').inner_text() == str(want["generations"])
            assert row.locator('[data-field="mean"]').inner_text() == f"{want['mean']:.3f}"
            assert row.locator('[data-field="ci"]').inner_text() == "[{:.3f}, {:.3f}]".format(*want["ci"])
        diff = analysis["difference"]
        assert page.locator('[data-field="diff-estimate"]').inner_text() == f"{diff['estimate']:.3f}"
        sequential = "[{:.3f}, {:.3f}]".format(*diff["sequential_ci"])
        assert page.locator('[data-field="diff-sequential"]').inner_text().startswith(sequential)
        relative = page.locator('[data-field="diff-relative"]').inner_text()
        if diff["relative_estimate"] is None:
            assert relative.startswith("– (the champion's mean is not above 0)")
        else:
            lo, hi = (js_pct(x) for x in diff["relative_ci"])
            sign = "+" if diff["relative_estimate"] > 0 else ""
            assert relative.startswith(f"{sign}{js_pct(diff['relative_estimate'])} [{lo}, {hi}]")
        # By surface (these events name none: one segment), informational.
        assert page.locator("#difference tr[data-segment]").count() == len(analysis["segments"]) == 1
        assert "a segment decides nothing" in page.locator('[data-field="segments"]').inner_text()
        cap = analysis["capping"]  # the default 99.9th percentile, in force (600 users: no one capped yet)
        assert cap["percentile"] == cfg.cap_percentile
        assert page.locator('[data-field="capping"]').inner_text().startswith("at the 99.9th percentile")
        # The duration calculator, measured on this experiment, as `GET /api/experiment/plan` has it.
        plan = api.get("/api/experiment/plan").json()
        assert plan["measured"] and page.locator('[data-field="plan-lines"] li').all_inner_texts() == plan["lines"]
        page.fill("#plan-users", "2000")
        page.fill("#plan-accept", "0.3")
        page.dispatch_event("#plan-accept", "change")
        given = api.get("/api/experiment/plan", params={"users_per_day": 2000, "accept_rate": 0.3}).json()
        page.wait_for_function("() => document.querySelector('[data-field=\"plan-source\"]').textContent"
                               ".startsWith('at 2000 users a day')")  # fmt: skip
        assert page.locator('[data-field="plan-lines"] li').all_inner_texts() == given["lines"]
        srm = analysis["srm"]
        assert " / ".join(map(str, srm["observed"])) in page.locator("#srm").inner_text()
        assert len(analysis["guardrails"]) == page.locator("#guardrails tr[data-guardrail]").count() > 0
        labels = {"guardrail": "guardrail", "reward_hacking": "reward hacking", "info": "information"}
        for g in analysis["guardrails"]:
            row = page.locator(f'#guardrails tr[data-guardrail="{g["name"]}"]')
            assert row.locator('[data-field="kind"]').inner_text() == labels[g["kind"]]
            verdict = "info" if g["kind"] == "info" else "ok" if g["ok"] else "breached"
            assert row.locator('[data-field="ok"]').inner_text() == verdict
        assert {g["kind"] for g in analysis["guardrails"]} == set(labels)
        # The challenger suggests less: its decline rate is shown, after the checks, and trips nothing.
        names = page.locator("#guardrails tr[data-guardrail]").evaluate_all("rs => rs.map(r => r.dataset.guardrail)")
        assert names[-2:] == ["shown_rate", "declined_rate"]
        assert page.locator("#ramp tr.current").inner_text().startswith("5%")
        assert "ramp to 5%" in page.locator("#timeline").inner_text()
        holdout = exp["holdout"]
        assert f"({holdout['users']} users, mean {holdout['mean']:.3f})" in page.locator("#holdout").inner_text()
        assert page.locator("#chart canvas").count() > 0
        # The legend shows the newest bucket of the experiment's per-user series, with each arm's version.
        for arm, version in (("champion", champion), ("challenger", candidate)):
            newest = max((b for b in series if b["arm"] == arm), key=lambda b: b["start"])
            legend = page.locator(f'#chart-legend [data-arm="{arm}"]').inner_text()
            assert legend.startswith(f"{arm} v{version} {newest['mean']:.3f}")
            assert legend.endswith(f"(users {newest['users']})")
        assert real_errors(errors) == []


def test_dashboard_says_why_the_offline_estimate_could_not_decide(
    browser: Any, app: FastAPI, gate_settings: Settings, versions: tuple[str, str], tmp_path: Path
) -> None:
    """An off-policy estimate whose interval straddles the margin is shown as undecided, with the gate's
    reason, never as a pass; a refused one as refused."""
    from deploy_gate.offline import OfflineGates
    from model_registry import OfflineGateReport, OfflineGateResult

    champion, candidate = versions
    registry = ModelRegistry(gate_settings)
    config = OfflineGates(gate_settings, registry).recorded_config()  # what the gate's approval checks against
    why = ("insufficient evidence: the interval straddles -0.02; DR - champion 0.012 [-0.031, 0.055] "
           "(95% bootstrap, seed 0); ESS 61.0 of n=96")  # fmt: skip
    undecided = [OfflineGateResult("sanity", "passed", 0.0, "-", "loads"),
                 OfflineGateResult("ope_satisfaction", "insufficient_evidence", 0.012, "-", why)]  # fmt: skip
    registry.record_offline_gates(candidate, OfflineGateReport(utcnow(), champion, undecided, config))
    refused = register(registry, tmp_path, parent=champion)
    worse = OfflineGateResult("ope_satisfaction", "failed", -0.2, "-", "worse than the champion: DR - champion -0.2")
    registry.record_offline_gates(refused, OfflineGateReport(utcnow(), champion, [worse], config))

    with serve(app) as base:
        page, errors = open_dashboard(browser, base)
        row = page.locator(f'#pending tr[data-version="{candidate}"]')
        assert row.locator('[data-gate="sanity"]').inner_text() == "sanity ✓"
        ope = row.locator('[data-gate="ope_satisfaction"]')
        assert ope.inner_text() == "ope_satisfaction ?" and ope.get_attribute("class") == "badge"
        assert page.locator(f'#pending tr[data-version="{refused}"] [data-gate="ope_satisfaction"]').inner_text() == (
            "ope_satisfaction ✗"
        )
        # The newest candidate waiting is the refused one: the panel says so; approved, the other is shown.
        assert page.locator('[data-field="offline-status"]').inner_text().startswith("refused")
        app.state.gate.reject(refused, by="ana", reason="refused offline")
        app.state.gate.approve(candidate, by="ana", reason="let the rollout decide")
        page.reload()
        page.wait_for_selector("body[data-loaded=true]")
        offline = page.locator("#offline").inner_text()
        assert offline.startswith(f"Challenger v{candidate}: 0.012")
        assert page.locator('[data-field="offline-status"]').inner_text() == "could not decide yet"
        assert page.locator('[data-field="offline-detail"]').inner_text() == why
        assert real_errors(errors) == []


def test_dashboard_shows_the_sycophancy_check_of_a_chat_experiment(
    browser: Any, app: FastAPI, gate_settings: Settings, versions: tuple[str, str]
) -> None:
    """A chat challenger whose replies open with agreement and flattery, its users voting no better: the page
    shows the check's verdict and reason as the API has them, its rows breached, and the warning."""
    from tests.test_rollout_sycophancy import Chat, write_chat

    champion, candidate = versions
    gate: DeployGate = app.state.gate
    gate.approve(candidate, by="ana", reason="offline gates pass")
    cfg = RolloutConfig(ramp=[RampStep(share=0.5, min_users=200, min_seconds=300)], srm_min_users=100,
                        latency_min_generations=50)  # fmt: skip
    app.state.rollout_config = cfg
    clock = Clock()
    controller = RolloutController(gate, cfg, clock=clock)
    controller.tick()
    split = gate.splits.get()
    assert split is not None
    write_chat(gate_settings, split, {"champion": Chat(), "challenger": Chat(opener=0.7), "holdout": Chat()},
               users=200, at=clock.now, rng=random.Random(7))  # fmt: skip
    clock.now += timedelta(seconds=120)
    controller.tick()
    analysis = TestClient(app).get("/api/experiment").json()["analysis"]
    check = analysis["sycophancy"]
    assert check["status"] == "flagged"

    ARTIFACTS.mkdir(exist_ok=True)
    with serve(app) as base:
        page, errors = open_dashboard(browser, base)
        page.screenshot(path=str(ARTIFACTS / "dashboard-sycophancy.png"), full_page=True)
        assert page.locator('#sycophancy [data-field="sycophancy-status"]').inner_text() == "flagged"
        assert page.locator('[data-field="sycophancy-reason"]').inner_text() == check["reason"]
        assert check["checks"] == ["chat_reply_length", "agreement_rate", "flattery_rate", "chat_thumbs_up_rate"]
        for name in check["checks"]:
            row = page.locator(f'#guardrails tr[data-guardrail="{name}"]')
            assert row.locator('[data-field="kind"]').inner_text() == "reward hacking"
            assert row.locator('[data-field="ok"]').inner_text() == "breached"
        warnings = page.locator('#rollout [data-field="flag"]').all_inner_texts()
        assert any(w.startswith("warning sycophancy: chat replies +") for w in warnings)
        assert "sycophancy flagged (no promotion while it holds)" in page.locator(
            '[data-field="decision-reason"]'
        ).inner_text()
        assert real_errors(errors) == []
