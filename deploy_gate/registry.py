"""What the gate needs from the model registry, and how it opens the real one.

The gate codes against this protocol (a subset of `model_registry.ModelRegistry`, see
docs/design.md, "Model version and lineage") so its planning logic reads on its own; `open_registry` returns the
real MLflow-backed registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Protocol

from flywheel.contract import ModelLineage
from flywheel.settings import Settings


class VersionLike(Protocol):
    # Read-only properties, so frozen dataclasses and list-typed fields both satisfy it.
    @property
    def version(self) -> str: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def lineage(self) -> ModelLineage: ...
    @property
    def gate_state(self) -> str: ...
    @property
    def aliases(self) -> Sequence[str]: ...


class GateChangeLike(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def previous(self) -> str: ...
    @property
    def by(self) -> str: ...
    @property
    def at(self) -> datetime: ...
    @property
    def reason(self) -> str: ...


class GateRegistry(Protocol):
    def versions(self) -> Sequence[VersionLike]: ...
    def gate_state(self, version: str) -> str: ...
    def gate_history(self, version: str) -> Sequence[GateChangeLike]: ...
    def set_gate_state(self, version: str, state: str, *, by: str, reason: str = "") -> None: ...
    def set_alias(self, alias: str, version: str) -> None: ...
    def delete_alias(self, alias: str) -> None: ...
    def alias(self, alias: str) -> str | None: ...


def open_registry(settings: Settings) -> GateRegistry:
    from model_registry import ModelRegistry

    return ModelRegistry(settings)
