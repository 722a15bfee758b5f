"""Validate a batch of event envelopes from Kafka fast, with pydantic as the judge of anything unusual.

The ingest worker turns each valid record into one lake row (`flywheel.lake.tables.EVENTS`); the signals
worker decodes its polls with it too, so both take exactly the same events, with the same properties. Full
pydantic validation (`Event.from_bytes`) costs ~60 us an event; most events are
ordinary, so `validate_batch` first decodes each one with a msgspec struct that accepts
only the plain, unambiguous form of the envelope (every field present and of its exact
JSON type, a known type and version, lengths within the contract), then checks the rest
column-wise in polars (times in plain UTC RFC 3339 with at most microseconds, properties
already in the lake's JSON spelling), and each type's properties against the contract's table
(flywheel/event_properties.py: one msgspec decode per type of the whole batch's properties, into a
struct derived from the table; a text it does not take is judged by the contract's own check, and
refused ones go on to pydantic for the reason; `generation` events' properties likewise, into a struct of
`GenerationRecord`'s names, so serving's generations no longer go to pydantic one by one). Whatever that plain
path does not take goes to
`Event.from_bytes`, which either accepts it or refuses it with today's reason. So the
plain path never refuses anything itself, and the row it builds is the one pydantic would
have built (tests/test_ingest_fast_validate.py checks both on edge cases).

Nothing a record holds makes `validate_batch` raise: a tombstone (no value), invalid UTF-8, JSON nested past
any parser's depth, NaN, times outside the lake's range all come out as refusals with a reason.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import msgspec
import polars as pl
import pyarrow as pa

from flywheel.bus import Record, RecordBatch
from flywheel.compact_json import compact_json_encoder
from flywheel.contract import (
    MAX_EVENT_BYTES,
    MAX_PROPERTIES_DEPTH,
    SUPPORTED_SCHEMA_VERSIONS,
    Event,
    EventType,
    GenerationRecord,
    InvalidEvent,
    check_properties,
    token_fields_problem,
)
from flywheel.event_properties import (
    ARMS,
    FEEDBACK_PROPERTIES,
    FINISH_REASONS,
    Prop,
    normalised,
    properties_of,
    property_problems,
)
from flywheel.lake.tables import EVENTS, rows_frame

log = logging.getLogger(__name__)

# (event_id, type, schema_version, generation_id, user_id, session_id, ts, received_at (both as
#  microseconds since the epoch, UTC), source,
#  properties as JSON, kafka_topic, kafka_partition, kafka_offset): the order of EVENTS.schema.
LakeRow = tuple[str, str, int, str, str, str, int, int, str, str, str, int, int]

_FAST_TYPES = frozenset(t.value for t in EventType)

# The properties column holds `json.dumps(properties, separators=(",", ":"))`.
_encode_properties = compact_json_encoder()


def properties_json(properties: dict[str, Any]) -> str:
    return _encode_properties(properties)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def epoch_us(value: datetime) -> int:
    """Microseconds since the epoch (naive means UTC): polars builds a Datetime column from ints far faster."""
    return ((value if value.tzinfo else value.replace(tzinfo=UTC)) - _EPOCH) // _MICROSECOND


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


# ---------------------------------------------------------------- whole batches, column-wise

# The plain form of a time, the only one the batch path parses (vectorised): UTC, "Z", at most
# microseconds, years 0001-9999 (Python's). Anything else (offsets, other spellings) is judged by pydantic per record.
_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_PLAIN_TIME = "^" + _YEAR + r"-[0-9]{2}-[0-9]{2}T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?Z$"
_TIME_FORMAT = "%+"  # RFC 3339; `_PLAIN_TIME` already held it to "Z" and at most microseconds
# Properties whose JSON text is already what `properties_json` writes: a flat object of printable
# ASCII strings (nothing json.dumps escapes), integers (not -0, which reads as 0), booleans and nulls,
# no spaces, no key twice (checked apart: `_repeat_a_key`). These are stored as they came; anything
# else is parsed and written back by `properties_json`. An integer of 19 digits or more may be past 64 bits
# (`contract.MAX_INTEGER`): it takes the other path, where the contract's check judges it.
_JSON_STR = r'"[ !#-\[\]-~]*"'
_CANONICAL_PROPERTIES = rf"^\{{(?:{_JSON_STR}:(?:{_JSON_STR}|0|-?[1-9]\d{{0,17}}|true|false|null)(?:,|\}}$))*\}}?$"
# A run of digits that may be an integer past 64 bits (or inside a string: the check then finds nothing).
_LONG_DIGITS = re.compile(r"\d{19}")
_FAST_TYPE_LITERAL = Literal[tuple(sorted(_FAST_TYPES))]  # type: ignore[valid-type]  # built at import time


class _PlainEnvelope(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    event_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    type: _FAST_TYPE_LITERAL  # type: ignore[valid-type]  # a Literal built from _FAST_TYPES
    generation_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    user_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    # Strings here; their form is checked column-wise (`_PLAIN_TIME`), far cheaper than a msgspec pattern.
    ts: Annotated[str, msgspec.Meta(max_length=32)]
    received_at: Annotated[str, msgspec.Meta(max_length=32)]
    schema_version: Literal[tuple(sorted(SUPPORTED_SCHEMA_VERSIONS))] = 1  # type: ignore[valid-type]
    session_id: Annotated[str, msgspec.Meta(max_length=256)] = ""
    source: Annotated[str, msgspec.Meta(max_length=128)] = "native"
    properties: msgspec.Raw = msgspec.Raw(b"{}")


_PLAIN_DECODER = msgspec.json.Decoder(_PlainEnvelope)
# What msgspec raises for bytes it cannot take: bad JSON (DecodeError, a ValueError), invalid UTF-8 inside a
# string (UnicodeDecodeError, also a ValueError) and nesting past its depth limit (RecursionError).
_UNDECODABLE = (ValueError, RecursionError)
_PLAIN_LIST_DECODER = msgspec.json.Decoder(list[_PlainEnvelope])


def _decode_plain(values: list[bytes]) -> tuple[list[_PlainEnvelope], list[int]]:
    """The values that take the plain path, decoded, and the indices of those that do not.

    Usually every value does: the whole batch is then decoded as one JSON array, which saves a Python
    step per record. That is safe because the array has exactly one element per value only if each value
    is one JSON object: a value holding two would add an element, and one holding none (empty, blanks)
    would leave two commas in a row, which is no JSON. Otherwise, record by record.
    """
    # A tombstone (no value) never takes the plain path, nor lets the batch be decoded as one array.
    if values and None not in values and max(map(len, values)) <= MAX_EVENT_BYTES:
        try:
            # One copy of the batch: the brackets ride on the first and last values.
            framed = list(values)
            framed[0] = b"[" + framed[0]
            framed[-1] = framed[-1] + b"]"
            plain = _PLAIN_LIST_DECODER.decode(b",".join(framed))
            if len(plain) == len(values):
                return plain, []
        except _UNDECODABLE:
            pass
    decode = _PLAIN_DECODER.decode
    plain = []
    slow: list[int] = []
    for i, raw in enumerate(values):
        try:
            if raw is not None and len(raw) <= MAX_EVENT_BYTES:
                plain.append(decode(raw))
                continue
        except _UNDECODABLE:
            pass
        slow.append(i)
    return plain, slow


_ARROW_UTC_US = pa.timestamp("us", tz="UTC")


def _plain_times(texts: pl.Series) -> pl.Series:
    """`texts` as UTC times where they are in the plain form (`_PLAIN_TIME`); null elsewhere, and for a plain
    form that names no date (February 30th): pydantic says why.

    A column all in the plain form, the usual one, goes through Arrow's ISO 8601 cast: measured on 10k event
    times, 0.03 us a value against 0.28 for polars' `str.to_datetime`. That cast refuses the whole column over
    one impossible date; polars then parses it value by value.
    """
    plain = texts.str.contains(_PLAIN_TIME)
    if plain.all():
        try:
            return pl.Series(texts.name, texts.to_arrow(compat_level=pl.CompatLevel.oldest()).cast(_ARROW_UTC_US))
        except pa.ArrowInvalid:
            pass
    # No parse cache: times are nearly all distinct, and the cache cost a sixth of the parse.
    parsed = texts.str.to_datetime(_TIME_FORMAT, time_unit="us", time_zone="UTC", strict=False, cache=False)
    return pl.select(pl.when(plain).then(parsed)).to_series().alias(texts.name)


_PROPERTIES_DECODER = msgspec.json.Decoder(dict[str, Any])


def _repeat_a_key(canonical_texts: pl.Series) -> pl.Series:
    """Whether each canonical properties text names a key twice: pydantic keeps the last value, so the text is
    not what it would store. Only objects of two keys or more are looked into (a string holds no quote, so
    the count of '":' is the count of keys)."""
    keys = canonical_texts.str.count_matches('":', literal=True)
    several = keys > 1
    repeated = pl.repeat(False, canonical_texts.len(), eager=True)
    if several.any():
        # The decoded dict has fewer entries than the text has keys: measured 0.17 us an event of three keys,
        # against 0.28 for polars' extract_all of the keys and n_unique.
        decode = _PROPERTIES_DECODER.decode
        distinct = pl.Series([len(decode(text)) for text in canonical_texts.filter(several).to_list()])
        repeated = repeated.scatter(several.arg_true(), distinct < keys.filter(several))
    return repeated


def _property_struct(event_type: str) -> type[msgspec.Struct]:
    """A msgspec struct that takes exactly the properties of `event_type` the contract accepts, less what it
    cannot say (names it does not know, which may still be fine; numbers past 64 bits): those go to
    `property_problems`, the contract's own check. So the struct never takes what the contract refuses."""
    fields: list[tuple[str, Any, Any] | tuple[str, Any]] = []
    for name, prop in properties_of(event_type).items():
        kind = _struct_type(prop)
        fields.append((name, kind) if prop.required else (name, kind | None, None))
    fields.sort(key=len)  # msgspec: required fields first
    return msgspec.defstruct(f"{event_type}_properties", fields, forbid_unknown_fields=True, gc=False)


