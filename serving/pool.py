"""The versions serving holds in memory, and the traffic split they serve under.

A background refresher reads the split from Redis; when it names a version not yet
loaded, the weights are fetched from the registry and loaded *before* the new split
takes effect, so no request is ever answered by a version other than the one its
arm names, and no restart is needed to pick up a challenger.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from flywheel.contract import TrafficSplit
from flywheel.lm import Policy, load_policy
from serving.errors import NoModelReady

log = logging.getLogger(__name__)

SplitSource = Callable[[], TrafficSplit | None]
CheckpointSource = Callable[[str], str]  # version -> local checkpoint directory


@dataclass(frozen=True)
class Route:
    arm: str
    version: str
    policy: Policy
    experiment: str


class PolicyPool:
    def __init__(
        self,
        split_source: SplitSource,
        checkpoint_source: CheckpointSource,
        *,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        self._split_source = split_source
        self._checkpoint_source = checkpoint_source
        self._device = device
        self._dtype = dtype
        self._policies: dict[str, Policy] = {}
        self._split: TrafficSplit | None = None
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()

    @property
    def split(self) -> TrafficSplit | None:
        return self._split

    @property
    def loaded_versions(self) -> list[str]:
        return sorted(self._policies)

    def refresh(self) -> bool:
        """Adopt the split in Redis once every version it names is loaded. Returns True if it changed."""
        with self._refresh_lock:
            split = self._split_source()
            if split is None or split == self._split:
                return False
            wanted = split.versions()  # champion, challenger and the long-term holdout's version
            for version in sorted(wanted - set(self._policies)):
                path = self._checkpoint_source(version)
                log.info("loading model version %s from %s", version, path)
                policy = load_policy(path, device=self._device, dtype=self._dtype)
                with self._lock:
                    self._policies[version] = policy
            with self._lock:
                self._split = split
                for stale in set(self._policies) - wanted:
                    del self._policies[stale]
            log.info(
                "serving split: champion=%s challenger=%s share=%.2f holdout=%s (%.2f)",
                split.champion_version, split.challenger_version, split.challenger_share,
                split.holdout_version, split.holdout_share,
            )
            return True

    def route(self, user_id: str) -> Route:
        with self._lock:
            split = self._split
            if split is None:
                raise NoModelReady("no traffic split has been loaded yet")
            arm = split.arm_for(user_id)
            version = split.version_for(arm)
            return Route(arm=arm, version=version, policy=self._policies[version], experiment=split.experiment)


__all__ = ["NoModelReady", "PolicyPool", "Route"]
