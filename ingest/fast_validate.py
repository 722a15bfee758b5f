"""Validate a batch of event envelopes from Kafka fast, with pydantic as the judge of anything unusual.

The worker turns each valid record into one lake row (`LakeRow`, in `EVENTS_SCHEMA`
order). Full pydantic validation (`Event.from_bytes`) costs ~60 us an event; most
events are ordinary, so this module first decodes each one with a msgspec struct that
accepts only the plain, unambiguous form of the envelope (every field present and of
its exact JSON type, RFC 3339 times with at most microseconds, a known type and
version, lengths within the contract). Whatever that fast path does not accept goes
to `Event.from_bytes`, which either accepts it or refuses it with today's reason. So
the fast path never refuses anything itself, and the row it builds is the one pydantic
would have built (tests/test_ingest_fast_validate.py checks both on edge cases).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import msgspec

from flywheel.bus import Record
from flywheel.contract import MAX_EVENT_BYTES, SUPPORTED_SCHEMA_VERSIONS, Event, EventType, InvalidEvent

# (event_id, type, schema_version, generation_id, user_id, session_id, ts, received_at (both as
#  microseconds since the epoch, UTC), source,
#  properties as JSON, kafka_topic, kafka_partition, kafka_offset): the order of EVENTS_SCHEMA.
LakeRow = tuple[str, str, int, str, str, str, int, int, str, str, str, int, int]

# `generation` events also need their GenerationRecord checked: pydantic does that.
_FAST_TYPES = frozenset(t.value for t in EventType) - {EventType.GENERATION.value}

# msgspec parses RFC 3339 times in C and accepts a subset of what pydantic accepts, to the same
# instant, except that it rounds fractions longer than microseconds where pydantic truncates:
# a body with such a time anywhere takes the pydantic path.
_LONG_FRACTION = re.compile(rb":\d\d\.\d{7}")

# The properties column holds `json.dumps(properties, separators=(",", ":"))`. json.dumps (and
# JSONEncoder.encode) build a new C encoder on every call, most of the cost for small dicts:
# build the very encoder `encode` would build, once. Same output; pure Python where the C
# accelerator is missing.
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_C_ENCODER = (
    json.encoder.c_make_encoder(
        None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
    )
    if json.encoder.c_make_encoder is not None
    else None
)


def properties_json(properties: dict[str, Any]) -> str:
    if _C_ENCODER is None:
        return _ENCODER.encode(properties)
    return "".join(_C_ENCODER(properties, 0))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def epoch_us(value: datetime) -> int:
    """Microseconds since the epoch (naive means UTC): polars builds a Datetime column from ints far faster."""
    return ((value if value.tzinfo else value.replace(tzinfo=UTC)) - _EPOCH) // _MICROSECOND


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    # Required here even where the contract has a default (event_id, ts, received_at):
    # a missing one takes the pydantic path, which fills it exactly as today.
    event_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    type: str
    generation_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    user_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ts: datetime
    received_at: datetime
    schema_version: int = 1
    session_id: Annotated[str, msgspec.Meta(max_length=256)] = ""
    source: Annotated[str, msgspec.Meta(max_length=128)] = "native"
    properties: dict[str, Any] = msgspec.field(default_factory=dict)


_DECODER = msgspec.json.Decoder(_Envelope)


def _fast_row(raw: bytes, record: Record) -> LakeRow | None:
    if len(raw) > MAX_EVENT_BYTES or _LONG_FRACTION.search(raw) is not None:
        return None
    try:
        e = _DECODER.decode(raw)
    except msgspec.DecodeError:
        return None
    if e.type not in _FAST_TYPES or e.schema_version not in SUPPORTED_SCHEMA_VERSIONS:
        return None
    return (
        e.event_id,
        e.type,
        e.schema_version,
        e.generation_id,
        e.user_id,
        e.session_id,
        epoch_us(e.ts),
        epoch_us(e.received_at),
        e.source,
        properties_json(e.properties),
        record.topic,
        record.partition,
        record.offset,
    )


def event_row(e: Event, record: Record) -> LakeRow:
    """The lake row of an event validated by pydantic."""
    return (
        e.event_id,
        e.type.value,
        e.schema_version,
        e.generation_id,
        e.user_id,
        e.session_id,
        epoch_us(e.ts),
        epoch_us(e.received_at),
        e.source,
        properties_json(e.properties),
        record.topic,
        record.partition,
        record.offset,
    )


def validate_records(records: Sequence[Record]) -> tuple[list[tuple[Record, LakeRow]], list[tuple[Record, str]]]:
    """Valid records with their lake rows, and refused records with the contract's reason, in input order."""
    valid: list[tuple[Record, LakeRow]] = []
    refused: list[tuple[Record, str]] = []
    for record in records:
        row = _fast_row(record.value, record)
        if row is None:
            try:
                row = event_row(Event.from_bytes(record.value), record)
            except InvalidEvent as exc:
                refused.append((record, str(exc)))
                continue
        valid.append((record, row))
    return valid, refused
