"""The gate's HTTP API: read the versions, split, metrics and audit log; approve, reject, promote, roll back.

Changes need `Authorization: Bearer <token>` of an identity with the approver role (or the
bootstrap admin token, `FLYWHEEL_APPROVAL_TOKEN`); the audit log records that identity's name
and role, never a name the client typed. Every change says why, and `?dry_run=true` answers
the plan without applying it (plan-then-apply over HTTP). Every attempt by a known identity,
refused ones included (a viewer's, a revoked token's, a version that is not pending), is in the
audit log (`GET /api/audit`) before the caller gets its answer. An attempt without a token, or with
one nobody was given, is not an action of anyone: it is counted
(`flywheel_gate_unauthenticated_total{action}`) and logged at most once per 10 s, never written to
the durable audit, so nobody can fill it (or push real entries off the dashboard) anonymously. A known token
that may not act (a viewer's, a revoked one) is audited refused at most once per token per
`REFUSAL_AUDIT_WINDOW_S`; its other refusals in the window are counted
(`flywheel_gate_refusals_not_audited_total{action,role}`) and logged at most once per 10 s, so a held token cannot
fill the audit either.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from prometheus_client import Counter
from pydantic import BaseModel, ConfigDict, Field

from deploy_gate.audit import AuditEntry, AuditLog, AuditPage
from deploy_gate.errors import InvalidRequest
from deploy_gate.gate import DeployGate
from deploy_gate.metrics import ArmMetrics, arm_metrics
from deploy_gate.plan import Plan
from deploy_gate.views import VersionView
from flywheel.contract import TrafficSplit, utcnow
from flywheel.identity import Authenticator, Identity, NotAuthenticated, Role
from flywheel.ops.rate_limit import ThrottledLog
from flywheel.settings import Settings
from model_registry import UnknownVersion

log = logging.getLogger(__name__)
UNAUTHENTICATED = Counter(
    "flywheel_gate_unauthenticated_total", "Release attempts without a known token (not audited)", ["action"]
)
_unauthenticated_log = ThrottledLog(log, every_s=10.0)
REFUSALS_NOT_AUDITED = Counter(
    "flywheel_gate_refusals_not_audited_total",
    "Refused attempts of a known token past its one audited refusal per window",
    ["action", "role"],
)
_refusal_log = ThrottledLog(log, every_s=10.0)
REFUSAL_AUDIT_WINDOW_S = 600.0


class RefusalWindow:
    """When each token's last audited refusal was: at most one per token per `window_s`. In memory, per process:
    bounded by the tokens ever issued (only known tokens get here)."""

    def __init__(self, window_s: float = REFUSAL_AUDIT_WINDOW_S) -> None:
        self.window_s = window_s
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def first(self, key: str) -> bool:
        """Whether a refusal for `key` is the first in its window (and so is audited); records it if so."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.window_s:
                return False
            self._last[key] = now
            return True


def refusal_window(request: Request) -> RefusalWindow:
    """The app's `RefusalWindow` (one per app: made on first use)."""
    state = request.app.state
    if getattr(state, "refusals", None) is None:
        state.refusals = RefusalWindow()
    window: RefusalWindow = state.refusals
    return window


def unauthenticated(action: str, who: str, request: Request) -> None:
    UNAUTHENTICATED.labels(action).inc()
    client = request.client.host if request.client else "unknown"
    _unauthenticated_log.warning("unauthenticated release attempt refused", action=action, who=who, client=client)


BUCKET = re.compile(r"^[1-9][0-9]{0,3}(m|h|d)$")


def check_bucket(bucket: str) -> str:
    if not BUCKET.match(bucket):
        raise InvalidRequest("bucket must look like 5m, 1h or 1d (a number and m, h or d)")
    return bucket


def get_gate(request: Request) -> DeployGate:
    gate: DeployGate = request.app.state.gate
    return gate


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_audit(request: Request) -> AuditLog:
    audit: AuditLog = request.app.state.audit
    return audit


