"""Helpers shared by the gate's tests."""

from __future__ import annotations

from deploy_gate.offline import OfflineGates
from flywheel.contract import utcnow
from flywheel.settings import Settings
from model_registry import ModelRegistry, OfflineGateReport, OfflineGateResult


def offline_gates_passed(settings: Settings, registry: ModelRegistry, version: str, champion: str) -> None:
    """Record passing offline gates: a fake checkpoint cannot run them (tests/test_offline_gates.py runs them)."""
    result = OfflineGateResult("sanity", "passed", 0.0, "-", "recorded by the test")
    config = OfflineGates(settings, registry).recorded_config()
    registry.record_offline_gates(version, OfflineGateReport(utcnow(), champion, [result], config))
