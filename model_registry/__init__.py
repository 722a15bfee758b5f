"""Model registry: versioned checkpoints (full or lossless deltas) with lineage and gate state, on MLflow."""

from __future__ import annotations

from model_registry.diff import TensorDiff
from model_registry.manifest import ArtifactIntegrityError
from model_registry.registry import (
    GATE_STATES,
    ArtifactInfo,
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
    "ArtifactInfo",
    "ArtifactIntegrityError",
    "GateChange",
    "ModelRegistry",
    "OfflineGateReport",
    "OfflineGateResult",
    "RegistryUnavailable",
    "TensorDiff",
    "UnknownVersion",
    "VersionInfo",
    "ensure_experiment",
]
