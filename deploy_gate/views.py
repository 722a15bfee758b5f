"""What the gate shows: versions and the rollout's state, as JSON-ready models."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from flywheel.contract import TrafficSplit
from model_registry import VersionInfo


class VersionView(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: str
    created_at: datetime
    gate_state: str
    aliases: list[str]
    parent_version: str | None
    sample_count: int
    run_id: str | None
    reason: str = ""  # why it is in its gate state (the latest history entry), e.g. which offline gates refused it

    @classmethod
    def of(cls, info: VersionInfo) -> VersionView:
        return cls(
            version=info.version,
            created_at=info.created_at,
            gate_state=info.gate_state,
            aliases=sorted(info.aliases),
            parent_version=info.lineage.parent_version,
            sample_count=info.lineage.sample_count,
            run_id=info.lineage.run_id,
            reason=info.reason,
        )


class GateStatus(BaseModel):
    model_config = ConfigDict(extra="forbid")

    split: TrafficSplit | None
    champion: str | None
    challenger: str | None
    pending: list[VersionView]
    versions: list[VersionView]
