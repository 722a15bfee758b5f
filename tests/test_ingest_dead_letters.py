"""Dead letters can be listed and, after a fix, replayed (CLI against the real broker)."""

from __future__ import annotations

import base64
import json
import socket
from dataclasses import replace
from datetime import timedelta

from fastapi.testclient import TestClient
from typer.testing import CliRunner

from flywheel import contract
from flywheel.bus import ensure_topics
from flywheel.bus.reader import read_topic
from flywheel.contract import Event
from flywheel.settings import get_settings
from ingest.collector.app import create_app
from ingest.dead_letters import DeadLetter
from ingest.replay import revalidate
from launcher.cli import app as flywheel_cli
from launcher.embedded import settings_env

AUTH = {"Authorization": "Basic " + base64.b64encode(b"dev-write-key:").decode()}


def test_list_then_replay_after_a_fix_produces_only_what_passes_now(settings, monkeypatch):
    ensure_topics(settings)
    v2 = {
        "event_id": "v2-event",
        "type": "thumbs",
        "generation_id": "g1",
        "user_id": "u",
        "schema_version": 2,
        "properties": {"value": "up"},
    }
    # No generation_id: stays invalid.
    broken = {"event_id": "broken", "type": "thumbs", "user_id": "u", "properties": {"value": "up"}}
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/events", json={"events": [v2, broken]}, headers=AUTH)
    assert [x["event_id"] for x in r.json()["refused"]] == ["v2-event", "broken"]

    for name, value in settings_env(settings).items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    runner = CliRunner()
    listed = runner.invoke(flywheel_cli, ["ingest", "dead-letters", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    docs = [json.loads(line) for line in listed.output.splitlines()]
    # The two letters may sit on different partitions of the dead-letter topic: no order between them.
    by_id = {json.loads(base64.b64decode(d["original"]))["event_id"]: d for d in docs}
    assert sorted(by_id) == ["broken", "v2-event"] and len(docs) == 2
    assert "unknown schema_version 2" in by_id["v2-event"]["reason"]
    assert by_id["v2-event"]["source"] == "http:/v1/events"
    # The table shows each reason whole (wrapped), not cut: a reader came for the reason.
    table = runner.invoke(flywheel_cli, ["ingest", "dead-letters", "list"])
    assert table.exit_code == 0, table.output
    shown = "".join(ch for ch in table.output if ch not in "│ \n")
    for doc in docs:
        assert "".join(doc["reason"].split()) in shown, (doc["reason"], table.output)

    before = runner.invoke(flywheel_cli, ["ingest", "dead-letters", "replay"])
    assert before.exit_code == 0 and "replayed 0 event(s); 2 still invalid" in before.output

    # The fix: schema version 2 is supported now.
    monkeypatch.setattr(contract, "SUPPORTED_SCHEMA_VERSIONS", frozenset({1, 2}))
    after = runner.invoke(flywheel_cli, ["ingest", "dead-letters", "replay"])
    assert after.exit_code == 0 and "replayed 1 event(s); 1 still invalid" in after.output, after.output
    (replayed,) = [Event.from_bytes(r.value) for r in read_topic(settings, settings.events_topic)]
    assert replayed.event_id == "v2-event" and replayed.schema_version == 2
    get_settings.cache_clear()


def test_a_segment_batch_item_replays_with_its_batch_clock_skew_correction(settings):
    """`sentAt` sits on the batch body, outside the refused item: the letter keeps it for the replay."""
    ensure_topics(settings)
    item = {"type": "track", "messageId": "m1", "userId": "u", "event": "Accepted",
            "properties": {"accepted_chars": 3}, "timestamp": "2024-05-01T12:00:00Z"}  # fmt: skip
    # The client's clock runs 10 s behind its sentAt: the event happened 10 s before the collector got it.
    body = {"batch": [item], "sentAt": "2024-05-01T12:00:10Z"}
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/batch", json=body, headers=AUTH)
    assert "generation_id" in r.json()["refused"][0]["reason"]
    (record,) = read_topic(settings, settings.dead_letter_topic)
    letter = DeadLetter.from_bytes(record.value)
    assert letter.sent_at == "2024-05-01T12:00:10Z" and json.loads(letter.original) == item

    # The fix: the sender's item now names its generation (the letter's bytes, corrected by hand).
    fixed = {**item, "properties": {**item["properties"], "generation_id": "g1"}}
    event = revalidate(replace(letter, original=json.dumps(fixed).encode()))
    assert event.ts == letter.received_at - timedelta(seconds=10)


def test_listing_dead_letters_with_no_kafka_says_what_to_set(monkeypatch):
    """No Kafka configured and no `flywheel up` beside it: a clear message and exit 2 at once, not a traceback
    after a 30-second bootstrap from an empty address."""
    with socket.socket() as probe:  # a loopback port nothing listens on, for the embedded broker's
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    for name in ("KAFKA_BOOTSTRAP_SERVERS", "FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLYWHEEL_EMBEDDED_KAFKA_PORT", str(free_port))
    get_settings.cache_clear()
    try:
        for command in ("list", "replay"):
            result = CliRunner().invoke(flywheel_cli, ["ingest", "dead-letters", command])
            assert result.exit_code == 2, result.output
            assert "FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS" in result.output and f"127.0.0.1:{free_port}" in result.output
    finally:
        get_settings.cache_clear()
