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

import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import msgspec
import polars as pl

from flywheel.bus import Record, RecordBatch
from flywheel.contract import MAX_EVENT_BYTES, SUPPORTED_SCHEMA_VERSIONS, Event, EventType, InvalidEvent
from ingest.compact_json import compact_json_encoder

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

# The properties column holds `json.dumps(properties, separators=(",", ":"))`.
_encode_properties = compact_json_encoder()


def properties_json(properties: dict[str, Any]) -> str:
    return _encode_properties(properties)


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
    return _lake_row(e, e.type, record)


def event_row(e: Event, record: Record) -> LakeRow:
    """The lake row of an event validated by pydantic."""
    return _lake_row(e, e.type.value, record)


def _lake_row(e: _Envelope | Event, type_: str, record: Record) -> LakeRow:
    return (
        e.event_id,
        type_,
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


# ---------------------------------------------------------------- whole batches, column-wise

# The plain form of a time, the only one the batch path parses (in polars, vectorised): UTC, "Z",
# at most microseconds. Anything else (offsets, other spellings) is judged by pydantic per record.
_PLAIN_TIME = r"^\d{4}-\d\d-\d\dT([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,6})?Z$"
_PlainTime = Annotated[str, msgspec.Meta(pattern=_PLAIN_TIME)]
# Properties whose JSON text is already what `properties_json` writes: a flat object of printable
# ASCII strings (nothing json.dumps escapes), integers, booleans and nulls, no spaces. These are
# stored as they came; anything else is parsed and written back by `properties_json`.
_JSON_STR = r'"[ !#-\[\]-~]*"'
_CANONICAL_PROPERTIES = rf"^\{{(?:{_JSON_STR}:(?:{_JSON_STR}|-?(?:0|[1-9]\d*)|true|false|null)(?:,|\}}$))*\}}?$"
_FAST_TYPE_LITERAL = Literal[tuple(sorted(_FAST_TYPES))]  # type: ignore[valid-type]  # built at import time


class _PlainEnvelope(msgspec.Struct, forbid_unknown_fields=True):
    event_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    type: _FAST_TYPE_LITERAL  # type: ignore[valid-type]  # a Literal built from _FAST_TYPES
    generation_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    user_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ts: _PlainTime
    received_at: _PlainTime
    schema_version: Literal[tuple(sorted(SUPPORTED_SCHEMA_VERSIONS))] = 1  # type: ignore[valid-type]
    session_id: Annotated[str, msgspec.Meta(max_length=256)] = ""
    source: Annotated[str, msgspec.Meta(max_length=128)] = "native"
    properties: msgspec.Raw = msgspec.Raw(b"{}")


_PLAIN_DECODER = msgspec.json.Decoder(_PlainEnvelope)
_PROPERTIES_DECODER = msgspec.json.Decoder(dict[str, Any])


def validate_batch(batch: RecordBatch) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """Valid records as lake rows (`lake_sink.EVENTS_SCHEMA`, plus `_i`, the record's index, ascending),
    and refused records as (index, the contract's reason).

    Each value is decoded once by msgspec into `_PlainEnvelope` (strict types, lengths, literal type and
    version, plain UTC times); columns are then built and checked in polars. A record the plain path does
    not take goes to `Event.from_bytes`, which accepts it with the same row or refuses it with today's reason.
    """
    from ingest.lake_sink import EVENTS_SCHEMA

    values = batch.values
    decode = _PLAIN_DECODER.decode
    plain: list[_PlainEnvelope] = []
    plain_i: list[int] = []
    slow: list[int] = []
    for i, raw in enumerate(values):
        if len(raw) > MAX_EVENT_BYTES:
            slow.append(i)
            continue
        try:
            plain.append(decode(raw))
            plain_i.append(i)
        except msgspec.DecodeError:
            slow.append(i)

    frames: list[pl.DataFrame] = []
    if plain:
        time_format = "%Y-%m-%dT%H:%M:%S%.fZ"
        topics, partitions, offsets = batch.topics, batch.partitions, batch.offsets
        df = pl.DataFrame(
            {
                "event_id": [e.event_id for e in plain],
                "type": [e.type for e in plain],
                "schema_version": [e.schema_version for e in plain],
                "generation_id": [e.generation_id for e in plain],
                "user_id": [e.user_id for e in plain],
                "session_id": [e.session_id for e in plain],
                "ts": [e.ts for e in plain],
                "received_at": [e.received_at for e in plain],
                "source": [e.source for e in plain],
                "properties": pl.Series([bytes(e.properties) for e in plain], dtype=pl.Binary),
                "kafka_topic": [topics[i] for i in plain_i],
                "kafka_partition": [partitions[i] for i in plain_i],
                "kafka_offset": [offsets[i] for i in plain_i],
                "_i": plain_i,
            },
        ).with_columns(
            pl.col("ts", "received_at").str.to_datetime(time_format, time_unit="us", time_zone="UTC", strict=False),
            # Valid UTF-8 already (msgspec checked the whole document).
            pl.col("properties").cast(pl.String),
        )
        # A time that matched the pattern yet is no date (February 30th): pydantic says why.
        bad_time = df.filter(pl.col("ts").is_null() | pl.col("received_at").is_null())
        if bad_time.height:
            slow.extend(bad_time["_i"].to_list())
            df = df.filter(pl.col("ts").is_not_null() & pl.col("received_at").is_not_null())
        canonical = df["properties"].str.contains(_CANONICAL_PROPERTIES)
        if not canonical.all():
            rewritten: list[str | None] = []
            for text, ok in zip(df["properties"].to_list(), canonical.to_list(), strict=True):
                if ok:
                    rewritten.append(text)
                    continue
                try:
                    rewritten.append(properties_json(_PROPERTIES_DECODER.decode(text)))
                except msgspec.DecodeError:  # not an object: pydantic says why
                    rewritten.append(None)
            df = df.with_columns(pl.Series("properties", rewritten, dtype=pl.String))
            gone = df.filter(pl.col("properties").is_null())
            if gone.height:
                slow.extend(gone["_i"].to_list())
                df = df.filter(pl.col("properties").is_not_null())
        frames.append(df.cast({**EVENTS_SCHEMA, "_i": pl.Int64}))  # type: ignore[dict-item]

    refused: list[tuple[int, str]] = []
    if slow:
        slow.sort()
        rows: list[tuple[object, ...]] = []
        for i in slow:
            record = Record(batch.topics[i], batch.partitions[i], batch.offsets[i], None, values[i], 0)
            try:
                rows.append((*event_row(Event.from_bytes(values[i]), record), i))
            except InvalidEvent as exc:
                refused.append((i, str(exc)))
        if rows:
            from ingest.lake_sink import rows_frame

            idx = pl.Series("_i", [r[-1] for r in rows], dtype=pl.Int64)
            frames.append(rows_frame([r[:-1] for r in rows]).with_columns(idx))
    if not frames:
        return pl.DataFrame(schema={**EVENTS_SCHEMA, "_i": pl.Int64}), refused
    valid = frames[0] if len(frames) == 1 else pl.concat(frames).sort("_i")
    return valid, refused
