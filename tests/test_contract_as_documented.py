"""The contract behaves as docs/sending-events.md says for every event type: names it does not declare are kept in the
lake and ignored by the signals; other APIs' values are mapped (a product's arm name, OpenAI's
`content_filter`); an over-long feedback text is cut with a flag, not lost, on every path into the lake
(collector, and straight onto the topic through the worker's fast path and pydantic alike)."""

from __future__ import annotations

import base64
import json
import time

import pytest
from fastapi.testclient import TestClient

from flywheel.bus import Outgoing, RecordBatch, ensure_topics, make_producer
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, EventType, InvalidEvent
from flywheel.event_properties import FEEDBACK_PROPERTIES, MAX_TEXT_CHARS
from flywheel.fast_validate import validate_batch
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.worker.loop import IngestWorker
from signals.events import FeedbackEvent, GenerationInfo
from signals.reward import builtin_definition

AUTH = {"Authorization": "Basic " + base64.b64encode(b"dev-write-key:").decode()}
GENERATION = {"prompt": "hi", "completion": "hello there", "model_version": "acme-7b", "surface": "chat"}
EXTRAS = {"language": "en", "request_id": "req-1", "client": {"app": "web"}}


@pytest.mark.parametrize("event_type", [t.value for t in EventType])
def test_every_type_keeps_names_it_does_not_declare(event_type: str) -> None:
    required = {
        "generation": GENERATION,
        "edited": {"edit_distance": 1},
        "retained": {"seconds_after_accept": 1, "fraction_present": 1},
        "thumbs": {"value": "up"},
        "followup": {"text": "ok"},
    }.get(event_type, {})
    event = Event(type=event_type, generation_id="g", user_id="u", properties={**required, **EXTRAS})
    assert {k: event.properties[k] for k in EXTRAS} == EXTRAS
    assert Event.from_bytes(event.to_bytes()) == event


def test_signals_ignore_names_they_do_not_declare() -> None:
    definition = builtin_definition("chat")
    t0 = 1_700_000_000_000_000

    def reward(extra: dict) -> float:
        gen = GenerationInfo.from_properties("g", t0, "u", {**GENERATION, **extra})
        events = [
            FeedbackEvent("e1", "thumbs", t0 + 1_000_000, {"value": "up", **extra}),
            FeedbackEvent("e2", "followup", t0 + 2_000_000, {"text": "thanks, great", **extra}),
        ]
        return definition.record(gen, events, window_end_us=t0 + 10**9).reward

    assert reward(EXTRAS) == reward({})


@pytest.mark.parametrize(
    ("sent", "stored"),
    [
        ({"arm": "variant-b"}, {"product_arm": "variant-b"}),
        (
            {"finish_reason": "content_filter"},
            {"finish_reason": "declined", "provider_finish_reason": "content_filter"},
        ),
        ({"finish_reason": "MAX_TOKENS"}, {"finish_reason": "length", "provider_finish_reason": "MAX_TOKENS"}),
        ({"finish_reason": "end_turn"}, {"finish_reason": "stop", "provider_finish_reason": "end_turn"}),
        ({"finish_reason": None, "latency_ms": None}, {}),  # null: not sent (OpenAI streams send it)
        ({"arm": "challenger", "finish_reason": "length"}, {"arm": "challenger", "finish_reason": "length"}),
    ],
)
def test_other_apis_generation_values_are_mapped(sent: dict, stored: dict) -> None:
    event = Event(type="generation", generation_id="g", user_id="u", properties={**GENERATION, **sent})
    assert event.properties == {**GENERATION, **stored}
    assert Event.from_bytes(event.to_bytes()) == event  # the mapping is its own fixed point
    assert event.generation().arm == stored.get("arm", "champion")


@pytest.mark.parametrize(
    ("sent", "reason"),
    [
        ({"finish_reason": "sideways"}, "generation.finish_reason must be one of 'stop', 'length', 'declined'"),
        ({"modelVersion": "x"}, "did you mean 'model_version'"),
        ({"arm": "variant-b", "product_arm": "variant-c"}, "product_arm, which already holds 'variant-c'"),
    ],
)
def test_generation_values_that_map_to_nothing_are_refused_with_the_reason(sent: dict, reason: str) -> None:
    raw = json.dumps({"type": "generation", "generation_id": "g", "user_id": "u", "properties": {**GENERATION, **sent}})
    with pytest.raises(InvalidEvent, match="properties: ") as err:
        Event.from_bytes(raw.encode())
    assert reason in str(err.value)


