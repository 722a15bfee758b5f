"""LoRA adapters (`peft`): what an adapter directory holds, and many adapters served on one shared base model.

An adapter version is a standard peft directory (`adapter_config.json`, `adapter_model.safetensors`: what
vLLM's runtime LoRA API and `PeftModel.from_pretrained` load) plus `flywheel_adapter.json` (`ADAPTER_INFO`),
which names the base it was trained on: the base's registry version, the sha256 of that version's manifest
(its content hash) and its lineage's base. The registry refuses to fetch an adapter whose base no longer has
that hash, and fetches the base beside it (its cache holds `<base version>/` next to `<adapter version>/`),
so `adapter_base_dir` finds the base of a fetched adapter without asking the registry again.

`SharedBase` holds one copy of a base model's weights and any number of adapters on it. Each version is a
`Policy` view of the same model object whose forward passes run, under the base's lock, with its own
adapter active (or every adapter disabled, for the base itself): the log-probs of a view are those of a
lone base + adapter, computed by the same unmerged LoRA forward the trainer runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flywheel.lm.adapter_info import (
    ADAPTER_CONFIG,
    ADAPTER_INFO,
    AdapterInfo,
    adapter_base_dir,
    is_adapter_dir,
    read_adapter_info,
    write_adapter_info,
)
from flywheel.lm.errors import CheckpointError
from flywheel.lm.policy import Policy


class SharedBase:
    """One base model in memory and the adapters loaded on it, each served as its own `Policy` view.

    Views share the model object (one copy of the base weights); a view's forward passes take the lock and
    activate its adapter first, so batches of different versions never interleave on the model. Serving's
    batcher runs one batch at a time anyway; the lock keeps the guarantee for any caller.
    """

    def __init__(self, base: Policy, version: str, manifest_sha256: str = "") -> None:
        self.base = base
        self.version = version
        self.manifest_sha256 = manifest_sha256
        self._lock = threading.RLock()
        self._peft: Any = None  # peft.PeftModel once the first adapter is loaded
        self._adapters: set[str] = set()

    @property
    def adapters(self) -> list[str]:
        return sorted(self._adapters)

    def describe(self) -> str:
        sha = f" (manifest sha256 {self.manifest_sha256[:12]}...)" if self.manifest_sha256 else ""
        return f"base version {self.version}{sha}"

    def view(self, adapter: str | None = None) -> Policy:
        """The policy of `adapter` on this base (None: the base itself, every adapter disabled)."""
        if adapter is not None and adapter not in self._adapters:
            raise KeyError(f"adapter {adapter!r} is not loaded on {self.describe()}")
        return Policy(self.base.model, self.base.tokenizer, self.base.device, weights=lambda: self._use(adapter))

    def load(self, name: str, adapter_dir: str | Path) -> Policy:
        """Load the adapter at `adapter_dir` under `name` (a version) and return its view."""
        from peft import PeftModel

        with self._lock:
            try:
                if self._peft is None:
                    self._peft = PeftModel.from_pretrained(self.base.model, str(adapter_dir), adapter_name=name)
                else:
                    self._peft.load_adapter(str(adapter_dir), adapter_name=name)
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"{adapter_dir} could not be loaded as a LoRA adapter: {exc}") from exc
            self._peft.eval()
            self._adapters.add(name)
        return self.view(name)

    def unload(self, name: str) -> None:
        """Free adapter `name` (its LoRA weights); the base and the other adapters stay."""
        with self._lock:
            if name in self._adapters:
                self._peft.delete_adapter(name)
                self._adapters.discard(name)

    @contextlib.contextmanager
    def _use(self, adapter: str | None) -> Iterator[None]:
        with self._lock:
            if adapter is not None:
                if adapter not in self._adapters:
                    raise CheckpointError(f"adapter {adapter!r} was unloaded from {self.describe()}")
                self._peft.set_adapter(adapter)
                yield
            elif self._adapters:
                with self._peft.disable_adapter():
                    yield
            else:
                yield


def share_storage(a: Policy, b: Policy) -> bool:
    """Whether two policies compute on the same base weight tensors (one copy in memory)."""
    pa = dict(a.model.named_parameters())
    pb = dict(b.model.named_parameters())
    base = [n for n in pa if "lora_" not in n]
    return bool(base) and all(n in pb and pa[n].data_ptr() == pb[n].data_ptr() for n in base)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_INFO",
    "AdapterInfo",
    "SharedBase",
    "adapter_base_dir",
    "is_adapter_dir",
    "read_adapter_info",
    "share_storage",
    "write_adapter_info",
]
