"""The versions serving holds in memory, and the traffic split they serve under.

A background refresher reads the split from Redis (woken at once by the split's pub/sub
channel, polling as a fallback); when it names a version not yet loaded, the weights are
fetched from the registry (a delta is rebuilt from its parent and verified there) and loaded
into a second copy *before* the new split takes effect. The swap is one assignment under a
lock: a request holds the `Route` (and so the policy) it started with and finishes on it,
every later request gets the new one, and every generation event names the version whose
weights produced it. No restart is needed to pick up a challenger.

The in-process back end's default loader (`flywheel.lm.adapters.PolicyLoader`) loads a LoRA adapter version
onto the one copy of the base it names (never a second copy): champion and challenger can be two adapters, or
base and adapter, on one model, each request computed with the adapter of the version it was routed to. An
adapter on another base than the loaded ones is refused with both named; one that leaves the split is freed
once the last request routed to it has finished.

A version whose artifact is refused (corrupt, a broken chain, not a checkpoint) is not
adopted: serving keeps the split and weights it has, logs the reason once, and tries that
version again only after a backoff that doubles up to `MAX_RETRY_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from flywheel.contract import TrafficSplit
from flywheel.lm import CheckpointError
from flywheel.lm.adapters import PolicyLoader
from model_registry import ArtifactIntegrityError, ModelRegistry, UnknownVersion
from serving.errors import NoModelReady
from serving.generator import Generator

log = logging.getLogger(__name__)

SplitSource = Callable[[], TrafficSplit | None]
CheckpointSource = Callable[[str], str]  # version -> local checkpoint directory
Loader = Callable[[str, str], Generator]  # (version, checkpoint directory) -> that version's Generator


FIRST_RETRY_S = 5.0
MAX_RETRY_S = 300.0
_REFUSED = (ArtifactIntegrityError, CheckpointError, UnknownVersion)


@dataclass(frozen=True)
class Refusal:
    """A version serving would not load: why, and when it may be tried again."""

    version: str
    reason: str
    failures: int
    retry_at: float  # time.monotonic()


@dataclass(frozen=True)
class Route:
    arm: str
    version: str
    policy: Generator
    experiment: str


class PolicyPool:
    def __init__(
        self,
        split_source: SplitSource,
        checkpoint_source: CheckpointSource,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        loader: Loader | None = None,
        release: Callable[[str], None] | None = None,
    ) -> None:
        """`loader` makes a version's `Generator` from its checkpoint (default: the in-process HF back end;
        flywheel.lm.vllm's for vLLM); `release` frees what a version no longer routed to holds."""
        self._split_source = split_source
        self._checkpoint_source = checkpoint_source
        self._device = device
        self._dtype = dtype
        if loader is None:  # the in-process HF back end: LoRA adapters share one copy of their base
            hf = PolicyLoader(device=device, dtype=dtype)
            loader, release = hf, release or hf.release
        self._loader: Loader = loader
        self._release = release
        self._policies: dict[str, Generator] = {}
        self._split: TrafficSplit | None = None
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._refused: dict[str, Refusal] = {}
        self.last_swap_s: float | None = None  # how long the last adoption held the routing lock
        self.last_load_s: float | None = None  # fetch (delta rebuild + verification) and load of the last version

    @property
    def split(self) -> TrafficSplit | None:
        return self._split

    @property
    def loaded_versions(self) -> list[str]:
        return sorted(self._policies)

    @property
    def refused(self) -> dict[str, Refusal]:
        """Versions whose artifacts were refused, by version (cleared once one loads)."""
        return dict(self._refused)

    def refresh(self) -> bool:
        """Adopt the split in Redis once every version it names is loaded. Returns True if it changed.

        A version whose artifact is refused leaves the current split and weights in place."""
        with self._refresh_lock:
            split = self._split_source()
            if split is None or split == self._split:
                return False
            wanted = split.versions()  # champion, challenger and the long-term holdout's version
            for version in sorted(wanted - set(self._policies)):
                refusal = self._refused.get(version)
                if refusal is not None and time.monotonic() < refusal.retry_at:
                    return False  # known bad: not fetched again before its backoff ends
                policy = self._load(version, refusal)
                if policy is None:
                    return False
                with self._lock:
                    self._policies[version] = policy
            started = time.perf_counter()
            with self._lock:
                self._split = split
                stale = set(self._policies) - wanted
                for version in stale:
                    del self._policies[version]
            self.last_swap_s = time.perf_counter() - started
            if self._release is not None:  # after the swap: a request in flight finishes on what it holds
                for version in sorted(stale):
                    self._release(version)
            log.info(
                "serving split: champion=%s challenger=%s share=%.2f holdout=%s (%.2f)",
                split.champion_version, split.challenger_version, split.challenger_share,
                split.holdout_version, split.holdout_share,
            )
            return True

    def _load(self, version: str, previous: Refusal | None) -> Generator | None:
        """The loaded version (a second copy; the serving ones are untouched), or None when refused."""
        started = time.perf_counter()
        try:
            path = self._checkpoint_source(version)
            log.info("loading model version %s from %s", version, path)
            policy: Generator = self._loader(version, path)
        except _REFUSED as exc:
            failures = previous.failures + 1 if previous else 1
            delay = min(MAX_RETRY_S, FIRST_RETRY_S * 2 ** (failures - 1))
            self._refused[version] = Refusal(version, str(exc), failures, time.monotonic() + delay)
            if previous is None or previous.reason != str(exc):  # once per version and reason
                log.error("model version refused; serving keeps the versions it has",
                          extra={"version": version, "reason": str(exc), "retry_in_s": delay})
            return None
        self._refused.pop(version, None)
        self.last_load_s = time.perf_counter() - started
        return policy

    def route(self, user_id: str) -> Route:
        with self._lock:
            split = self._split
            if split is None:
                raise NoModelReady("no traffic split has been loaded yet")
            arm = split.arm_for(user_id)
            version = split.version_for(arm)
            return Route(arm=arm, version=version, policy=self._policies[version], experiment=split.experiment)


