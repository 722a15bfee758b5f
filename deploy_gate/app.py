"""The deploy gate service: API, dashboard page and the one error handler.

`create_app(settings)` wires the real registry (MLflow), Redis and the token store; on start
it creates the traffic split with the champion when none exists, so serving has something to
follow. Every response carries the security headers (`deploy_gate.security`); errors map to
statuses through `deploy_gate.errors.as_gate_error` (a dependency down is 503).
When Redis or the registry is down at start, the app starts anyway, logs the outage once, and creates
the split once they answer (`flywheel.ops`: backoff, `/readyz` names what is down).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from deploy_gate.api import read, write
from deploy_gate.audit import AuditLog
from deploy_gate.dashboard import STATIC_DIR, page
from deploy_gate.errors import MAPPED, GateError, NoChampion, Unauthorized, as_gate_error
from deploy_gate.gate import DeployGate
from deploy_gate.policy import AutoApprove
from deploy_gate.rollout.api import router as experiment_router
from deploy_gate.security import SECURITY_HEADERS, add_security_headers, token_holder
from flywheel.identity import Authenticator
from flywheel.logs import redact_access_log
from flywheel.ops import ProcessHealth, add_ops, mlflow_dependency, redis_dependency
from flywheel.ops.rate_limit import add_rate_limit
from flywheel.settings import Settings

log = logging.getLogger(__name__)

AUTO_APPROVE_EVERY_S = 5.0


def create_app(
    settings: Settings, *, gate: DeployGate | None = None, authenticator: Authenticator | None = None
) -> FastAPI:
    """The gate's FastAPI app; pass `gate` to share one already built (tests, `flywheel up`)."""

    health = ProcessHealth("gate", [redis_dependency(settings), mlflow_dependency(settings)])

    def prepare(stop: threading.Event) -> bool:
        """Build the gate and make sure of the split; False when a backend is down (logged once)."""
        try:
            if getattr(app.state, "gate", None) is None:
                gate = DeployGate.from_settings(settings)
                gate.audit = app.state.audit
                app.state.gate = gate
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

    def auto_approve(stop: threading.Event) -> None:
        policy: AutoApprove | None = None
        while not stop.wait(AUTO_APPROVE_EVERY_S):
            gate = getattr(app.state, "gate", None)
            if gate is None:
                continue
            policy = policy or AutoApprove(gate)
            try:
                policy.tick()
            except Exception:  # audited by the policy; the next tick tries again
                log.warning("auto-approve tick failed", exc_info=False)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = threading.Event()
        # A backend down at start must not keep the dashboard down: it is waited for in the background.
        if not await run_in_threadpool(prepare, stop):
            threading.Thread(target=keep_preparing, args=(stop,), name="gate-prepare", daemon=True).start()
        if settings.auto_approve:
            threading.Thread(target=auto_approve, args=(stop,), name="gate-auto-approve", daemon=True).start()
        yield
        stop.set()

    # No /docs or /redoc: Swagger UI loads its script from a CDN, which the CSP forbids;
    # /openapi.json still describes the API.
    app = FastAPI(title="Flywheel deploy gate", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.gate = gate
    app.state.authenticator = authenticator or Authenticator(settings)
    # One audit log for the app's actions and its gate's (an injected gate brings its own).
    app.state.audit = gate.audit if gate is not None else AuditLog.from_settings(settings)
    # The last middleware added runs first: the rate limit's 429 passes through the security headers too.
    add_rate_limit(app, settings.gate_rate_limit, service="gate", trusted_proxies=settings.trusted_proxies,
                   token_of=token_holder(app.state.authenticator))  # fmt: skip
    add_security_headers(app)
    redact_access_log()  # a token sent in a query string is refused, and never written by the access log
    app.state.health = health

    def answer(err: GateError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(err, Unauthorized) else None
        return JSONResponse(
            {"error": err.code, "detail": str(err)}, status_code=err.status_code, headers=headers
        )

    async def known_error(request: Request, exc: Exception) -> Response:
        err = as_gate_error(exc)
        if err is None:  # MAPPED and as_gate_error disagree: a bug, answered as one
            return await internal_error(request, exc)
        if err.status_code >= 500:  # no traceback: a dependency's message may name its URL
            log.warning("%s %s: %s (%s)", request.method, request.url.path, err, type(exc).__name__)
        return answer(err)

    for cls in MAPPED:
        app.add_exception_handler(cls, known_error)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own answer echoes the input, and fails (500) when that input is bytes that
        # are not UTF-8: say where and what is wrong, never what was sent.
        errors = [{k: e[k] for k in ("type", "loc", "msg") if k in e} for e in exc.errors()]
        return JSONResponse({"error": "invalid_request", "detail": errors}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # Never echo an unknown exception's text: it may hold paths, URIs or secrets. This handler
        # runs outside the middleware, so it adds the security headers itself.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"error": "internal", "detail": "internal error; see the gate's log"},
            status_code=500,
            headers=SECURITY_HEADERS,
        )

    app.include_router(read)
    app.include_router(write)
    app.include_router(experiment_router)
    app.include_router(page)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    add_ops(app, health, metrics_port=settings.gate_metrics_port, host=settings.bind_host)

    return app
