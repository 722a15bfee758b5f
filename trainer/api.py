"""The trainer's HTTP surface: status and a manual trigger, served by the scheduler process.

`POST /api/run` moves the scheduled job's next run to now, so a manual cycle still goes
through the replica-wide lock and the persistent schedule (it never trains beside a
running cycle). It needs the bearer token of an approver (issued with `flywheel gate tokens
issue`, from the token store the gate uses) or the bootstrap admin token
(`FLYWHEEL_APPROVAL_TOKEN`): no token or an unknown / revoked one is 401, a viewer's 403. `/metrics`,
`/healthz` and `/readyz` are the ones every process answers (`flywheel.ops`); `/metrics` on
`FLYWHEEL_TRAINER_METRICS_PORT` instead when that is set.
"""

from __future__ import annotations

import logging
from typing import Any

import sqlalchemy.exc
from fastapi import FastAPI, Header, HTTPException

from flywheel.identity import Authenticator, NotAllowed, NotAuthenticated
from flywheel.ops import add_ops
from flywheel.settings import Settings
from trainer.scheduler import TrainerScheduler

log = logging.getLogger(__name__)


def create_app(
    settings: Settings, scheduler: TrainerScheduler, *, authenticator: Authenticator | None = None
) -> FastAPI:
    app = FastAPI(title="Flywheel trainer")
    auth = authenticator or Authenticator(settings)

    def require_approver(authorization: str | None) -> str:
        try:
            return auth.require(authorization, "approver").name
        except NotAuthenticated as exc:
            raise HTTPException(401, str(exc), headers={"WWW-Authenticate": "Bearer"}) from None
        except NotAllowed as exc:
            raise HTTPException(403, str(exc)) from None
        except sqlalchemy.exc.OperationalError:
            log.warning("the token store does not answer", exc_info=True)
            raise HTTPException(503, "the token store does not answer; try again shortly") from None

    add_ops(app, scheduler.health, metrics_port=settings.trainer_metrics_port, host=settings.bind_host)

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
        who = require_approver(authorization)
        log.info("training cycle requested now by %s", who)
        scheduler.run_now()
        next_run = scheduler.next_run_time()
        return {"scheduled_at": next_run.isoformat() if next_run else None}

    return app
