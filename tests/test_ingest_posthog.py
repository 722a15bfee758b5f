"""PostHog door: posthog-python, unchanged, with gzip on and off, against a running collector (real broker, real
lake): its events land as Segment's do, once each; PostHog's own `$` events are ignored and counted; a message that
cannot be an event and a body that cannot be read are dead-lettered with their reason, the API key redacted."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi.testclient import TestClient
from posthog import Posthog
from prometheus_client import REGISTRY

from flywheel.bus import ensure_topics
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, InvalidEvent
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.dead_letters import DeadLetter
from ingest.replay import revalidate
from ingest.worker.loop import IngestWorker
from launcher.embedded import free_port, wait_for_port

KEY = "dev-write-key"


@pytest.fixture
def collector_url(settings: Settings) -> Iterator[str]:
    ensure_topics(settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for_port("127.0.0.1", port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def ignored(endpoint: str, why: str) -> float:
    """The collector's count (it runs in this process, on the default registry)."""
    return REGISTRY.get_sample_value("flywheel_collector_ignored_total", {"endpoint": endpoint, "why": why}) or 0.0


@pytest.mark.parametrize("gzip", [True, False])
def test_posthog_python_delivers_events_that_land_like_segments(
    settings: Settings, collector_url: str, gzip: bool
) -> None:
    n = 30
    ignored_before = ignored("/batch/", "$pageview")
    client = Posthog(KEY, host=collector_url, gzip=gzip, flush_at=10, max_retries=1)
    for i in range(n):
        client.capture(
            "Accepted" if i % 3 else "thumbs",
            distinct_id=f"user-{i % 4}",
            properties={"generation_id": f"gen-{i}", "$session_id": f"s-{i % 2}", "language": "en",
                        **({"accepted_chars": i} if i % 3 else {"value": "up"})},
            uuid=f"00000000-0000-4000-8000-{i:012d}",
        )  # fmt: skip
    client.capture("$pageview", distinct_id="user-0", properties={"$current_url": "https://acme.test/"})
    client.flush()
    client.shutdown()

    worker = IngestWorker(settings, group_id=f"g-posthog-{gzip}", poll_timeout_s=0.3)
    table = EVENTS.at(settings.lake_root)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and EVENTS.read(table).height < n:
            worker.run_once()
        worker.run_once()
    finally:
        worker.close()
    lake = EVENTS.read(table)
    assert lake.height == n
    assert sorted(lake["event_id"].to_list()) == sorted(f"00000000-0000-4000-8000-{i:012d}" for i in range(n))
    row = lake.filter(lake["event_id"] == f"00000000-0000-4000-8000-{7:012d}").row(0, named=True)
    assert (row["type"], row["generation_id"], row["user_id"], row["session_id"], row["source"]) == (
        "accepted", "gen-7", "user-3", "s-1", "posthog"
    )  # fmt: skip
    assert json.loads(row["properties"]) == {"accepted_chars": 7, "language": "en"}  # no `$` properties
    assert set(lake.filter(lake["type"] == "thumbs")["generation_id"].to_list()) == {f"gen-{i}" for i in range(0, n, 3)}
    assert read_topic(settings, settings.dead_letter_topic) == []
    assert ignored("/batch/", "$pageview") == ignored_before + 1


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    ensure_topics(settings)
    with TestClient(create_app(settings)) as c:
        yield c


def test_a_message_that_cannot_be_an_event_is_refused_alone_with_its_reason(
    client: TestClient, settings: Settings
) -> None:
    batch = [
        {"event": "thumbs", "distinct_id": "u", "uuid": "ok", "properties": {"generation_id": "g", "value": "up"}},
        {"event": "thumbs", "uuid": "no-user", "properties": {"generation_id": "g", "value": "up"}},
        {"event": "Clicked Buy", "distinct_id": "u", "uuid": "not-a-type", "properties": {"generation_id": "g"}},
        {"event": "followup", "distinct_id": "u", "uuid": "long",
         "properties": {"generation_id": "g", "text": "x" * 9000}},
        {"event": "thumbs", "distinct_id": "u", "uuid": "huge",
         "properties": {"generation_id": "g", "value": "up", "blob": "y" * 300_000}},
    ]  # fmt: skip
    refused_before = REGISTRY.get_sample_value("flywheel_ingest_events_refused_total", {"stage": "collector"}) or 0
    r = client.post("/batch/", json={"api_key": KEY, "batch": batch, "sent_at": "2026-01-01T00:00:00Z"})
    refused_after = REGISTRY.get_sample_value("flywheel_ingest_events_refused_total", {"stage": "collector"})
    assert refused_after == refused_before + 3  # counted, as well as answered and dead-lettered
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["status"] == 1 and doc["accepted"] == 2
    assert [(x["event_id"], x["reason"]) for x in doc["refused"]] == [
        ("no-user", "userId or anonymousId: one is required"),
        ("not-a-type", doc["refused"][1]["reason"]),
        ("huge", doc["refused"][2]["reason"]),
    ]
    assert "the limit is 262144" in doc["refused"][2]["reason"]
    assert "'Clicked Buy' is not an event type" in doc["refused"][1]["reason"]
    events = {e.event_id: e for e in (Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic))}
    assert set(events) == {"ok", "long"} and events["long"].properties["text_truncated"] is True
    letters = [DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic)]
    assert sorted(json.loads(d.original)["uuid"] for d in letters) == ["huge", "no-user", "not-a-type"]
    assert all(d.source == "http:/batch/" and d.sent_at == "2026-01-01T00:00:00Z" for d in letters)


