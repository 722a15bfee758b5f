"""Turn an HTTP body into accepted events and refusals (no I/O here).

Both the native contract endpoint and the Segment-compatible ones end up as an
`Intake`: the events to produce and, for every refused item, its index, event id,
the reason and the item's bytes (for the dead-letter topic).
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from pydantic import ValidationError

from flywheel.compact_json import compact_json_encoder
from flywheel.contract import MAX_EVENT_BYTES, Event, InvalidEvent, describe_validation_error
from ingest.collector.segment import shown, track_to_event

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
        # A reason may quote what was sent: written back as valid UTF-8 whatever that held.
        reason = self.reason.encode("utf-8", "backslashreplace").decode()
        return {"index": self.index, "event_id": self.event_id, "reason": reason}


@dataclass
class Intake:
    accepted: list[Event] = field(default_factory=list)
    refused: list[Refusal] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Body:
    """A decoded body. `lenient`: msgspec refused it and `json.loads` took it (NaN, Infinity, lone
    surrogates, huge numbers): its items then hold values only `json.dumps` writes back faithfully."""

    doc: Any
    lenient: bool = False


def decode_body(raw: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Un-gzip when asked, never inflating past `max_bytes` (a gzip bomb is a 413, not an OOM)."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in ("gzip", "deflate"):
        raise BodyError(415, f"Content-Encoding {shown(encoding)} is not supported; send gzip or none")
    inflater = zlib.decompressobj(wbits=47 if encoding == "gzip" else 15)  # 47: gzip or zlib header
    try:
        out = inflater.decompress(raw, max_bytes + 1)
    except zlib.error as exc:
        raise BodyError(400, f"body is not valid {encoding}: {exc}") from None
    if len(out) > max_bytes or inflater.unconsumed_tail:
        raise BodyError(413, f"body inflates past the {max_bytes}-byte limit")
    return out


def parse_json(body: bytes) -> Body:
    # msgspec decodes several times faster than json.loads and to the same values; whatever it
    # refuses as JSON (NaN, lone surrogates, huge numbers) goes to json.loads, which takes it so that
    # the item holding it is refused alone, with its reason (the contract refuses such values).
    try:
        return Body(_MSGSPEC_JSON.decode(body))
    except msgspec.DecodeError:
        pass
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"body is not UTF-8: {exc}") from None
    except RecursionError:
        raise BodyError(400, "body is nested too deeply to read") from None
    try:
        return Body(json.loads(body), lenient=True)
    except RecursionError:
        raise BodyError(400, "body is nested too deeply to read") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer past Python's 4300 digits
        raise BodyError(400, f"body is not JSON: {exc}") from None


class _Credentials(msgspec.Struct):
    writeKey: Any = None  # noqa: N815 - Segment's spelling


_CREDENTIALS_ONLY = msgspec.json.Decoder(_Credentials)


def body_write_key(body: bytes) -> tuple[str | None, Body | None]:
    """The `writeKey` a body carries (Segment libraries may send it there instead of in the header), read
    without building or validating anything else; and the decoded body when finding it took a full decode
    (a body msgspec does not take). Raises nothing: a body it cannot read carries no key."""
    try:
        key = _CREDENTIALS_ONLY.decode(body).writeKey
        return (key if isinstance(key, str) else None), None
    except msgspec.ValidationError:  # JSON, but no object at the top
        return None, None
    except (ValueError, RecursionError):
        pass
    try:
        parsed = parse_json(body)
    except BodyError:
        return None, None
    key = parsed.doc.get("writeKey") if isinstance(parsed.doc, dict) else None
    return (key if isinstance(key, str) else None), parsed


# Where a write key or credentials can sit in a body: never copied into a dead letter. Names are compared as
# parsed (JSON escapes decoded), lower-case and without separators: `writeKey`, `write_key`, `Write-Key`, ...
_CREDENTIAL_KEYS = frozenset({"writekey", "authorization"})
_CREDENTIAL_TEXT = re.compile(
    rb'("(?:write[_-]?key|authorization)"\s*:\s*)"(?:[^"\\]|\\.)*"', re.IGNORECASE
)
REDACTED = "[redacted]"


def _is_credential(key: object) -> bool:
    return isinstance(key, str) and re.sub(r"[^a-z]", "", key.lower()) in _CREDENTIAL_KEYS


def without_credentials(item: Any) -> Any:
    """`item` with every credential field's value redacted, at any depth (Segment puts them at the top; a client
    may nest them in `context` or anywhere else). Returns `item` itself when there is none (no copy); an item
    nested too deeply to walk is replaced whole (it is refused for its depth anyway)."""
    try:
        return _without_credentials(item)
    except RecursionError:
        return "<item nested too deeply to keep>"


def _without_credentials(item: Any) -> Any:
    if isinstance(item, dict):
        out = {k: REDACTED if _is_credential(k) else _without_credentials(v) for k, v in item.items()}
        return item if all(out[k] is item[k] for k in item) else out
    if isinstance(item, list):
        items = [_without_credentials(v) for v in item]
        return item if all(a is b for a, b in zip(items, item, strict=True)) else items
    return item


def body_without_credentials(body: bytes, parsed: Body | None = None) -> bytes:
    """A refused body as it may be dead-lettered: a JSON object with its credentials redacted and written
    back; any other body with every `"writeKey": "..."`-looking text redacted."""
    if parsed is not None and isinstance(parsed.doc, dict):
        stripped = without_credentials(parsed.doc)
        return body if stripped is parsed.doc else _item_bytes(stripped, parsed.lenient)
    return _CREDENTIAL_TEXT.sub(rb'\1"' + REDACTED.encode() + rb'"', body)


_encode_item = compact_json_encoder(default=str)


def _item_bytes(item: Any, lenient: bool = False) -> bytes:
    """An item's bytes for its size check and its dead letter (`lenient`: see `Body`)."""
    try:
        if lenient:
            return json.dumps(item, separators=(",", ":"), default=str).encode()
        return _encode_item(item).encode()
    except (ValueError, RecursionError):
        # Deeper than the encoder goes (decoders and encoders differ by a few levels): only the reason is kept.
        return b'"<item nested too deeply to write back>"'


