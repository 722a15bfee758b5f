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
import logging
import threading
import warnings
import weakref
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
from flywheel.lm.policy import Policy, load_policy

log = logging.getLogger(__name__)


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
                with warnings.catch_warnings():  # "adapter was active, now deleted": the next batch sets its own
                    warnings.simplefilter("ignore", UserWarning)
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


class PolicyLoader:
    """Serving's in-process loader: (version, checkpoint directory) -> that version's `Policy`.

    Full weights load as their own copy (as before adapters existed); a LoRA adapter loads onto the one copy of
    the base it names: the full version itself when it is loaded, else that base loaded once for every adapter
    on it. An adapter on another base than the loaded adapters' is refused (`CheckpointError` naming both): one
    base is served at a time, so a second copy never appears unasked. `release(version)` (the version left the
    split) frees an adapter once no request holds its view any more (the last routed request has finished),
    and a base once nothing uses it.
    """

    def __init__(self, device: str = "cpu", dtype: str = "float32") -> None:
        self._device, self._dtype = device, dtype
        self._lock = threading.RLock()  # reentrant: a freed view's finalizer may run while it is held
        self._bases: dict[str, SharedBase] = {}  # base (full) version -> its one copy
        self._adapter_base: dict[str, str] = {}  # adapter version -> base version (until freed)
        self._views: dict[str, weakref.ref[Policy]] = {}  # adapter version -> the view handed out
        self._full: set[str] = set()  # full versions loaded and not released
        self._retired: dict[str, weakref.finalize] = {}  # adapter version released -> frees it when unheld

    @property
    def adapters(self) -> dict[str, str]:
        """Adapter versions in memory (released ones not yet freed included), each with its base version."""
        return dict(self._adapter_base)

    def shared_base(self, version: str) -> SharedBase | None:
        """The base model `version` computes on (itself when it is full weights), if loaded."""
        return self._bases.get(self._adapter_base.get(version, version))

    def __call__(self, version: str, path: str | Path) -> Policy:
        with self._lock:
            finalizer = self._retired.pop(version, None)
            if finalizer is not None:
                finalizer.detach()  # back in the split before it was freed
            alive = self._views[version]() if version in self._views else None
            if alive is not None:
                return alive
            if version in self._adapter_base:
                view = self._bases[self._adapter_base[version]].view(version)
                self._views[version] = weakref.ref(view)
                return view
            if is_adapter_dir(path):
                return self._load_adapter(version, Path(path))
            self._full.add(version)
            if version not in self._bases:
                log.info("loading model version %s from %s", version, path)
                policy = load_policy(path, device=self._device, dtype=self._dtype)
                self._bases[version] = SharedBase(policy, version)
            return self._bases[version].view()

    def _load_adapter(self, version: str, path: Path) -> Policy:
        info = read_adapter_info(path)
        for other, base_version in sorted(self._adapter_base.items()):
            if base_version != info.base_version:
                raise CheckpointError(
                    f"version {version} is a LoRA adapter of {info.describe()}, but serving holds "
                    f"{self._bases[base_version].describe()} for adapter version {other}: one base model is "
                    "served at a time, so it is refused"
                )
        base = self._bases.get(info.base_version)
        if base is not None and base.manifest_sha256 and base.manifest_sha256 != info.base_manifest_sha256:
            raise CheckpointError(
                f"version {version} is a LoRA adapter of {info.describe()}, but serving holds {base.describe()}: "
                "the base it was trained on does not match, so it is refused"
            )
        if base is None:
            base_dir = adapter_base_dir(path)
            log.info("loading base version %s from %s for LoRA adapter %s", info.base_version, base_dir, version)
            base = SharedBase(load_policy(base_dir, device=self._device, dtype=self._dtype), info.base_version)
            self._bases[info.base_version] = base
        if not base.manifest_sha256:  # a full version loaded as such; the registry checked the adapter's record
            base.manifest_sha256 = info.base_manifest_sha256
        log.info("loading LoRA adapter %s from %s onto base version %s", version, path, info.base_version)
        policy = base.load(version, path)
        self._adapter_base[version] = info.base_version
        self._views[version] = weakref.ref(policy)
        return policy

    def release(self, version: str) -> None:
        """`version` left the split: free it once no request holds it (an adapter) or at once (full weights:
        a request in flight holds its own reference to the model)."""
        with self._lock:
            if version in self._adapter_base and version not in self._retired:
                # The pool has dropped its view: whatever still holds it is a request routed before the swap.
                view = self._views[version]()
                if view is None:
                    self._free(version)
                else:
                    self._retired[version] = weakref.finalize(view, self._free, version)
                    del view
            self._full.discard(version)
            self._drop_unused_bases()

    def _free(self, version: str) -> None:
        with self._lock:
            self._retired.pop(version, None)
            self._views.pop(version, None)
            if version not in self._adapter_base:
                return
            base = self._bases[self._adapter_base.pop(version)]
            base.unload(version)
            log.info("unloaded LoRA adapter %s from base version %s", version, base.version)
            self._drop_unused_bases()

    def _drop_unused_bases(self) -> None:
        for version, base in list(self._bases.items()):
            if version not in self._full and not base.adapters:
                del self._bases[version]


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_INFO",
    "AdapterInfo",
    "PolicyLoader",
    "SharedBase",
    "adapter_base_dir",
    "is_adapter_dir",
    "read_adapter_info",
    "share_storage",
    "write_adapter_info",
]
