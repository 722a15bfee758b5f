"""Collector: native and Segment endpoints against the real embedded broker."""

from __future__ import annotations

import base64
import gzip
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from flywheel.bus import ensure_topics
from flywheel.bus.reader import read_topic
from flywheel.contract import Event
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.dead_letters import DeadLetter
from launcher.embedded import free_port


def auth(key: str = "dev-write-key") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{key}:".encode()).decode()}


@pytest.fixture
def client(settings: Settings):
    ensure_topics(settings)
    with TestClient(create_app(settings)) as c:
        yield c


def track(i: int, **over: object) -> dict:
    msg = {
        "type": "track",
        "event": "accepted",
        "messageId": f"m{i}",
        "userId": f"u{i}",
        "properties": {"generation_id": f"g{i}", "accepted_chars": i},
        "timestamp": "2024-05-01T12:00:00.000+00:00",
    }
    msg.update(over)
    return msg


def test_batch_gzip_accepts_valid_refuses_invalid_with_reasons_and_dead_letters(client, settings):
    body = {
        "batch": [
            track(0),
            track(1, event="Not A Type"),
            track(2, properties={"accepted_chars": 1}),  # no generation_id
            track(3, event="Session End"),
        ],
        "sentAt": "2024-05-01T12:00:10.000+00:00",
    }
    r = client.post(
        "/v1/batch",
        content=gzip.compress(json.dumps(body).encode()),
        headers={**auth(), "Content-Encoding": "gzip", "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["accepted"] == 2
    assert [(x["index"], x["event_id"]) for x in doc["refused"]] == [(1, "m1"), (2, "m2")]
    assert "'Not A Type' is not an event type" in doc["refused"][0]["reason"]
    assert "generation_id" in doc["refused"][1]["reason"]

    events = [Event.from_bytes(rec.value) for rec in read_topic(settings, settings.events_topic)]
    assert sorted(e.event_id for e in events) == ["m0", "m3"]
    by_id = {e.event_id: e for e in events}
    assert by_id["m3"].type == "session_end"
    assert by_id["m0"].generation_id == "g0" and by_id["m0"].properties == {"accepted_chars": 0}
    # Keyed by generation id, so everything about one generation shares a partition.
    assert {rec.key for rec in read_topic(settings, settings.events_topic)} == {b"g0", b"g3"}

    letters = [DeadLetter.from_bytes(rec.value) for rec in read_topic(settings, settings.dead_letter_topic)]
    assert {json.loads(d.original)["messageId"] for d in letters} == {"m1", "m2"}
    assert all(d.source == "http:/v1/batch" for d in letters)


def test_clock_skew_is_corrected_with_sent_at(client, settings):
    # The client's clock runs one hour fast: the event happened 10 s before it was sent.
    now = datetime.now(UTC)
    skewed = now + timedelta(hours=1)
    body = {
        "batch": [track(0, timestamp=(skewed - timedelta(seconds=10)).isoformat())],
        "sentAt": skewed.isoformat(),
    }
    assert client.post("/v1/batch", json=body, headers=auth()).status_code == 200
    (event,) = [Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic)]
    assert abs((event.received_at - event.ts) - timedelta(seconds=10)) < timedelta(milliseconds=1)
    assert abs(event.received_at - now) < timedelta(seconds=30)


def test_native_endpoint_partial_acceptance(client, settings):
    good = Event(type="thumbs", generation_id="g1", user_id="u1", properties={"value": "up"})
    body = {
        "events": [
            json.loads(good.to_bytes()),
            {"type": "thumbs", "generation_id": "g2", "user_id": "u", "schema_version": 99},
            {
                "event_id": "bad-ts",
                "type": "thumbs",
                "generation_id": "g3",
                "user_id": "u",
                "ts": "yesterday",
            },
        ]
    }
    r = client.post("/v1/events", json=body, headers=auth())
    assert r.status_code == 200
    doc = r.json()
    assert doc["accepted"] == 1
    assert [x["index"] for x in doc["refused"]] == [1, 2]
    assert "unknown schema_version 99" in doc["refused"][0]["reason"]
    assert doc["refused"][1]["event_id"] == "bad-ts" and doc["refused"][1]["reason"].startswith("ts:")
    (produced,) = [Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic)]
    assert produced.event_id == good.event_id
    assert len(read_topic(settings, settings.dead_letter_topic)) == 2


@pytest.mark.parametrize("headers", [auth("wrong-key"), {}], ids=["wrong", "missing"])
def test_wrong_or_missing_write_key_is_401_and_nothing_is_produced(client, settings, headers):
    r = client.post("/v1/batch", json={"batch": [track(0)]}, headers=headers)
    assert r.status_code == 401
    r = client.post("/v1/events", json={"events": [{"type": "thumbs"}]}, headers=headers)
    assert r.status_code == 401
    assert read_topic(settings, settings.events_topic, timeout_s=2) == []
    assert read_topic(settings, settings.dead_letter_topic, timeout_s=2) == []


