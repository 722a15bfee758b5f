"""Offline gates: checks every candidate must pass before anyone can approve it.

`OfflineGates(settings, registry).check(version, champion)` runs them and records the report on
the version; `OfflineGateConfig` holds every bound (documented defaults). See `gates` for the
list and the pass rules, `ope` for the off-policy estimators.
"""

from __future__ import annotations

from deploy_gate.offline.config import OfflineGateConfig
from deploy_gate.offline.gates import GATES
from deploy_gate.offline.runner import OfflineGates

__all__ = ["GATES", "OfflineGateConfig", "OfflineGates"]
