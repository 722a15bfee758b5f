"""The collector bounds what a client may claim: event times near their arrival, consent only from those allowed
to state it, secrets in no log line or dead letter wherever they are placed, and a rate per client."""

from __future__ import annotations

import base64
import json
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from flywheel.bus import ensure_topics
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, utcnow
from flywheel.settings import Settings
from ingest.collector import create_app
from ingest.dead_letters import DeadLetter

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
