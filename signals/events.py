"""The two inputs a reward definition reads: the generation and its feedback events.

Both the streaming worker (from Kafka `Event`s) and the batch recompute (from lake
rows) build these same small values, so the reward code sees identical inputs on
both paths. Times are integer microseconds since the epoch: the lake stores
microseconds, and integers keep stream and batch arithmetic bit-identical.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from flywheel.contract import LATEST_TIME, Event, EventType, InvalidEvent
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


def decode_event(raw: bytes | None, window_us: int) -> Event | None:
    """The event in a record's value, or None for one that carries no signal: a tombstone, bytes that fail
    the contract, or an event so close to the end of time that its reward window (`window_us`) would end
    past it (its record's `window_end` could not be written). Never raises over what a record holds."""
    try:
        event = Event.from_bytes(raw)
    except InvalidEvent:
        return None
    except Exception:  # noqa: BLE001 - a record that breaks the decoder must not stop the stream
        log.warning("skipping an event that could not be decoded", exc_info=True)
        return None
    if to_us(event.ts) + window_us > _LATEST_US:
        return None
    return event


def properties_bytes(properties: Mapping[str, Any]) -> int:
    """The size of `properties` as compact JSON (what a generation's state holds of a feedback event).

    >>> properties_bytes({"text": "hi"})
    13
    """
    return len(json.dumps(properties, separators=(",", ":"), ensure_ascii=False, default=str).encode())


@dataclass(frozen=True, slots=True)
class FeedbackEvent:
    """One feedback event about a generation (any type but `generation`)."""

    event_id: str
    type: str
    ts_us: int
    properties: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_event(cls, e: Event) -> FeedbackEvent:
        return cls(e.event_id, str(e.type), to_us(e.ts), dict(e.properties))

    def to_json(self) -> list[Any]:
        return [self.event_id, self.type, self.ts_us, dict(self.properties)]

    @classmethod
    def from_json(cls, raw: list[Any]) -> FeedbackEvent:
        return cls(raw[0], raw[1], int(raw[2]), raw[3])


@dataclass(frozen=True, slots=True)
class GenerationInfo:
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
    def from_properties(
        cls, generation_id: str, ts_us: int, user_id: str, props: Mapping[str, Any]
    ) -> GenerationInfo:
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
