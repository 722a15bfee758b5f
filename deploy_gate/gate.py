"""The deploy gate's actions: approve, reject, promote, roll back (each planned, then applied).

State lives in two systems, the registry (gate state with who/when/why, aliases) and the
traffic split in Redis (which version serves whom, with its own history). They cannot
change in one transaction, so each plan orders its steps so that a failure part-way
leaves users safe: approval writes the registry first and gives traffic last; rollback
takes traffic away first and records it after. Gate actions are serialised across
processes by a Redis lock.

Every applied plan, and every plan that fails to apply, is recorded in the audit log
(`deploy_gate.audit`), the one home of who did what and why; the registry's gate-state
tags and the split's `changed_by` are the current state, not the record. Callers record
refusals that happen before a plan exists (a bad token, a version that is not pending)
with `AuditLog.attempt`.

Example: `DeployGate.from_settings(settings).approve("3", by="ana", reason="offline checks pass")`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import redis
from redis.exceptions import LockError

from deploy_gate.audit import Attempt, AuditLog
from deploy_gate.errors import (
    ApplyFailed,
    ChallengerRunning,
    CorruptArtifact,
    DependencyUnavailable,
    GateBusy,
    InvalidRequest,
    NoChallenger,
    NoChampion,
    NotPending,
    OfflineGateFailed,
    StalePlan,
    dependency_down,
)
from deploy_gate.offline import OfflineGates
from deploy_gate.plan import Action, Plan, Step
from deploy_gate.views import GateStatus, VersionView
from flywheel.connections import redis_client
from flywheel.contract import TrafficSplit, utcnow
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from model_registry import ArtifactIntegrityError, ModelRegistry, OfflineGateReport

log = logging.getLogger(__name__)

SYSTEM_ACTOR = "deploy-gate"
_REASON_CHARS = 1500  # a refusal's reason in the version's history (the full report stays on the version)


class DeployGate:
    """Approvals and the traffic split for one experiment."""

    def __init__(
        self,
        registry: ModelRegistry,
        client: redis.Redis,
        settings: Settings,
        experiment: str = "default",
        audit: AuditLog | None = None,
        *,
        offline: OfflineGates | None = None,
    ) -> None:
        """`offline`: the offline gates approval requires; `from_settings` always wires them in, and
        only tests of the gate's own bookkeeping (fake checkpoints that no model could load) leave them out."""
        self.registry = registry
        self.audit = audit or AuditLog.from_settings(settings)
        self.offline = offline
        self.settings = settings
        self.experiment = experiment
        self.splits = TrafficSplitStore(client, settings, experiment)
        self.redis = client  # the gate's state store; the rollout controller keeps its experiment record there too
        self._lock_key = f"{settings.redis_prefix}deploy_gate:lock:{experiment}"

    @classmethod
    def from_settings(cls, settings: Settings) -> DeployGate:
        registry = ModelRegistry(settings)
        return cls(registry, redis_client(settings), settings, offline=OfflineGates(settings, registry))

    # ---- reading -------------------------------------------------------------------------

    def status(self) -> GateStatus:
        split = self.splits.get()
        versions = [VersionView.of(v) for v in self.registry.versions()]
        champion = split.champion_version if split else self.registry.alias("champion")
        challenger = split.challenger_version if split and split.challenger_share > 0 else None
        return GateStatus(
            split=split,
            champion=champion,
            challenger=challenger,
            pending=[v for v in versions if v.gate_state == "pending"],
            versions=versions,
        )

    def history(self, limit: int = 100) -> list[TrafficSplit]:
        return self.splits.history(limit)

    def snapshot(self, version: str | None) -> dict[str, Any]:
        """What an audit entry keeps as "before"/"after": the version's gate state and the split."""
        split = self.splits.get()
        state: dict[str, Any] = {
            "split": None
            if split is None
            else {
                "state": split.state,
                "champion": split.champion_version,
                "challenger": split.challenger_version,
                "challenger_share": split.challenger_share,
            }
        }
        if version is not None:
            state["version"] = version
            state["gate_state"] = self.registry.gate_state(version)
        return state

    # ---- planning ------------------------------------------------------------------------

    def plan_approve(self, version: str, *, by: str, reason: str, verify: bool = True) -> Plan:
        """Approve a pending candidate and make it the challenger with `settings.challenger_share`.

        With `verify` (always, except when `apply` re-plans a plan that was verified), the
        candidate's artifacts are downloaded and checked against their manifest first: a version
        no server could load must never take traffic.
        """
        _require_who_why(by, reason)
        state = self.registry.gate_state(version)
        if state != "pending":
            raise NotPending(f"version {version} is {state}; only a pending candidate can be approved")
        stored, split, steps = self._current_split()
        if _challenger_live(split):
            raise ChallengerRunning(
                f"version {split.challenger_version} is the challenger ({split.state}, "
                f"{split.challenger_share:.0%} of traffic); "
                f"promote it or roll it back before approving {version}"
            )
        if verify:
            self._verify(version)
            self._require_offline_gates(version, split.champion_version)
        share = self.settings.challenger_share
        after = split.model_copy(
            update={
                "challenger_version": version,
                "challenger_share": share,
                # A fresh salt per experiment, so users are not carried over from the last A/B test.
                "salt": uuid.uuid4().hex[:8],
                "state": "running",
                "changed_by": by,
                "reason": f"approve {version}: {reason}",
            }
        )
        steps += [
            Step(
                f"registry: gate state of {version} pending -> approved",
                lambda: self.registry.set_gate_state(version, "approved", by=by, reason=reason),
            ),
            Step(
                f"registry: alias challenger -> {version}",
                lambda: self.registry.set_alias("challenger", version),
            ),
            Step(
                f"traffic: {version} becomes the challenger with {share:.0%} of traffic "
                f"(champion {split.champion_version} keeps {1 - share:.0%})",
                lambda: self._put(after),
            ),
        ]
        return Plan("approve", version, by, reason, stored, after, tuple(steps))

    def plan_reject(self, version: str, *, by: str, reason: str) -> Plan:
        """Reject a pending candidate (a person's decision, or a control run's)."""
        return self._plan_from_pending(version, "rejected", by, reason)

    def plan_refuse(self, version: str, *, reason: str) -> Plan:
        """Mark a pending candidate refused by its offline gates (`reason` names them): final, so nothing
        (a person, the auto-approve policy, the demo) tries it again. The gate does this itself, as
        `SYSTEM_ACTOR`, when approval finds a failed report."""
        return self._plan_from_pending(version, "refused", SYSTEM_ACTOR, reason)

    def _plan_from_pending(self, version: str, state: Literal["rejected", "refused"], by: str, reason: str) -> Plan:
        """A plan that moves a pending candidate to the final `state` ("rejected" or "refused"): one registry
        step; the split is unchanged (a pending version never takes traffic)."""
        _require_who_why(by, reason)
        current = self.registry.gate_state(version)
        action: Action = "reject" if state == "rejected" else "refuse"
        if current != "pending":
            raise NotPending(f"version {version} is {current}; only a pending candidate can be {state}")
        split = self.splits.get()
        why = " (offline gates)" if state == "refused" else ""
        step = Step(
            f"registry: gate state of {version} pending -> {state}{why}",
            lambda: self.registry.set_gate_state(version, state, by=by, reason=reason),
        )
        return Plan(action, version, by, reason, split, split, (step,))

    def plan_promote(self, *, by: str, reason: str, verify: bool = True) -> Plan:
        """The challenger becomes the champion and takes all traffic (its artifacts verified first)."""
        _require_who_why(by, reason)
        split = self.splits.get()
        if split is None or not _challenger_live(split):
            raise NoChallenger("no challenger is running; approve a candidate first")
        new, old = split.challenger_version, split.champion_version
        assert new is not None  # _challenger_live checked it
        if verify:
            self._verify(new)
        after = split.model_copy(
            update={
                "champion_version": new,
                "challenger_version": None,
                "challenger_share": 0.0,
                "state": "promoted",
                "changed_by": by,
                "reason": f"promote {new}: {reason}",
            }
        )
        steps = (
            Step(
                f"registry: alias champion -> {new} (was {old})",
                lambda: self.registry.set_alias("champion", new),
            ),
            Step(
                f"registry: gate state of {new} -> champion",
                lambda: self.registry.set_gate_state(new, "champion", by=by, reason=reason),
            ),
            # The old champion stays approved: it passed the gate and can be served again.
            Step(
                f"registry: gate state of {old} -> approved (superseded)",
                lambda: self.registry.set_gate_state(old, "approved", by=by, reason=f"superseded by {new}"),
            ),
            Step(f"traffic: {new} serves 100% as champion", lambda: self._put(after)),
            Step("registry: alias challenger removed", lambda: self.registry.delete_alias("challenger")),
        )
        return Plan("promote", new, by, reason, split, after, steps)

    def plan_rollback(self, *, by: str, reason: str) -> Plan:
        """All traffic back to the champion; the challenger is marked rolled back."""
        _require_who_why(by, reason)
        split = self.splits.get()
        if split is None or not _challenger_live(split):
            raise NoChallenger("no challenger is running; nothing to roll back")
        version = split.challenger_version
        assert version is not None
        after = split.model_copy(
            update={
                "challenger_version": None,
                "challenger_share": 0.0,
                "state": "rolled_back",
                "changed_by": by,
                "reason": f"roll back {version}: {reason}",
            }
        )
        # Users first: traffic goes back before the bookkeeping, so a registry failure cannot keep
        # a bad model serving.
        steps = (
            Step(
                f"traffic: 100% back to champion {split.champion_version} ({version} gets 0%)",
                lambda: self._put(after),
            ),
            Step(
                f"registry: gate state of {version} -> rolled_back",
                lambda: self.registry.set_gate_state(version, "rolled_back", by=by, reason=reason),
            ),
            Step("registry: alias challenger removed", lambda: self.registry.delete_alias("challenger")),
            # Quarantine: what the rolled-back version served is left out of later training
            # (the trainer skips quarantined versions); an admin can lift it (plan_unquarantine).
            Step(
                f"registry: gate state of {version} -> quarantined (its served data is left out of training)",
                lambda: self.registry.set_gate_state(
                    version, "quarantined", by=by, reason=f"quarantined on rollback: {reason}"
                ),
            ),
        )
        return Plan("rollback", version, by, reason, split, after, steps)

    def plan_ramp(self, share: float, *, by: str, reason: str, state: str = "running") -> Plan:
        """Change the live challenger's share of traffic (a ramp step), or freeze it (`state="paused"`).

        The salt stays, so users already on the challenger stay there as the share grows.
        """
        _require_who_why(by, reason)
        if not 0 < share <= 1:
            raise InvalidRequest("a ramp share must be in (0, 1]")
        if state not in ("running", "paused"):
            raise InvalidRequest("a ramp leaves the experiment running or paused")
        split = self.splits.get()
        if split is None or not _challenger_live(split):
            raise NoChallenger("no challenger is running; approve a candidate first")
        after = split.model_copy(
            update={"challenger_share": share, "state": state, "changed_by": by, "reason": f"ramp: {reason}"}
        )
        verb = "freeze at" if state == "paused" else "ramp to"
        step = Step(
            f"traffic: {verb} {share:.0%} for challenger {split.challenger_version} "
            f"(was {split.challenger_share:.0%}, {split.state})",
            lambda: self._put(after),
        )
        return Plan("ramp", split.challenger_version, by, reason, split, after, (step,))

    def plan_holdout(self, version: str | None, share: float, *, by: str, reason: str) -> Plan:
        """Keep `share` of users on `version` across releases (the long-term holdout); None ends it."""
        _require_who_why(by, reason)
        if version is not None:
            self.registry.gate_state(version)  # UnknownVersion (404) for a version the registry lacks
        stored, split, steps = self._current_split()
        after = split.model_copy(
            update={
                "holdout_version": version,
                "holdout_share": share if version else 0.0,
                "changed_by": by,
                "reason": f"holdout: {reason}",
            }
        )
        what = f"{share:.1%} of users stay on {version}" if version else "no holdout"
        steps = [*steps, Step(f"traffic: long-term holdout: {what}", lambda: self._put(after))]
        return Plan("holdout", version, by, reason, stored, after, tuple(steps))

    def plan_unquarantine(self, version: str, *, by: str, reason: str) -> Plan:
        """Lift a quarantine: the version's served data may be trained on again (admin only, at the API)."""
        _require_who_why(by, reason)
        state = self.registry.gate_state(version)
        if state != "quarantined":
            raise InvalidRequest(f"version {version} is {state}, not quarantined")
        split = self.splits.get()
        step = Step(
            f"registry: gate state of {version} quarantined -> rolled_back (its data may be trained on again)",
            lambda: self.registry.set_gate_state(version, "rolled_back", by=by, reason=f"unquarantine: {reason}"),
        )
        return Plan("unquarantine", version, by, reason, split, split, (step,))

    def ensure_split(self) -> TrafficSplit:
        """The current split; created with the registry's champion (all traffic) when none exists."""
        with self._locked():
            _, split, steps = self._current_split()
            for step in steps:
                step.run()
            return self.splits.get() or split

    # ---- applying ------------------------------------------------------------------------

    def apply(self, plan: Plan, *, role: str = "system") -> TrafficSplit | None:
        """Run a plan's steps in order, refusing if the gate changed since it was made.

        The outcome is in the audit log before this returns or raises, recorded as `plan.by`
        with `role` (the caller's, which the plan does not know).
        """
        target = f"version {plan.version}" if plan.version else f"experiment {self.experiment}"
        attempt = Attempt(plan.action, plan.by, role, target, plan.reason)
        # An audit log that cannot be written refuses the action before anything changes.
        self.audit.check()
        try:
            with self._locked():
                attempt.before = self.snapshot(plan.version)
                split = self._apply_locked(plan)
        except Exception as exc:
            self.audit.refused(attempt, exc)
            raise
        try:
            after: dict[str, Any] | None = self.snapshot(plan.version)
        except Exception:  # applied all the same: the entry says so, without the state after
            log.warning("could not read the state after an applied action", extra={"action": plan.action})
            after = None
        self.audit.allowed(attempt, detail="; ".join(plan.describe()), after=after)
        return split

    def _apply_locked(self, plan: Plan) -> TrafficSplit | None:
        """The plan's steps, under the gate lock, after checking it was made from the current state."""
        fresh = self._replan(plan)
        if not plan.same_basis(fresh):
            raise StalePlan("the gate changed since this plan was made; plan again and review it")
        for i, step in enumerate(plan.steps):
            try:
                step.run()
            except Exception as exc:
                done = "; ".join(s.description for s in plan.steps[:i]) or "nothing"
                where = f"{plan.action} failed at step {i + 1} ({step.description}); already applied: {done}"
                down = dependency_down(exc)
                if down is not None:  # no traceback: a dependency's message may name its URL
                    log.warning("%s: %s does not answer (%s)", where, down, type(exc).__name__)
                    raise DependencyUnavailable(f"{down} does not answer: {where}") from exc
                log.exception("gate %s", where)
                raise ApplyFailed(where) from exc
        log.info(
            "gate action applied",
            extra={"action": plan.action, "version": plan.version, "by": plan.by, "reason": plan.reason},
        )
        return self.splits.get()

    def approve(self, version: str, *, by: str, reason: str) -> TrafficSplit | None:
        return self.apply(self.plan_approve(version, by=by, reason=reason))

    def reject(self, version: str, *, by: str, reason: str) -> TrafficSplit | None:
        return self.apply(self.plan_reject(version, by=by, reason=reason))

    def promote(self, *, by: str, reason: str) -> TrafficSplit | None:
        return self.apply(self.plan_promote(by=by, reason=reason))

    def rollback(self, *, by: str, reason: str) -> TrafficSplit | None:
        return self.apply(self.plan_rollback(by=by, reason=reason))

    # ---- internals -----------------------------------------------------------------------

    def _replan(self, plan: Plan) -> Plan:
        if plan.action == "approve":
            assert plan.version is not None
            # Verified when the plan was made; checking again under the lock would download the
            # whole model a second time while every other gate action waits.
            return self.plan_approve(plan.version, by=plan.by, reason=plan.reason, verify=False)
        if plan.action == "reject":
            assert plan.version is not None
            return self.plan_reject(plan.version, by=plan.by, reason=plan.reason)
        if plan.action == "refuse":
            assert plan.version is not None
            return self.plan_refuse(plan.version, reason=plan.reason)
        if plan.action == "promote":
            return self.plan_promote(by=plan.by, reason=plan.reason, verify=False)
        if plan.action == "ramp":
            assert plan.split_after is not None
            after = plan.split_after
            return self.plan_ramp(after.challenger_share, by=plan.by, reason=plan.reason, state=after.state)
        if plan.action == "holdout":
            assert plan.split_after is not None
            return self.plan_holdout(plan.version, plan.split_after.holdout_share, by=plan.by, reason=plan.reason)
        if plan.action == "unquarantine":
            assert plan.version is not None
            return self.plan_unquarantine(plan.version, by=plan.by, reason=plan.reason)
        return self.plan_rollback(by=plan.by, reason=plan.reason)

    def _current_split(self) -> tuple[TrafficSplit | None, TrafficSplit, list[Step]]:
        """(stored split or None, the split to build on, steps that initialise it when missing).

        The initial split gives the registry's champion all traffic.
        """
        split = self.splits.get()
        if split is not None:
            return split, split, []
        champion = self.registry.alias("champion")
        if champion is None:
            raise NoChampion(
                "the registry has no champion alias; register a model and make it the champion first"
            )
        initial = TrafficSplit(
            experiment=self.experiment,
            champion_version=champion,
            changed_by=SYSTEM_ACTOR,
            reason=f"initial split: champion {champion} serves all traffic",
        )
        return (
            None,
            initial,
            [
                Step(
                    f"traffic: initialise the split with champion {champion} (100%)",
                    lambda: self._put(initial),
                )
            ],
        )

    def _verify(self, version: str) -> None:
        try:
            self.registry.verify(version)
        except ArtifactIntegrityError as exc:
            raise CorruptArtifact(
                f"{exc}; refusing to send traffic to it (register the checkpoint again)"
            ) from None

    def _require_offline_gates(self, version: str, champion: str) -> None:
        """Refuse a candidate that failed an offline gate against the current champion (run them when
        they have not been). Re-planning under the lock skips this, as it skips verification.

        A refusal is a state, not only an answer: the candidate is marked "refused" (with the failed gates
        as the reason, in its history) before the error is raised, so no caller retries it and the
        registry says why it never reached users."""
        if self.offline is None:
            return
        report = self.offline.ensure(version, champion)
        if not report.passed:
            failed = "; ".join(f"{r.name}: {r.detail} (bound {r.bound})" for r in report.failed)
            self.refuse_if_failed(version, report)
            raise OfflineGateFailed(
                f"version {version} failed offline gates against champion {champion}: {failed}; "
                f"it is marked refused and cannot be approved (see GET /api/versions/{version})"
            )

    def precheck(self, version: str) -> OfflineGateReport | None:
        """Run a pending `version`'s offline gates against the current champion before anyone approves it,
        and mark it refused at once when they fail; the report, or None when nothing was run (no offline
        gates or champion, not pending, or a report against this champion already exists).

        The auto-approvers do this for the next candidate while an experiment runs, so approval after it ends
        takes seconds instead of the gates' minutes, and users are not left without a challenger meanwhile.
        A report checked against a champion that is replaced before approval is run again at approval."""
        if self.offline is None or self.registry.gate_state(version) != "pending":
            return None
        split = self.splits.get()
        if split is None or self.offline.current(version, split.champion_version) is not None:
            return None
        report = self.offline.check(version, split.champion_version)
        self.refuse_if_failed(version, report)
        return report

    def refuse_if_failed(self, version: str, report: OfflineGateReport) -> bool:
        """Mark a pending `version` refused when its offline `report` failed (approval and `flywheel gate check`
        both do); whether it was marked."""
        if report.passed or self.registry.gate_state(version) != "pending":
            return False
        failed = "; ".join(f"{r.name}: {r.detail} (bound {r.bound})" for r in report.failed)
        why = f"offline gates failed against champion {report.champion}: {failed}"
        self.apply(self.plan_refuse(version, reason=why[:_REASON_CHARS]))
        return True

    def _put(self, split: TrafficSplit) -> None:
        self.splits.put(split.model_copy(update={"changed_at": utcnow()}))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        lock = self.redis.lock(self._lock_key, timeout=60, blocking_timeout=10)
        try:
            acquired = lock.acquire()
        except LockError:
            acquired = False
        if not acquired:
            raise GateBusy("another gate action is in progress; try again in a moment")
        try:
            yield
        finally:
            try:
                lock.release()
            except LockError:  # expired while we worked; nothing left to release
                log.warning("gate lock expired before release")


def _challenger_live(split: TrafficSplit) -> bool:
    return bool(split.challenger_version) and split.challenger_share > 0 and split.state in ("running", "paused")


def _require_who_why(by: str, reason: str) -> None:
    if not by.strip():
        raise InvalidRequest("say who makes this change (by)")
    if not reason.strip():
        raise InvalidRequest("say why (reason); it is kept in the version's history")
