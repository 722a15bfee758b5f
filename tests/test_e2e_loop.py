"""The whole loop, thin but real: on the real broker, Redis, MLflow and a torch model.

A completion is served; feedback for it posted to the collector becomes a reward; the
trainer registers a new version whose lineage names that data; after approval, serving
answers some users from the new version and logs that version on its generation events.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import polars as pl
import pytest
from fastapi.testclient import TestClient

from deploy_gate import DeployGate
from flywheel.bus import ensure_topics, make_consumer
from flywheel.contract import Event, EventType, ModelLineage
from flywheel.lake.tables import EVENTS, REWARDS
from flywheel.settings import Settings
from ingest.collector.app import create_app as create_collector
from ingest.worker.loop import IngestWorker
from model_registry import ModelRegistry
from serving import build_serving_app
from signals.sink import read_rewards
from signals.worker import SignalsWorker
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle

AUTH = ("dev-write-key", "")


def feedback(generation_id: str, user: str, accepted: bool) -> list[dict[str, object]]:
    base = {"generation_id": generation_id, "user_id": user, "source": "e2e"}
    # The product states the user's training consent on the events it sends (trainer's consent_property).
    shown = {**base, "type": "shown", "properties": {"training_consent": True}}
    if accepted:
        return [shown, {**base, "type": "accepted", "properties": {"accepted_chars": 3, "total_chars": 3}}]
    return [shown, {**base, "type": "rejected"}]


def generation_events(settings: Settings, wanted: set[str], timeout_s: float = 60.0) -> dict[str, Event]:
    """Read the events topic until the generation events of `wanted` are all seen (or time runs out)."""
    consumer = make_consumer(settings, [settings.events_topic], "e2e-check")
    out: dict[str, Event] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while not wanted <= set(out) and time.monotonic() < deadline:
            for r in consumer.poll_batch(timeout_s=1.0):
                event = Event.from_bytes(r.value)
                if event.type == EventType.GENERATION:
                    out[event.generation_id] = event
    finally:
        consumer.close()
    return out


def landed_generations(settings: Settings) -> set[str]:
    """The generation ids whose generation event is in the lake."""
    events = EVENTS.scan(EVENTS.at(settings.lake_root))
    if events is None:
        return set()
    return set(events.filter(pl.col("type") == "generation").select("generation_id").collect().to_series().to_list())


@pytest.mark.slow
def test_feedback_becomes_a_served_model_version(settings: Settings, tiny_model_dir: Path) -> None:
    settings = settings.model_copy(update={"challenger_share": 0.5})
    ensure_topics(settings)
    registry = ModelRegistry(settings)
    champion = registry.register(tiny_model_dir, ModelLineage(base=str(tiny_model_dir)))
    registry.set_alias("champion", champion)
    registry.set_gate_state(champion, "champion", by="e2e", reason="first champion")
    gate = DeployGate.from_settings(settings)
    gate.ensure_split()

    serving = TestClient(build_serving_app(settings))
    collector = TestClient(create_collector(settings))
    with serving, collector:
        # 1. Completions are served and users react to them through the collector.
        served: dict[str, bool] = {}  # generation id -> accepted
        declined: set[str] = set()
        for i in range(16):
            user = f"user-{i}"
            resp = serving.post("/v1/completions", json={"prompt": "def add(a, b):\n", "user": user,
                                                         "max_tokens": 6, "seed": i})
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["flywheel"]["model_version"] == champion
            if body["choices"][0]["finish_reason"] == "declined":
                declined.add(body["id"])
                continue
            accepted = i % 2 == 0
            sent = collector.post("/v1/events", json={"events": feedback(body["id"], user, accepted)}, auth=AUTH)
            assert sent.status_code == 200 and sent.json()["refused"] == [], sent.text
            served[body["id"]] = accepted
        assert len(served) >= 8

        # 2. Ingest writes the lake; signals turn each generation's feedback into one reward.
        ingest, signals = IngestWorker(settings), SignalsWorker(settings)
        deadline = time.monotonic() + 90
        rewards = pl.DataFrame()
        try:
            while time.monotonic() < deadline:
                ingest.run_once()
                signals.run_once()
                rewards = read_rewards(REWARDS.at(settings.lake_root), latest_only=True)
                # The trainer joins each reward to its generation event: wait for both (serving's events come
                # through its own producer, and may land after the feedback's rewards on a busy machine).
                if (not rewards.is_empty() and set(served) <= set(rewards["generation_id"])
                        and set(served) <= landed_generations(settings)):
                    break
        finally:
            ingest.close()
            signals.close()
        assert set(served) <= set(rewards["generation_id"].to_list()), "every reacted-to generation gets a reward"
        assert set(served) <= landed_generations(settings), "every served generation's event lands"
        by_id = dict(zip(rewards["generation_id"], rewards["reward"], strict=True))
        assert min(by_id[g] for g, a in served.items() if a) > max(by_id[g] for g, a in served.items() if not a)

        # 3. The trainer registers a candidate whose lineage names that data.
        result = run_cycle(settings, TrainerConfig(learning_rate=1e-3, epochs=1, batch_size=8), progress=False)
        assert result.status == "registered", result.reason
        assert result.version is not None
        lineage = registry.lineage(result.version)
        trained_ids = sorted(set(rewards["generation_id"].to_list()) - declined)  # nothing to learn from declines
        assert lineage.parent_version == champion
        assert lineage.sample_count == result.sample_count == len(trained_ids) >= len(served)
        window = lineage.data_window
        assert window is not None and window.end >= rewards["emitted_at"].max()
        assert window.generation_ids_sha256 == hashlib.sha256("\n".join(trained_ids).encode()).hexdigest()
        assert registry.gate_state(result.version) == "pending"

        # 4. Approved, the candidate becomes the challenger, and serving picks it up without a restart.
        gate.approve(result.version, by="ml-ops@example.com", reason="e2e test")
        deadline = time.monotonic() + 60
        while result.version not in serving.app.state.pool.loaded_versions and time.monotonic() < deadline:
            time.sleep(0.2)
        versions = {}
        for i in range(40):
            user = f"later-user-{i}"
            meta = serving.post("/v1/completions", json={"prompt": "import ", "user": user, "max_tokens": 2}).json()
            versions[meta["id"]] = (meta["flywheel"]["arm"], meta["model"])
    assert {m for _, m in versions.values()} == {champion, result.version}, "some users get the new version"

    # 5. Serving logged the version and arm that answered on each generation event.
    logged = generation_events(settings, set(versions))
    assert set(versions) <= set(logged)
    for gen_id, (arm, version) in versions.items():
        record = logged[gen_id].generation()
        assert record.model_version == version and record.arm == arm
