"""The auto-approve policy: for teams that let a candidate start its A/B test without a person.

Off by default (`settings.auto_approve`). When on, the oldest pending candidate is approved
through the same plan-then-apply as a person's approval, so every check still applies
(artifacts verified, one challenger at a time, and any offline-gate refusal that approval
enforces); each attempt is in the audit log as the actor "auto-approve policy". While an
experiment runs, the next candidate's offline gates run ahead of its approval (`DeployGate.precheck`;
one that fails is marked refused then). A refusal
is recorded once per candidate and process, not on every tick, so a candidate that waits for
the running experiment to end does not flood the log.
"""

from __future__ import annotations

import logging

from deploy_gate.audit import POLICY_ACTOR
from deploy_gate.errors import as_gate_error
from deploy_gate.gate import DeployGate

log = logging.getLogger(__name__)

POLICY_ROLE = "policy"


class AutoApprove:
    """One policy instance per process; `tick()` is called on a timer (or once from the CLI)."""

    def __init__(self, gate: DeployGate) -> None:
        self.gate = gate
        self._refused: set[str] = set()

    def tick(self) -> str | None:
        """Approve the oldest pending candidate if the policy is on and one can start; its version or None."""
        if not self.gate.settings.auto_approve:
            return None
        status = self.gate.status()
        candidates = sorted((v for v in status.pending if v.version not in self._refused), key=lambda v: v.created_at)
        if not candidates:
            return None
        version = candidates[0].version
        if status.challenger is not None:
            # One experiment at a time: the next candidate's offline gates run now, so it starts when this ends.
            report = self.gate.precheck(version)
            if report is not None:
                log.info("auto-approve checked the next candidate offline", extra={"version": version,
                         "passed": report.passed, "champion": report.champion})  # fmt: skip
            return None
        reason = "auto-approve policy is on (settings.auto_approve)"
        with self.gate.audit.attempt(
            "approve", who=POLICY_ACTOR, role=POLICY_ROLE, target=f"version {version}", reason=reason
        ) as attempt:
            try:
                attempt.before = self.gate.snapshot(version)
                plan = self.gate.plan_approve(version, by=POLICY_ACTOR, reason=reason)
                self.gate.apply(plan, role=POLICY_ROLE)
            except Exception as exc:
                err = as_gate_error(exc)
                if err is not None and err.status_code < 500:  # an outage is tried again next tick
                    self._refused.add(version)
                log.warning("auto-approve refused", extra={"version": version, "error": type(exc).__name__})
                raise
        return version