def test_size_limits_answer_413(settings):
    ensure_topics(settings)
    with TestClient(create_app(settings, max_body_bytes=2000, max_event_bytes=500)) as c:
        big_body = {"batch": [track(i) for i in range(30)]}
        assert c.post("/v1/batch", json=big_body, headers=auth()).status_code == 413
        bomb = gzip.compress(b" " * 100_000)
        r = c.post("/v1/batch", content=bomb, headers={**auth(), "Content-Encoding": "gzip"})
        assert r.status_code == 413
        huge = track(0, properties={"generation_id": "g", "comment": "x" * 600})
        assert c.post("/v1/track", json=huge, headers=auth()).status_code == 413
        r = c.post("/v1/batch", json={"batch": [track(1), huge]}, headers=auth())
        assert r.status_code == 200 and r.json()["refused"][0]["reason"].startswith("event is ")


def test_kafka_unreachable_is_503_with_retry_after(tmp_path):
    down = Settings(data_dir=tmp_path, kafka_bootstrap_servers=f"127.0.0.1:{free_port()}")
    with TestClient(create_app(down, send_timeout_s=1.0)) as c:
        r = c.post("/v1/batch", json={"batch": [track(0)]}, headers=auth())
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) > 0
        assert c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200


def test_schema_and_metrics_are_served(client):
    schema = client.get("/v1/schema").json()
    assert schema["$id"].endswith("/v1.json") and "event_id" in schema["properties"]
    assert client.get("/readyz").status_code == 200
    client.post("/v1/batch", json={"batch": [track(0)]}, headers=auth())
    text = client.get("/metrics").text
    assert 'flywheel_ingest_events_accepted_total{stage="collector"}' in text


def test_with_a_metrics_port_metrics_are_served_there_and_not_on_the_api_port(settings):
    """FLYWHEEL_COLLECTOR_METRICS_PORT (Kubernetes: the `metrics` port, the only one monitoring may reach): the
    collector's series on that port, and its public port, which anyone reaches with a write key, answers no /metrics."""
    import httpx

    ensure_topics(settings)
    port = free_port()
    with TestClient(create_app(settings.model_copy(update={"collector_metrics_port": port}))) as c:
        assert c.post("/v1/batch", json={"batch": [track(0)]}, headers=auth()).json()["accepted"] == 1
        assert c.get("/metrics").status_code == 404
        assert c.get("/readyz").status_code == 200  # the kubelet's probes stay on the API's port
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics")
        assert scraped.status_code == 200
        assert 'flywheel_ingest_events_accepted_total{stage="collector"}' in scraped.text


def test_concurrent_requests_each_land_once(client, settings):
    """Requests in flight at once share sends (`ingest.collector.group_send`); each is answered for its own events."""
    from concurrent.futures import ThreadPoolExecutor

    def post(k: int) -> int:
        body = {"batch": [track(k * 10 + i) for i in range(10)]}
        r = client.post("/v1/batch", json=body, headers=auth())
        assert r.status_code == 200, r.text
        return int(r.json()["accepted"])

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert sum(pool.map(post, range(24))) == 240
    ids = [Event.from_bytes(r.value).event_id for r in read_topic(settings, settings.events_topic)]
    assert sorted(ids) == sorted(f"m{i}" for i in range(240))


