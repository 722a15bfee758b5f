"""The two inputs a reward definition reads: the generation and its feedback events.

Both the streaming worker (from Kafka `Event`s) and the batch recompute (from lake
rows) build these same small values, so the reward code sees identical inputs on
both paths. Times are integer microseconds since the epoch: the lake stores
microseconds, and integers keep stream and batch arithmetic bit-identical.

They are frozen msgspec Structs rather than frozen dataclasses: a frozen dataclass sets each field through
`object.__setattr__`, about 3.5 µs an instance against 0.2 µs, and the streaming worker makes several a
polled event (bench/signals_stream_throughput.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import polars as pl

from flywheel.bus import RecordBatch
from flywheel.contract import LATEST_TIME, Event, EventType
from flywheel.fast_validate import validate_guarded
from flywheel.reward_versions import DEFAULT_SURFACE, surface_of

log = logging.getLogger(__name__)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_us(ts: datetime) -> int:
    """Microseconds since the epoch (exact; no float rounding)."""
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    delta = ts - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_us(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


_LATEST_US = to_us(LATEST_TIME)


class StreamEvent(msgspec.Struct, frozen=True, gc=False):
    """One event of a polled batch as the streaming worker reads it: the lake row's values (times in
    microseconds, properties decoded) and `index`, its record's position in the batch (for dead letters)."""

    event_id: str
    type: str
    generation_id: str
    user_id: str
    ts_us: int
    received_us: int
    properties: dict[str, Any]
    properties_chars: int
    partition: int
    index: int


_PROPERTIES_LIST = msgspec.json.Decoder(list[dict[str, Any]])


def decode_batch(
    batch: RecordBatch, window_us: int, refused: list[tuple[int, str]] | None = None
) -> tuple[list[StreamEvent], int]:
    """The events of a polled batch, in (partition, offset) order, and how many records carry no signal: a
    tombstone, bytes that fail the contract, or an event so close to the end of time that its reward window
    (`window_us`) would end past it (its record's `window_end` could not be written). Never raises over what a
    record holds. `refused`, when given, gets each record the contract refuses: (its index, the reason).

    Decoded column-wise by the contract's own batch validator behind the guard every consumer of the topic uses
    (`flywheel.fast_validate.validate_guarded`, ingest's), so an event is taken here exactly when ingest writes
    it to the lake, with the properties the lake holds (the batch recompute's input), and the per-event cost is
    a few polars columns rather than a pydantic model.
    """
    valid, refusals = validate_guarded(batch)
    if refused is not None:
        refused.extend(refusals)
    valid = (
        valid.select(
            "event_id", "type", "generation_id", "user_id",
            pl.col("ts").dt.epoch("us").alias("ts_us"), pl.col("received_at").dt.epoch("us").alias("received_us"),
            "properties", "kafka_partition", "kafka_offset", "_i",
        )
        .filter(pl.col("ts_us") <= _LATEST_US - window_us)
        .sort("kafka_partition", "kafka_offset", maintain_order=True)
    )  # fmt: skip
    skipped = len(batch) - valid.height
    if not valid.height:
        return [], skipped
    texts = valid["properties"]
    # The lake's compact JSON objects, so one array of them decodes in one call.
    properties = _PROPERTIES_LIST.decode(("[" + texts.str.join(",").item() + "]").encode())
    columns = valid.select("event_id", "type", "generation_id", "user_id", "ts_us", "received_us").get_columns()
    rest = texts.str.len_chars(), valid.get_column("kafka_partition"), valid.get_column("_i")
    events = list(map(StreamEvent, *(c.to_list() for c in columns), properties, *(c.to_list() for c in rest)))
    return events, skipped


def properties_bytes(properties: Mapping[str, Any]) -> int:
    """The size of `properties` as compact JSON (what a generation's state holds of a feedback event).

    >>> properties_bytes({"text": "hi"})
    13
    """
    return len(json.dumps(properties, separators=(",", ":"), ensure_ascii=False, default=str).encode())


class FeedbackEvent(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One feedback event about a generation (any type but `generation`). msgspec writes and reads it as the
    array `to_json` gives (`array_like`): a generation's state in Redis holds its events so."""

    event_id: str
    type: str
    ts_us: int
    properties: Mapping[str, Any] = msgspec.field(default_factory=dict)

    @classmethod
    def from_event(cls, e: Event) -> FeedbackEvent:
        return cls(e.event_id, str(e.type), to_us(e.ts), dict(e.properties))

    def to_json(self) -> list[Any]:
        return [self.event_id, self.type, self.ts_us, dict(self.properties)]

    @classmethod
    def from_json(cls, raw: list[Any]) -> FeedbackEvent:
        return cls(raw[0], raw[1], int(raw[2]), raw[3])


class GenerationInfo(msgspec.Struct, frozen=True, gc=False):
    """What a reward needs to know about the generation itself (from its `generation` event)."""

    generation_id: str
    ts_us: int
    user_id: str = ""
    model_version: str = ""
    arm: str = ""
    experiment: str = ""
    finish_reason: str = "stop"
    completion_chars: int = 0
    surface: str = DEFAULT_SURFACE

    @property
    def declined(self) -> bool:
        """The policy chose not to suggest anything (an empty completion)."""
        return self.finish_reason == "declined" or self.completion_chars == 0

    @classmethod
    def from_event(cls, e: Event) -> GenerationInfo:
        if e.type != EventType.GENERATION:
            raise ValueError(f"event {e.event_id} is {e.type}, not a generation")
        return cls.from_properties(e.generation_id, to_us(e.ts), e.user_id, e.properties)

    @classmethod
    def from_properties(cls, generation_id: str, ts_us: int, user_id: str, props: Mapping[str, Any]) -> GenerationInfo:
        return cls(
            generation_id=generation_id,
            ts_us=ts_us,
            user_id=user_id,
            model_version=str(props.get("model_version", "")),
            arm=str(props.get("arm", "")),
            experiment=str(props.get("experiment", "")),
            finish_reason=str(props.get("finish_reason", "stop")),
            completion_chars=len(str(props.get("completion", ""))),
            surface=surface_of(props.get("surface")),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "generation_id": self.generation_id,
            "ts_us": self.ts_us,
            "user_id": self.user_id,
            "model_version": self.model_version,
            "arm": self.arm,
            "experiment": self.experiment,
            "finish_reason": self.finish_reason,
            "completion_chars": self.completion_chars,
            "surface": self.surface,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> GenerationInfo:
        return cls(**raw)


def parse_properties(raw: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Lake rows hold properties as a JSON string; the stream holds a dict."""
    if raw is None:
        return {}
    if isinstance(raw, str):
        return dict(json.loads(raw)) if raw else {}
    return dict(raw)
