"""Live swap: serving adopts a new version (a delta rebuilt and verified by the registry) under concurrent
requests without failing one, names the right version in every generation event, and keeps what it has
when an artifact is refused."""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from flywheel.bus import ensure_topics, make_producer
from flywheel.connections import redis_client
from flywheel.contract import ModelLineage, TrafficSplit
from flywheel.lm import load_policy, token_logprobs
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from model_registry import ModelRegistry
from serving.app import create_app
from serving.pool import PolicyPool, aliased_checkpoints, watch_split
from tests.helpers import read_events


def _child(src: Path, out: Path) -> Path:
    policy = load_policy(src, dtype="bfloat16")  # the stored dtype, so the child is a delta against `src`
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)  # far enough to change what is sampled
    return policy.save(out)


def _setup(settings: Settings, tiny_model_dir: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    ensure_topics(settings)
    registry = ModelRegistry(settings)
    v1 = registry.register(tiny_model_dir, ModelLineage(base="tiny"))
    v2 = registry.register(_child(tiny_model_dir, tmp_path / "v2"), ModelLineage(base="tiny", parent_version=v1))
    assert registry.manifest(v2)["artifact"]["kind"] == "delta"
    shutil.rmtree(settings.data_dir / "models")  # serving rebuilds v2 from the store, as in production
    fetches: list[str] = []
    aliased = aliased_checkpoints(registry)  # serving's own source: only what the aliases name is fetched

    def source(version: str) -> str:
        fetches.append(version)
        return aliased(version)

    redis = redis_client(settings)
    store = TrafficSplitStore(redis, settings)
    pool = PolicyPool(store.get, source)
    producer = make_producer(settings)  # closed with the app (its lifespan), not left running after the test
    app = create_app(pool, producer, settings.events_topic, refresh_interval_s=30.0, on_shutdown=producer.close,
                     signing_key=settings.serving_key.get_secret_value())  # fmt: skip
    return registry, store, pool, TestClient(app), v1, v2, fetches


def test_a_swap_under_concurrent_requests_fails_none_and_every_event_names_its_weights(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    registry, store, pool, client, v1, v2, _ = _setup(settings, tiny_model_dir, tmp_path)
    registry.set_alias("champion", v1)
    store.put(TrafficSplit(champion_version=v1))
    stop = threading.Event()
    # The poll is 30 s here: the swap arrives through the split's pub/sub channel.
    watch_split(redis_client(settings), store.channel, pool.refresh, stop)
    n = 48

    def ask(i: int) -> tuple[int, str]:
        if i == n // 3:  # a promotion, as the gate makes it: the alias first, then the split
            registry.set_alias("champion", v2)
            store.put(TrafficSplit(champion_version=v2))
        resp = client.post("/v1/completions", json={"prompt": "def f(", "user": f"u{i}", "max_tokens": 6,
                                                    "seed": i})  # fmt: skip
        return resp.status_code, resp.json().get("model", "")

    with client:
        with ThreadPoolExecutor(4) as ex:
            answers = list(ex.map(ask, range(n)))
        deadline = time.monotonic() + 30
        while pool.split is None or pool.split.champion_version != v2:
            assert time.monotonic() < deadline, "the swap never happened"
            time.sleep(0.05)
        tail = [ask(n + i) for i in range(4)]
    stop.set()
    assert all(code == 200 for code, _ in answers + tail), answers
    assert {m for _, m in tail} == {v2}
    events = read_events(settings, len(answers) + len(tail))
    assert len(events) == n + 4
    served = {e.generation().model_version for e in events}
    assert served == {v1, v2}, "requests before the swap ran on v1, after on v2"
    # The logged log-probs are exactly those of the named version's weights (v1 and v2 disagree on them).
    policies = {v: load_policy(registry.fetch(v)) for v in (v1, v2)}
    for event in events:
        record = event.generation()
        policy = policies[record.model_version]
        lp, mask = token_logprobs(policy.model, [record.prompt_token_ids], [record.completion_token_ids],
                                  policy.pad_id)  # fmt: skip
        assert lp[0][mask[0].bool()].tolist() == record.behaviour_logprobs, record.model_version


def test_a_corrupted_delta_is_refused_once_and_serving_keeps_the_old_version(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    registry, store, pool, client, v1, v2, fetches = _setup(settings, tiny_model_dir, tmp_path)
    run_id = registry.lineage(v2).run_id
    assert run_id
    stored = next(p for p in (settings.data_dir / "mlflow" / "artifacts").rglob("*.fwdelta") if run_id in p.parts)
    raw = bytearray(stored.read_bytes())
    raw[-10] ^= 0xFF
    stored.write_bytes(bytes(raw))

    registry.set_alias("champion", v1)
    store.put(TrafficSplit(champion_version=v1))
    with client:
        assert client.post("/v1/completions", json={"prompt": "x", "user": "a"}).json()["model"] == v1
        registry.set_alias("challenger", v2)
        store.put(TrafficSplit(champion_version=v2))
        assert pool.refresh() is False
        refusal = pool.refused[v2]
        assert "stored delta is corrupted" in refusal.reason and refusal.failures == 1
        calls = len(fetches)
        assert pool.refresh() is False and len(fetches) == calls, "a known-bad artifact is not fetched again at once"
        resp = client.post("/v1/completions", json={"prompt": "x", "user": "a"})
    assert resp.status_code == 200 and resp.json()["model"] == v1
    assert pool.split is not None and pool.split.champion_version == v1 and pool.loaded_versions == [v1]


def test_a_delta_whose_manifest_names_another_parent_is_refused_by_serving(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    registry, store, pool, client, v1, v2, _ = _setup(settings, tiny_model_dir, tmp_path)
    run_id = registry.lineage(v2).run_id
    assert run_id
    path = next(p for p in (settings.data_dir / "mlflow" / "artifacts").rglob("checkpoint_manifest.json")
                if run_id in p.parts)  # fmt: skip
    manifest = json.loads(path.read_bytes())
    manifest["artifact"]["parent_manifest_sha256"] = "0" * 64
    raw = json.dumps(manifest, sort_keys=True, indent=1).encode()
    path.write_bytes(raw)
    registry.client.set_model_version_tag(settings.registered_model_name, v2, "flywheel.manifest_sha256",
                                          hashlib.sha256(raw).hexdigest())  # fmt: skip
    registry.set_alias("champion", v1)
    registry.set_alias("challenger", v2)
    store.put(TrafficSplit(champion_version=v1))
    with client:
        store.put(TrafficSplit(champion_version=v2))
        assert pool.refresh() is False
        assert "names another parent" in pool.refused[v2].reason
        assert client.post("/v1/completions", json={"prompt": "x", "user": "a"}).json()["model"] == v1


def test_a_split_naming_a_version_no_alias_names_is_refused(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    registry, store, pool, client, v1, v2, _ = _setup(settings, tiny_model_dir, tmp_path)
    registry.set_alias("champion", v1)
    store.put(TrafficSplit(champion_version=v1))
    with client:
        store.put(TrafficSplit(champion_version=v1, challenger_version=v2, challenger_share=1.0))  # no alias
        assert pool.refresh() is False
        assert "serving runs only what champion and challenger name" in pool.refused[v2].reason
        assert client.post("/v1/completions", json={"prompt": "x", "user": "a"}).json()["model"] == v1