@contextmanager
def collector_cli(settings: Settings, env: dict[str, str], until: Callable[[int], bool] = lambda pid: True):
    """`flywheel ingest collector --workers 2` as a real subprocess: yields (process, base URL) once /readyz answers
    200 and `until(its pid)` holds; killed afterwards if still running."""
    import subprocess
    import sys
    import time

    import httpx

    from launcher.embedded import settings_env

    ensure_topics(settings)
    port = free_port()
    cli = [str(Path(sys.executable).parent / "flywheel"), "ingest", "collector", "--workers", "2", "--port", str(port)]
    proc = subprocess.Popen(cli, env={**os.environ, **settings_env(settings), **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # two processes importing torch on two busy cores
        while True:
            try:
                if httpx.get(f"{base}/readyz").status_code == 200 and until(proc.pid):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the collector did not start"
            time.sleep(0.2)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.terminate()  # the supervisor stops its worker processes; a SIGKILL would orphan them on their port
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def test_collector_cli_with_several_processes_lands_every_event_and_sums_metrics(settings, tmp_path):
    """`flywheel ingest collector --workers 2`, a real subprocess: every event lands once, whichever process took
    its request, and /metrics counts the events of both processes (prometheus-client multiprocess mode)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    metrics_dir = tmp_path / "prom"
    metrics_dir.mkdir()
    metrics_port = free_port()  # both processes answer it (SO_REUSEPORT), as they answer the API's port
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "FLYWHEEL_COLLECTOR_METRICS_PORT": str(metrics_port)}
    with collector_cli(settings, env) as (proc, base):
        per_request = 100

        def post(k: int) -> int:
            body = {"batch": [track(k * per_request + i) for i in range(per_request)]}
            # A new connection per request: each process listens on its own socket (SO_REUSEPORT), and the
            # kernel picks one for each new connection by hashing its addresses.
            r = httpx.post(f"{base}/v1/batch", json=body, headers=auth())
            assert r.status_code == 200, r.text
            return int(r.json()["accepted"])

        def pids_that_counted() -> set[str]:
            # Each process writes its own metrics file (counter_<pid>.db) once it has counted something.
            return {p.stem.rsplit("_", 1)[-1] for p in metrics_dir.glob("counter_*.db")}

        # /readyz answers as soon as one process is up; the other may still be importing, and takes nothing
        # until it listens. Send rounds of requests until both processes have taken some (once both listen, the
        # chance that one round of 24 connections all go to one process is 2**-23), then check that every event
        # of every round landed.
        requests, deadline = 0, time.monotonic() + 60
        with ThreadPoolExecutor(max_workers=12) as pool:
            while True:
                assert sum(pool.map(post, range(requests, requests + 24))) == 24 * per_request
                requests += 24
                if len(pids_that_counted()) == 2:
                    break
                assert time.monotonic() < deadline, f"one process took every request: {pids_that_counted()}"
        events = requests * per_request
        ids = [Event.from_bytes(r.value).event_id for r in read_topic(settings, settings.events_topic)]
        assert sorted(ids) == sorted(f"m{i}" for i in range(events))

        # Whichever process answers the scrape (each on its own connection) reports the sum over both.
        for _ in range(4):
            accepted = {
                sample.labels.get("stage"): sample.value
                for family in text_string_to_metric_families(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text)
                for sample in family.samples
                if sample.name == "flywheel_ingest_events_accepted_total"
            }
            assert accepted["collector"] == events
        assert httpx.get(f"{base}/metrics").status_code == 404

        # SIGTERM reaches both processes, which finish and exit cleanly; so does the parent.
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_collector_cli_stops_when_one_of_its_processes_dies(settings):
    """A collector process killed from outside: the parent stops the other one and exits with an error, so the
    process manager restarts a whole collector rather than leave one serving half the port."""
    import signal

    def collector_children(pid: int) -> list[int]:
        # The serving processes, not multiprocessing's resource tracker.
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [int(c) for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]

    with collector_cli(settings, {}, until=lambda pid: len(collector_children(pid)) == 2) as (proc, _):
        victim, survivor = collector_children(proc.pid)
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=30) != 0
        # The parent joined the survivor before it exited, so nothing is left of it.
        assert not Path(f"/proc/{survivor}").exists()


def test_a_body_whose_dead_letter_would_pass_the_broker_limit_is_a_400_and_readiness_stays(client, settings):
    """Junk a little over Kafka's 1 MiB message limit (under the collector's 4 MB body limit): the caller's error,
    a 400 whose dead letter is cut to a bounded size with the whole body's size and digest; Kafka stays ready."""
    import hashlib

    from flywheel.dead_letters import MAX_LETTER_BYTES

    junk = b"x" * (1_100_000)
    r = client.post("/v1/events", content=junk, headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 400
    assert client.get("/readyz").status_code == 200
    (record,) = read_topic(settings, settings.dead_letter_topic)
    assert len(record.value) <= MAX_LETTER_BYTES < 1024 * 1024
    letter = DeadLetter.from_bytes(record.value)
    assert letter.truncated and letter.original_size == len(junk)
    assert letter.original_sha256 == hashlib.sha256(junk).hexdigest() and junk.startswith(letter.original)
    ok = client.post("/v1/events", json={"events": [Event(type="shown", generation_id="g", user_id="u").model_dump(
        mode="json")]}, headers=auth())  # fmt: skip
    assert ok.status_code == 200 and ok.json()["accepted"] == 1


def test_a_message_too_large_for_kafka_is_a_413_and_readiness_stays(settings):
    """A broker whose message limit is below the collector's event limit (here the producer's, 40 kB): the request
    holding the large event is a 413, nothing of it is accepted, and readiness and the next request are untouched."""
    from flywheel.bus import make_producer

    ensure_topics(settings)
    producer = make_producer(settings, max_request_size=40_000)
    with TestClient(create_app(settings, producer=producer)) as c:
        big = Event(type="shown", generation_id="g-big", user_id="u", properties={"text": "x" * 60_000})
        small = Event(type="shown", generation_id="g-small", user_id="u")
        r = c.post("/v1/events", json={"events": [big.model_dump(mode="json")]}, headers=auth())
        assert r.status_code == 413 and "larger than Kafka takes" in r.json()["error"]
        assert c.get("/readyz").status_code == 200
        r = c.post("/v1/events", json={"events": [small.model_dump(mode="json")]}, headers=auth())
        assert r.status_code == 200 and r.json()["accepted"] == 1
        assert c.get("/readyz").status_code == 200
    events = [Event.from_bytes(rec.value) for rec in read_topic(settings, settings.events_topic)]
    assert [e.generation_id for e in events] == ["g-small"]
