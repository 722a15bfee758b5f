"""The contracts every component agrees on (docs/design.md, "Contracts").

Nothing else crosses a component boundary: events on Kafka and in the lake are
`Event` envelopes; serving's `generation` events carry a `GenerationRecord` in
their properties; signals emit `RewardRecord`s; serving reads a `TrafficSplit`.
"""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flywheel.event_properties import (
    ARMS,
    FEEDBACK_PROPERTIES,
    FINISH_REASON_ALIASES,
    FINISH_REASONS,
    generation_properties,
    normalised,
    properties_json_schema,
    property_problems,
)

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})
MAX_EVENT_BYTES = 256 * 1024
# Event times must be UTC instants the lake can partition (`date=YYYY-MM-DD/hour=HH`, Python's years 1-9999)
# and Arrow can hold (microseconds since the epoch in an int64: far wider). A time written with an offset can
# be inside years 1-9999 as written and outside them in UTC (`0001-01-01T00:30:00+01:00`): refused.
EARLIEST_TIME = datetime(1, 1, 1, tzinfo=UTC)
LATEST_TIME = datetime(9999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)
# Deeper properties are refused: nothing real nests this far, and every JSON reader on the way (pydantic's
# among them, at about 200) has a depth past which it gives up.
MAX_PROPERTIES_DEPTH = 64
# Integers in properties fit a signed 64-bit integer: what every reader of the lake and the topic reads as a number
# (polars, Arrow, Java and Go clients). One of thousands of digits stopped polars' JSON parse in the signals worker.
MIN_INTEGER, MAX_INTEGER = -(2**63), 2**63 - 1


