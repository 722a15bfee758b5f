"""Helpers several test modules share: fake registry versions, offline-gate records, reading the events topic,
a consumer that hands out small polls, loading a benchmark script as a module."""

from __future__ import annotations

import importlib.util
import secrets
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from deploy_gate.offline import OfflineGates
from flywheel.bus import Consumer, RecordBatch, make_consumer
from flywheel.contract import Event, ModelLineage, utcnow
from flywheel.settings import Settings, get_settings
from model_registry import ModelRegistry, OfflineGateReport, OfflineGateResult


def offline_gates_passed(settings: Settings, registry: ModelRegistry, version: str, champion: str) -> None:
    """Record passing offline gates: a fake checkpoint cannot run them (tests/test_offline_gates.py runs them)."""
    result = OfflineGateResult("sanity", "passed", 0.0, "-", "recorded by the test")
    config = OfflineGates(settings, registry).recorded_config()
    registry.record_offline_gates(version, OfflineGateReport(utcnow(), champion, [result], config))


def register(registry: ModelRegistry, tmp_path: Path, parent: str | None = None) -> str:
    """A fake checkpoint: the registry stores files, it does not look inside them."""
    ckpt = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "fake"}')
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    return registry.register(ckpt, ModelLineage(base="fake", parent_version=parent, sample_count=8))


def read_events(settings: Settings, n: int, timeout_s: float = 30.0, group: str | None = None) -> list[Event]:
    """At least `n` events from the events topic (fewer if `timeout_s` passes first). A group of its own unless
    given: a reader left in a shared group by an earlier test can hold some of the partitions until it expires."""
    consumer = make_consumer(settings, [settings.events_topic], group or f"test-reader-{secrets.token_hex(4)}")
    out: list[Event] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n and time.monotonic() < deadline:
            out += [Event.from_bytes(r.value) for r in consumer.poll_batch(timeout_s=1.0)]
    finally:
        consumer.close()
    return out


def cli_settings(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, extra: dict[str, str] | None = None
) -> Iterator[Settings]:
    """`settings` given to CLI commands through the environment, as a user's shell would (for a fixture)."""
    s = settings.model_copy(update={"registered_model_name": f"gate-{uuid.uuid4().hex[:8]}"})
    for key, value in {
        "FLYWHEEL_DATA_DIR": str(s.data_dir),
        "FLYWHEEL_REDIS_URL": s.redis_url,
        "FLYWHEEL_REDIS_PREFIX": s.redis_prefix,
        "FLYWHEEL_MLFLOW_TRACKING_URI": s.mlflow_tracking_uri,
        "FLYWHEEL_REGISTERED_MODEL_NAME": s.registered_model_name,
        **(extra or {}),
    }.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    yield s
    get_settings.cache_clear()


class SmallPolls:
    """A worker's real consumer, handing out at most `most` records a poll (as a topic that trickles in does, or a
    broker whose fetch responses are small)."""

    def __init__(self, inner: Consumer, most: int) -> None:
        self.inner, self.most, self.polls = inner, most, 0

    def poll_columns(self, max_records: int = 500, timeout_s: float = 1.0) -> RecordBatch:
        self.polls += 1
        return self.inner.poll_columns(min(max_records, self.most), timeout_s)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def bench_module(name: str) -> ModuleType:
    """`bench/NAME.py` loaded as the module `name` (bench/ is a folder of scripts, not a package)."""
    path = Path(__file__).parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
