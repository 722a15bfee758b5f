"""The trainer's HTTP surface: status and a manual trigger, served by the scheduler process.

`POST /api/run` moves the scheduled job's next run to now, so a manual cycle still goes
through the replica-wide lock and the persistent schedule (it never trains beside a
running cycle). It needs the ML ops bearer token (`FLYWHEEL_APPROVAL_TOKEN`). `/metrics`, `/healthz` and
`/readyz` are the ones every process answers (`flywheel.ops`).
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Header, HTTPException

from flywheel.ops import ops_router
from flywheel.settings import Settings
from trainer.scheduler import TrainerScheduler


def create_app(settings: Settings, scheduler: TrainerScheduler) -> FastAPI:
    app = FastAPI(title="Flywheel trainer")

    def require_token(authorization: str | None) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), settings.approval_token.encode()):
            raise HTTPException(401, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"})

    app.include_router(ops_router(scheduler.health))

    @app.get("/api/status")
    def status() -> dict[str, Any]:
        next_run = scheduler.next_run_time()
        return {
            "interval_s": scheduler.interval_s,
            "next_run_at": next_run.isoformat() if next_run else None,
            "recent": [
                {"status": r.status, "reason": r.reason, "version": r.version, "parent_version": r.parent_version,
                 "sample_count": r.sample_count}
                for r in scheduler.results[-10:]
            ],
        }

    @app.post("/api/run", status_code=202)
    def run(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        require_token(authorization)
        scheduler.run_now()
        next_run = scheduler.next_run_time()
        return {"scheduled_at": next_run.isoformat() if next_run else None}

    return app
