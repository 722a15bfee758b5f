"""The collector's PostHog door: `POST /batch/` and `/capture/`, the capture API posthog-python sends to.

`posthog.Posthog(<write key>, host=<collector>)` works unchanged, gzip on or off. What must hold:

- The project API key is a write key: `api_key` (or `token`) in the body, or `Authorization: Bearer <key>`,
  read before the rest of the body is parsed; unknown or missing: 401, nothing produced.
- Each message maps onto a Segment track call and then onto the envelope exactly as Segment's are
  (ingest/collector/segment.py): `uuid` -> `event_id`, `distinct_id` -> `user_id`, `event` -> `type` ("Suggestion
  Accepted"-style names normalised), `properties.generation_id` -> `generation_id`, `properties.$session_id`
  -> `session_id`, the client clock corrected with the batch's `sent_at`. PostHog's own properties (named
  `$...`: the library's name and version, geo-IP and person-profile flags) are not the product's and are
  left out; every other property is kept. The events are the same events, with `source` "posthog".
- PostHog's own events (named `$...`: `$pageview`, `$identify`, `$feature_flag_called`, ...) are not
  feedback: ignored and counted (`flywheel_collector_ignored_total{why}`: the name, or `$other`), not dead-lettered.
- A message that cannot be an event is refused alone with its reason, dead-lettered, and listed in the
  answer (`refused`); a body that cannot be read is a 400, dead-lettered with its key redacted.
"""

from __future__ import annotations

import re
from collections import Counter
from datetime import UTC, datetime
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from flywheel.contract import MAX_EVENT_BYTES, Event, InvalidEvent
from ingest.collector.doors import Door
from ingest.collector.intake import (
    REDACTED,
    Body,
    BodyError,
    Intake,
    Refusal,
    _item_bytes,
    _item_id,
    _reason,
    parse_json,
)
from ingest.collector.segment import track_to_event

POSTHOG_SOURCE = "posthog"
ENDPOINTS = ("/batch/", "/capture/", "/e/")
MISSING_KEY = "missing or unknown API key (posthog-python sends it as api_key: use a Flywheel write key)"
_ITEM_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)
_KEY_NAMES = ("api_key", "token")
# PostHog's own events, counted by name when ignored; any other `$` name is counted as `$other`.
_OWN_EVENTS = frozenset({
    "$pageview", "$pageleave", "$screen", "$autocapture", "$identify", "$groupidentify", "$create_alias",
    "$set", "$feature_flag_called", "$exception", "$web_vitals", "$snapshot", "$rageclick", "$opt_in",
    "$ai_generation", "$ai_span", "$ai_trace", "$ai_embedding", "$ai_feedback", "$ai_metric",
})  # fmt: skip
_KEY_TEXT = re.compile(rb'("(?:api_key|token)"\s*:\s*)"(?:[^"\\]|\\.)*"', re.IGNORECASE)


class _Keys(msgspec.Struct):
    api_key: Any = None
    token: Any = None


_KEYS_ONLY = msgspec.json.Decoder(_Keys)


