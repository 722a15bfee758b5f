"""Each event type's properties: published at /v1/schema, and a misspelled, wrongly typed, out-of-range or
missing one refused to the dead-letter topic with its reason, whether it came through the collector or
straight onto the events topic (ingest worker, fast path and pydantic). Real broker, real lake."""

from __future__ import annotations

import base64
import itertools
import json
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import settings as settings_for_fuzz
from hypothesis import strategies as st

from flywheel.bus import Outgoing, RecordBatch, ensure_topics, make_producer
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, InvalidEvent
from flywheel.event_properties import FEEDBACK_PROPERTIES, property_problems
from flywheel.fast_validate import validate_batch
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.dead_letters import DeadLetter
from ingest.worker.loop import IngestWorker

AUTH = {"Authorization": "Basic " + base64.b64encode(b"dev-write-key:").decode()}

# (type, properties, what the reason must say); each refused.
REFUSED = [
    ("retained", {"seconds_after_acept": 30, "fraction_present": 0.5}, "did you mean 'seconds_after_accept'"),
    ("retained", {"seconds_after_accept": 30, "fractionPresent": 0.5}, "did you mean 'fraction_present'"),
    ("retained", {"seconds_after_accept": "30", "fraction_present": 0.5}, "must be a number >= 0, got '30'"),
    ("retained", {"seconds_after_accept": 30, "fraction_present": 1.5}, "must be a number in [0, 1], got 1.5"),
    ("retained", {"seconds_after_accept": 30}, "retained.fraction_present is required"),
    ("accepted", {"chars_accepted": 3}, "did you mean 'accepted_chars'"),
    ("accepted", {"accepted_chars": 3.5, "total_chars": 9}, "must be an integer >= 0, got 3.5"),
    ("accepted", {"accepted_chars": 9, "total_chars": 3}, "more than total_chars"),
    ("edited", {"edit_distance": True}, "got True (a boolean)"),
    ("thumbs", {"value": "sideways"}, "must be one of 'up', 'down'"),
    ("thumbs", {"value": "up", "coment": "great"}, "did you mean 'comment'"),
    ("followup", {"txt": "thanks"}, "followup.text is required"),
    ("shown", {"training_consent": "yes"}, "must be a boolean, got 'yes'"),
]
ACCEPTED = [
    ("retained", {"seconds_after_accept": 900, "fraction_present": 1}),
    ("accepted", {}),
    ("accepted", {"accepted_chars": 3, "total_chars": 9, "surface": "code-completion"}),
    ("thumbs", {"value": "down", "comment": None}),
    ("followup", {"text": "thanks", "language": "en", "client": {"app": "ide"}}),  # extras: kept, as sent
]


@pytest.mark.parametrize(("event_type", "properties", "reason"), REFUSED)
def test_contract_refuses_with_the_reason(event_type: str, properties: dict, reason: str) -> None:
    raw = json.dumps({"type": event_type, "generation_id": "g", "user_id": "u", "properties": properties})
    with pytest.raises(InvalidEvent, match="properties: ") as err:
        Event.from_bytes(raw.encode())
    assert reason in str(err.value)


@pytest.mark.parametrize(("event_type", "properties"), ACCEPTED)
def test_declared_and_unknown_extra_properties_are_kept(event_type: str, properties: dict) -> None:
    assert property_problems(event_type, properties) == []
    assert Event(type=event_type, generation_id="g", user_id="u", properties=properties).properties == properties


def test_schema_lists_every_event_types_properties(settings: Settings) -> None:
    with TestClient(create_app(settings)) as client:
        schema = client.get("/v1/schema").json()
    listed = schema["x-event-properties"]
    assert set(listed) == {*FEEDBACK_PROPERTIES, "generation"}
    retained = listed["retained"]
    assert set(retained["required"]) == {"seconds_after_accept", "fraction_present"}
    assert retained["properties"]["fraction_present"] | {"minimum": 0, "maximum": 1} == retained["properties"][
        "fraction_present"
    ]
    assert listed["thumbs"]["properties"]["value"]["enum"] == ["up", "down"]
    assert "comment" in listed["thumbs"]["properties"] and "accepted_chars" in listed["accepted"]["properties"]
    assert "surface" in listed["rejected"]["properties"]  # the common ones, on every type
    assert "completion_token_ids" not in listed["generation"]["required"]  # text-only generations


