"""The deploy gate service: API, dashboard page and the one error handler.

`create_app(settings)` wires the real registry (MLflow) and Redis; on start it creates the
traffic split with the champion when none exists, so serving has something to follow.
"""

from __future__ import annotations

import logging
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
from flywheel.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings, *, gate: DeployGate | None = None) -> FastAPI:
    """The gate's FastAPI app; pass `gate` to share one already built (tests, `flywheel up`)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if getattr(app.state, "gate", None) is None:
            app.state.gate = await run_in_threadpool(DeployGate.from_settings, settings)
        try:
            split = await run_in_threadpool(app.state.gate.ensure_split)
            log.info("traffic split: champion %s, state %s", split.champion_version, split.state)
        except NoChampion as exc:  # serving waits for a split; say why there is none yet
            log.warning("no traffic split yet: %s", exc)
        except Exception:
            # A backend down at start must not keep the dashboard down; the first gate action
            # creates the split once the registry and Redis answer.
            log.exception("could not check the traffic split at start")
        yield

    app = FastAPI(title="Flywheel deploy gate", lifespan=lifespan)
    app.state.settings = settings
    app.state.gate = gate

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

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