Gate = Annotated[DeployGate, Depends(get_gate)]
Audit = Annotated[AuditLog, Depends(get_audit)]
# The raw header: an action checks it itself, inside its audited attempt, so a refused token is recorded.
Authorization = Annotated[str | None, Header()]


class ActionRequest(BaseModel):
    """Why a change is made. Who makes it is the token's identity, so there is no `by` field."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=2000, description="Why; kept in the history.")


class ActionResult(BaseModel):
    applied: bool
    plan: dict[str, Any]
    split: TrafficSplit | None


class SplitView(BaseModel):
    split: TrafficSplit | None
    history: list[TrafficSplit]


class GateChangeView(BaseModel):
    state: str
    previous: str
    by: str
    at: datetime
    reason: str


class OfflineGateView(BaseModel):
    """One offline gate's verdict; `status`: passed, failed, or "insufficient_evidence" / "undecided" (never block)."""

    name: str
    passed: bool
    status: str
    value: float | None
    bound: str
    detail: str


class VersionDetail(VersionView):
    history: list[GateChangeView]
    audit: list[AuditEntry]  # every attempt on this version, allowed or refused, newest first
    offline_gates: list[OfflineGateView] = Field(
        default_factory=list, description="The last offline-gate report; empty until the gates have run."
    )
    offline_gates_checked_at: datetime | None = None
    offline_gates_champion: str | None = Field(default=None, description="The champion they compared against.")


read = APIRouter(prefix="/api", tags=["read"])
write = APIRouter(prefix="/api", tags=["change"])


@read.get("/versions")
def list_versions(gate: Gate) -> list[VersionView]:
    return gate.status().versions


@read.get("/versions/{version}")
def get_version(version: str, gate: Gate) -> VersionDetail:
    for v in gate.status().versions:
        if v.version == version:
            history = [
                GateChangeView(state=c.state, previous=c.previous, by=c.by, at=c.at, reason=c.reason)
                for c in gate.registry.gate_history(version)
            ]
            report = gate.registry.offline_gates(version)
            gates = [
                OfflineGateView(
                    name=r.name, passed=r.passed, status=r.status, value=r.value, bound=r.bound, detail=r.detail
                )
                for r in (report.results if report else [])
            ]
            return VersionDetail(
                **v.model_dump(),
                history=history,
                audit=gate.audit.entries(100, target=f"version {version}"),
                offline_gates=gates,
                offline_gates_checked_at=report.checked_at if report else None,
                offline_gates_champion=report.champion if report else None,
            )
    raise UnknownVersion(f"no model version {version!r} in the registry")  # 404 (deploy_gate.errors)


class Me(BaseModel):
    name: str
    role: str
    can_approve: bool


@read.get("/me")
def whoami(request: Request, authorization: Authorization = None) -> Me:
    """Whose the bearer token is (401 if nobody's): the dashboard enables its buttons for approvers."""
    auth: Authenticator = request.app.state.authenticator
    identity = auth.identify(authorization)
    return Me(name=identity.name, role=identity.role, can_approve=identity.allows("approver"))


