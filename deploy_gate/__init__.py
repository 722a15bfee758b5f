"""Deploy gate: approvals, the traffic split and the A/B dashboard.

A candidate waits for approval; once approved it becomes the challenger with a share of
traffic; promotion or rollback ends the experiment. Every change is planned, then applied,
and records who, when and why.
"""

from __future__ import annotations

from deploy_gate.errors import GateError
from deploy_gate.gate import DeployGate
from deploy_gate.metrics import ArmMetrics, arm_metrics
from deploy_gate.plan import Plan
from deploy_gate.stats import RewardStats
from deploy_gate.views import GateStatus

__all__ = ["ArmMetrics", "DeployGate", "GateError", "GateStatus", "Plan", "RewardStats", "arm_metrics"]
