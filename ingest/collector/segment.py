"""Segment HTTP Tracking API messages mapped onto the event contract (docs/design.md, "Contracts").

`messageId` -> `event_id`, `userId` / `anonymousId` -> `user_id`, `event` -> `type`
("Suggestion Accepted"-style names are normalised to `accepted`-style ones),
`properties.generation_id` -> `generation_id`, `properties.session_id` (or
`context.sessionId`) -> `session_id`; the remaining properties stay properties.

Client clocks are wrong; Segment corrects them with the time the client sent the
batch: event time = received_at - (sentAt - timestamp).
"""

from __future__ import annotations

import hashlib
import json
import reprlib
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from flywheel.contract import Event, EventType, InvalidEvent, describe_validation_error

SEGMENT_SOURCE = "segment"
_TYPES = {t.value for t in EventType}


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 80


def shown(value: object) -> str:
    """`value` as a sender may be shown it in a reason: a short repr, valid UTF-8 whatever it holds."""
    return _SHORT_REPR.repr(value).encode("utf-8", "backslashreplace").decode()


def _parse_time(value: Any, field: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidEvent(f"{field}: expected an ISO 8601 string, got {type(value).__name__}")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidEvent(f"{field}: {shown(value)} is not an ISO 8601 time") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def normalise_event_name(name: str) -> str:
    """`"Suggestion Accepted"`-free mapping: `"Session End"` -> `"session_end"`, `"accepted"` stays."""
    return "_".join(name.strip().lower().replace("-", " ").split())


def corrected_time(msg: dict[str, Any], received_at: datetime, batch_sent_at: Any = None) -> datetime:
    """Segment's clock-skew correction: received_at - (sentAt - timestamp); no sentAt: the client's time."""
    stamp = _parse_time(msg.get("originalTimestamp", msg.get("timestamp")), "timestamp")
    sent_at = _parse_time(msg.get("sentAt", batch_sent_at), "sentAt")
    if stamp is None:
        return received_at
    if sent_at is None:
        return stamp
    try:
        return received_at - (sent_at - stamp)
    except OverflowError:  # e.g. timestamp 0001-01-01, sentAt 9999-12-31: no such time
        raise InvalidEvent(
            "timestamp, sentAt: the clock-skew correction (received_at - (sentAt - timestamp)) falls outside"
            " the years 1-9999"
        ) from None


def track_to_event(msg: Any, *, received_at: datetime, batch_sent_at: Any = None) -> Event:
    """Map one Segment message; raise `InvalidEvent` saying why it cannot be an event."""
    if not isinstance(msg, dict):
        raise InvalidEvent(f"message must be a JSON object, got {type(msg).__name__}")
    kind = msg.get("type", "track")
    if kind != "track":
        raise InvalidEvent(f"type {shown(kind)} is not supported; only track calls map onto events")
    name = msg.get("event")
    if not isinstance(name, str) or not name.strip():
        raise InvalidEvent("event: a track call needs an event name")
    event_type = normalise_event_name(name)
    if event_type not in _TYPES:
        raise InvalidEvent(f"event: {shown(name)} is not an event type; expected one of {sorted(_TYPES)}")
    properties = msg.get("properties") or {}
    if not isinstance(properties, dict):
        raise InvalidEvent("properties: must be a JSON object")
    properties = dict(properties)
    raw_context = msg.get("context")
    context: dict[str, Any] = raw_context if isinstance(raw_context, dict) else {}
    generation_id = properties.pop("generation_id", None)
    if generation_id is None:
        raise InvalidEvent("properties.generation_id: required, it says which generation the event is about")
    session_id = properties.pop("session_id", None) or context.get("sessionId") or ""
    user_id = msg.get("userId") or msg.get("anonymousId")
    if user_id is None:
        raise InvalidEvent("userId or anonymousId: one is required")
    message_id = msg.get("messageId")
    if message_id is None:
        # No id from the client: a stable one from the message itself, so a retried request de-duplicates.
        message_id = hashlib.sha256(json.dumps(msg, sort_keys=True, default=str).encode()).hexdigest()[:32]
    try:
        return Event(
            event_id=str(message_id),
            type=EventType(event_type),
            generation_id=str(generation_id),
            user_id=str(user_id),
            session_id=str(session_id),
            ts=corrected_time(msg, received_at, batch_sent_at),
            received_at=received_at,
            source=SEGMENT_SOURCE,
            properties=properties,
        )
    except ValidationError as exc:
        raise InvalidEvent(describe_validation_error(exc)) from None
