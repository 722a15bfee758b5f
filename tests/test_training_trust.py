"""Only generations serving produced become trainer samples, whatever a write-key holder posts.

The real path: serving logs its signed generation to the broker; a client with a write key posts
forged and tampered `generation` events through the collector; the ingest worker writes both
into the lake; the trainer selects its samples from the lake. Rewards are written straight to
the lake (signals are not what is under test, and score every generation alike).
"""

from __future__ import annotations

import base64
import time
from datetime import UTC, datetime
from pathlib import Path

from fastapi.testclient import TestClient

from flywheel.bus import ensure_topics, make_producer
from flywheel.bus.reader import read_topic
from flywheel.connections import redis_client
from flywheel.contract import Event, GenerationRecord, RewardRecord, TrafficSplit
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from flywheel.signing import Untrusted, check_generation, sign_generation
from flywheel.traffic import TrafficSplitStore
from ingest.collector.app import create_app as create_collector
from ingest.worker.loop import IngestWorker
from serving.app import create_app as create_serving
from serving.pool import PolicyPool
from simulator.lake_feedback import write_rewards
from trainer.config import TrainerConfig
from trainer.data import load_selection

AUTH = {"Authorization": "Basic " + base64.b64encode(b"dev-write-key:").decode()}


def record(**over: object) -> dict:
    made_up = GenerationRecord(
        prompt="x = ", prompt_token_ids=[5, 6], completion=" 1\n", completion_token_ids=[7, 8],
        behaviour_logprobs=[-0.01, -0.01], model_version="1",
    )  # fmt: skip
    return {**made_up.model_dump(), **over}


def post(collector: TestClient, gid: str, user: str, properties: dict) -> None:
    event = {"type": "generation", "generation_id": gid, "user_id": user, "source": "serving",
             "properties": properties}  # fmt: skip
    resp = collector.post("/v1/events", json={"events": [event]}, headers=AUTH)
    assert resp.status_code == 200 and resp.json()["accepted"] == 1, resp.text  # the collector takes it


def ingest_all(settings: Settings, rows: int, timeout_s: float = 60.0) -> None:
    worker = IngestWorker(settings)
    deadline = time.monotonic() + timeout_s
    try:
        while EVENTS.read(EVENTS.at(settings.lake_root)).height < rows and time.monotonic() < deadline:
            worker.run_once()
    finally:
        worker.close()
    assert EVENTS.read(EVENTS.at(settings.lake_root)).height == rows


def test_forged_and_tampered_generations_never_become_samples(settings: Settings, tiny_model_dir: Path) -> None:
    ensure_topics(settings)
    store = TrafficSplitStore(redis_client(settings), settings)
    store.put(TrafficSplit(champion_version="1"))
    key = settings.serving_key.get_secret_value()
    producer = make_producer(settings)  # closed with the app (its lifespan), not left running after the test
    serving = create_serving(PolicyPool(store.get, lambda _: str(tiny_model_dir)), producer,
                             settings.events_topic, signing_key=key, on_shutdown=producer.close)  # fmt: skip
    with TestClient(serving) as client, TestClient(create_collector(settings)) as collector:
        real = client.post("/v1/completions", json={"prompt": "def f(x):\n", "user": "alice", "max_tokens": 4,
                                                    "seed": 7}).json()["id"]  # fmt: skip
        (served,) = [Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic)]
        signed = served.generation()

        # A write-key holder's made-up generation, unsigned and with a guessed signature.
        post(collector, "forged", "alice", record())
        post(collector, "forged-sig", "alice", record(signature="v1:" + "0" * 64))
        # Serving's own record with better-looking log-probs, its signature kept.
        post(collector, "tampered", "alice", {**signed.model_dump(), "behaviour_logprobs":
                                              [0.0] * len(signed.behaviour_logprobs)})  # fmt: skip
        # Serving's record replayed for another generation id and another user: the signature binds both.
        post(collector, "replayed", "alice", signed.model_dump())
        post(collector, real, "mallory", signed.model_dump())
        # An unsigned copy claiming serving's generation id must not push serving's record aside.
        post(collector, real, "alice", record())
        resp = collector.post("/v1/events", headers=AUTH, json={"events": [
            {"type": "shown", "generation_id": g, "user_id": u, "properties": {"training_consent": True}}
            for g, u in (("c1", "alice"), ("c2", "mallory"))
        ]})  # fmt: skip
        assert resp.status_code == 200, resp.text
    ingest_all(settings, rows=1 + 6 + 2)

    now = datetime.now(UTC)
    gids = [real, "forged", "forged-sig", "tampered", "replayed"]
    write_rewards(settings, [
        RewardRecord(generation_id=g, reward_version="r1", reward=1.0, confidence=1.0, label_source="explicit",
                     window_start=now, window_end=now, emitted_at=now)
        for g in gids
    ])  # fmt: skip
    selection = load_selection(settings, TrainerConfig(), watermark=None, quarantined=set(),
                               encode_prompt=lambda text: [1])  # fmt: skip

    (sample,) = selection.samples
    assert sample.generation_id == real and sample.user_id == "alice"
    assert sample.behaviour_logprobs == signed.behaviour_logprobs
    assert sample.completion_token_ids == signed.completion_token_ids
    assert selection.dropped == {Untrusted.UNSIGNED.value: 1, Untrusted.MISMATCH.value: 3}
    assert selection.drop_metrics() == {
        "left_out_unsigned_not_logged_by_serving": 1.0, "left_out_with_a_signature_that_does_not_verify": 3.0,
    }  # fmt: skip
    assert "3 with a signature that does not verify" in selection.describe_drops()


def test_the_signature_covers_every_field_the_trainer_reads() -> None:
    key = "k" * 32
    rec = GenerationRecord.model_validate(record(temperature=1.0, experiment="exp", arm="champion"))
    rec.signature = sign_generation(key, "g1", "alice", rec)
    assert check_generation(key, "g1", "alice", rec) is None
    # The record survives a trip through JSON (Kafka, the lake) and still verifies.
    again = GenerationRecord.model_validate_json(rec.model_dump_json())
    assert check_generation(key, "g1", "alice", again) is None
    # Latency is not something the trainer learns from: it may differ.
    assert check_generation(key, "g1", "alice", rec.model_copy(update={"latency_ms": 12.5})) is None

    changes = {
        "prompt": "y = ", "prompt_token_ids": [5, 9], "completion": " 2\n", "completion_token_ids": [7, 9],
        "behaviour_logprobs": [-0.01, -0.02], "model_version": "2", "arm": "challenger", "experiment": "other",
        "temperature": 0.7, "finish_reason": "length",
    }  # fmt: skip
    for name, value in changes.items():
        assert check_generation(key, "g1", "alice", rec.model_copy(update={name: value})) == Untrusted.MISMATCH, name
    assert check_generation(key, "g2", "alice", rec) == Untrusted.MISMATCH
    assert check_generation(key, "g1", "bob", rec) == Untrusted.MISMATCH
    assert check_generation("another key", "g1", "alice", rec) == Untrusted.MISMATCH
    assert check_generation(key, "g1", "alice", rec.model_copy(update={"signature": ""})) == Untrusted.UNSIGNED
    v2 = rec.model_copy(update={"signature": "v2:" + rec.signature[3:]})
    assert check_generation(key, "g1", "alice", v2) == Untrusted.UNKNOWN_SCHEME