def test_capture_takes_one_event_with_its_key_in_the_body_or_a_bearer_header(
    client: TestClient, settings: Settings
) -> None:
    one = {"event": "rejected", "distinct_id": "u", "uuid": "c1", "properties": {"generation_id": "g"}}
    assert client.post("/capture/", json={**one, "api_key": KEY}).json()["accepted"] == 1
    assert (
        client.post("/capture/", json={**one, "uuid": "c2"}, headers={"Authorization": f"Bearer {KEY}"}).status_code
        == 200
    )
    assert sorted(Event.from_bytes(r.value).event_id for r in read_topic(settings, settings.events_topic)) == [
        "c1",
        "c2",
    ]


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (json.dumps({"api_key": "wrong", "batch": []}).encode(), {}),
        (json.dumps({"batch": []}).encode(), {}),
        (b"not json", {"Authorization": "Bearer wrong"}),
    ],
)
def test_a_missing_or_unknown_api_key_is_a_401_and_nothing_is_kept(
    client: TestClient, settings: Settings, content: bytes, headers: dict[str, str]
) -> None:
    r = client.post("/batch/", content=content, headers={"Content-Type": "application/json", **headers})
    assert r.status_code == 401
    assert read_topic(settings, settings.events_topic) == [] and read_topic(settings, settings.dead_letter_topic) == []


def test_a_body_that_cannot_be_read_is_a_400_dead_lettered_without_its_key(
    client: TestClient, settings: Settings
) -> None:
    r = client.post("/batch/", json={"api_key": KEY, "batch": "not a list"})
    assert r.status_code == 400 and "batch" in r.json()["error"]
    (letter,) = [DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic)]
    assert KEY.encode() not in letter.original and json.loads(letter.original)["batch"] == "not a list"


def test_a_dead_lettered_message_replays_after_a_fix(client: TestClient, settings: Settings) -> None:
    msg = {"event": "thumbs", "uuid": "no-user", "properties": {"generation_id": "g", "value": "up", "$lib": "x"}}
    assert client.post("/batch/", json={"api_key": KEY, "batch": [msg]}).json()["accepted"] == 0
    (letter,) = [DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic)]
    with pytest.raises(InvalidEvent, match="userId or anonymousId"):
        revalidate(letter)
    fixed = dataclasses.replace(letter, original=json.dumps({**msg, "distinct_id": "u"}).encode())
    event = revalidate(fixed)
    assert (event.event_id, event.user_id, event.source, event.properties) == (
        "no-user",
        "u",
        "posthog",
        {"value": "up"},
    )


def test_the_answer_counts_only_what_was_kept_after_the_time_bounds(client: TestClient, settings: Settings) -> None:
    """An event from before the arrival window passes the mapping and is then refused by the time bounds: the
    answer lists it refused, not accepted, as the topics hold it."""
    batch = [
        {"event": "thumbs", "distinct_id": "u", "uuid": "now", "properties": {"generation_id": "g", "value": "up"}},
        {"event": "thumbs", "distinct_id": "u", "uuid": "ancient", "timestamp": "2001-01-01T00:00:00Z",
         "properties": {"generation_id": "g", "value": "up"}},
    ]  # fmt: skip
    r = client.post("/batch/", json={"api_key": KEY, "batch": batch})
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 1 and [x["event_id"] for x in r.json()["refused"]] == ["ancient"]
    assert [Event.from_bytes(rec.value).event_id for rec in read_topic(settings, settings.events_topic)] == ["now"]
    assert len(read_topic(settings, settings.dead_letter_topic)) == 1


def test_form_bodies_with_the_key_inside_leave_no_dead_letter_holding_it(
    client: TestClient, settings: Settings
) -> None:
    """posthog-js's `data=` form bodies, the key inside an encoding (base64 at each of its three alignments, URL-
    safe, and compressed as lz64 would be): whatever becomes of each body, no dead letter holds the key."""
    import base64
    import zlib
    from urllib.parse import quote

    doc = json.dumps({"api_key": KEY, "batch": [{"event": "thumbs", "properties": {"token": KEY}}]}).encode()
    encoded = [base64.b64encode(doc), base64.b64encode(b" " + doc), base64.b64encode(b"  " + doc),
               base64.urlsafe_b64encode(doc), base64.b64encode(zlib.compress(doc))]  # fmt: skip
    for value, compression in zip(encoded, ["base64"] * 4 + ["lz64"], strict=True):
        form = b"data=" + quote(value).encode() + b"&compression=" + compression.encode()
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"}
        r = client.post("/batch/", content=form, headers=headers)
        assert r.status_code == 400, r.text
    letters = [DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic)]
    assert len(letters) == len(encoded)
    for letter in letters:
        from urllib.parse import parse_qsl

        kept = dict(parse_qsl(letter.original.decode()))
        assert KEY not in letter.original.decode() and KEY not in kept["data"], kept
        # decoded and scrubbed, or not kept at all: never an encoding the key could hide in
        assert kept["data"].startswith("[not kept: an encoded value") or '"api_key": "[redacted]"' in kept["data"]
