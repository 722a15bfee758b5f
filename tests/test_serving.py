"""Serving: completions routed by the traffic split in Redis, logged to the real broker."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from flywheel.bus import make_producer
from flywheel.bus.reader import read_topic
from flywheel.connections import redis_client
from flywheel.contract import Event, EventType, TrafficSplit
from flywheel.lm import load_policy, token_logprobs
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from serving.app import create_app
from serving.pool import PolicyPool
from tests.helpers import read_events


@pytest.fixture
def two_versions(tiny_model_dir: Path, tmp_path: Path) -> dict[str, str]:
    """Two 'versions' backed by checkpoints on disk (the registry is tested on its own)."""
    v2 = tmp_path / "v2"
    shutil.copytree(tiny_model_dir, v2)
    return {"1": str(tiny_model_dir), "2": str(v2)}


def make_client(
    settings: Settings, versions: dict[str, str], api_keys: frozenset[str] = frozenset()
) -> tuple[TestClient, TrafficSplitStore, PolicyPool]:
    from flywheel.bus import ensure_topics

    ensure_topics(settings)
    store = TrafficSplitStore(redis_client(settings), settings)
    pool = PolicyPool(store.get, versions.__getitem__)
    producer = make_producer(settings)  # closed with the app (its lifespan), not left running after the test
    app = create_app(pool, producer, settings.events_topic, refresh_interval_s=0.2, on_shutdown=producer.close,
                     signing_key=settings.serving_key.get_secret_value(), api_keys=api_keys)
    return TestClient(app), store, pool


def test_with_api_keys_set_only_a_caller_with_one_is_answered_and_nothing_is_logged_for_the_others(
    settings: Settings, two_versions: dict[str, str]
) -> None:
    client, store, _ = make_client(settings, two_versions, frozenset({"key-old", "key-new"}))
    store.put(TrafficSplit(champion_version="1"))
    body = {"prompt": "def ", "user": "u1", "max_tokens": 4, "seed": 1}
    with client:
        refused = [client.post("/v1/completions", json=body, headers=h)
                   for h in ({}, {"Authorization": "Bearer key-other"}, {"Authorization": "Basic key-new"},
                             {"Authorization": "Bearer key-ol"})]  # fmt: skip
        models = client.get("/v1/models")
        health = client.get("/readyz")
        answered = [client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {k}"})
                    for k in ("key-old", "key-new")]  # both while one is rotated out
    for r in refused:
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key" and "key-" not in r.text  # no key echoed
    assert models.status_code == 401
    assert health.status_code == 200  # probes need no key
    assert [r.status_code for r in answered] == [200, 200]
    # Only the answered requests were logged: everything in the topic, once two have arrived, is the answered two.
    deadline, logged = time.monotonic() + 30, []
    while len(logged) < 2 and time.monotonic() < deadline:
        logged = [Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic)]
    assert sorted(e.generation_id for e in logged) == sorted(r.json()["id"] for r in answered)


def test_production_serving_refuses_to_start_without_api_keys(settings: Settings) -> None:
    from serving import build_serving_app

    production = settings.model_copy(update={"environment": "production"})
    with pytest.raises(ValueError, match="FLYWHEEL_SERVING_API_KEYS is empty"):
        build_serving_app(production)


def test_not_ready_without_a_split(settings: Settings, two_versions: dict[str, str]) -> None:
    client, _, _ = make_client(settings, two_versions)
    with client:
        resp = client.post("/v1/completions", json={"prompt": "def ", "user": "u1"})
        metrics = client.get("/metrics").text
    assert resp.status_code == 503
    assert resp.headers["Retry-After"]
    # Counted for the FlywheelServingErrors alert (k8s/), by status and code.
    assert re.search(r'flywheel_serving_errors_total\{code="[a-z_]+",status="503"\} 1\.0', metrics), metrics


def test_completion_is_logged_with_behaviour_logprobs(settings: Settings, two_versions: dict[str, str]) -> None:
    client, store, _ = make_client(settings, two_versions)
    store.put(TrafficSplit(champion_version="1"))
    with client:
        resp = client.post("/v1/completions", json={"prompt": "import os\n", "user": "u1", "max_tokens": 8, "seed": 3})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["flywheel"]["arm"] == "champion" and body["model"] == "1"
    (event,) = read_events(settings, 1)
    assert event.type == EventType.GENERATION and event.generation_id == body["id"] == body["flywheel"]["generation_id"]
    record = event.generation()
    assert record.model_version == "1" and record.arm == "champion"
    assert record.completion == body["choices"][0]["text"]
    # The logged log-probs are exactly what the trainer will recompute for the same tokens.
    policy = load_policy(two_versions["1"])
    if record.completion_token_ids:
        lp, mask = token_logprobs(policy.model, [record.prompt_token_ids], [record.completion_token_ids],
                                  policy.tokenizer.pad_token_id)
        assert lp[0][mask[0].bool()].tolist() == record.behaviour_logprobs


def test_challenger_is_picked_up_without_restart_and_routing_is_sticky(
    settings: Settings, two_versions: dict[str, str]
) -> None:
    client, store, pool = make_client(settings, two_versions)
    store.put(TrafficSplit(champion_version="1", salt="s"))
    users = [f"user-{i}" for i in range(40)]
    with client:
        first = {u: client.post("/v1/completions", json={"prompt": "x = ", "user": u, "max_tokens": 2}).json()
                 for u in users}
        assert {b["model"] for b in first.values()} == {"1"}

        store.put(TrafficSplit(champion_version="1", challenger_version="2", challenger_share=0.5, salt="s",
                               state="running"))
        deadline = time.monotonic() + 30
        while "2" not in pool.loaded_versions and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "2" in pool.loaded_versions

        def served(u: str) -> dict[str, str]:
            body = client.post("/v1/completions", json={"prompt": "x = ", "user": u, "max_tokens": 2}).json()
            return body["flywheel"]

        second = {u: served(u) for u in users}
        again = {u: served(u) for u in users}
    arms = {u: m["arm"] for u, m in second.items()}
    assert set(arms.values()) == {"champion", "challenger"}
    assert arms == {u: m["arm"] for u, m in again.items()}, "a user must stay in one arm"
    assert all(m["model_version"] == ("2" if m["arm"] == "challenger" else "1") for m in second.values())
