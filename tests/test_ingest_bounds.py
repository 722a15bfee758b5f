"""The collector bounds what a client may claim: event times near their arrival, consent only from those allowed
to state it, secrets in no log line or dead letter wherever they are placed, and a rate per client."""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from flywheel.bus import ensure_topics
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, utcnow
from flywheel.logs import redact_access_log
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.dead_letters import DeadLetter
from launcher.embedded import free_port

KEY = "dev-write-key"
AUTH = {"Authorization": "Basic " + base64.b64encode(f"{KEY}:".encode()).decode()}


def native(event_id: str, **over: Any) -> dict[str, Any]:
    return {"event_id": event_id, "type": "accepted", "generation_id": f"g-{event_id}", "user_id": "u", **over}


def letters(settings: Settings) -> list[DeadLetter]:
    return [DeadLetter.from_bytes(r.value) for r in read_topic(settings, settings.dead_letter_topic)]


def accepted(settings: Settings) -> list[Event]:
    return [Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic)]


@pytest.fixture
def client(settings: Settings):
    ensure_topics(settings)
    with TestClient(create_app(settings)) as c:
        yield c


def test_event_times_outside_the_window_around_arrival_are_dead_lettered_with_the_reason(client, settings):
    now = utcnow()
    body = {"events": [
        native("ahead", ts=(now + timedelta(days=3)).isoformat()),
        native("skewed", ts=(now + timedelta(hours=1)).isoformat()),
        native("far", ts=now.replace(year=5000).isoformat()),
        native("ancient", ts=(now - timedelta(days=2000)).isoformat()),
        native("history", ts=(now - timedelta(days=90)).isoformat()),
    ]}  # fmt: skip
    r = client.post("/v1/events", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    refused = {x["event_id"]: (x["index"], x["reason"]) for x in r.json()["refused"]}
    assert refused.keys() == {"ahead", "far", "ancient"}
    assert refused["ahead"][0] == 0 and refused["far"][0] == 2 and refused["ancient"][0] == 3
    assert "FLYWHEEL_EVENT_TIME_AHEAD_S" in refused["far"][1]
    assert "FLYWHEEL_EVENT_TIME_BEHIND_S" in refused["ancient"][1]
    assert sorted(e.event_id for e in accepted(settings)) == ["history", "skewed"]
    kept = {json.loads(d.original)["event_id"]: d.reason for d in letters(settings)}
    assert kept.keys() == {"ahead", "far", "ancient"}


def test_a_write_key_speaks_only_for_its_sources_and_user_namespaces(settings: Settings) -> None:
    ensure_topics(settings)
    scoped = settings.model_copy(update={"write_keys": SecretStr(f"{KEY},k-web;source=web;user=acme:")})
    web = {"Authorization": "Basic " + base64.b64encode(b"k-web:").decode()}
    with TestClient(create_app(scoped)) as client:
        grant = {"properties": {"training_consent": True}}
        r = client.post("/v1/events", headers=web, json={"events": [
            native("mine", user_id="acme:1", source="web", **grant),
            native("other-user", user_id="victim", source="web", **grant),
            native("other-source", user_id="acme:1", source="ios"),
        ]})  # fmt: skip
        assert r.status_code == 200, r.text
        refused = {x["event_id"]: x["reason"] for x in r.json()["refused"]}
        assert "may not speak for user 'victim'" in refused["other-user"]
        assert "may not send events of source 'ios'" in refused["other-source"]
        # the unlimited key may still send anything
        r = client.post("/v1/events", headers=AUTH, json={"events": [native("any", user_id="victim", source="ios")]})
        assert r.json()["accepted"] == 1
    assert sorted(e.event_id for e in accepted(settings)) == ["any", "mine"]
    assert sorted(json.loads(d.original)["event_id"] for d in letters(settings)) == ["other-source", "other-user"]


def test_a_malformed_write_key_limit_fails_at_start_without_echoing_the_key() -> None:
    with pytest.raises(ValueError, match="`source=<name>` or `user=<prefix>`") as err:
        Settings(write_keys=SecretStr("secret-key-value;team=web"))
    assert "secret-key-value" not in str(err.value)


SECRET = "s3cr3t-placement-key-0042"
SECRET_AUTH = {"Authorization": "Basic " + base64.b64encode(f"{SECRET}:".encode()).decode()}


def track(message_id: str, **over: Any) -> dict[str, Any]:
    msg = {"type": "track", "event": "not-a-type", "messageId": message_id, "userId": "u",
           "properties": {"generation_id": f"g-{message_id}"}}  # fmt: skip
    return {**msg, **over}


# Every place a client can put its write key in what the collector takes; each refused, so each dead-lettered.
PLACEMENTS: dict[str, tuple[str, bytes, dict[str, str]]] = {
    "body top level": ("/v1/track", json.dumps(track("t", writeKey=SECRET)).encode(), {}),
    "escaped key name": ("/v1/batch", b'{"batch": [{"type": "track", "event": "nope", "messageId": "e", '
                         b'"userId": "u", "write\\u004bey": "' + SECRET.encode() + b'"}]}', SECRET_AUTH),
    "nested context": ("/v1/batch", json.dumps({"batch": [track("n", context={"library": {
        "writeKey": SECRET, "headers": {"Authorization": f"Basic {SECRET}"}}})]}).encode(), SECRET_AUTH),
    "any property": ("/v1/events", json.dumps({"events": [native("p", type="nope", properties={
        "note": f"key={SECRET}"})]}).encode(), SECRET_AUTH),
    "form body": ("/v1/batch", f"writeKey={SECRET}&event=accepted".encode(), SECRET_AUTH),
    "escaped key name, broken json": ("/v1/batch", b'{"write\\u004bey": "' + SECRET.encode() + b'", "batch": [',
                                      SECRET_AUTH),
    "broken json": ("/v1/batch", b'{"write_key": "' + SECRET.encode() + b'", "batch": [', SECRET_AUTH),
    "sentAt": ("/v1/batch", json.dumps({"batch": [track("s")], "sentAt": {"writeKey": SECRET,
                                                                          "t": SECRET}}).encode(), SECRET_AUTH),
    "query string": (f"/v1/batch?writeKey={SECRET}", json.dumps({"batch": [track("q")]}).encode(), SECRET_AUTH),
}  # fmt: skip


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
def test_no_log_line_or_dead_letter_holds_a_configured_secret(
    placement: str, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    ensure_topics(settings)
    path, body, headers = PLACEMENTS[placement]
    keyed = settings.model_copy(update={"write_keys": SecretStr(f"{KEY},{SECRET}")})
    caplog.set_level(logging.DEBUG)
    with TestClient(create_app(keyed)) as client:
        r = client.post(path, content=body, headers={"Content-Type": "application/json", **headers})
        assert r.status_code in (200, 400), r.text
    found = read_topic(settings, settings.dead_letter_topic)
    assert found, "the refusal is kept as a dead letter"
    forms = [SECRET, base64.b64encode(f"{SECRET}:".encode()).decode()]
    for record in found:
        assert not any(f.encode() in record.value for f in forms), record.value
        letter = DeadLetter.from_bytes(record.value)
        assert not any(f.encode() in letter.original for f in forms), letter.original
    # the collector's lines (the test client's own httpx logger writes the URL it was asked to send)
    served = [caplog.handler.format(r) for r in caplog.records if not r.name.startswith("httpx")]
    assert served and not any(f in line for f in forms for line in served)


def test_access_log_lines_keep_query_names_not_values(caplog: pytest.LogCaptureFixture) -> None:
    access = logging.getLogger("uvicorn.access")
    redact_access_log()
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        access.info('%s - "%s %s HTTP/%s" %d', "1.2.3.4:5", "POST", f"/v1/batch?writeKey={SECRET}&x=1", "1.1", 401)
    assert SECRET not in caplog.text and "/v1/batch?writeKey=[redacted]&x=[redacted]" in caplog.text


def test_the_collector_with_several_processes_logs_no_query_secret(settings: Settings, tmp_path) -> None:  # noqa: ANN001
    """`flywheel ingest collector --workers 2` as a real process tree: its stderr never holds the key."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "FLYWHEEL_WRITE_KEYS": SECRET,
           "FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS": settings.kafka_bootstrap_servers,
           "FLYWHEEL_DATA_DIR": str(tmp_path), "FLYWHEEL_EVENTS_TOPIC": settings.events_topic,
           "FLYWHEEL_DEAD_LETTER_TOPIC": settings.dead_letter_topic}  # fmt: skip
    log_path = tmp_path / "collector.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "flywheel"), "ingest", "collector", "--workers", "2",
             "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )
        try:
            answered = 0
            deadline = time.monotonic() + 150  # the processes start in seconds, or half a minute on a busy machine
            while answered < 4 and time.monotonic() < deadline:
                try:
                    r = httpx.post(f"http://127.0.0.1:{port}/v1/batch?writeKey={SECRET}", json={"batch": []},
                                   headers=SECRET_AUTH, timeout=5)
                    answered += r.status_code == 200
                except httpx.TransportError:
                    time.sleep(0.3)
            assert answered == 4, log_path.read_text()[-2000:]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    text = log_path.read_text()
    assert "collector: 2 processes" in text and SECRET not in text


def test_a_client_past_its_rate_gets_429_and_health_still_answers(settings: Settings) -> None:
    limited = settings.model_copy(update={"collector_rate_limit": "3/minute"})
    with TestClient(create_app(limited)) as client:
        codes = [client.post("/v1/events", json={"events": []}, headers=AUTH).status_code for _ in range(5)]
        assert codes == [200, 200, 200, 429, 429]
        r = client.post("/v1/events", json={"events": []}, headers=AUTH)
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 0 and r.json()["error"] == "rate_limited"
        assert client.get("/healthz").status_code == 200


def test_the_posthog_door_keeps_the_same_bounds(settings: Settings) -> None:
    ensure_topics(settings)
    scoped = settings.model_copy(update={"write_keys": SecretStr(f"{KEY},k-web;user=acme:")})
    far = utcnow().replace(year=5000).isoformat()
    batch = [
        {"event": "shown", "distinct_id": "acme:1", "uuid": "ok", "properties": {"generation_id": "g"}},
        {"event": "shown", "distinct_id": "victim", "uuid": "other-user",
         "properties": {"generation_id": "g", "training_consent": True}},
        {"event": "shown", "distinct_id": "acme:2", "uuid": "far", "timestamp": far,
         "properties": {"generation_id": "g"}},
    ]  # fmt: skip
    with TestClient(create_app(scoped)) as client:
        r = client.post("/batch/", json={"api_key": "k-web", "batch": batch})
        assert r.status_code == 200, r.text
    assert [e.event_id for e in accepted(settings)] == ["ok"]
    reasons = {json.loads(d.original)["event_id"]: d.reason for d in letters(settings)}
    assert "may not speak for user 'victim'" in reasons["other-user"]
    assert "FLYWHEEL_EVENT_TIME_AHEAD_S" in reasons["far"]


def test_a_requests_memory_and_its_dead_letters_are_bounded_by_multiples_of_the_body_limit(
    settings: Settings,
) -> None:
    """Requests at a 1 MB body limit built to amplify: thousands of refused items, refused spans under one large
    resource, junk. Each one's dead letters add up to a constant factor of its body, and the collector's peak of
    Python memory while taking it (traced, producer included) to a constant multiple of the limit."""
    import gc
    import tracemalloc

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tests.test_ingest_otlp import good, kv

    limit = 1_000_000
    ensure_topics(settings)
    trace = ExportTraceServiceRequest()
    spans = trace.resource_spans.add()
    spans.resource.attributes.extend([kv("enduser.id", "u"), kv("host.blob", "b" * 500_000)])
    spans.scope_spans.add().spans.extend(good(n, **{"user.id": None, "gen_ai.input.messages": None})
                                         for n in range(1, 1200))  # fmt: skip
    refused = {"events": [native(f"e{i}", type="not-a-type") for i in range(9000)]}
    protobuf = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-protobuf"}
    requests = [
        ("/v1/traces", trace.SerializeToString(), protobuf),
        ("/v1/events", json.dumps(refused).encode(), AUTH),
        ("/v1/events", b"z" * (limit - 10), AUTH),
    ]
    with TestClient(create_app(settings, max_body_bytes=limit, max_event_bytes=64_000)) as client:
        client.post("/v1/events", json={"events": []}, headers=AUTH)  # the producer made before measuring
        letter_bytes = 0
        for path, body, headers in requests:
            assert len(body) <= limit
            gc.collect()
            tracemalloc.start()
            try:
                r = client.post(path, content=body, headers=headers)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert r.status_code in (200, 400), r.text
            assert peak < 32 * limit, (path, peak)
            total = sum(len(rec.value) for rec in read_topic(settings, settings.dead_letter_topic))
            assert 0 < total - letter_bytes < 8 * len(body), (path, total - letter_bytes)
            letter_bytes = total


def test_a_write_key_naming_too_many_surfaces_has_the_rest_refused_with_the_reason(settings: Settings) -> None:
    """3,000 generations each naming a new surface, in one request: the key's first 64 surfaces are taken, the
    rest refused (answered and dead-lettered) with the reason; a generation of an already named surface still
    lands."""
    ensure_topics(settings)

    def generation(i: int, surface: str) -> dict[str, Any]:
        return native(f"g{i}", type="generation", properties={"prompt": "p", "completion": "c",
                                                              "model_version": "m", "surface": surface})  # fmt: skip

    body = {"events": [generation(i, f"made-up-{i}") for i in range(3000)] + [generation(3000, "made-up-0")]}
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/events", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["accepted"] == 65 and len(r.json()["refused"]) == 2936
    assert all("FLYWHEEL_COLLECTOR_MAX_SURFACES_PER_KEY" in x["reason"] for x in r.json()["refused"])
    assert r.json()["refused"][0]["index"] == 64
    assert len(read_topic(settings, settings.dead_letter_topic)) == 2936