def test_collector_dead_letters_a_misspelled_or_wrongly_typed_property(settings: Settings) -> None:
    ensure_topics(settings)
    native = [
        {"event_id": f"n{i}", "type": t, "generation_id": "g", "user_id": "u", "properties": p}
        for i, (t, p, _) in enumerate(REFUSED)
    ]
    good = {"event_id": "ok", "type": "retained", "generation_id": "g", "user_id": "u",
            "properties": {"seconds_after_accept": 600, "fraction_present": 0.25}}  # fmt: skip
    segment = {
        "batch": [
            {"type": "track", "event": "Retained", "messageId": "s0", "userId": "u",
             "properties": {"generation_id": "g", "seconds_after_accept": 5, "fraction_presnt": 1.0}},
            {"type": "track", "event": "Thumbs", "messageId": "s1", "userId": "u",
             "properties": {"generation_id": "g", "value": 1}},
        ]
    }  # fmt: skip
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/events", json={"events": [*native, good]}, headers=AUTH)
        s = client.post("/v1/batch", json=segment, headers=AUTH)
    assert r.status_code == 200 and r.json()["accepted"] == 1
    refused = r.json()["refused"]
    assert [x["event_id"] for x in refused] == [e["event_id"] for e in native]
    for x, (_, _, reason) in zip(refused, REFUSED, strict=True):
        assert reason in x["reason"], x
    assert s.status_code == 200 and s.json()["accepted"] == 0
    assert "did you mean 'fraction_present'" in s.json()["refused"][0]["reason"]
    assert "thumbs.value must be one of 'up', 'down', got 1" in s.json()["refused"][1]["reason"]

    letters = [DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic)]
    assert len(letters) == len(REFUSED) + 2
    by_id = {json.loads(d.original).get("event_id") or json.loads(d.original)["messageId"]: d for d in letters}
    assert "did you mean 'seconds_after_accept'" in by_id["n0"].reason
    assert "did you mean 'fraction_present'" in by_id["s0"].reason
    (accepted,) = [Event.from_bytes(rec.value) for rec in read_topic(settings, settings.events_topic)]
    assert accepted.event_id == "ok"


def test_ingest_worker_dead_letters_them_straight_off_the_topic(settings: Settings) -> None:
    ensure_topics(settings)
    base = {"generation_id": "g", "user_id": "u", "ts": "2026-01-01T00:00:00Z", "received_at": "2026-01-01T00:00:00Z"}
    good = [
        json.dumps({**base, "event_id": f"ok{i}", "type": t, "properties": p}).encode()
        for i, (t, p) in enumerate(ACCEPTED)
    ]
    bad = [
        json.dumps({**base, "event_id": f"bad{i}", "type": t, "properties": p}).encode()
        for i, (t, p, _) in enumerate(REFUSED)
    ]
    bad.append(json.dumps({**base, "event_id": "no-props", "type": "thumbs"}).encode())  # required, absent
    producer = make_producer(settings)
    # Interleaved in one batch: the fast path takes the good ones, the bad ones go to pydantic for a reason.
    mixed = [v for pair in itertools.zip_longest(good, bad) for v in pair if v is not None]
    producer.send_all([Outgoing(settings.events_topic, v) for v in mixed])
    producer.close()
    worker = IngestWorker(settings, group_id="g-props", poll_timeout_s=0.3)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            worker.run_once()
            rows = EVENTS.read(EVENTS.at(settings.lake_root)).height
            if rows >= len(good) and len(read_topic(settings, settings.dead_letter_topic)) >= len(bad):
                break
    finally:
        worker.close()
    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    assert sorted(lake["event_id"].to_list()) == sorted(f"ok{i}" for i in range(len(ACCEPTED)))
    extras = json.loads(lake.filter(lake["event_id"] == "ok4")["properties"].item())
    assert extras == ACCEPTED[4][1]
    dead = [DeadLetter.from_bytes(r.value) for r in read_topic(settings, settings.dead_letter_topic)]
    letters = {json.loads(d.original)["event_id"]: d.reason for d in dead}
    assert sorted(letters) == sorted([f"bad{i}" for i in range(len(REFUSED))] + ["no-props"])
    for i, (_, _, reason) in enumerate(REFUSED):
        assert reason in letters[f"bad{i}"], letters[f"bad{i}"]
    assert "thumbs.value is required" in letters["no-props"]


_NAMES = sorted({n for spec in FEEDBACK_PROPERTIES.values() for n in spec} | {"surface", "training_consent"})
_VALUES = st.none() | st.booleans() | st.integers(-3, 50) | st.floats(-1, 2, allow_nan=False)
# "x" * 9000: cut; "Like": an alias of "up"; on both paths.
_VALUES = _VALUES | st.sampled_from(["up", "down", "3", "", "x" * 9000, "Like"])


@settings_for_fuzz(max_examples=300, deadline=None)
@given(
    batch=st.lists(
        st.tuples(
            st.sampled_from(sorted(FEEDBACK_PROPERTIES)),
            st.dictionaries(st.sampled_from([*_NAMES, "chars_accepted", "Value", "lang", "x"]), _VALUES, max_size=4),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_fast_path_and_pydantic_accept_the_same_properties(batch: list[tuple[str, dict]]) -> None:
    base = {"generation_id": "g", "user_id": "u", "ts": "2026-01-01T00:00:00Z", "received_at": "2026-01-01T00:00:00Z"}
    values = [
        json.dumps({**base, "event_id": f"e{i}", "type": t, "properties": p}).encode() for i, (t, p) in enumerate(batch)
    ]
    n = len(values)
    valid, refused = validate_batch(RecordBatch(["t"] * n, [0] * n, list(range(n)), values))
    expected = []
    for i, raw in enumerate(values):
        try:
            Event.from_bytes(raw)
            expected.append(i)
        except InvalidEvent:
            pass
    assert valid["_i"].to_list() == expected
    assert sorted([i for i, _ in refused] + expected) == list(range(len(values)))