def _struct_type(prop: Prop) -> Any:
    if prop.choices:
        return Literal[prop.choices]  # type: ignore[valid-type]  # built from the contract's table
    base: Any = {"string": str, "integer": int, "number": float, "boolean": bool}[prop.kind]
    if prop.max_length is not None:
        return Annotated[base, msgspec.Meta(max_length=prop.max_length)]
    if prop.minimum is not None or prop.maximum is not None:
        return Annotated[base, msgspec.Meta(ge=prop.minimum, le=prop.maximum)]
    return base


class _GenerationProperties(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """A `generation` event's properties in the form `Event` stores exactly as sent: only `GenerationRecord`'s
    names, each of its exact JSON type, `arm` and `finish_reason` already the contract's values (no mapping by
    `generation_properties`), no `null` but for the three token fields. Anything else (a product's own names,
    another API's finish reason, a number where text belongs) goes to pydantic, which maps it or says why not.
    What `GenerationRecord` asks of the token fields together is checked on the decoded struct
    (`contract.token_fields_problem`, its own check)."""

    prompt: str
    completion: str
    model_version: str
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    behaviour_logprobs: list[float] | None = None
    experiment: str = ""
    arm: Literal[ARMS] = "champion"  # type: ignore[valid-type]  # the contract's tuple
    product_arm: Annotated[str, msgspec.Meta(max_length=128)] = ""
    # pydantic's `$` is the end of the text; Python's also matches before a final newline, hence `\Z`.
    surface: Annotated[str, msgspec.Meta(pattern=r"\A(?:[a-z0-9][a-z0-9._-]{0,63})?\Z")] = ""
    latency_ms: float = 0.0
    finish_reason: Literal[FINISH_REASONS] = "stop"  # type: ignore[valid-type]  # the contract's tuple
    provider_finish_reason: Annotated[str, msgspec.Meta(max_length=64)] = ""
    temperature: float = 1.0
    signature: Annotated[str, msgspec.Meta(max_length=128)] = ""


assert set(_GenerationProperties.__struct_fields__) == set(GenerationRecord.model_fields), "keep them in step"


def _misaligned(props: Any) -> bool:
    return token_fields_problem(props) is not None


def _more_taken_than_shown(props: Any) -> bool:
    taken, total = props.accepted_chars, props.total_chars
    return taken is not None and total is not None and taken > total


_GENERATION = EventType.GENERATION.value
_STRUCTS: dict[str, type[msgspec.Struct]] = {
    **{t: _property_struct(t) for t in FEEDBACK_PROPERTIES},
    _GENERATION: _GenerationProperties,
}
_PROPERTY_DECODERS = {
    t: (msgspec.json.Decoder(list[s]), msgspec.json.Decoder(s))  # type: ignore[valid-type]  # built at import time
    for t, s in _STRUCTS.items()
}
# What a type's struct cannot say: relations between its properties.
_CROSS_CHECKS = {"accepted": _more_taken_than_shown, _GENERATION: _misaligned}
# An empty object fits every type without a required property.
_EMPTY_FITS = frozenset(t for t, spec in FEEDBACK_PROPERTIES.items() if not any(p.required for p in spec.values()))


def _property_misfits(frame: pl.DataFrame) -> list[int]:
    """The `_i` of rows whose properties (compact JSON) the contract refuses for their type (pydantic then
    says why). Each type's texts are decoded at once into its struct; a type with a text the struct does
    not take is looked at text by text, and a text no struct takes is judged by `property_problems`."""
    misfits: list[int] = []
    for (event_type,), group in frame.select("type", "properties", "_i").partition_by("type", as_dict=True).items():
        texts = group["properties"]
        if event_type in _EMPTY_FITS and (texts == "{}").all():
            continue
        many, one = _PROPERTY_DECODERS[str(event_type)]
        try:
            decoded = many.decode(("[" + texts.str.join(",").item() + "]").encode())
            checked = None
        except _UNDECODABLE:
            decoded, checked = [], []
            for text in texts.to_list():
                try:
                    decoded.append(one.decode(text))
                    checked.append(True)
                except _UNDECODABLE:
                    decoded.append(None)
                    if event_type == _GENERATION:  # pydantic maps it (an alias, a product's arm) or refuses it
                        checked.append(False)
                        continue
                    props = _PROPERTIES_DECODER.decode(text)
                    # One that is stored otherwise than sent (`normalised`: a text cut, an alias) goes to pydantic too.
                    checked.append(
                        not property_problems(str(event_type), props) and normalised(str(event_type), props) is None
                    )
        rows = group["_i"].to_list()
        cross = _CROSS_CHECKS.get(str(event_type))
        for k, props in enumerate(decoded):
            if props is None:
                if checked is not None and not checked[k]:
                    misfits.append(rows[k])
            elif cross is not None and cross(props):
                misfits.append(rows[k])
    return misfits


def _is_utf8(text: bytes) -> bool:
    try:
        text.decode()
    except UnicodeDecodeError:
        return False
    return True


def validate_batch(batch: RecordBatch) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """Valid records as lake rows (`flywheel.lake.tables.EVENTS`, plus `_i`, the record's index, ascending),
    and refused records as (index, the contract's reason).

    Each value is decoded once by msgspec into `_PlainEnvelope` (strict types, lengths, literal type and
    version); columns are then built and checked in polars (plain UTC times, canonical properties). A record
    the plain path does not take goes to `Event.from_bytes`, which accepts it with the same row or refuses it
    with today's reason.
    """
    values = batch.values
    plain, slow = _decode_plain(values)

    frames: list[pl.DataFrame] = []
    properties = [bytes(e.properties) for e in plain]
    # msgspec checks the UTF-8 of what it decodes, not of a Raw: properties that are not UTF-8 go to pydantic.
    not_utf8 = [k for k, text in enumerate(properties) if not text.isascii() and not _is_utf8(text)]
    if not_utf8:
        taken = set(slow)
        plain_i = [i for i in range(len(values)) if i not in taken]
        slow.extend(plain_i[k] for k in not_utf8)
        drop = set(not_utf8)
        plain = [e for k, e in enumerate(plain) if k not in drop]
        properties = [text for k, text in enumerate(properties) if k not in drop]
    if plain:
        topics, partitions, offsets = batch.topics, batch.partitions, batch.offsets
        plain_i = list(range(len(values)))
        if slow:  # rare: keep the records that took the plain path
            skip = set(slow)
            plain_i = [i for i in plain_i if i not in skip]
            topics = [topics[i] for i in plain_i]
            partitions = [partitions[i] for i in plain_i]
            offsets = [offsets[i] for i in plain_i]
        df = pl.DataFrame(
            {
                "event_id": [e.event_id for e in plain],
                "type": [e.type for e in plain],
                "schema_version": pl.Series([e.schema_version for e in plain], dtype=pl.Int32),
                "generation_id": [e.generation_id for e in plain],
                "user_id": [e.user_id for e in plain],
                "session_id": [e.session_id for e in plain],
                "ts": [e.ts for e in plain],
                "received_at": [e.received_at for e in plain],
                "source": [e.source for e in plain],
                "properties": pl.Series(properties, dtype=pl.Binary),
                "kafka_topic": topics,
                "kafka_partition": pl.Series(partitions, dtype=pl.Int32),
                "kafka_offset": pl.Series(offsets, dtype=pl.Int64),
                "_i": pl.Series(plain_i, dtype=pl.Int64),
            },
        )
        df = df.with_columns(
            _plain_times(df["ts"]),
            _plain_times(df["received_at"]),
            pl.col("properties").cast(pl.String),  # checked UTF-8 above
        )
        bad_time = pl.col("ts").is_null() | pl.col("received_at").is_null()
        if df.select(bad_time.any()).item():
            slow.extend(df.filter(bad_time)["_i"].to_list())
            df = df.filter(~bad_time)
        canonical = df["properties"].str.contains(_CANONICAL_PROPERTIES)
        canonical = canonical & ~_repeat_a_key(df["properties"].set(~canonical, "{}"))
        if not canonical.all():
            rewritten: list[str | None] = []
            generation = (df["type"] == _GENERATION).to_list()
            for text, ok, gen in zip(df["properties"].to_list(), canonical.to_list(), generation, strict=True):
                if ok:
                    rewritten.append(text)
                    continue
                try:
                    decoded = _PROPERTIES_DECODER.decode(text)
                    # msgspec takes no NaN, Infinity or lone surrogate; only the depth is left to check, and a
                    # text with fewer brackets than the limit cannot be deeper than it. A generation's is checked
                    # by its struct (`_property_misfits`: two levels), and a prompt of code holds many brackets.
                    if (not gen and text.count("[") + text.count("{") > MAX_PROPERTIES_DEPTH) or _LONG_DIGITS.search(
                        text
                    ):
                        check_properties(decoded)
                    rewritten.append(properties_json(decoded))
                except _UNDECODABLE:  # not an object, or not storable: pydantic says why
                    rewritten.append(None)
            df = df.with_columns(pl.Series("properties", rewritten, dtype=pl.String))
            gone = df.filter(pl.col("properties").is_null())
            if gone.height:
                slow.extend(gone["_i"].to_list())
                df = df.filter(pl.col("properties").is_not_null())
        misfits = _property_misfits(df)
        if misfits:
            slow.extend(misfits)
            df = df.filter(~pl.col("_i").is_in(misfits))
        frames.append(df.select(*EVENTS.schema, "_i"))

    refused: list[tuple[int, str]] = []
    if slow:
        slow.sort()
        rows: list[tuple[object, ...]] = []
        for i in slow:
            record = Record(batch.topics[i], batch.partitions[i], batch.offsets[i], None, values[i] or b"", 0)
            try:
                rows.append((*event_row(Event.from_bytes(values[i]), record), i))
            except InvalidEvent as exc:
                refused.append((i, str(exc)))
            except Exception as exc:  # noqa: BLE001 - a record that breaks the validator is refused, not fatal
                refused.append((i, f"cannot be validated: {type(exc).__name__}: {exc}"))
        if rows:
            idx = pl.Series("_i", [r[-1] for r in rows], dtype=pl.Int64)
            frames.append(rows_frame([r[:-1] for r in rows]).with_columns(idx))
    if not frames:
        return pl.DataFrame(schema={**EVENTS.schema, "_i": pl.Int64}), refused
    valid = frames[0] if len(frames) == 1 else pl.concat(frames).sort("_i")
    return valid, refused


def validate_guarded(batch: RecordBatch) -> tuple[pl.DataFrame, list[tuple[int, str]]]:
    """`validate_batch`, as every consumer of the events topic calls it (ingest's worker, signals' worker): it
    refuses rather than raises; should a record still break it (a bug), each record is validated alone and the
    one that breaks it is refused with what it raised, so the batch goes on and no record stops a consumer."""
    try:
        return validate_batch(batch)
    except Exception:  # noqa: BLE001 - one record must not stop a consumer for good
        log.exception("validating a batch of %d records failed; validating them one by one", len(batch))
    frames = [pl.DataFrame(schema={**EVENTS.schema, "_i": pl.Int64})]
    refused: list[tuple[int, str]] = []
    for i in range(len(batch)):
        one = RecordBatch([batch.topics[i]], [batch.partitions[i]], [batch.offsets[i]], [batch.values[i]])
        try:
            valid, no = validate_batch(one)
        except Exception as exc:  # noqa: BLE001
            refused.append((i, f"cannot be validated: {type(exc).__name__}: {str(exc)[:500]}"))
            continue
        frames.append(valid.with_columns(pl.lit(i, dtype=pl.Int64).alias("_i")))
        refused += [(i, reason) for _, reason in no]
    return pl.concat(frames), refused
