"""The properties each feedback event type carries: names, types, ranges, required or optional.

This table is the contract between products and the reward (docs/design.md, "Contracts"): the
signals read exactly these names (signals/features.py), the collector publishes them at
`GET /v1/schema`, and `Event` refuses an event of a known type whose property is
- of the wrong JSON type (`"0.9"` for a number, `1` for a boolean, `3.0` for an integer),
- out of its range or not one of its values (`fraction_present` 1.5, thumbs `value` "sideways"),
- missing while required (a `retained` event without `fraction_present`), or
- a misspelling of one of its properties: an unknown name that has the same words as a known one in
  another order, case or separator (`fractionPresent`, `chars_accepted`), or differs from it by a
  letter or two (`seconds_after_acept`; similarity 0.8 or more).
A refusal names the property and says what was expected; nothing is silently defaulted.

Other unknown names are kept, as sent, in the lake and ignored by the reward: products attach their own
context (a language, a file type, a consent flag under another name) and the lake is the place to keep it.
`null` for an optional property means "not sent". `generation` events are checked by `GenerationRecord`
(contract.py), which refuses any unknown name.

What must hold: the validators here (used by pydantic) and ingest's fast path accept the same events
(the fast path derives its msgspec structs from `FEEDBACK_PROPERTIES`).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["string", "integer", "number", "boolean"]
_JSON_TYPE = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean"}
# Unknown names at least this similar to a known one are taken for a misspelling of it.
NEAR_MISS_RATIO = 0.8


@dataclass(frozen=True, slots=True)
class Prop:
    """One property of an event type."""

    kind: Kind
    description: str
    required: bool = False
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    max_length: int | None = None

    def expected(self) -> str:
        """What the property must hold, in words ("a number in [0, 1]")."""
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        article = "an" if self.kind == "integer" else "a"
        text = f"{article} {self.kind}"
        if self.minimum is not None and self.maximum is not None:
            text += f" in [{_num(self.minimum)}, {_num(self.maximum)}]"
        elif self.minimum is not None:
            text += f" >= {_num(self.minimum)}"
        if self.max_length is not None:
            text += f" of at most {self.max_length} characters"
        return text

    def problem(self, value: Any) -> str | None:
        """Why `value` does not fit, or None."""
        if self.kind == "boolean":
            ok = isinstance(value, bool)
        elif self.kind == "integer":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind == "number":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            ok = isinstance(value, str)
        if not ok:
            return f"must be {self.expected()}, got {_shown(value)} ({_json_type(value)})"
        if self.choices and value not in self.choices:
            return f"must be {self.expected()}, got {_shown(value)}"
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            return f"must be {self.expected()}, got {_shown(value)}"
        if self.max_length is not None and len(value) > self.max_length:
            return f"must be {self.expected()}, got {len(value)} characters"
        return None

    def json_schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": _JSON_TYPE[self.kind], "description": self.description}
        if self.choices:
            out["enum"] = list(self.choices)
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.max_length is not None:
            out["maxLength"] = self.max_length
        return out


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_SECONDS = "Seconds from the accept to this measurement."
# Properties any feedback event may carry.
COMMON_PROPERTIES: dict[str, Prop] = {
    "surface": Prop(
        "string",
        "The product surface the generation was made for (e.g. 'code-completion', 'chat'); it chooses the"
        " reward definition.",
        max_length=64,
    ),
    "training_consent": Prop(
        "boolean", "The user's consent to training on their data; the latest statement per user counts."
    ),
}

FEEDBACK_PROPERTIES: dict[str, dict[str, Prop]] = {
    "shown": {"chars": Prop("integer", "Characters of the suggestion shown.", minimum=0)},
    "accepted": {
        "accepted_chars": Prop(
            "integer",
            "Characters taken, for a partial accept (with total_chars); neither: a full accept.",
            minimum=0,
        ),
        "total_chars": Prop("integer", "Characters the suggestion had.", minimum=0),
    },
    "rejected": {},
    "ignored": {},
    "edited": {
        "edit_distance": Prop(
            "integer", "Characters changed in the accepted text (summed over events).", required=True, minimum=0
        )
    },
    "undone": {
        "seconds_after_accept": Prop("number", _SECONDS + " Absent: measured from the accept event.", minimum=0)
    },
    "retained": {
        "seconds_after_accept": Prop("number", _SECONDS, required=True, minimum=0),
        "fraction_present": Prop(
            "number", "Share of the accepted text still present.", required=True, minimum=0, maximum=1
        ),
    },
    "copied": {},
    "regenerated": {},
    "thumbs": {
        "value": Prop("string", "The vote; the latest one wins.", required=True, choices=("up", "down")),
        "comment": Prop("string", "The user's comment; its sentiment is a signal.", max_length=8192),
    },
    "followup": {
        "text": Prop("string", "The user's next message; its sentiment is a signal.", required=True, max_length=8192)
    },
    "session_end": {},
}


def properties_of(event_type: str) -> dict[str, Prop]:
    """Every property an event of `event_type` may carry (its own, then the common ones)."""
    return {**FEEDBACK_PROPERTIES[event_type], **COMMON_PROPERTIES}


_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def _words(name: str) -> tuple[str, ...]:
    return tuple(w.lower() for w in _WORD.findall(name))


@functools.lru_cache(maxsize=4096)
def misspelling_of(event_type: str, name: str) -> str | None:
    """The known property of `event_type` that the unknown `name` looks like a misspelling of, or None."""
    known = properties_of(event_type)
    words = sorted(_words(name))
    joined = "_".join(_words(name))
    for candidate in known:
        if words == sorted(_words(candidate)):
            return candidate
    close = difflib.get_close_matches(joined, list(known), n=1, cutoff=NEAR_MISS_RATIO)
    return close[0] if close else None


def property_problems(event_type: str, properties: Mapping[str, Any]) -> list[str]:
    """What is wrong with a feedback event's properties (empty: nothing); `generation` is not checked here."""
    spec = FEEDBACK_PROPERTIES.get(event_type)
    if spec is None:
        return []
    problems = []
    for name, value in properties.items():
        prop = spec.get(name) or COMMON_PROPERTIES.get(name)
        if prop is None:
            near = misspelling_of(event_type, name)
            if near is not None:
                problems.append(f"{event_type} has no property {name!r}; did you mean {near!r}?")
        elif value is not None or prop.required:
            problem = prop.problem(value)
            if problem is not None:
                problems.append(f"{event_type}.{name} {problem}")
    for name, prop in spec.items():
        if prop.required and name not in properties:
            problems.append(f"{event_type}.{name} is required: {prop.expected()}")
    if event_type == "accepted" and not problems:
        taken, total = properties.get("accepted_chars"), properties.get("total_chars")
        if taken is not None and total is not None and taken > total:
            problems.append(f"accepted.accepted_chars ({taken}) is more than total_chars ({total})")
    return problems


def properties_json_schema(event_type: str) -> dict[str, Any]:
    """The JSON Schema of a feedback event type's properties (unknown names allowed, see the module doc)."""
    spec = properties_of(event_type)
    return {
        "type": "object",
        "properties": {name: prop.json_schema() for name, prop in spec.items()},
        "required": [name for name, prop in spec.items() if prop.required],
        "additionalProperties": True,
    }
