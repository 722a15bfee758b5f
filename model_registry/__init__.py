"""Model registry: versioned checkpoints with lineage and gate state, on MLflow."""

from __future__ import annotations

from model_registry.manifest import ArtifactIntegrityError
from model_registry.registry import (
    GATE_STATES,
    GateChange,
    ModelRegistry,
    OfflineGateReport,
    OfflineGateResult,
    RegistryUnavailable,
    UnknownVersion,
    VersionInfo,
    ensure_experiment,
)

__all__ = [
    "GATE_STATES",
    "ArtifactIntegrityError",
    "GateChange",
    "ModelRegistry",
    "OfflineGateReport",
    "OfflineGateResult",
    "RegistryUnavailable",
    "UnknownVersion",
    "VersionInfo",
    "ensure_experiment",
]