def _key_of(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return None
    for name in _KEY_NAMES:
        if isinstance(doc.get(name), str):
            return str(doc[name])
    properties = doc.get("properties")
    token = properties.get("token") if isinstance(properties, dict) else None
    return token if isinstance(token, str) else None


def body_api_key(body: bytes) -> tuple[str | None, Body | None]:
    """The API key a body carries at its top level (or, for a single event, as `properties.token`), and the
    parsed body when finding it took a full parse. Raises nothing: a body it cannot read carries no key."""
    try:
        keys = _KEYS_ONLY.decode(body)
        for value in (keys.api_key, keys.token):
            if isinstance(value, str):
                return value, None
    except msgspec.ValidationError:  # JSON, but not an object
        return None, None
    except (ValueError, RecursionError):
        pass
    try:
        parsed = parse_json(body)
    except BodyError:
        return None, None
    return _key_of(parsed.doc), parsed


def without_key(body: bytes, parsed: Body | None) -> bytes:
    """A body as it may be dead-lettered: its API key redacted."""
    if parsed is not None and isinstance(parsed.doc, dict):
        doc = {k: REDACTED if k in _KEY_NAMES else v for k, v in parsed.doc.items()}
        return _item_bytes(doc, parsed.lenient)
    return _KEY_TEXT.sub(rb'\1"' + REDACTED.encode() + rb'"', body)


def as_track(msg: dict[str, Any]) -> dict[str, Any]:
    """A PostHog capture message as the Segment track call it means (see the module doc)."""
    properties = msg.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    own = {k: v for k, v in properties.items() if not k.startswith("$") and k not in ("distinct_id", "token")}
    session = properties.get("$session_id")
    if session not in (None, "") and "session_id" not in own:
        own["session_id"] = session
    track: dict[str, Any] = {
        "type": "track",
        "event": msg.get("event"),
        "userId": msg.get("distinct_id", properties.get("distinct_id")),
        "properties": own,
    }
    if msg.get("uuid") is not None:
        track["messageId"] = msg["uuid"]
    if msg.get("timestamp") is not None:
        track["timestamp"] = msg["timestamp"]
    return track


def posthog_intake(
    doc: Any, received_at: datetime, *, max_event_bytes: int = MAX_EVENT_BYTES, lenient: bool = False
) -> tuple[Intake, Counter[str]]:
    """A `/batch/` body `{"api_key", "batch": [...], "sent_at"}` or a single `/capture/` event."""
    if not isinstance(doc, dict):
        raise BodyError(400, "body must be a JSON object")
    if "batch" in doc:
        if not isinstance(doc["batch"], list):
            raise BodyError(400, 'body must be {"batch": [<event>, ...]}')
        messages = doc["batch"]
    else:
        messages = [doc]
    sent_at = doc.get("sent_at")
    intake, ignored = Intake(), Counter[str]()
    for index, msg in enumerate(messages):
        event_id = _item_id(msg, "uuid")
        name = msg.get("event") if isinstance(msg, dict) else None
        if isinstance(name, str) and name.startswith("$"):
            ignored[name if name in _OWN_EVENTS else "$other"] += 1  # a bounded set of metric labels
            continue
        raw = _item_bytes(
            {k: v for k, v in msg.items() if k not in _KEY_NAMES} if isinstance(msg, dict) else msg, lenient
        )
        if len(raw) > max_event_bytes:
            reason = f"event is {len(raw)} bytes; the limit is {max_event_bytes}"
            intake.refused.append(Refusal(index, event_id, reason, raw, sent_at))
            continue
        try:
            intake.accepted.append(replay_message(msg, received_at, sent_at))
        except _ITEM_ERRORS as exc:
            intake.refused.append(Refusal(index, event_id, _reason(exc), raw, sent_at))
    return intake, ignored


def replay_message(msg: Any, received_at: datetime, sent_at: object = None) -> Event:
    """The event a dead-lettered PostHog message makes today; `InvalidEvent` (or `ValueError`) if it still fails."""
    if not isinstance(msg, dict):
        raise InvalidEvent(f"event must be a JSON object, got {type(msg).__name__}")
    event = track_to_event(as_track(msg), received_at=received_at, batch_sent_at=sent_at)
    return event.model_copy(update={"source": POSTHOG_SOURCE})


def _bearer(request: Request) -> str | None:
    scheme, _, credentials = (request.headers.get("authorization") or "").partition(" ")
    return credentials.strip() or None if scheme.lower() == "bearer" else None


def posthog_router(door: Door) -> APIRouter:
    router = APIRouter()

    async def capture(request: Request) -> dict[str, Any]:
        endpoint = request.url.path
        header_key = _bearer(request)
        if header_key is not None and header_key not in door.write_keys:
            raise BodyError(401, MISSING_KEY)
        received_at = datetime.now(UTC)
        sent = await door.read_body(request)
        try:
            body = await run_in_threadpool(door.inflate, request, sent)  # off the event loop, as every door
        except BodyError as exc:
            if header_key is None:
                raise BodyError(401, MISSING_KEY) from None
            await door.keep_unreadable(
                exc, endpoint, _KEY_TEXT.sub(rb'\1"' + REDACTED.encode() + rb'"', sent), received_at
            )
            raise
        parsed: Body | None = None
        body_key: str | None = None
        if header_key is None:
            # a scan for the key (a full parse when the body is unusual): off the event loop too
            body_key, parsed = await run_in_threadpool(body_api_key, body)
            if body_key is None or body_key not in door.write_keys:
                raise BodyError(401, MISSING_KEY)
        try:
            if parsed is None:
                parsed = await run_in_threadpool(parse_json, body)  # off the event loop, as every door
            doc, lenient = parsed.doc, parsed.lenient
            try:
                intake, ignored = await run_in_threadpool(
                    lambda: posthog_intake(doc, received_at, max_event_bytes=door.max_event_bytes, lenient=lenient)
                )
            except _ITEM_ERRORS as exc:
                raise BodyError(400, f"body cannot be read: {type(exc).__name__}: {exc}") from None
        except BodyError as exc:
            await door.keep_unreadable(exc, endpoint, without_key(body, parsed), received_at)
            raise
        intake = await door.deliver(endpoint, intake, received_at, ignored, header_key or body_key)  # as kept
        # PostHog's own answer is {"status": 1}; the rest says what became of each event.
        return {
            "status": 1,
            "accepted": len(intake.accepted),
            "ignored": sum(ignored.values()),
            "refused": [r.public() for r in intake.refused],
        }

    for path in ENDPOINTS:
        router.add_api_route(path, capture, methods=["POST"])
    return router
