"""The experiment's HTTP endpoints: the analysis the dashboard shows, and the rollout's manual actions.

Reads (`GET /api/experiment`, `/api/experiment/series`) need no token, like the gate's other
reads. A manual ramp, freeze or resume needs an approver; lifting a quarantine needs an admin.
Each change is plan-then-apply (`?dry_run=true` answers the plan only) and records the token's
identity.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from deploy_gate.api import ActionResult, check_bucket, get_gate
from deploy_gate.gate import DeployGate
from deploy_gate.plan import Plan
from deploy_gate.rollout import data
from deploy_gate.rollout.analysis import series
from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.controller import RolloutController, challenger_live
from deploy_gate.rollout.models import DurationPlanView, ExperimentView, SeriesBucket, SeriesView
from flywheel.contract import utcnow
from flywheel.identity import Authenticator, Identity

router = APIRouter(prefix="/api", tags=["experiment"])
Gate = Annotated[DeployGate, Depends(get_gate)]


def rollout_config(request: Request) -> RolloutConfig:
    config: RolloutConfig | None = getattr(request.app.state, "rollout_config", None)
    if config is None:
        config = request.app.state.rollout_config = RolloutConfig()
    return config


Config = Annotated[RolloutConfig, Depends(rollout_config)]


def _role(request: Request, authorization: str | None, role: Literal["approver", "admin"]) -> Identity:
    auth: Authenticator = request.app.state.authenticator
    return auth.require(authorization, role)


def approver(request: Request, authorization: Annotated[str | None, Header()] = None) -> Identity:
    return _role(request, authorization, "approver")


def admin(request: Request, authorization: Annotated[str | None, Header()] = None) -> Identity:
    return _role(request, authorization, "admin")


class RampRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    share: float = Field(gt=0, le=1, description="The challenger's new share of users.")
    state: Literal["running", "paused"] = Field("running", description="paused: freeze the ramp here.")
    reason: str = Field(min_length=1, max_length=2000)


class ReasonRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=2000)


def _run(gate: DeployGate, plan: Plan, dry_run: bool) -> ActionResult:
    if dry_run:
        return ActionResult(applied=False, plan=plan.to_dict(), split=plan.split_after)
    return ActionResult(applied=True, plan=plan.to_dict(), split=gate.apply(plan))


@router.get("/experiment")
def get_experiment(gate: Gate, config: Config) -> ExperimentView:
    """The experiment's state, ramp, last analysis and decision, timeline and holdout."""
    return RolloutController(gate, config).view()


@router.get("/experiment/plan")
def get_plan(
    gate: Gate,
    config: Config,
    users_per_day: Annotated[float | None, Query(gt=0, description="New users a day, all arms.")] = None,
    accept_rate: Annotated[float | None, Query(gt=0, le=1, description="The champion's accepts a generation.")] = None,
) -> DurationPlanView | None:
    """The duration calculator (`flywheel gate plan`) under the rollout's configuration. What is not given is
    measured on the running experiment: its users so far over its days, the champion's accept rate; null when
    neither is given nor measurable yet (no experiment, or no user)."""
    from deploy_gate.rollout.duration import plan

    measured = users_per_day is None or accept_rate is None
    if measured:
        rec = RolloutController(gate, config).record()
        a = rec.analysis
        if users_per_day is None and a is not None and rec.started_at is not None:
            # Up to its last look (the controller's clock), not now: an experiment stopped long ago is not slower.
            days = max(((rec.looked_at or utcnow()) - rec.started_at).total_seconds(), 60.0) / 86400
            seen = sum(arm.users for arm in a.arms.values())
            users_per_day = seen / days if seen else None
        if accept_rate is None:
            power = (a.power if a is not None else None) or rec.plan
            accept_rate = power.champion_accept_rate if power is not None else None
    if users_per_day is None or not accept_rate:
        return None
    p = plan(config, users_per_day, accept_rate)
    return DurationPlanView(
        users_per_day=users_per_day, accept_rate=accept_rate, measured=measured, reachable=p.reachable,
        ramp_days=p.ramp_days, max_days=p.max_days, users=p.users, promoted_if_margin_worse=p.promoted_if_margin_worse,
        promoted_if_10pct_worse=p.promoted_if_10pct_worse, lines=p.lines(config, accept_rate),
    )  # fmt: skip


@router.get("/experiment/series")
def get_series(gate: Gate, config: Config, bucket: str = "1h") -> SeriesView:
    """Per-arm satisfaction (per-user ratio and its delta-method interval) per time bucket, on the reward
    versions the experiment decides on."""
    check_bucket(bucket)
    split = gate.splits.get()
    rec = RolloutController(gate, config).record()
    if split is None:
        return SeriesView(buckets=[])
    arms = {"champion": split.champion_version}
    challenger = split.challenger_version if challenger_live(split) else rec.challenger
    if challenger:
        arms["challenger"] = challenger
    if not challenger_live(split) and rec.champion:
        arms["champion"] = rec.champion
    # The experiment's own reward versions (recorded at its start), so the chart shows what it decides on;
    # before it has any, the active one of each surface.
    versions = rec.reward.versions() or None
    rewards, _ = data.reward_rows(gate.settings.lake_root, arms, since=rec.started_at, reward_versions=versions)
    return SeriesView(
        buckets=[
            SeriesBucket(start=s, arm=a, users=n, mean=m, ci=ci) for s, a, n, m, ci in series(rewards, bucket, config)
        ]
    )


@router.post("/experiment/ramp")
def ramp(
    body: RampRequest,
    gate: Gate,
    request: Request,
    who: Annotated[Identity, Depends(approver)],
    dry_run: Annotated[bool, Query()] = False,
) -> ActionResult:
    """Set the challenger's share by hand, freeze the ramp (`state: paused`) or resume it."""
    return _run(gate, gate.plan_ramp(body.share, by=who.name, reason=body.reason, state=body.state), dry_run)


@router.post("/versions/{version}/unquarantine")
def unquarantine(
    version: str,
    body: ReasonRequest,
    gate: Gate,
    who: Annotated[Identity, Depends(admin)],
    dry_run: Annotated[bool, Query()] = False,
) -> ActionResult:
    """Lift a rolled-back version's quarantine: its served data may be trained on again (admin only)."""
    return _run(gate, gate.plan_unquarantine(version, by=who.name, reason=body.reason), dry_run)
