"""Plan-then-apply: a production change is first described, shown, then applied step by step.

A `Plan` is made from the gate's current state; applying it re-plans under the gate lock
and refuses (`StalePlan`) when the state it was made from has changed meanwhile, so an
operator never applies a plan they have not seen. Later rollout stages (canary, ramp)
add steps; the apply loop stays the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from flywheel.contract import TrafficSplit

Action = Literal["approve", "reject", "refuse", "promote", "rollback", "ramp", "holdout", "unquarantine"]


@dataclass(frozen=True)
class Step:
    """One change to one system (registry or traffic split), described before it runs."""

    description: str
    run: Callable[[], None] = field(repr=False, compare=False)


@dataclass(frozen=True)
class Plan:
    action: Action
    version: str | None
    by: str
    reason: str
    split_before: TrafficSplit | None
    split_after: TrafficSplit | None
    steps: tuple[Step, ...]

    def describe(self) -> list[str]:
        return [s.description for s in self.steps]

    def same_basis(self, other: Plan) -> bool:
        """True when `other` was planned from the same state and would do the same things."""
        return (
            self.action == other.action
            and self.version == other.version
            and self.split_before == other.split_before
            and self.describe() == other.describe()
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "version": self.version,
            "by": self.by,
            "reason": self.reason,
            "steps": self.describe(),
            "split_before": self.split_before.model_dump(mode="json") if self.split_before else None,
            "split_after": self.split_after.model_dump(mode="json") if self.split_after else None,
        }
