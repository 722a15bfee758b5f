"""The collector's OTLP/HTTP traces door: `POST /v1/traces`, protobuf or JSON, as the OTLP specification says.

An OpenTelemetry exporter pointed at the collector (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=<collector>/v1/traces`)
sends every span it has; each GenAI generation among them becomes one text-only `generation` event
(ingest/collector/otlp_genai.py says which spans and how). What must hold:

- The write key comes first, from `Authorization: Bearer <key>` (or Basic, as Segment's), or from the header
  `FLYWHEEL_OTLP_WRITE_KEY_HEADER` names: unknown or missing, a 401 before the body is read.
- The body is decoded by the OpenTelemetry protocol package (`ExportTraceServiceRequest`): protobuf as is;
  JSON with OTLP's own rules (trace and span ids in hex, not base64) applied before protobuf's JSON parser.
  A body that is neither: 415; one that does not decode: 400 with the parser's reason, kept as a dead letter.
- Each span is judged alone. A generation is produced; a span that is not one is ignored and counted
  (`flywheel_collector_ignored_total{endpoint="/v1/traces"}`); a span refused (content capture off, no user,
  an unknown operation, an event past the size limit) is dead-lettered with its reason, as OTLP/JSON of a
  request holding that span alone (its resource and scope kept; values past `_CUT_AT` characters cut when the
  whole is past the event limit, and the reason says so; a resource or scope that several refused spans of one
  request share is kept whole in the first one's letter only, the others keeping what the mapping reads of it and
  the first letter's event id: so a refused span's letter costs a constant factor of its own bytes, not of its
  resource's), and counted in the answer's `partial_success`
  (`rejected_spans`, and the first reasons in `error_message`), which the exporter logs and does not retry.
- The answer comes once Kafka acknowledged every event and dead letter; in the request's own encoding.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections import Counter
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Response
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from starlette.concurrency import run_in_threadpool

from flywheel.contract import MAX_EVENT_BYTES, Event, InvalidEvent
from ingest.collector.doors import Door
from ingest.collector.intake import BodyError, Intake, Refusal, parse_json
from ingest.collector.otlp_genai import RESOURCE_KEYS, Ignored, resource_attributes, span_to_event

ENDPOINT = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
MISSING_KEY = "missing or unknown write key (send it as Authorization: Bearer <key>, or in the configured header)"
_ID_FIELDS = frozenset({"traceId", "spanId", "parentSpanId"})
_CUT_AT = 1024  # characters of a value kept in an over-size span's dead letter
_REASONS_SHOWN = 5
_ENVELOPE_BYTES = 4096  # the envelope's fields and property names, generously


def write_key(request: Request, header: str) -> str | None:
    """The key in `Authorization: Bearer <key>` or `Basic base64(<key>:)`, or in the configured header."""
    value = request.headers.get(header)
    if value:
        return value.strip()
    authorization = request.headers.get("authorization") or ""
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(credentials.strip(), validate=True).decode().split(":", 1)[0] or None
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


def _media_type(request: Request) -> str:
    media = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    if media not in (PROTOBUF, JSON):
        raise BodyError(415, f"Content-Type {media[:64]!r} is not OTLP/HTTP; send {PROTOBUF} or {JSON}")
    return media


def _items(doc: Any, key: str) -> list[dict[str, Any]]:
    """The objects in the list `doc[key]` (anything else there is left to protobuf's parser to refuse)."""
    found = doc.get(key) if isinstance(doc, dict) else None
    return [item for item in found if isinstance(item, dict)] if isinstance(found, list) else []


def _ids(doc: Any, convert: Any) -> None:
    """Rewrite the span and link ids of an OTLP/JSON document in place with `convert`."""
    for resource_spans in _items(doc, "resourceSpans"):
        for scope_spans in _items(resource_spans, "scopeSpans"):
            for span in _items(scope_spans, "spans"):
                for item in (span, *_items(span, "links")):
                    for name in _ID_FIELDS:
                        if isinstance(item.get(name), str) and item[name]:
                            item[name] = convert(item[name])


def _hex_to_base64(text: str) -> str:
    try:
        return base64.b64encode(bytes.fromhex(text)).decode("ascii")
    except ValueError:
        raise BodyError(400, f"OTLP/JSON ids are hex; {text[:40]!r} is not") from None


def _base64_to_hex(text: str) -> str:
    return base64.b64decode(text).hex()


# proto3 JSON writes 64-bit integers as strings; the constructors take ints.
_INT64_FIELDS = frozenset({"startTimeUnixNano", "endTimeUnixNano", "timeUnixNano", "intValue"})
_FIELD_NAMES: dict[str, str] = {}


def _field_name(json_name: str) -> str:
    """A proto3 JSON name (`startTimeUnixNano`) as its field's name (`start_time_unix_nano`)."""
    name = _FIELD_NAMES.get(json_name)
    if name is None:
        name = _FIELD_NAMES[json_name] = re.sub(r"(?<!^)([A-Z])", r"_\1", json_name).lower()
    return name


def _as_fields(value: dict[str, Any]) -> dict[str, Any]:
    """An OTLP/JSON object as the keyword arguments protobuf's message constructors take: field names, ids and
    bytes as bytes, 64-bit integers (JSON strings) as ints. Raises on anything unusual; see `decode_request`."""
    out = {}
    for key, item in value.items():
        kind = type(item)
        if kind is str:
            if key in _ID_FIELDS:
                item = bytes.fromhex(item)
            elif key in _INT64_FIELDS:
                item = int(item)
            elif key == "bytesValue":
                item = base64.b64decode(item, validate=True)
        elif kind is dict:
            item = _as_fields(item)
        elif kind is list:
            item = [_as_fields(x) if type(x) is dict else x for x in item]
        out[_FIELD_NAMES.get(key) or _field_name(key)] = item
    return out


def decode_request(body: bytes, media: str) -> ExportTraceServiceRequest:
    """The request an OTLP/HTTP body holds; `BodyError(400)` with the decoder's reason."""
    request = ExportTraceServiceRequest()
    if media == PROTOBUF:
        try:
            request.ParseFromString(body)
        except (DecodeError, RecursionError) as exc:
            raise BodyError(400, f"body is not an OTLP ExportTraceServiceRequest (protobuf): {exc}") from None
        return request
    doc = parse_json(body).doc  # msgspec, with json.loads for what it refuses; a 400 with the reason
    if not isinstance(doc, dict):
        raise BodyError(400, "body must be an OTLP/JSON ExportTraceServiceRequest object")
    try:
        # The usual body, built by the generated classes' own constructors (in C): five times faster than
        # protobuf's JSON parser, which stays the judge of anything else (names in snake case, enum names, null,
        # unknown fields, wrong types) and gives the same message or the reason.
        return ExportTraceServiceRequest(**_as_fields(doc))
    except Exception:  # noqa: BLE001, S110 - whatever the shortcut does not take, the parser below judges
        pass
    _ids(doc, _hex_to_base64)
    try:
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    except (json_format.ParseError, RecursionError) as exc:
        raise BodyError(400, f"body is not an OTLP/JSON ExportTraceServiceRequest: {exc}") from None
    return request


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > _CUT_AT:
        return value[:_CUT_AT] + f"...[{len(value) - _CUT_AT} characters cut]"
    if isinstance(value, dict):
        return {k: _cut(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut(v) for v in value]
    return value


ELIDED = "flywheel.elided"  # the attribute a letter's shortened resource or scope carries: where the whole one is


def _elided_resource(resource: Resource, whole_in: str) -> Resource:
    """`resource` as a later letter of the same request keeps it: the attributes the mapping reads (values cut),
    and which letter holds the whole of it."""
    out = Resource()
    for kv in resource.attributes:
        if kv.key in RESOURCE_KEYS:
            kept = out.attributes.add()
            kept.CopyFrom(kv)
            if len(kv.value.string_value) > _CUT_AT:
                kept.value.string_value = _cut(kv.value.string_value)
    note = out.attributes.add()
    note.key = ELIDED
    note.value.string_value = f"{len(resource.attributes)} attributes; whole in the letter of {whole_in}"
    return out


def _elided_scope(scope: InstrumentationScope, whole_in: str) -> InstrumentationScope:
    out = InstrumentationScope(name=_cut(scope.name), version=_cut(scope.version))
    note = out.attributes.add()
    note.key = ELIDED
    note.value.string_value = f"{len(scope.attributes)} attributes; whole in the letter of {whole_in}"
    return out


def span_letter(
    resource_spans: ResourceSpans,
    scope_spans: ScopeSpans,
    span: Span,
    limit: int,
    resource: Resource | None = None,
    scope: InstrumentationScope | None = None,
) -> tuple[bytes, bool]:
    """The OTLP/JSON of a request holding `span` alone (with its resource and scope, or the `resource` and `scope`
    given in their place), and whether values had to be cut to bring it under `limit` bytes."""
    alone = ExportTraceServiceRequest()
    rs = alone.resource_spans.add()
    rs.resource.CopyFrom(resource_spans.resource if resource is None else resource)
    rs.schema_url = resource_spans.schema_url
    ss = rs.scope_spans.add()
    ss.scope.CopyFrom(scope_spans.scope if scope is None else scope)
    ss.schema_url = scope_spans.schema_url
    ss.spans.append(span)
    doc = json_format.MessageToDict(alone)
    _ids(doc, _base64_to_hex)
    raw = json.dumps(doc, separators=(",", ":")).encode()
    if len(raw) <= limit:
        return raw, False
    return json.dumps(_cut(doc), separators=(",", ":")).encode(), True


def traces_intake(
    request: ExportTraceServiceRequest, received_at: datetime, max_event_bytes: int
) -> tuple[Intake, Counter[str]]:
    """Every span judged alone: generations accepted, other spans counted by why, the rest refused."""
    intake = Intake()
    ignored: Counter[str] = Counter()
    index = 0
    for resource_spans in request.resource_spans:
        resource = resource_attributes(resource_spans.resource.attributes)
        resource_in: str | None = None  # the event id of the letter that holds this resource whole
        for scope_spans in resource_spans.scope_spans:
            scope_in: str | None = None
            for span in scope_spans.spans:
                reason = None
                try:
                    event = span_to_event(span, resource, received_at)
                    # An event's JSON is at most a few times its span's protobuf (escapes, field names): only
                    # a span past a sixth of the limit is encoded here to be measured (it is encoded again to be sent).
                    size = len(event.to_bytes()) if span.ByteSize() * 6 + _ENVELOPE_BYTES > max_event_bytes else 0
                    if size > max_event_bytes:
                        reason = f"the span's event is {size} bytes; the limit is {max_event_bytes}"
                    else:
                        intake.accepted.append(event)
                except Ignored as exc:
                    ignored[exc.why] += 1
                except InvalidEvent as exc:
                    reason = str(exc)
                except Exception as exc:  # noqa: BLE001 - a span that breaks the mapping is refused alone, not a 500
                    reason = f"cannot be read: {type(exc).__name__}: {str(exc)[:200]}"
                if reason is not None:
                    event_id = f"otlp-{span.trace_id.hex()}-{span.span_id.hex()}"
                    original, cut = span_letter(
                        resource_spans, scope_spans, span, max_event_bytes,
                        None if resource_in is None else _elided_resource(resource_spans.resource, resource_in),
                        None if scope_in is None else _elided_scope(scope_spans.scope, scope_in),
                    )  # fmt: skip
                    resource_in, scope_in = resource_in or event_id, scope_in or event_id
                    if cut:
                        reason += f" (values past {_CUT_AT} characters are cut in this letter's copy of the span)"
                    intake.refused.append(Refusal(index, event_id, reason, original))
                index += 1
    return intake, ignored


def replay_span(original: bytes, received_at: datetime) -> Event:
    """The event a dead-lettered span (OTLP/JSON of a request holding it alone) makes today; else `InvalidEvent`."""
    try:
        request = decode_request(original, JSON)
    except BodyError as exc:
        raise InvalidEvent(exc.reason) from None
    intake, ignored = traces_intake(request, received_at, MAX_EVENT_BYTES)
    if intake.refused:
        raise InvalidEvent(intake.refused[0].reason)
    if not intake.accepted:
        raise InvalidEvent(f"not a generation span ({', '.join(ignored) or 'no span'})")
    return intake.accepted[0]


def _answer(media: str, intake: Intake) -> Response:
    response = ExportTraceServiceResponse()
    if intake.refused:
        reasons = "; ".join(f"{r.event_id}: {r.reason}" for r in intake.refused[:_REASONS_SHOWN])
        more = len(intake.refused) - _REASONS_SHOWN
        response.partial_success.CopyFrom(
            ExportTracePartialSuccess(
                rejected_spans=len(intake.refused),
                error_message=reasons + (f"; and {more} more (in the dead letters)" if more > 0 else ""),
            )
        )
    if media == PROTOBUF:
        return Response(response.SerializeToString(), media_type=PROTOBUF)
    return Response(json_format.MessageToJson(response, indent=None).encode(), media_type=JSON)


def otlp_router(door: Door) -> APIRouter:
    router = APIRouter()
    header = door.settings.otlp_write_key_header.lower()

    @router.post(ENDPOINT)
    async def traces(request: Request) -> Response:
        key = write_key(request, header)
        if key is None or key not in door.write_keys:
            raise BodyError(401, MISSING_KEY)  # before the body is read: an unknown key costs nothing
        media = _media_type(request)
        received_at = datetime.now(UTC)
        sent = await door.read_body(request)
        body = sent
        try:
            body = await run_in_threadpool(door.inflate, request, sent)  # off the event loop, as every door
            parsed = await run_in_threadpool(decode_request, body, media)
        except BodyError as exc:
            await door.keep_unreadable(exc, ENDPOINT, body, received_at)
            raise
        intake, ignored = await run_in_threadpool(traces_intake, parsed, received_at, door.max_event_bytes)
        intake = await door.deliver(ENDPOINT, intake, received_at, ignored, key)
        return _answer(media, intake)  # what was kept: a span the time bounds refused is counted refused

    return router
