"""Nothing a client sends stops the loop or poisons what it learns (real broker, Redis and lake).

Each defect of an attacker-style review, as the attacker would send it: through the collector, and
straight onto the events topic for the ingest and signals workers.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import polars as pl
import pytest
from fastapi.testclient import TestClient

from flywheel.bus import Outgoing, ensure_topics, make_producer
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, utcnow
from flywheel.lake.tables import EVENTS, rows_frame
from flywheel.settings import Settings
from ingest.collector import app as collector_module
from ingest.collector.app import create_app
from ingest.dead_letters import DeadLetter
from ingest.worker import lake_sink
from ingest.worker.lake_sink import storable
from ingest.worker.loop import IngestWorker
from signals.config import SignalsConfig
from signals.worker import SignalsWorker
from simulator.telemetry import generation_event

KEY = "dev-write-key"
AUTH = {"Authorization": "Basic " + base64.b64encode(f"{KEY}:".encode()).decode()}
OUT_OF_RANGE = ["0001-01-01T00:30:00+01:00", "9999-12-31T23:30:00-01:00"]


def native(event_id: str, **over: Any) -> dict[str, Any]:
    return {"event_id": event_id, "type": "accepted", "generation_id": f"g-{event_id}", "user_id": "u", **over}


def track(message_id: str, **over: Any) -> dict[str, Any]:
    msg = {
        "type": "track",
        "event": "accepted",
        "messageId": message_id,
        "userId": "u",
        "properties": {"generation_id": f"g-{message_id}"},
    }
    return {**msg, **over}


def letters(settings: Settings) -> list[DeadLetter]:
    return [DeadLetter.from_bytes(r.value) for r in read_topic(settings, settings.dead_letter_topic)]


def drain(worker: IngestWorker, settings: Settings, rows: int, letters_at_least: int = 0) -> None:
    """Run batches until the lake holds `rows` rows and the dead-letter topic `letters_at_least` letters, then
    a few more (so anything extra would show)."""
    for _ in range(200):
        if EVENTS.read(EVENTS.at(settings.lake_root)).height >= rows and len(letters(settings)) >= letters_at_least:
            break
        worker.run_once()
    for _ in range(3):
        worker.run_once()


@pytest.fixture
def client(settings: Settings):
    ensure_topics(settings)
    with TestClient(create_app(settings)) as c:
        yield c


def test_out_of_range_times_through_the_collector_are_refused_and_ingest_goes_on(client, settings):
    body = {"events": [native("bad-low", ts=OUT_OF_RANGE[0]), native("good"), native("bad-high", ts=OUT_OF_RANGE[1])]}
    r = client.post("/v1/events", json=body, headers=AUTH)
    assert r.status_code == 200
    refused = {x["event_id"]: x["reason"] for x in r.json()["refused"]}
    assert r.json()["accepted"] == 1 and sorted(refused) == ["bad-high", "bad-low"]
    assert all(reason.startswith("ts:") and "in UTC" in reason for reason in refused.values())
    # Segment: the client's time as sent (no sentAt), and a sentAt whose correction leaves the calendar.
    batch = {
        "batch": [
            track("seg-low", timestamp=OUT_OF_RANGE[0]),
            track("seg-skew", timestamp="0001-01-01T00:00:00Z"),
            track("seg-good"),
        ],
        "sentAt": "9999-12-31T00:00:00Z",
    }
    r = client.post("/v1/batch", json=batch, headers=AUTH)
    assert r.status_code == 200 and r.json()["accepted"] == 1
    assert sorted(x["event_id"] for x in r.json()["refused"]) == ["seg-low", "seg-skew"]

    worker = IngestWorker(settings, group_id="g-range", poll_timeout_s=0.3)
    drain(worker, settings, 2, 4)
    worker.close()
    assert sorted(EVENTS.read(EVENTS.at(settings.lake_root))["event_id"].to_list()) == ["good", "seg-good"]
    assert len(letters(settings)) == 4


def test_hostile_records_on_the_topic_are_dead_lettered_and_the_worker_keeps_going(settings):
    """Out-of-range times, invalid UTF-8, JSON nested 1,000 deep, NaN and a tombstone, written straight to the
    topic: each is dead-lettered with its reason and bytes, and good events before and after land once, also
    across a restart."""
    ensure_topics(settings)
    good = [Event(event_id=f"e{i}", type="accepted", generation_id="g", user_id="u") for i in range(6)]
    base = json.loads(good[0].to_bytes())
    hostile: dict[str, bytes | None] = {
        "low": json.dumps({**base, "event_id": "low", "ts": OUT_OF_RANGE[0]}).encode(),
        "high": json.dumps({**base, "event_id": "high", "ts": OUT_OF_RANGE[1]}).encode(),
        "utf8": json.dumps({**base, "event_id": "utf8"}).encode().replace(b'"u"', b'"\xff\xfe"'),
        "utf8-props": json.dumps({**base, "event_id": "utf8p", "properties": {"k": "PLACE"}})
        .encode()
        .replace(b"PLACE", b"\xc3\x28"),
        "deep": json.dumps({**base, "event_id": "deep", "properties": {"k": 0}})
        .encode()
        .replace(b'"k": 0', b'"k": ' + b"[" * 1000 + b"]" * 1000),
        "nan": json.dumps({**base, "event_id": "nan", "properties": {"k": float("nan")}}).encode(),
        "tombstone": None,
    }
    t = settings.events_topic
    producer = make_producer(settings)
    # One partition (same key), so the hostile records sit between good ones.
    producer.send_all(
        [Outgoing(t, good[0].to_bytes(), key=b"k")]
        + [Outgoing(t, v, key=b"k") for v in hostile.values()]  # type: ignore[arg-type]  # a tombstone's value is None
        + [Outgoing(t, good[1].to_bytes(), key=b"k")]
    )
    worker = IngestWorker(settings, group_id="g-hostile", poll_timeout_s=0.3)
    drain(worker, settings, 2, len(hostile))
    producer.send_all([Outgoing(t, e.to_bytes(), key=b"k") for e in good[2:4]])
    drain(worker, settings, 4)
    worker.close()

    restarted = IngestWorker(settings, group_id="g-hostile", poll_timeout_s=0.3)
    producer.send_all([Outgoing(t, e.to_bytes(), key=b"k") for e in good[4:]])
    drain(restarted, settings, 6)
    restarted.close()
    producer.close()

    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    assert sorted(lake["event_id"].to_list()) == [f"e{i}" for i in range(6)]
    found = letters(settings)
    assert len(found) == len(hostile), "each hostile record dead-lettered once (the restart re-read none)"
    by_original = {d.original: d.reason for d in found}
    reasons = {name: by_original[raw or b""] for name, raw in hostile.items()}
    assert reasons["low"].startswith("ts:") and reasons["high"].startswith("ts:")
    assert "Invalid JSON" in reasons["utf8"] and "Invalid JSON" in reasons["utf8-props"]
    assert "recursion limit" in reasons["deep"]
    assert "NaN and Infinity are refused" in reasons["nan"]
    assert "tombstone" in reasons["tombstone"]
    assert not (lake["properties"].str.contains("NaN")).any()


def test_signals_worker_skips_tombstones_and_undecodable_records(settings):
    ensure_topics(settings)
    t = settings.events_topic
    producer = make_producer(settings)
    gen = generation_event("g-after", utcnow(), user_id="u")
    as_sent = json.loads(gen.to_bytes())
    hostile = [
        None,
        b"\xff\xfe",
        b"[" * 1000 + b"]" * 1000,
        json.dumps({**as_sent, "event_id": "high", "ts": OUT_OF_RANGE[1]}).encode(),
        # A valid event, but its reward window would end past year 9999: no record could say when.
        json.dumps({**as_sent, "event_id": "last", "ts": "9999-12-31T23:59:59Z"}).encode(),
    ]
    producer.send_all(
        [Outgoing(t, v, key=b"k") for v in hostile]  # type: ignore[arg-type]  # a tombstone's value is None
        + [Outgoing(t, gen.to_bytes(), key=b"k")]
    )
    producer.close()
    worker = SignalsWorker(settings, SignalsConfig(idle_after_s=60, poll_timeout_s=0.2))
    try:
        for _ in range(100):
            if worker.stats.events + worker.stats.invalid >= len(hostile) + 1:
                break
            worker.run_once()
    finally:
        worker.close()
    assert worker.stats.invalid == len(hostile) and worker.stats.events == 1


def test_no_write_key_reaches_the_dead_letters(client, settings):
    secret = {"writeKey": KEY, "Authorization": f"Basic {KEY}"}
    # A refused track call (its body is its item), refused by its write key in the body alone.
    r = client.post("/v1/track", json=track("t1", event="not-a-type", **secret))
    assert r.status_code == 400
    # A batch item carrying the key; a body refused whole; a body that is not even JSON.
    r = client.post("/v1/batch", json={"batch": [track("b1", userId=None, **secret)], **secret}, headers=AUTH)
    assert r.status_code == 200 and len(r.json()["refused"]) == 1
    assert client.post("/v1/events", json={"events": "nope", **secret}, headers=AUTH).status_code == 400
    broken = json.dumps({"writeKey": KEY, "batch": [1]}).encode()[:-1]
    assert client.post("/v1/batch", content=broken, headers=AUTH).status_code == 400

    found = letters(settings)
    assert len(found) == 4
    for letter in found:
        assert KEY.encode() not in letter.original and KEY.encode() not in letter.to_bytes()
    assert any(b'"writeKey":"[redacted]"' in d.original for d in found)


def test_segment_batch_with_one_bad_item_accepts_the_rest(client, settings):
    items = [
        track("ok-1"),
        track("bad-nan", properties={"generation_id": "g", "score": float("nan")}),
        track("ok-2"),
        track("bad-skew", timestamp="0001-01-01T00:00:00Z"),
        track("bad-deep", properties={"generation_id": "g", "nest": json.loads("[" * 100 + "]" * 100)}),
    ]
    # The good items carry no timestamp: they take the time received, whatever the batch's sentAt.
    body = json.dumps({"batch": items, "sentAt": "9999-12-31T00:00:00Z"}).encode()
    r = client.post("/v1/batch", content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["accepted"] == 2
    reasons = {x["event_id"]: x["reason"] for x in doc["refused"]}
    assert sorted(reasons) == ["bad-deep", "bad-nan", "bad-skew"]
    assert "NaN and Infinity are refused" in reasons["bad-nan"]
    assert "clock-skew correction" in reasons["bad-skew"]
    assert "nested deeper than" in reasons["bad-deep"]
    produced = sorted(Event.from_bytes(x.value).event_id for x in read_topic(settings, settings.events_topic))
    assert produced == ["ok-1", "ok-2"]
    assert sorted(d.reason for d in letters(settings)) == sorted(reasons.values())


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"events": [' + b"[" * 1000 + b"]" * 1000 + b"]}", "body is nested too deeply"),
        (b'{"events": [{"event_id": "\xff"}]}', "body is not UTF-8"),
        (b'{"events": [' + b"9" * 5000 + b"]}", "body is not JSON"),
        (b'{"events": [', "body is not JSON"),
    ],
    ids=["deep", "utf8", "digits", "truncated"],
)
def test_unreadable_bodies_are_400_with_a_reason_and_dead_lettered(client, settings, body, reason):
    r = client.post("/v1/events", content=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"].startswith(reason)
    (letter,) = letters(settings)
    assert letter.reason.startswith(reason) and letter.original == body


def test_credentials_are_checked_before_the_body_is_parsed(client, settings, monkeypatch):
    """A 4 MB body without credentials, or with a wrong key, is a 401 without being parsed or validated."""
    parsed: list[bytes] = []
    real_parse = collector_module.parse_json

    def spy(body: bytes):  # noqa: ANN202 - records the call, then parses as the collector would
        parsed.append(body)
        return real_parse(body)

    monkeypatch.setattr(collector_module, "parse_json", spy)
    big = json.dumps({"batch": [track(f"m{i}", pad="x" * 400) for i in range(7500)]}).encode()
    assert 3_500_000 < len(big) <= collector_module.MAX_BODY_BYTES
    assert client.post("/v1/batch", content=big).status_code == 401
    wrong = {"Authorization": "Basic " + base64.b64encode(b"nope:").decode()}
    assert client.post("/v1/batch", content=big, headers=wrong).status_code == 401
    with_body_key = json.dumps({"writeKey": "nope", "batch": [track("m")]}).encode()
    assert client.post("/v1/batch", content=with_body_key).status_code == 401
    assert parsed == []
    assert read_topic(settings, settings.events_topic, timeout_s=2) == []
    # A right key in the body: parsed then, and taken.
    ok = json.dumps({"writeKey": KEY, "batch": [track("m")]}).encode()
    assert client.post("/v1/batch", content=ok).json()["accepted"] == 1 and parsed == [ok]


def _rows(n: int, ts_us: list[int] | None = None) -> pl.DataFrame:
    ts = ts_us or [1_767_225_600_000_000 + i for i in range(n)]  # 2026-01-01
    rows = [(f"e{i}", "accepted", 1, "g", "u", "", ts[i], ts[i], "native", "{}", "events", 0, i) for i in range(n)]
    return rows_frame(rows).with_columns(pl.Series("_i", range(n), dtype=pl.Int64))


def test_rows_the_lake_cannot_partition_are_handed_back_and_the_rest_written():
    year_zero = -62_167_219_200_000_000 - 3_600_000_000  # 0000-12-31T23:00Z: before year 1
    frame = _rows(3, [1_767_225_600_000_000, year_zero, 1_767_225_600_000_001])
    kept, refused = storable(frame)
    assert [i for i, _ in refused] == [1] and "partition" in refused[0][1]
    assert sorted(kept["event_id"].to_list()) == ["e0", "e2"]


def test_a_row_the_lake_fails_on_is_handed_back_alone_and_every_other_row_kept_once(monkeypatch):
    """Fault injection: the conversion to the table's Arrow rows is made to fail on one row (no real row is known
    to), to prove the split: every other row is kept exactly once."""
    real = lake_sink.to_arrow

    def failing(df: pl.DataFrame) -> object:
        if "e5" in df["event_id"].to_list():
            raise pl.exceptions.ComputeError("cannot write e5")
        return real(df)

    monkeypatch.setattr(lake_sink, "to_arrow", failing)
    kept, refused = storable(_rows(12))
    assert refused == [(5, "cannot be written to the lake: ComputeError: cannot write e5")]
    ids = kept["event_id"].to_list()
    assert sorted(ids) == sorted(f"e{i}" for i in range(12) if i != 5) and len(ids) == len(set(ids))
    with pytest.raises(OSError):  # the lake's own failure is not a row's: the batch is retried
        monkeypatch.setattr(lake_sink, "to_arrow", lambda df: (_ for _ in ()).throw(OSError("disk full")))
        storable(_rows(2))


def _malformed_set(as_sent: dict[str, Any]) -> dict[str, bytes]:
    """Records a client could put on the events topic that break a parser, not the contract's rules: an integer of
    thousands of digits (in properties and in an envelope field) and nesting past the parsers' depth."""
    big = b"9" * 4_000
    deep = b"[" * 5_000 + b"]" * 5_000

    def spliced(event_id: str, where: bytes, what: bytes) -> bytes:
        return json.dumps({**as_sent, "event_id": event_id}).encode().replace(where, what)

    return {
        "big-property": spliced("big-prop", b'"k": 0', b'"k": ' + big),
        "big-nested": spliced("big-nest", b'"k": 0', b'"k": [{"n": ' + big + b"}]"),
        "big-envelope": spliced("big-env", b'"schema_version": 1', b'"schema_version": ' + big),
        "deep-property": spliced("deep-prop", b'"k": 0', b'"k": ' + deep),
        "deep-envelope": b'{"event_id": ' + deep + b"}",
    }