@read.get("/audit")
def get_audit_log(audit: Audit, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> AuditPage:
    """The newest audit entries, newest first: every gate action, allowed or refused."""
    return AuditPage(entries=audit.entries(limit))


@read.get("/split")
def get_split(gate: Gate, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> SplitView:
    return SplitView(split=gate.splits.get(), history=gate.history(limit))


@read.get("/metrics/arms")
def get_arm_metrics(
    request: Request,
    bucket: str = "1h",
    reward_version: str | None = None,
    since_hours: Annotated[float | None, Query(gt=0)] = None,
) -> ArmMetrics:
    """n, mean reward and 95% interval per arm and model version, overall and per time bucket."""
    check_bucket(bucket)
    since = utcnow() - timedelta(hours=since_hours) if since_hours else None
    return arm_metrics(get_settings(request), bucket=bucket, reward_version=reward_version, since=since)


DryRun = Annotated[bool, Query(description="Answer the plan without applying it.")]


def act(
    request: Request,
    authorization: str | None,
    action: str,
    version: str | None,
    reason: str,
    make_plan: Callable[[DeployGate, str], Plan],
    dry_run: bool,
    needs: Role = "approver",
) -> ActionResult:
    """Authenticate, plan and (unless a dry run) apply one action, recording the attempt either way."""
    gate: DeployGate = get_gate(request)
    audit = get_audit(request)
    auth: Authenticator = request.app.state.authenticator
    target = f"version {version}" if version else f"experiment {gate.experiment}"
    try:
        found = auth.identify(authorization)
        known: Identity | None = found
        who, role = found.name, str(found.role)
    except NotAuthenticated:
        # No token, or one nobody was ever given: noise anyone can make, counted and logged (throttled), never
        # written to the durable audit. A revoked token names its former holder: that attempt is audited.
        who, role = auth.claimant(authorization)
        if role != "revoked":
            unauthenticated(action, who, request)
            raise
        known = None
    if (known is None or not known.allows(needs)) and not refusal_window(request).first(f"{role}:{who}"):
        # Refused, and this token's refusal is in the audit already this window: counted and logged, not written.
        REFUSALS_NOT_AUDITED.labels(action, role).inc()
        _refusal_log.warning("refused release attempt (audited once per token per window)", action=action, who=who,
                             role=role)  # fmt: skip
        auth.require(authorization, needs)  # raises the refusal the caller would have had
    with audit.attempt(action, who=who, role=role, target=target, reason=reason) as attempt:
        identity = known or auth.identify(authorization)  # a revoked token: refused here, and recorded
        auth.require(authorization, needs)  # a viewer's refusal is recorded under the viewer's name
        attempt.before = gate.snapshot(version)
        plan = make_plan(gate, identity.name)
        if plan.version:  # promote and roll back act on the challenger: name it, as `apply` does
            attempt.target = f"version {plan.version}"
        if dry_run:
            attempt.action = f"{action} (dry run)"
            audit.allowed(attempt, detail="planned, not applied: " + "; ".join(plan.describe()), after=None)
            return ActionResult(applied=False, plan=plan.to_dict(), split=plan.split_after)
        return ActionResult(applied=True, plan=plan.to_dict(), split=gate.apply(plan, role=identity.role))


@write.post("/versions/{version}/approve")
def approve(
    version: str,
    body: ActionRequest,
    request: Request,
    authorization: Authorization = None,
    dry_run: DryRun = False,
) -> ActionResult:
    return act(
        request,
        authorization,
        "approve",
        version,
        body.reason,
        lambda g, who: g.plan_approve(version, by=who, reason=body.reason),
        dry_run,
    )


@write.post("/versions/{version}/reject")
def reject(
    version: str,
    body: ActionRequest,
    request: Request,
    authorization: Authorization = None,
    dry_run: DryRun = False,
) -> ActionResult:
    return act(
        request,
        authorization,
        "reject",
        version,
        body.reason,
        lambda g, who: g.plan_reject(version, by=who, reason=body.reason),
        dry_run,
    )


@write.post("/promote")
def promote(
    body: ActionRequest, request: Request, authorization: Authorization = None, dry_run: DryRun = False
) -> ActionResult:
    return act(
        request,
        authorization,
        "promote",
        None,
        body.reason,
        lambda g, who: g.plan_promote(by=who, reason=body.reason),
        dry_run,
    )


@write.post("/rollback")
def rollback(
    body: ActionRequest, request: Request, authorization: Authorization = None, dry_run: DryRun = False
) -> ActionResult:
    return act(
        request,
        authorization,
        "rollback",
        None,
        body.reason,
        lambda g, who: g.plan_rollback(by=who, reason=body.reason),
        dry_run,
    )