class NotAliased(UnknownVersion):
    """The split names a version that neither registry alias (champion, challenger) names."""


def aliased_checkpoints(registry: ModelRegistry) -> CheckpointSource:
    """The checkpoint source serving uses: a verified local copy of `version`, fetched only when the
    registry's `champion` or `challenger` alias names it. The gate sets the alias before it writes the
    split, so a split naming any other version (Redis written by hand, a stale split) is refused."""

    def checkpoint(version: str) -> str:
        aliased = {registry.alias("champion"), registry.alias("challenger")}
        if version not in aliased:
            raise NotAliased(
                f"the traffic split names version {version}, but the registry's aliases name "
                f"{sorted(v for v in aliased if v) or 'nothing'}: serving runs only what champion and challenger name"
            )
        return str(registry.fetch(version))

    return checkpoint


def watch_split(redis_client: object, channel: str, on_change: Callable[[], object],
                stop: threading.Event) -> threading.Thread:  # fmt: skip
    """Call `on_change` whenever a message arrives on the split's pub/sub `channel`, until `stop` is set.

    The poll in serving's refresher stays the fallback: a lost connection only delays a swap to the
    next poll, and the watcher resubscribes with a backoff."""

    def run() -> None:
        backoff = 0.5
        while not stop.is_set():
            try:
                pubsub = redis_client.pubsub(ignore_subscribe_messages=True)  # type: ignore[attr-defined]
                pubsub.subscribe(channel)
                backoff = 0.5
                while not stop.is_set():
                    if pubsub.get_message(timeout=0.5) is not None:
                        on_change()
            except Exception:  # Redis down: the refresher's poll reports it; retry quietly
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    thread = threading.Thread(target=run, name="split-watcher", daemon=True)
    thread.start()
    return thread


__all__ = ["NoModelReady", "NotAliased", "PolicyPool", "Refusal", "Route", "aliased_checkpoints", "watch_split"]