def test_a_malformed_record_is_dead_lettered_by_every_consumer_of_the_topic_and_none_exits(settings):
    """The same malformed set, straight onto the events topic, before a good generation and its feedback: the
    ingest worker and the signals worker each dead-letter every record of it with a reason, and each goes on to
    the good events (ingest writes them, signals scores the generation)."""
    ensure_topics(settings)
    t0 = utcnow()
    gen = generation_event("g-good", t0, user_id="u")
    feedback = Event(event_id="fb-big", type="thumbs", generation_id="g-good", user_id="u", ts=t0,
                     properties={"value": "up", "k": 0})  # fmt: skip
    malformed = _malformed_set(json.loads(feedback.to_bytes()))
    t = settings.events_topic
    producer = make_producer(settings)
    producer.send_all([Outgoing(t, v, key=b"g-good") for v in malformed.values()]
                      + [Outgoing(t, gen.to_bytes(), key=b"g-good")])  # fmt: skip
    producer.close()

    ingest_worker = IngestWorker(settings, group_id="g-malformed", poll_timeout_s=0.3)
    drain(ingest_worker, settings, 1, len(malformed))
    ingest_worker.close()
    ingest_letters = letters(settings)
    assert EVENTS.read(EVENTS.at(settings.lake_root))["event_id"].to_list() == [gen.event_id]

    signals = SignalsWorker(settings, SignalsConfig(idle_after_s=60, poll_timeout_s=0.2))
    try:
        for _ in range(100):
            if signals.stats.events >= 1 and len(letters(settings)) >= 2 * len(malformed):
                break
            signals.run_once()
    finally:
        signals.close()
    assert signals.stats.events == 1 and signals.stats.invalid == len(malformed)
    every = letters(settings)
    signals_letters = [d for d in every if d not in ingest_letters]
    for found in (ingest_letters, signals_letters):
        assert sorted(d.original for d in found) == sorted(malformed.values())
        assert all(d.reason and d.source.startswith(f"kafka:{t}/") for d in found)