@pytest.mark.parametrize(("event_type", "name"), [("followup", "text"), ("thumbs", "comment")])
def test_an_over_long_text_is_cut_with_a_flag(event_type: str, name: str) -> None:
    long = "a" * MAX_TEXT_CHARS + "b" * 100
    props = {"value": "down"} if event_type == "thumbs" else {}
    event = Event(type=event_type, generation_id="g", user_id="u", properties={**props, name: long})
    assert event.properties[name] == "a" * MAX_TEXT_CHARS and event.properties[f"{name}_truncated"] is True
    fitting = Event(type=event_type, generation_id="g", user_id="u", properties={**props, name: "a" * MAX_TEXT_CHARS})
    assert f"{name}_truncated" not in fitting.properties
    assert f"{name}_truncated" in FEEDBACK_PROPERTIES[event_type]


@pytest.mark.parametrize(("sent", "stored"), [("Like", "up"), ("thumbs_down", "down"), ("UP", "up"), ("-1", "down")])
def test_other_apis_votes_are_mapped_and_kept_as_sent(sent: str, stored: str) -> None:
    event = Event(type="thumbs", generation_id="g", user_id="u", properties={"value": sent})
    assert event.properties == {"value": stored, "value_as_sent": sent}
    assert Event(type="thumbs", generation_id="g", user_id="u", properties={"value": stored}).properties == {
        "value": stored
    }


def test_fast_path_cuts_and_maps_like_pydantic() -> None:
    base = {"generation_id": "g", "user_id": "u", "ts": "2026-01-01T00:00:00Z", "received_at": "2026-01-01T00:00:00Z"}
    values = [
        json.dumps({**base, "event_id": "long", "type": "followup", "properties": {"text": "x" * 9000}}).encode(),
        json.dumps({**base, "event_id": "short", "type": "followup", "properties": {"text": "ok"}}).encode(),
        json.dumps({**base, "event_id": "vote", "type": "thumbs", "properties": {"value": "Like"}}).encode(),
    ]
    valid, refused = validate_batch(RecordBatch(["t"] * 3, [0] * 3, [0, 1, 2], values))
    assert refused == []
    stored = dict(zip(valid["event_id"].to_list(), valid["properties"].to_list(), strict=True))
    assert json.loads(stored["long"]) == {"text": "x" * MAX_TEXT_CHARS, "text_truncated": True}
    assert json.loads(stored["short"]) == {"text": "ok"}
    assert json.loads(stored["vote"]) == {"value": "up", "value_as_sent": "Like"}


def test_through_the_collector_and_worker_the_lake_keeps_extras_mapped_values_and_cut_texts(settings: Settings) -> None:
    ensure_topics(settings)
    batch = [
        {"type": "track", "event": "generation", "messageId": "gen", "userId": "u",
         "properties": {"generation_id": "g1", **GENERATION, **EXTRAS, "arm": "variant-b",
                        "finish_reason": "content_filter"}},
        {"type": "track", "event": "Followup", "messageId": "fu", "userId": "u",
         "properties": {"generation_id": "g1", "text": "y" * 10_000, "language": "en"}},
    ]  # fmt: skip
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/batch", json={"batch": batch}, headers=AUTH)
    assert r.status_code == 200 and r.json() == {"success": True, "accepted": 2, "refused": []}
    # Straight onto the topic too: the worker cuts it as the collector does.
    raw = {"event_id": "fu2", "type": "followup", "generation_id": "g1", "user_id": "u",
           "properties": {"text": "z" * 10_000}}  # fmt: skip
    producer = make_producer(settings)
    producer.send_all([Outgoing(settings.events_topic, json.dumps(raw).encode(), key=b"g1")])
    producer.close()
    worker = IngestWorker(settings, group_id="g-contract", poll_timeout_s=0.3)
    try:
        deadline = time.monotonic() + 60
        table = EVENTS.at(settings.lake_root)
        while time.monotonic() < deadline and EVENTS.read(table).height < 3:
            worker.run_once()
    finally:
        worker.close()
    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    props = {row["event_id"]: json.loads(row["properties"]) for row in lake.iter_rows(named=True)}
    assert props["gen"] == {**GENERATION, **EXTRAS, "product_arm": "variant-b", "finish_reason": "declined",
                            "provider_finish_reason": "content_filter"}  # fmt: skip
    assert props["fu"] == {"text": "y" * MAX_TEXT_CHARS, "text_truncated": True, "language": "en"}
    assert props["fu2"] == {"text": "z" * MAX_TEXT_CHARS, "text_truncated": True}
    assert read_topic(settings, settings.dead_letter_topic) == []
