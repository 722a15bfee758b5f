"""The rollout controller: each tick reads the split and the lake, analyses, decides, and acts.

Every action goes through the gate's plan-then-apply (`DeployGate.plan_ramp`, `plan_promote`,
`plan_rollback`), recorded with the controller as the actor, so serving sees each transition
through the traffic split in Redis and the registry's history says who did it. The experiment's
ramp, timeline and last analysis live in Redis (`<prefix>rollout:<experiment>`), so a restarted
controller picks up where it left off and the gate's API answers without reading the lake.

A new experiment starts when the split names a challenger (and salt) the record does not know;
it ends when the controller or a person promotes or rolls back. A person pausing the split
freezes the controller; setting it running again resumes it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from typing import cast

from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field

from deploy_gate.errors import GateError
from deploy_gate.gate import DeployGate
from deploy_gate.plan import Plan
from deploy_gate.rollout import data
from deploy_gate.rollout.analysis import StepContext, analyse, bucket_for, cumulative_effect, plan
from deploy_gate.rollout.config import RolloutConfig
from deploy_gate.rollout.models import (
    AnalysisView,
    ExperimentState,
    ExperimentView,
    HoldoutView,
    PowerView,
    RampView,
    SrmPeriod,
    TimelineEntry,
)
from deploy_gate.rollout.reward_basis import RewardBasis
from flywheel.contract import TrafficSplit, utcnow

log = logging.getLogger(__name__)

_TICKS = Counter("flywheel_rollout_ticks", "Rollout controller looks at the experiment")
_DECISIONS = Counter("flywheel_rollout_decisions", "Decisions per look, by action", ["action"])
_SHARE = Gauge("flywheel_rollout_challenger_share", "The live challenger's share of users (0: none)")
# The no-data alarm: a live challenger with no rewarded user past its first step's minimum time (its traffic or
# rewards do not reach the lake); the rules roll it back once its absence cannot be chance, or at the end.
_NO_DATA = Gauge("flywheel_rollout_no_data", "1 while the live challenger has no rewarded user (the no-data alarm)")
_ENDED = Counter("flywheel_rollout_ended", "Experiments ended by the controller, by action and why", ["action", "why"])

CONTROLLER_ACTOR = "rollout-controller"
TIMELINE_MAX = 200


class ExperimentRecord(BaseModel):
    """What the controller keeps in Redis about the current (or last) experiment."""

    model_config = ConfigDict(extra="forbid")

    experiment: str = "default"
    challenger: str | None = None
    champion: str | None = None
    salt: str | None = None
    started_at: datetime | None = None
    state: ExperimentState = "idle"
    step: int = 0
    ramp: list[RampView] = Field(default_factory=list)
    timeline: list[TimelineEntry] = Field(default_factory=list)
    analysis: AnalysisView | None = None
    holdout: HoldoutView | None = None
    holdout_since: datetime | None = None
    # The shares in force since the SRM test was (re-)armed, as the split had them: what SRM tests against.
    srm_periods: list[SrmPeriod] = Field(default_factory=list)
    looked_at: datetime | None = None  # the last tick that looked at this experiment
    plan: PowerView | None = None  # before the challenger has rewards, from the champion's users
    # The reward versions it decides on, per surface, recorded at its start (reward_basis.py says why and how).
    reward: RewardBasis = Field(default_factory=RewardBasis)

    def note(self, at: datetime, event: str, by: str = CONTROLLER_ACTOR) -> None:
        self.timeline = [*self.timeline, TimelineEntry(at=at, event=event, by=by)][-TIMELINE_MAX:]


def challenger_live(split: TrafficSplit | None) -> bool:
    return bool(
        split and split.challenger_version and split.challenger_share > 0 and split.state in ("running", "paused")
    )


class RolloutController:
    def __init__(
        self, gate: DeployGate, config: RolloutConfig | None = None, *, clock: Callable[[], datetime] = utcnow
    ) -> None:
        self.gate = gate
        self.config = config or RolloutConfig()
        self.clock = clock
        self._key = f"{gate.settings.redis_prefix}rollout:{self.config.experiment}"
        self._cache = data.FileCache()  # each lake file parsed once over the controller's life

    # ---- state ---------------------------------------------------------------------------

    def record(self) -> ExperimentRecord:
        raw = self.gate.redis.get(self._key)
        return ExperimentRecord.model_validate_json(raw) if raw else ExperimentRecord(experiment=self.config.experiment)

    def _save(self, rec: ExperimentRecord) -> None:
        self.gate.redis.set(self._key, rec.model_dump_json())

    def view(self) -> ExperimentView:
        """The `GET /api/experiment` answer, from the stored record and the split (no lake read)."""
        rec, split = self.record(), self.gate.splits.get()
        # An ended experiment is shown as it ended until the next tick starts one for the split's new challenger
        # (approved since): its state beside the new version's name and share would say that version ended.
        ended = rec.state in ("promoted", "rolled_back")
        newer = split is not None and split.challenger_version != rec.challenger
        live = challenger_live(split) and not (ended and newer)
        return ExperimentView(
            experiment=rec.experiment,
            state=rec.state if (live or ended) else "idle",
            champion=split.champion_version if split else rec.champion,
            challenger=split.challenger_version if split and live else rec.challenger,
            holdout_version=split.holdout_version if split else None,
            share=split.challenger_share if split and live else 0.0,
            ramp=rec.ramp,
            step=rec.step,
            analysis=rec.analysis,
            timeline=rec.timeline,
            holdout=rec.holdout if split and split.holdout_version else None,
            srm_periods=rec.srm_periods,
            plan=rec.plan if rec.analysis is None or rec.analysis.no_data else None,
            bucket=bucket_for(
                ((rec.ramp[-1].left_at or rec.looked_at or rec.started_at) - rec.started_at).total_seconds()
                if rec.started_at and rec.ramp else self.config.max_duration_s
            ),
        )

    # ---- the loop ------------------------------------------------------------------------

    def run(self, stop: threading.Event, *, port: int | None = None) -> None:
        """Tick every `interval_s` until `stop`, serving /metrics, /healthz and /readyz (`flywheel.ops`)."""
        from flywheel.ops import (
            ProcessHealth,
            lake_dependency,
            mlflow_dependency,
            redis_dependency,
            run_loop,
            serve_ops,
        )
        from flywheel.ops.health import LOOP_STALE_AFTER_S

        settings = self.gate.settings
        # A step includes the wait between ticks: liveness allows several of them before it calls the loop wedged.
        health = ProcessHealth(
            "rollout", [redis_dependency(settings), mlflow_dependency(settings), lake_dependency(settings.lake_root)],
            loop_stale_after_s=max(LOOP_STALE_AFTER_S, 4 * self.config.interval_s),
        )

        def step() -> None:
            rec = self.tick()
            split = self.gate.splits.get()
            _SHARE.set(split.challenger_share if split and challenger_live(split) else 0.0)
            _TICKS.inc()
            if rec.analysis is not None:
                _DECISIONS.labels(rec.analysis.decision.action).inc()
            stop.wait(self.config.interval_s)

        port = self.config.metrics_port if port is None else port
        # Not run_worker: that freezes the heap (gc.freeze), which the command does, not an in-process caller.
        server = None
        if port:
            try:
                server = serve_ops(port, health, settings.bind_host)
            except OSError as exc:  # the port is taken: deciding matters more than being scraped
                log.error("rollout does not serve /metrics and health: port taken",
                          extra={"port": port, "detail": str(exc)})
        try:
            run_loop(step, stop, health)
        finally:
            if server is not None:
                server.stop()

    def tick(self) -> ExperimentRecord:
        """One look: analyse the live experiment and take at most one action."""
        now = self.clock()
        split = self.gate.splits.get()
        rec = self.record()
        if split is None:
            return rec
        split = self._ensure_holdout(split, rec, now)
        if not challenger_live(split):
            if rec.state in ("ramping", "holding", "frozen"):
                ended: ExperimentState = "promoted" if split.state == "promoted" else "rolled_back"
                rec.state = ended
                rec.note(now, f"experiment ended by hand: {split.reason}", by=split.changed_by)
            self._holdout(split, rec)
            self._save(rec)
            return rec
        if rec.challenger != split.challenger_version or rec.salt != split.salt:
            rec, split = self._start(split, now)
        if split.state == "paused" and rec.state == "ramping":
            rec.state = "frozen"
            rec.note(now, f"frozen by {split.changed_by}: {split.reason}", by=split.changed_by)
        elif split.state == "running" and rec.state == "frozen":
            rec.state = "ramping"
            rec.note(now, f"resumed at {split.challenger_share:.0%}", by=split.changed_by)
            # Re-armed: what froze it was seen and acted on; the test starts afresh from the resume.
            rec.srm_periods = [SrmPeriod(share=split.challenger_share, since=self._since(split, rec, now)[1])]
        self._track_share(rec, split, now)
        assert split.challenger_version is not None
        arms = {"champion": split.champion_version, "challenger": split.challenger_version}
        agg = data.load(self.gate.settings.lake_root, arms, since=rec.started_at, cache=self._cache,
                        pre_period_s=self.config.pre_period_s,
                        reward_versions=self._reward_versions(rec, now))  # fmt: skip
        step = self._step(rec)
        assert rec.started_at is not None
        starts = [r.entered_at for r in rec.ramp[: step.index + 1] if r.entered_at is not None]
        rec.analysis = analyse(agg, step, self.config, started_at=rec.started_at, now=now, step_starts=starts,
                               srm_periods=rec.srm_periods)  # fmt: skip
        if rec.analysis is not None and (unused := rec.reward.unused()):  # an activation is said, never switched in
            rec.analysis.decision.reason += f"; {unused}"
        if rec.analysis is None or rec.analysis.no_data:
            rec.plan = plan(agg, self.config, running_s=(now - rec.started_at).total_seconds())
        if rec.analysis is not None and rec.state == "ramping":
            self._act(rec, split, step, now)
        elif rec.state == "frozen" and (now - rec.started_at).total_seconds() >= self.config.max_duration_s:
            self._end_frozen(rec, split, step, now)
        alarm = rec.analysis is not None and any(f.startswith("no_data") for f in rec.analysis.flags)
        _NO_DATA.set(1.0 if alarm and rec.state in ("ramping", "frozen") else 0.0)
        rec.looked_at = now
        self._holdout(self.gate.splits.get() or split, rec)
        self._save(rec)
        return rec

    # ---- internals -----------------------------------------------------------------------

    def _start(self, split: TrafficSplit, now: datetime) -> tuple[ExperimentRecord, TrafficSplit]:
        old = self.record()
        rec = ExperimentRecord(
            experiment=self.config.experiment,
            challenger=split.challenger_version,
            champion=split.champion_version,
            salt=split.salt,
            started_at=now,
            state="ramping",
            ramp=[RampView(**s.model_dump()) for s in self.config.ramp],
            timeline=old.timeline,
            holdout_since=old.holdout_since,
            reward=RewardBasis.at_start(data.active_versions(self.gate.settings.lake_root, self._cache)),
        )
        rec.ramp[0].entered_at = now
        basis = f", deciding on reward {rec.reward.describe()}" if rec.reward.decides_on else ""
        rec.note(now, f"experiment: challenger {split.challenger_version} against champion {split.champion_version}"
                      f"{basis}", by=split.changed_by)  # fmt: skip
        first = self.config.ramp[0].share
        if abs(split.challenger_share - first) > 1e-9 and self._apply(
            lambda: self.gate.plan_ramp(first, by=CONTROLLER_ACTOR, reason="ramp step 1")
        ):
            rec.note(now, f"ramp to {first:.0%}")
            self._new_period(rec, first, now)
        return rec, self.gate.splits.get() or split

    def _reward_versions(self, rec: ExperimentRecord, now: datetime) -> list[str]:
        """The versions this experiment decides on; what changed in the active ones since the last look is
        said on the timeline (`reward_basis.py`)."""
        for said in rec.reward.look(data.active_versions(self.gate.settings.lake_root, self._cache)):
            rec.note(now, said)
        return rec.reward.versions()

    @staticmethod
    def _since(split: TrafficSplit, rec: ExperimentRecord, now: datetime) -> tuple[datetime, datetime]:
        """(end of the old share, start of the new one) for a change this controller did not make.

        The split's own change time when it falls since the last look; otherwise the change happened at an
        unknown moment since the last look, and the users first seen in between are counted in neither.
        """
        last = rec.looked_at or rec.started_at or now
        changed = split.changed_at
        return (changed, changed) if last <= changed <= now else (last, now)

    def _track_share(self, rec: ExperimentRecord, split: TrafficSplit, now: datetime) -> None:
        """A new SRM period whenever the share in force changes, whoever changed it (controller or person)."""
        share = split.challenger_share
        if rec.srm_periods and abs(rec.srm_periods[-1].share - share) < 1e-12:
            return
        end_old, start_new = self._since(split, rec, now)
        self._new_period(rec, share, start_new, end_old)

    @staticmethod
    def _new_period(rec: ExperimentRecord, share: float, since: datetime, until: datetime | None = None) -> None:
        if rec.srm_periods:
            rec.srm_periods[-1] = rec.srm_periods[-1].model_copy(update={"until": until or since})
        rec.srm_periods = [*rec.srm_periods, SrmPeriod(share=share, since=since)]

    def _step(self, rec: ExperimentRecord) -> StepContext:
        i = min(rec.step, len(rec.ramp) - 1)
        r = rec.ramp[i]
        return StepContext(
            index=i, share=r.share, min_users=r.min_users, min_seconds=r.min_seconds,
            entered_at=r.entered_at or rec.started_at or self.clock(), last=i == len(rec.ramp) - 1,
        )

    def _act(self, rec: ExperimentRecord, split: TrafficSplit, step: StepContext, now: datetime) -> None:
        assert rec.analysis is not None
        d = rec.analysis.decision
        if d.action == "freeze":
            if self._apply(lambda: self.gate.plan_ramp(split.challenger_share, by=CONTROLLER_ACTOR,
                                                       reason=d.reason, state="paused")):
                rec.state = "frozen"
                rec.note(now, f"frozen: {d.reason}")
        elif d.action == "rollback":
            if self._apply(lambda: self.gate.plan_rollback(by=CONTROLLER_ACTOR, reason=d.reason)):
                rec.state = "rolled_back"
                rec.ramp[step.index].left_at = now
                rec.note(now, f"rolled back {split.challenger_version}: {d.reason}")
                _ENDED.labels("rollback", d.why).inc()
                if d.inconclusive and split.challenger_version:
                    self._unquarantine(rec, split.challenger_version, now, d.reason)
        elif d.action == "ramp":
            nxt = rec.ramp[step.index + 1]
            if self._apply(lambda: self.gate.plan_ramp(nxt.share, by=CONTROLLER_ACTOR, reason=d.reason)):
                self._new_period(rec, nxt.share, now)
                rec.ramp[step.index].left_at = now
                nxt.entered_at = now
                rec.step = step.index + 1
                rec.note(now, f"ramp to {nxt.share:.0%}: {d.reason}")
        elif d.action == "promote":
            version = cast(str, split.challenger_version)
            approved = self.gate.registry.gate_state(version) == "approved"
            if not (self.config.auto_promote and approved):
                rec.state = "holding"
                why = "auto-promotion is off" if approved else f"version {version} is not approved through the gate"
                rec.note(now, f"holding: promotion recommended ({d.reason}); {why}")
            elif self._apply(lambda: self.gate.plan_promote(by=CONTROLLER_ACTOR, reason=d.reason)):
                rec.state = "promoted"
                rec.ramp[step.index].left_at = now
                rec.note(now, f"promoted {version}: {d.reason}")
                _ENDED.labels("promote", d.why).inc()

    def _end_frozen(self, rec: ExperimentRecord, split: TrafficSplit, step: StepContext, now: datetime) -> None:
        """Every experiment ends: one frozen (SRM, or paused by a person) is rolled back at the maximum duration.
        Its served data stays quarantined: what froze it was never explained."""
        reason = "frozen at the maximum duration: nobody resumed it, so the challenger is not kept"
        if self._apply(lambda: self.gate.plan_rollback(by=CONTROLLER_ACTOR, reason=reason)):
            rec.state = "rolled_back"
            rec.ramp[step.index].left_at = now
            rec.note(now, f"rolled back {split.challenger_version}: {reason}")
            _ENDED.labels("rollback", "frozen").inc()

    def _unquarantine(self, rec: ExperimentRecord, version: str, now: datetime, decided: str) -> None:
        """An inconclusive rollback showed no harm: what the version served stays eligible for training
        (a rollback quarantines by default; a flywheel whose candidates all end inconclusive would
        otherwise stop learning from the traffic they served). The registry's reason, the version's last,
        keeps the rollback's (`decided`): `flywheel registry list` shows it."""
        why = "inconclusive: nothing showed it harmful, so its served data stays eligible for training"
        reason = f"{why} (rolled back: {decided})"
        if self._apply(lambda: self.gate.plan_unquarantine(version, by=CONTROLLER_ACTOR, reason=reason)):
            rec.note(now, f"{version} not quarantined: {why}")

    def _apply(self, make: Callable[[], Plan]) -> bool:
        try:
            self.gate.apply(make())
        except GateError as exc:  # busy, stale or changed by a person meanwhile: look again next tick
            log.warning("rollout action refused", extra={"detail": str(exc)})
            return False
        return True

    def _ensure_holdout(self, split: TrafficSplit, rec: ExperimentRecord, now: datetime) -> TrafficSplit:
        share = self.config.holdout_share
        if share <= 0 or (split.holdout_version and abs(split.holdout_share - share) < 1e-9):
            return split
        version = split.holdout_version or split.champion_version
        reason = f"long-term holdout: {share:.1%} of users stay on {version} across releases"
        if self._apply(lambda: self.gate.plan_holdout(version, share, by=CONTROLLER_ACTOR, reason=reason)):
            rec.holdout_since = rec.holdout_since or now
            rec.note(now, reason)
        return self.gate.splits.get() or split

    def _holdout(self, split: TrafficSplit, rec: ExperimentRecord) -> None:
        if not split.holdout_version or split.holdout_share <= 0:
            rec.holdout = None
            return
        arms = {"champion": split.champion_version, "holdout": split.holdout_version}
        agg = data.load(self.gate.settings.lake_root, arms, since=rec.holdout_since, cache=self._cache)
        users, mean, effect = cumulative_effect(agg.users, self.config)
        rec.holdout = HoldoutView(
            share=split.holdout_share, version=split.holdout_version, users=users, mean=mean, cumulative_effect=effect
        )