class EventType(StrEnum):
    GENERATION = "generation"
    SHOWN = "shown"
    ACCEPTED = "accepted"
    REJECTED = "rejected"
    IGNORED = "ignored"
    EDITED = "edited"
    UNDONE = "undone"
    RETAINED = "retained"
    COPIED = "copied"
    REGENERATED = "regenerated"
    THUMBS = "thumbs"
    FOLLOWUP = "followup"
    SESSION_END = "session_end"


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class Event(BaseModel):
    """The event envelope. `event_id` is the idempotency key.

    >>> e = Event(type="accepted", generation_id="g1", user_id="u1", properties={"accepted_chars": 3})
    >>> Event.from_bytes(e.to_bytes()) == e
    True
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    type: EventType
    schema_version: int = SCHEMA_VERSION
    generation_id: str = Field(min_length=1, max_length=128)
    user_id: str = Field(min_length=1, max_length=256)
    session_id: str = Field(default="", max_length=256)
    ts: datetime = Field(default_factory=utcnow, description="Event time.")
    received_at: datetime = Field(default_factory=utcnow)
    source: str = Field(default="native", max_length=128)
    # Validated when absent too: a type with a required property must not pass without it.
    properties: dict[str, Any] = Field(default_factory=dict, validate_default=True)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, v: int) -> int:
        if v not in SUPPORTED_SCHEMA_VERSIONS:
            raise ValueError(f"unknown schema_version {v}; supported: {sorted(SUPPORTED_SCHEMA_VERSIONS)}")
        return v

    @field_validator("ts", "received_at")
    @classmethod
    def _aware(cls, v: datetime) -> datetime:
        return check_time(v if v.tzinfo else v.replace(tzinfo=UTC))

    @field_validator("properties")
    @classmethod
    def _storable(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        check_properties(v)
        # `type` is validated first (declared first); absent when it failed, and that is the reason given.
        event_type = info.data.get("type")
        if event_type == EventType.GENERATION:
            # Other APIs' values mapped onto the record's; what is stored is the mapped form.
            v, problems = generation_properties(v, _GENERATION_NAMES, _GENERATION_NULLABLE)
        elif event_type is not None:
            problems = property_problems(event_type.value, v)
            v = normalised(event_type.value, v) or v if not problems else v
        else:
            problems = []
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _generation_carries_record(self) -> Event:
        if self.type == EventType.GENERATION:
            GenerationRecord.model_validate(self.properties)
        return self

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> Event:
        """Parse and validate; raises `InvalidEvent` with a readable reason (a record without a value, a
        Kafka tombstone, included)."""
        if raw is None:
            raise InvalidEvent("record has no value (a tombstone); an event is a JSON object")
        if len(raw) > MAX_EVENT_BYTES:
            raise InvalidEvent(f"event is {len(raw)} bytes; the limit is {MAX_EVENT_BYTES}")
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise InvalidEvent(describe_validation_error(exc)) from None

    def generation(self) -> GenerationRecord:
        if self.type != EventType.GENERATION:
            raise ValueError(f"event {self.event_id} is {self.type}, not a generation")
        return GenerationRecord.model_validate(self.properties)


class InvalidEvent(ValueError):
    """An event that fails the contract; its message is the reason given to the sender."""


def check_time(v: datetime) -> datetime:
    """`v` (aware) if it is a UTC instant between `EARLIEST_TIME` and `LATEST_TIME`; else `ValueError`."""
    try:
        v.astimezone(UTC)
    except OverflowError:
        raise ValueError(
            f"{v.isoformat()} is outside {EARLIEST_TIME.isoformat()} .. {LATEST_TIME.isoformat()} in UTC"
        ) from None
    return v


def check_properties(properties: dict[str, Any]) -> None:
    """Raise `ValueError` unless `properties` can be stored as it is: finite numbers only (JSON has no
    NaN or Infinity, and the lake must not hold them as text), text that is valid Unicode (no lone
    surrogate, which no UTF-8 writer can write), integers within 64 bits (`MIN_INTEGER` .. `MAX_INTEGER`), at
    most `MAX_PROPERTIES_DEPTH` levels deep."""
    stack: list[tuple[object, int]] = [(properties, 1)]
    while stack:  # a loop, not recursion: the depth is what is being checked
        value, depth = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"{value} is not a JSON number; NaN and Infinity are refused")
        elif isinstance(value, int) and not isinstance(value, bool):
            if not MIN_INTEGER <= value <= MAX_INTEGER:
                raise ValueError(
                    f"an integer of {len(str(abs(value)))} digits is outside the 64-bit range {MIN_INTEGER} .. "
                    f"{MAX_INTEGER}"
                )
        elif isinstance(value, str):
            _check_text(value)
        elif isinstance(value, dict | list):
            if depth > MAX_PROPERTIES_DEPTH:
                raise ValueError(f"nested deeper than {MAX_PROPERTIES_DEPTH} levels")
            if isinstance(value, dict):
                for key in value:
                    _check_text(key)
                stack.extend((item, depth + 1) for item in value.values())
            else:
                stack.extend((item, depth + 1) for item in value)


def _check_text(text: object) -> None:
    if isinstance(text, str) and not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise ValueError("text holds a lone surrogate, which is not Unicode") from None


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


class GenerationRecord(BaseModel):
    """What a `generation` event carries (its `properties`), in one of two forms.

    - Sampled by Flywheel's serving: token ids in the policy's tokenizer and the behaviour log-prob of
      each completion token, signed (`signature`, flywheel.signing). The trainer may learn from it
      off-policy (importance ratios against `behaviour_logprobs`).
    - Text only, from a product's own model: `prompt`, `completion`, `model_version` (and optionally
      arm, experiment, finish reason, surface), with the three token fields left out or null. It is
      scored and kept like any other; the trainer can use it only as text, re-tokenised under the
      current policy, with an objective that needs no behaviour log-probs (trainer/objectives.py).

    The token fields come together or not at all: ids without their log-probs (or the reverse) say
    nothing the trainer could use and are refused rather than half-kept.

    Names it does not declare are kept (a product's `language`, `request_id`) and read by nobody; a
    misspelling of a declared one is refused by `Event` (flywheel.event_properties.generation_properties,
    which also maps a product's arm name to `product_arm` and other APIs' finish reasons onto ours).
    """

    model_config = ConfigDict(extra="allow")

    prompt: str
    prompt_token_ids: list[int] | None = Field(default=None, description="Prompt tokens; absent: text only.")
    completion: str
    completion_token_ids: list[int] | None = Field(
        default=None, description="Completion tokens (a final end-of-text when it stopped); absent: text only."
    )
    behaviour_logprobs: list[float] | None = Field(
        default=None,
        description="Log-prob of each completion token under the policy that sampled it; absent: text only.",
    )
    model_version: str = Field(description="The model (and version) that wrote the completion.")
    experiment: str = ""
    arm: Literal["champion", "challenger", "holdout"] = Field(
        default="champion",
        description="The arm of Flywheel's traffic split; any other name is the product's own, kept in product_arm.",
    )
    product_arm: str = Field(default="", max_length=128, description="The product's own experiment arm, as sent.")
    surface: str = Field(
        default="",
        pattern=r"^$|^[a-z0-9][a-z0-9._-]{0,63}$",
        description="The product surface (e.g. code-completion, chat) whose reward definition scores it; "
        "empty: code-completion (flywheel.reward_versions).",
    )
    latency_ms: float = 0.0
    finish_reason: Literal["stop", "length", "declined"] = Field(
        default="stop",
        description="stop: the model ended its turn; length: it ran out of tokens; declined: no completion was"
        " given (the policy chose to suggest nothing, or a provider withheld it). Other APIs' names are mapped:"
        " " + ", ".join(f"{k} -> {v}" for k, v in sorted(FINISH_REASON_ALIASES.items()) if k != v) + ".",
    )
    provider_finish_reason: str = Field(
        default="", max_length=64, description="The finish reason as sent, when it was another API's name."
    )
    temperature: float = 1.0
    signature: str = Field(
        default="",
        max_length=128,
        description="Serving's HMAC over what the trainer learns from (flywheel.signing); empty: not from serving.",
    )

    @model_validator(mode="after")
    def _aligned(self) -> GenerationRecord:
        problem = token_fields_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def text_only(self) -> bool:
        """No token ids or log-probs: usable for training only as text (see the class doc)."""
        return self.completion_token_ids is None


def token_fields_problem(record: Any) -> str | None:
    """What is wrong with the token fields of `record` (a `GenerationRecord`, or anything with its three token
    attributes, as the batch validator's struct), or None: they come all three or none, and one log-prob a
    completion token."""
    tokens = (record.prompt_token_ids, record.completion_token_ids, record.behaviour_logprobs)
    given = sum(t is not None for t in tokens)
    if given not in (0, 3):
        return (
            "prompt_token_ids, completion_token_ids and behaviour_logprobs come together: all three (a"
            " sample of Flywheel's own policy) or none (text only, e.g. from your own inference server)"
        )
    logprobs = record.behaviour_logprobs
    if logprobs is not None and len(logprobs) != len(record.completion_token_ids or []):
        return "behaviour_logprobs must have one entry per completion token"
    return None


_GENERATION_NAMES = tuple(GenerationRecord.model_fields)
_GENERATION_NULLABLE = frozenset(("prompt_token_ids", "completion_token_ids", "behaviour_logprobs"))
assert set(ARMS) == set(GenerationRecord.model_fields["arm"].annotation.__args__)  # type: ignore[union-attr]
assert set(FINISH_REASONS) == set(GenerationRecord.model_fields["finish_reason"].annotation.__args__)  # type: ignore[union-attr]

LabelSource = Literal["explicit", "implicit", "default"]


class RewardRecord(BaseModel):
    """One satisfaction judgement per generation and reward-definition version (and revision)."""

    model_config = ConfigDict(extra="forbid")

    generation_id: str
    reward_version: str
    revision: int = 0
    reward: float
    confidence: float = Field(ge=0.0, le=1.0)
    label_source: LabelSource
    signals: dict[str, float] = Field(default_factory=dict)
    user_id: str = ""
    model_version: str = ""
    arm: str = ""
    experiment: str = ""
    window_start: datetime
    window_end: datetime
    late_events: int = 0
    emitted_at: datetime = Field(default_factory=utcnow)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()


RolloutState = Literal["idle", "running", "paused", "promoted", "rolled_back"]


class TrafficSplit(BaseModel):
    """Which versions serve whom. Serving reads it from Redis; the gate writes it."""

    model_config = ConfigDict(extra="forbid")

    experiment: str = "default"
    champion_version: str
    challenger_version: str | None = None
    challenger_share: float = Field(default=0.0, ge=0.0, le=1.0)
    salt: str = Field(default_factory=lambda: uuid.uuid4().hex[:8])
    state: RolloutState = "idle"
    changed_by: str = "system"
    changed_at: datetime = Field(default_factory=utcnow)
    reason: str = ""
    # Long-term holdout: a fixed share of users stays on an earlier champion across releases. Its salt
    # never changes with the experiment's, so the same users stay held out release after release.
    holdout_version: str | None = None
    holdout_share: float = Field(default=0.0, ge=0.0, le=0.5)
    holdout_salt: str = "holdout"

    def arm_for(self, user_id: str) -> Literal["champion", "challenger", "holdout"]:
        """Sticky assignment: the same user lands in the same arm while salt and share hold.

        A user's bucket is a hash of (salt, experiment, user) mapped to [0, 1); the challenger takes
        the buckets below its share, so raising the share during a ramp only moves champion users
        over, never back. Holdout users are picked first, by their own salt, and never see a challenger.

        >>> s = TrafficSplit(champion_version="1", challenger_version="2", challenger_share=0.5, salt="x")
        >>> s.arm_for("alice") == s.arm_for("alice")
        True
        >>> TrafficSplit(champion_version="1").arm_for("alice")
        'champion'
        >>> h = s.model_copy(update={"holdout_version": "0", "holdout_share": 0.5})
        >>> sorted({h.arm_for(f"u{i}") for i in range(50)})
        ['challenger', 'champion', 'holdout']
        """
        if self.in_holdout(user_id):
            return "holdout"
        if not self.challenger_version or self.challenger_share <= 0:
            return "champion"
        bucket = _bucket(f"{self.salt}:{self.experiment}:{user_id}")
        return "challenger" if bucket < self.challenger_share else "champion"

    def in_holdout(self, user_id: str) -> bool:
        return (
            bool(self.holdout_version)
            and self.holdout_share > 0
            and _bucket(f"{self.holdout_salt}:{user_id}") < self.holdout_share
        )

    def version_for(self, arm: str) -> str:
        if arm == "challenger" and self.challenger_version:
            return self.challenger_version
        if arm == "holdout" and self.holdout_version:
            return self.holdout_version
        return self.champion_version

    def versions(self) -> set[str]:
        """Every version this split serves (serving loads them all before adopting it)."""
        out = {self.champion_version}
        if self.challenger_version:
            out.add(self.challenger_version)
        if self.holdout_version and self.holdout_share > 0:
            out.add(self.holdout_version)
        return out


def _bucket(key: str) -> float:
    """A user's uniform position in [0, 1) from SHA-256 of `key` (first 8 bytes)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def event_json_schema() -> dict[str, Any]:
    """The published, versioned JSON Schema of the envelope (served by the collector)."""
    schema = Event.model_json_schema()
    schema["$id"] = f"https://flywheel.local/schemas/event/v{SCHEMA_VERSION}.json"
    schema["title"] = f"Flywheel event envelope v{SCHEMA_VERSION}"
    schema.setdefault("$defs", {})["GenerationRecord"] = GenerationRecord.model_json_schema()
    schema["x-event-properties"] = event_properties_schema()
    return schema


def event_properties_schema() -> dict[str, Any]:
    """Each event type's `properties`: a JSON Schema per type (flywheel.event_properties; `generation`:
    the `GenerationRecord`)."""
    out: dict[str, Any] = {t: properties_json_schema(t) for t in FEEDBACK_PROPERTIES}
    out[EventType.GENERATION.value] = GenerationRecord.model_json_schema()
    return out


# Every feedback type has its properties declared, and no declaration is for a type that does not exist.
assert set(FEEDBACK_PROPERTIES) == {t.value for t in EventType} - {EventType.GENERATION.value}


class DataWindow(BaseModel):
    """The slice of data a version was trained on."""

    model_config = ConfigDict(extra="forbid")

    start: datetime | None = None
    end: datetime
    reward_version: str = ""
    generation_ids_sha256: str = Field(default="", description="Hash of the sorted generation ids used.")
    lake_versions: dict[str, int] = Field(
        default_factory=dict,
        description="The lake's table versions read ({table: Delta version}): reading them again gives these rows.",
    )


class ModelLineage(BaseModel):
    """Where a model version came from (stored with the version in the registry)."""

    model_config = ConfigDict(extra="forbid")

    parent_version: str | None = None
    base: str = Field(description="The checkpoint the lineage started from (path or name).")
    trainer_config: dict[str, Any] = Field(default_factory=dict)
    data_window: DataWindow | None = None
    sample_count: int = 0
    metrics: dict[str, float] = Field(default_factory=dict)
    run_id: str | None = None
