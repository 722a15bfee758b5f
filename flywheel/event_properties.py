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
A refusal names the property and says what was expected; nothing is silently defaulted. A text longer
than its property's limit (a follow-up's `text`, a thumbs `comment`: 8,192 characters) is not refused: it
is cut to the limit and `<name>_truncated` is set true, so the feedback is kept and says so; and another API's
name for a choice (a thumbs `value` of `like`, `thumbs_down`, `-1`) is stored as the choice, the value sent in
`<name>_as_sent` (`normalised`, applied by `Event`; ingest's fast path hands such events to it).

Other unknown names are kept, as sent, in the lake and ignored by the reward: products attach their own
context (a language, a file type, a consent flag under another name) and the lake is the place to keep it.
`null` for an optional property means "not sent". `generation` events are checked by `GenerationRecord`
(contract.py) after `generation_properties` has mapped other APIs' values onto its own: a product's own arm
name (`variant-b`) moves to `product_arm` (`arm` is Flywheel's traffic-split arm), and a provider's finish
reason (OpenAI's `content_filter`, Anthropic's `end_turn`, Gemini's `MAX_TOKENS`) becomes one of
`FINISH_REASONS`, the value as sent kept in `provider_finish_reason`. Unknown names are kept there too.

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
    # Over `max_length`: cut to it and `<name>_truncated` set (`normalised`), rather than refused.
    truncate: bool = False
    # Other APIs' names for `choices` (lower case, each with the choice it means): mapped by `normalised`.
    aliases: tuple[tuple[str, str], ...] = ()

    def choice_for(self, value: Any) -> str | None:
        """The choice `value` names (itself, or an alias in any case), or None."""
        if value in self.choices:
            return str(value)
        return dict(self.aliases).get(value.lower()) if isinstance(value, str) else None

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
        if self.max_length is not None and not self.truncate:
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
        if self.choices and self.choice_for(value) is None:
            return f"must be {self.expected()}, got {_shown(value)}"
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            return f"must be {self.expected()}, got {_shown(value)}"
        if self.max_length is not None and not self.truncate and len(value) > self.max_length:
            return f"must be {self.expected()}, got {len(value)} characters"
        return None

    def json_schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": _JSON_TYPE[self.kind], "description": self.description}
        if self.choices:
            out["enum"] = list(self.choices)
        if self.aliases:
            out["x-aliases"] = dict(self.aliases)  # also taken, in any case, and stored as the choice
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        if self.max_length is not None:
            # A truncating property takes any length; what is kept is said apart.
            out["x-truncated-at" if self.truncate else "maxLength"] = self.max_length
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
# What other feedback APIs call a vote (Langfuse, PostHog surveys, OpenAI's and Anthropic's consoles, plain UIs).
THUMBS_ALIASES: tuple[tuple[str, str], ...] = (
    *((name, "up") for name in ("thumbs_up", "thumbsup", "like", "liked", "positive", "good", "helpful", "+1")),
    *((name, "down") for name in ("thumbs_down", "thumbsdown", "dislike", "disliked", "negative", "bad",
                                  "unhelpful", "-1")),
    ("up", "up"),
    ("down", "down"),
)  # fmt: skip
# Feedback texts are kept up to this many characters (sentiment reads no further); the rest is cut, and flagged.
MAX_TEXT_CHARS = 8192
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
        "value": Prop(
            "string",
            "The vote; the latest one wins. Other names for it are taken (any case) and stored as up or down,"
            " the value sent kept in value_as_sent.",
            required=True,
            choices=("up", "down"),
            aliases=THUMBS_ALIASES,
        ),
        "value_as_sent": Prop("string", "Set by Flywheel: the vote as sent, when it was another name for up or down."),
        "comment": Prop(
            "string",
            f"The user's comment; its sentiment is a signal. Longer than {MAX_TEXT_CHARS} characters: cut to"
            " them, with comment_truncated set.",
            max_length=MAX_TEXT_CHARS,
            truncate=True,
        ),
        "comment_truncated": Prop("boolean", "Set by Flywheel: the comment was longer and was cut."),
    },
    "followup": {
        "text": Prop(
            "string",
            f"The user's next message; its sentiment is a signal. Longer than {MAX_TEXT_CHARS} characters: cut"
            " to them, with text_truncated set.",
            required=True,
            max_length=MAX_TEXT_CHARS,
            truncate=True,
        ),
        "text_truncated": Prop("boolean", "Set by Flywheel: the text was longer and was cut."),
    },
    "session_end": {},
}


def properties_of(event_type: str) -> dict[str, Prop]:
    """Every property an event of `event_type` may carry (its own, then the common ones)."""
    return {**FEEDBACK_PROPERTIES[event_type], **COMMON_PROPERTIES}


_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")


def _words(name: str) -> tuple[str, ...]:
    return tuple(w.lower() for w in _WORD.findall(name))


def misspelling_of(event_type: str, name: str) -> str | None:
    """The known property of `event_type` that the unknown `name` looks like a misspelling of, or None."""
    return misspelling_among(tuple(properties_of(event_type)), name)


@functools.lru_cache(maxsize=4096)
def misspelling_among(known: tuple[str, ...], name: str) -> str | None:
    """The name in `known` that the unknown `name` looks like a misspelling of, or None."""
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


def normalised(event_type: str, properties: Mapping[str, Any]) -> dict[str, Any] | None:
    """`properties` (valid) as they are stored: each over-long text of a truncating property cut to its limit
    with `<name>_truncated` set true, each alias of a choice replaced by the choice with the value sent kept in
    `<name>_as_sent`; None when nothing changes (the common case: nothing copied).

    >>> normalised("followup", {"text": "x" * 9000})["text_truncated"]
    True
    >>> normalised("thumbs", {"value": "Like"})
    {'value': 'up', 'value_as_sent': 'Like'}
    >>> normalised("followup", {"text": "thanks"}) is None
    True
    """
    spec = FEEDBACK_PROPERTIES.get(event_type, {})
    out: dict[str, Any] | None = None
    for name, prop in spec.items():
        value = properties.get(name)
        if not isinstance(value, str):
            continue
        if prop.truncate and prop.max_length is not None and len(value) > prop.max_length:
            out = dict(properties) if out is None else out
            out[name] = value[: prop.max_length]
            out[f"{name}_truncated"] = True
        if prop.aliases and value not in prop.choices and (choice := prop.choice_for(value)) is not None:
            out = dict(properties) if out is None else out
            out[name] = choice
            out[f"{name}_as_sent"] = value
    return out


# ---------------------------------------------------------------- generation events

# `arm` is the arm of Flywheel's own traffic split; a product's own experiment arm goes to `product_arm`.
ARMS = ("champion", "challenger", "holdout")
FINISH_REASONS = ("stop", "length", "declined")
# Other APIs' finish reasons, lower-cased, and the one of `FINISH_REASONS` each means here: the model ended
# its turn (`stop`), ran out of tokens (`length`), or its completion was withheld (`declined`, as when the
# policy chooses to suggest nothing).
FINISH_REASON_ALIASES: dict[str, str] = {
    **{r: "stop" for r in ("stop", "end_turn", "stop_sequence", "tool_calls", "tool_use", "function_call",
                           "eos", "completed", "end")},
    **{r: "length" for r in ("length", "max_tokens", "max_output_tokens", "model_context_window_exceeded")},
    **{r: "declined" for r in ("declined", "content_filter", "refusal", "safety", "recitation", "blocklist",
                               "prohibited_content", "spii")},
}


def generation_properties(
    properties: Mapping[str, Any], known: tuple[str, ...], nullable: frozenset[str] = frozenset()
) -> tuple[dict[str, Any], list[str]]:
    """A `generation` event's properties with other APIs' values mapped onto the contract's, and what is
    wrong with them (misspellings of `known`, the `GenerationRecord`'s names; pydantic judges the rest).

    - `null` for an optional name that is not nullable means "not sent": dropped.
    - `arm` not one of `ARMS`: moved to `product_arm`.
    - `finish_reason` one of `FINISH_REASON_ALIASES` (any case): the contract's value, the one sent kept in
      `provider_finish_reason` when it differs.

    >>> generation_properties({"arm": "variant-b", "finish_reason": "content_filter"}, ("arm", "finish_reason"))[0]
    {'finish_reason': 'declined', 'product_arm': 'variant-b', 'provider_finish_reason': 'content_filter'}
    """
    out = {k: v for k, v in properties.items() if v is not None or k in nullable or k not in known}
    problems = []
    arm = out.get("arm")
    if isinstance(arm, str) and arm not in ARMS:
        if out.get("product_arm", arm) != arm:
            problems.append(
                f"generation.arm must be one of {', '.join(map(repr, ARMS))} (Flywheel's arms); {_shown(arm)} would"
                f" go to product_arm, which already holds {_shown(out['product_arm'])}"
            )
        else:
            del out["arm"]
            out["product_arm"] = arm
    reason = out.get("finish_reason")
    if isinstance(reason, str) and reason not in FINISH_REASONS:
        mapped = FINISH_REASON_ALIASES.get(reason.lower())
        if mapped is None:
            problems.append(
                f"generation.finish_reason must be one of {', '.join(map(repr, FINISH_REASONS))} or another API's"
                f" name for one ({', '.join(sorted(FINISH_REASON_ALIASES))}), got {_shown(reason)}"
            )
        else:
            out["finish_reason"] = mapped
            out.setdefault("provider_finish_reason", reason)
    for name in out:
        if name not in known:
            near = misspelling_among(known, name)
            if near is not None:
                problems.append(f"generation has no property {name!r}; did you mean {near!r}?")
    return out, problems
