"""Turn an HTTP body into accepted events and refusals (no I/O here).

Both the native contract endpoint and the Segment-compatible ones end up as an
`Intake`: the events to produce and, for every refused item, its index, event id,
the reason and the item's bytes (for the dead-letter topic).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from pydantic import ValidationError

from flywheel.contract import MAX_EVENT_BYTES, Event, InvalidEvent, describe_validation_error
from ingest.compact_json import compact_json_encoder
from ingest.segment import track_to_event

_MSGSPEC_JSON = msgspec.json.Decoder()


class BodyError(Exception):
    """The request as a whole cannot be taken; `status` is the HTTP answer."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Refusal:
    index: int
    event_id: str | None
    reason: str
    original: bytes
    sent_at: object = None  # the batch body's `sentAt`, kept with the dead letter for a replay's clock-skew correction

    def public(self) -> dict[str, Any]:
        return {"index": self.index, "event_id": self.event_id, "reason": self.reason}


@dataclass
class Intake:
    accepted: list[Event] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)
    write_key: str | None = None  # a `writeKey` carried in the body (Segment libraries send it there too)


def decode_body(raw: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Un-gzip when asked, never inflating past `max_bytes` (a gzip bomb is a 413, not an OOM)."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in ("gzip", "deflate"):
        raise BodyError(415, f"Content-Encoding {encoding!r} is not supported; send gzip or none")
    inflater = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)  # 47: gzip or zlib header
    try:
        out = inflater.decompress(raw, max_bytes + 1)
    except zlib.error as exc:
        raise BodyError(400, f"body is not valid {encoding}: {exc}") from None
    if len(out) > max_bytes or inflater.unconsumed_tail:
        raise BodyError(413, f"body inflates past the {max_bytes}-byte limit")
    return out


def parse_json(body: bytes) -> Any:
    # msgspec decodes several times faster than json.loads and to the same values; whatever it
    # refuses (NaN, lone surrogates, huge numbers, bad JSON) goes to json.loads, which accepts
    # it as before or gives today's error.
    try:
        return _MSGSPEC_JSON.decode(body)
    except msgspec.DecodeError:
        pass
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BodyError(400, f"body is not JSON: {exc}") from None


_encode_item = compact_json_encoder(default=str)


def _item_bytes(item: Any) -> bytes:
    return _encode_item(item).encode()


def _item_id(item: Any, key: str) -> str | None:
    value = item.get(key) if isinstance(item, dict) else None
    return str(value) if value is not None else None


def native_intake(doc: Any, received_at: datetime, max_event_bytes: int = MAX_EVENT_BYTES) -> Intake:
    """`{"events": [<Event JSON>, ...]}`; the server sets `received_at`."""
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise BodyError(400, 'body must be {"events": [<event>, ...]}')
    intake = Intake(write_key=doc.get("writeKey"))
    for index, item in enumerate(doc["events"]):
        raw = _item_bytes(item)
        event_id = _item_id(item, "event_id")
        if len(raw) > max_event_bytes:
            intake.refused.append(
                Refusal(index, event_id, f"event is {len(raw)} bytes; the limit is {max_event_bytes}", raw)
            )
            continue
        if not isinstance(item, dict):
            intake.refused.append(
                Refusal(index, None, f"event must be a JSON object, got {type(item).__name__}", raw)
            )
            continue
        try:
            intake.accepted.append(Event.model_validate({**item, "received_at": received_at}))
        except ValidationError as exc:
            intake.refused.append(Refusal(index, event_id, describe_validation_error(exc), raw))
    return intake


def segment_intake(
    doc: Any, received_at: datetime, *, single: bool, max_event_bytes: int = MAX_EVENT_BYTES
) -> Intake:
    """A Segment `/v1/track` message or a `/v1/batch` body `{"batch": [...], "sentAt", "writeKey"}`."""
    if not isinstance(doc, dict):
        raise BodyError(400, "body must be a JSON object")
    if single:
        messages, sent_at = [doc], doc.get("sentAt")
    else:
        if not isinstance(doc.get("batch"), list):
            raise BodyError(400, 'body must be {"batch": [<message>, ...]}')
        messages, sent_at = doc["batch"], doc.get("sentAt")
    # Outside the items: a refused item's dead letter carries it apart (`Refusal.sent_at`).
    batch_sent_at = None if single else sent_at
    intake = Intake(write_key=doc.get("writeKey"))
    for index, msg in enumerate(messages):
        raw = _item_bytes(msg)
        message_id = _item_id(msg, "messageId")
        if len(raw) > max_event_bytes:
            if single:
                raise BodyError(413, f"event is {len(raw)} bytes; the limit is {max_event_bytes}")
            reason = f"event is {len(raw)} bytes; the limit is {max_event_bytes}"
            intake.refused.append(Refusal(index, message_id, reason, raw, batch_sent_at))
            continue
        try:
            intake.accepted.append(track_to_event(msg, received_at=received_at, batch_sent_at=sent_at))
        except InvalidEvent as exc:
            intake.refused.append(Refusal(index, message_id, str(exc), raw, batch_sent_at))
    return intake
