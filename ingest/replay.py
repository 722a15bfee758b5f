"""List dead letters and replay the ones that pass validation now (after a fix).

Replaying re-validates each letter's original bytes the way its source would have
(`kafka:` -> an event envelope, `http:/v1/events` -> a native event, `http:/v1/track|batch`
-> a Segment message, with the letter's `received_at` and its batch's `sent_at`) and produces those that pass to
the events topic. Replay is idempotent: a replayed event keeps its `event_id`, so the
ingest workers write it once however often it is replayed. Letters that still fail stay
where they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pydantic import ValidationError

from flywheel.bus import Outgoing, Producer, Record, make_producer
from flywheel.bus.reader import read_topic
from flywheel.contract import Event, InvalidEvent, describe_validation_error
from flywheel.settings import Settings
from ingest.collector.otlp import ENDPOINT as OTLP_ENDPOINT
from ingest.collector.otlp import replay_span
from ingest.collector.posthog import ENDPOINTS as POSTHOG_ENDPOINTS
from ingest.collector.posthog import replay_message
from ingest.collector.segment import track_to_event
from ingest.dead_letters import DeadLetter


@dataclass
class ReplayResult:
    replayed: list[str] = field(default_factory=list)  # event ids produced to the events topic
    still_invalid: list[tuple[str, str]] = field(default_factory=list)  # (letter position, reason)


def list_dead_letters(settings: Settings, timeout_s: float = 10.0) -> list[tuple[Record, DeadLetter]]:
    return [
        (r, DeadLetter.from_bytes(r.value))
        for r in read_topic(settings, settings.dead_letter_topic, timeout_s)
    ]


def revalidate(letter: DeadLetter) -> Event:
    """The event the letter's original bytes make today; `InvalidEvent` if they still fail."""
    if letter.truncated:
        raise InvalidEvent(f"the letter keeps only the first {len(letter.original)} of {letter.original_size} bytes")
    if letter.source.startswith("kafka:"):
        return Event.from_bytes(letter.original)
    try:
        doc = json.loads(letter.original)
    # ValueError covers invalid UTF-8, bad JSON and integers past Python's digit limit; RecursionError, deep nesting.
    except (ValueError, RecursionError) as exc:
        raise InvalidEvent(f"not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if letter.source == "http:/v1/events":
        if not isinstance(doc, dict):
            raise InvalidEvent("event must be a JSON object")
        try:
            return Event.model_validate({**doc, "received_at": letter.received_at})
        except ValidationError as exc:
            raise InvalidEvent(describe_validation_error(exc)) from None
    if letter.source in ("http:/v1/track", "http:/v1/batch"):
        return track_to_event(doc, received_at=letter.received_at, batch_sent_at=letter.sent_at)
    if letter.source == f"http:{OTLP_ENDPOINT}":
        return replay_span(letter.original, letter.received_at)
    if letter.source.removeprefix("http:") in POSTHOG_ENDPOINTS:
        return replay_message(doc, letter.received_at, letter.sent_at)
    raise InvalidEvent(f"no way to replay a letter from {letter.source!r}")


def replay_dead_letters(
    settings: Settings,
    *,
    producer: Producer | None = None,
    source_prefix: str = "",
    dry_run: bool = False,
) -> ReplayResult:
    result = ReplayResult()
    outgoing: list[Outgoing] = []
    for record, letter in list_dead_letters(settings):
        if not letter.source.startswith(source_prefix):
            continue
        position = f"{record.topic}/{record.partition}/{record.offset}"
        try:
            event = revalidate(letter)
        except InvalidEvent as exc:
            result.still_invalid.append((position, str(exc)))
            continue
        result.replayed.append(event.event_id)
        outgoing.append(Outgoing(settings.events_topic, event.to_bytes(), key=event.generation_id.encode()))
    if outgoing and not dry_run:
        owned = producer is None
        producer = producer or make_producer(settings)
        try:
            producer.send_all(outgoing)
        finally:
            if owned:
                producer.close()
    return result
