"""What a LoRA adapter directory says about the base model it was trained on (`flywheel.lm.adapters`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flywheel.lm.errors import CheckpointError

ADAPTER_INFO = "flywheel_adapter.json"
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class AdapterInfo:
    """The base an adapter was trained on: its registry version, its manifest's sha256 and its lineage's base."""

    base_version: str
    base_manifest_sha256: str
    base: str = ""

    def describe(self) -> str:
        return f"base version {self.base_version} (manifest sha256 {self.base_manifest_sha256[:12]}...)"


def is_adapter_dir(path: str | Path) -> bool:
    """Whether `path` holds a peft adapter (not a full checkpoint)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def write_adapter_info(adapter_dir: Path, info: AdapterInfo) -> None:
    (Path(adapter_dir) / ADAPTER_INFO).write_text(json.dumps(asdict(info), indent=1, sort_keys=True))


def read_adapter_info(adapter_dir: str | Path) -> AdapterInfo:
    """The base `adapter_dir` was trained on; `CheckpointError` when the directory does not say."""
    path = Path(adapter_dir) / ADAPTER_INFO
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        return AdapterInfo(str(raw["base_version"]), str(raw["base_manifest_sha256"]), str(raw.get("base", "")))
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{adapter_dir} is a LoRA adapter without a readable {ADAPTER_INFO} naming its base model: {exc}"
        ) from exc


def adapter_base_dir(adapter_dir: str | Path) -> Path:
    """Where the registry put the base of a fetched adapter: `<cache>/<base version>` beside `<cache>/<adapter>`."""
    info = read_adapter_info(adapter_dir)
    base = Path(adapter_dir).resolve().parent / info.base_version
    if not (base / "config.json").is_file():
        raise CheckpointError(
            f"the adapter at {adapter_dir} was trained on {info.describe()}, which is not beside it at {base}: "
            "fetch the adapter through the registry (it fetches the base too) or pass base= explicitly"
        )
    return base