def _item_id(item: Any, key: str) -> str | None:
    value = item.get(key) if isinstance(item, dict) else None
    if value is None or isinstance(value, dict | list):
        return None
    return str(value)[:256].encode("utf-8", "backslashreplace").decode()


# What validating one item can raise over what the item holds; the item is then refused, the rest goes on.
_ITEM_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        return describe_validation_error(exc)
    if isinstance(exc, InvalidEvent):
        return str(exc)
    if isinstance(exc, RecursionError):
        return "nested too deeply to read"
    return f"cannot be read: {type(exc).__name__}: {exc}"


def native_intake(
    doc: Any, received_at: datetime, max_event_bytes: int = MAX_EVENT_BYTES, *, lenient: bool = False
) -> Intake:
    """`{"events": [<Event JSON>, ...]}`; the server sets `received_at`."""
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list):
        raise BodyError(400, 'body must be {"events": [<event>, ...]}')
    intake = Intake()
    for index, item in enumerate(doc["events"]):
        raw = _item_bytes(without_credentials(item), lenient)
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
        except _ITEM_ERRORS as exc:
            intake.refused.append(Refusal(index, event_id, _reason(exc), raw))
    return intake


def segment_intake(
    doc: Any,
    received_at: datetime,
    *,
    single: bool,
    max_event_bytes: int = MAX_EVENT_BYTES,
    lenient: bool = False,
) -> Intake:
    """A Segment `/v1/track` message or a `/v1/batch` body `{"batch": [...], "sentAt", "writeKey"}`.
    An item that cannot be an event is refused alone (a whole batch refused would be retried forever by
    Segment's and RudderStack's libraries)."""
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
    intake = Intake()
    for index, msg in enumerate(messages):
        raw = _item_bytes(without_credentials(msg), lenient)
        message_id = _item_id(msg, "messageId")
        if len(raw) > max_event_bytes:
            if single:
                raise BodyError(413, f"event is {len(raw)} bytes; the limit is {max_event_bytes}")
            reason = f"event is {len(raw)} bytes; the limit is {max_event_bytes}"
            intake.refused.append(Refusal(index, message_id, reason, raw, batch_sent_at))
            continue
        try:
            intake.accepted.append(track_to_event(msg, received_at=received_at, batch_sent_at=sent_at))
        except _ITEM_ERRORS as exc:
            intake.refused.append(Refusal(index, message_id, _reason(exc), raw, batch_sent_at))
    return intake
