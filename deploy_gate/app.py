"""The deploy gate service: API, dashboard page and the one error handler.

`create_app(settings)` wires the real registry (MLflow) and Redis; on start it creates the
traffic split with the champion when none exists, so serving has something to follow. When Redis or
the registry is down at start, the app starts anyway, logs the outage once, and creates the split
once they answer (`flywheel.ops`: backoff, `/readyz` names what is down).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, JSONResponse

from deploy_gate.api import Gate, check_bucket, read, write
from deploy_gate.dashboard import render_dashboard
from deploy_gate.errors import GateError, NoChampion, Unauthorized
from deploy_gate.gate import DeployGate
from deploy_gate.metrics import arm_metrics
from flywheel.ops import ProcessHealth, mlflow_dependency, ops_router, redis_dependency
from flywheel.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings, *, gate: DeployGate | None = None) -> FastAPI:
    """The gate's FastAPI app; pass `gate` to share one already built (tests, `flywheel up`)."""

    health = ProcessHealth("gate", [redis_dependency(settings), mlflow_dependency(settings)])

    def prepare(stop: threading.Event) -> bool:
        """Build the gate and make sure of the split; False when a backend is down (logged once)."""
        try:
            if getattr(app.state, "gate", None) is None:
                app.state.gate = DeployGate.from_settings(settings)
            split = app.state.gate.ensure_split()
            log.info("traffic split ready", extra={"champion": split.champion_version, "state": split.state})
        except NoChampion as exc:  # serving waits for a split; say why there is none yet
            log.warning("no traffic split yet", extra={"detail": str(exc)})
        except Exception as exc:
            dep = health.blame(exc)
            if dep is None:
                log.exception("could not check the traffic split at start")
                return True
            dep.failed(exc)
            return False
        for dep in health.dependencies:
            dep.recovered()
        return True

    def keep_preparing(stop: threading.Event) -> None:
        failures = 1
        while not stop.wait(min(5.0, 0.25 * 2**failures)) and not prepare(stop):
            failures += 1

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        # A backend down at start must not keep the dashboard down: it is waited for in the background.
        if not await run_in_threadpool(prepare, stop):
            threading.Thread(target=keep_preparing, args=(stop,), name="gate-prepare", daemon=True).start()
        yield
        stop.set()

    app = FastAPI(title="Flywheel deploy gate", lifespan=lifespan)
    app.state.settings = settings
    app.state.gate = gate
    app.state.health = health

    @app.exception_handler(GateError)
    async def gate_error(request: Request, exc: GateError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        return JSONResponse(
            {"error": exc.code, "detail": str(exc)}, status_code=exc.status_code, headers=headers
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Never echo an unknown exception's text: it may hold paths, URIs or secrets.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"error": "internal", "detail": "internal error; see the gate's log"}, status_code=500
        )

    app.include_router(read)
    app.include_router(write)

    @app.get("/", response_class=HTMLResponse)
    def dashboard(gate: Gate, bucket: str = "1h") -> HTMLResponse:
        check_bucket(bucket)
        status = gate.status()
        page = render_dashboard(status, gate.history(20), arm_metrics(settings, bucket=bucket))
        return HTMLResponse(page)

    app.include_router(ops_router(health))

    return app
