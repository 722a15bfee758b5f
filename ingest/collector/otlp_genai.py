"""OpenTelemetry GenAI spans as text-only `generation` events (no I/O here; the door is ingest/collector/otlp.py).

A span is a generation when its `gen_ai.operation.name` is one of `GENERATION_OPERATIONS`; the surface
comes from the operation (`chat` and `generate_content`: `chat`; `text_completion`: `code-completion`)
unless the span or its resource sets `flywheel.surface`. A span of another GenAI operation
(`NOT_GENERATIONS`: embeddings, tool calls, agents) or with no operation at all is not an event: it is
ignored and counted (`Ignored`). A span whose operation is none of these, or a generation without its
content, user or model, is refused with the reason (`InvalidEvent`): the door dead-letters it.

Where the content is read from, first found wins:
1. the latest conventions: `gen_ai.input.messages`, `gen_ai.output.messages` (and
   `gen_ai.system_instructions`) as span attributes, or as attributes of the span's
   `gen_ai.client.inference.operation.details` event; JSON text or structured values;
2. v1.36 and earlier (each instrumentation's `OTEL_SEMCONV_STABILITY_OPT_IN` decides): one span event
   per message, `gen_ai.system.message`, `gen_ai.user.message`, `gen_ai.assistant.message`,
   `gen_ai.tool.message` for the input and `gen_ai.choice` for the output, the body in the event's
   `content` / `message` attributes or as JSON in `gen_ai.event.content`; and the older
   `gen_ai.content.prompt` / `gen_ai.content.completion` events (`gen_ai.prompt`, `gen_ai.completion`);
3. the indexed attributes some instrumentations write (`gen_ai.prompt.0.content`, `gen_ai.completion.0.content`).

Only text is kept: a message's text parts are joined; the prompt is the one message's text, or, for several,
each as `<role>: <text>` separated by blank lines; the completion is the first choice's text. A generation
whose output holds no text (tool calls only) is not a text generation: ignored and counted.

The generation id is `gen_ai.response.id` when present, else `<trace id>-<span id>` in lower-case hex, the
ids the product's own span context holds, so feedback can name it. The event id is
`otlp-<trace id>-<span id>`: an export retried lands once.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from pydantic import ValidationError

from flywheel.contract import Event, EventType, InvalidEvent, describe_validation_error
from flywheel.event_properties import FINISH_REASON_ALIASES

OTLP_SOURCE = "otlp"
# Operation -> the surface its generations are scored as.
GENERATION_OPERATIONS = {"chat": "chat", "generate_content": "chat", "text_completion": "code-completion"}
NOT_GENERATIONS = frozenset(
    {"embeddings", "execute_tool", "create_agent", "invoke_agent", "invoke_workflow", "retrieval"}
)
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
_MESSAGE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}
# Span attributes kept as they are, under these names.
_ALSO_KEPT = (
    ("gen_ai.usage.input_tokens", "input_tokens"),
    ("gen_ai.usage.output_tokens", "output_tokens"),
    ("gen_ai.provider.name", "provider"),
    ("gen_ai.system", "provider"),
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_decode_json = msgspec.json.Decoder().decode


class Ignored(Exception):  # noqa: N818 - an outcome, not an error
    """The span is not a text generation; `why` is the counter's label."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


_SCALARS = frozenset({"string_value", "int_value", "double_value", "bool_value"})


def any_value(value: AnyValue) -> Any:
    """An OTLP `AnyValue` as plain Python (arrays: lists, key-value lists: dicts, bytes: base64 text)."""
    kind = value.WhichOneof("value")
    if kind in _SCALARS:
        return getattr(value, kind)
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return None


def attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs}


# The span attributes read (`span_attributes`), and the resource attributes (`resource_attributes`).
_SPAN_KEYS = frozenset({
    "gen_ai.operation.name", "gen_ai.response.id", "gen_ai.response.model", "gen_ai.request.model",
    "gen_ai.response.finish_reasons", "gen_ai.request.temperature", "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens", "gen_ai.provider.name", "gen_ai.system", "gen_ai.conversation.id",
    "gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions",
    "user.id", "enduser.id", "session.id", "flywheel.surface",
})  # fmt: skip
RESOURCE_KEYS = frozenset({"user.id", "enduser.id", "session.id", "gen_ai.conversation.id", "flywheel.surface"})
_INDEXED = ("gen_ai.prompt.", "gen_ai.completion.")


def span_attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    """The attributes Flywheel reads from a span, converted; the others (a span has many) are passed over.
    (Each read of a protobuf field makes a new Python object: each is read once. Most values are strings: a
    non-empty `string_value` is taken as is, without asking which of the oneof's fields is set.)"""
    out = {}
    for kv in pairs:
        key = kv.key
        if key in _SPAN_KEYS or key.startswith(_INDEXED):
            value = kv.value
            text = value.string_value  # "" when another kind is set (or an empty string): then asked
            if text:
                out[key] = text
                continue
            kind = value.WhichOneof("value")
            out[key] = getattr(value, kind) if kind in _SCALARS else any_value(value)
    return out


def resource_attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in pairs if kv.key in RESOURCE_KEYS}


def _structured(value: Any) -> Any:
    """A value instrumentations may send as JSON text or structured: parsed when it is JSON text."""
    if isinstance(value, str) and value[:1] in ("[", "{"):
        try:
            return _decode_json(value)
        except (ValueError, RecursionError):  # not JSON after all (msgspec.DecodeError is a ValueError)
            return value
    return value


def _text(content: Any) -> str:
    """The text a message's content holds: a string, a list of parts (`{"type": "text", "content"|"text"}`),
    or a message (`parts` or `content`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        if "parts" in content:
            return _text(content["parts"])
        if "message" in content:
            return _text(content["message"])
        if content.get("type", "text") == "text":
            inner = content.get("content", content.get("text"))
            return inner if isinstance(inner, str) else _text(inner) if inner is not None else ""
        return ""
    if isinstance(content, list):
        return "".join(_text(part) for part in content)
    return ""


def _turns(messages: Any, default_role: str) -> list[tuple[str, str]]:
    """(role, text) of each message with text; `messages` a list of messages or a plain text."""
    messages = _structured(messages)
    if isinstance(messages, str):
        return [(default_role, messages)] if messages else []
    if isinstance(messages, dict):
        messages = [messages]
    if not isinstance(messages, list):
        return []
    out = []
    for message in messages:
        role = message.get("role", default_role) if isinstance(message, dict) else default_role
        text = _text(message)
        if text:
            out.append((str(role), text))
    return out


class _Content:
    """A span's messages, from wherever its instrumentation put them (see the module doc)."""

    def __init__(self, span: Span, attrs: Mapping[str, Any]) -> None:
        self.system: Any = attrs.get("gen_ai.system_instructions")
        self.inputs: Any = attrs.get("gen_ai.input.messages")
        self.outputs: Any = attrs.get("gen_ai.output.messages")
        self.finish_reason: Any = None
        if self.inputs is None and self.outputs is None:
            self._from_events(span)
        if self.inputs is None and self.outputs is None:
            self._from_indexed(attrs)

    def _from_events(self, span: Span) -> None:
        inputs: list[dict[str, Any]] = []
        outputs: list[Any] = []
        for event in span.events:
            name = event.name
            if name == DETAILS_EVENT:
                details = attributes(event.attributes)
                self.system = details.get("gen_ai.system_instructions", self.system)
                self.inputs = details.get("gen_ai.input.messages")
                self.outputs = details.get("gen_ai.output.messages")
                return
            if name in _MESSAGE_EVENTS or name == "gen_ai.choice":
                attrs = attributes(event.attributes)
                body = _structured(attrs.get("gen_ai.event.content"))
                body = body if isinstance(body, dict) else {}
                if name == "gen_ai.choice":
                    message = _structured(attrs.get("message", body.get("message", attrs.get("content"))))
                    self.finish_reason = attrs.get("finish_reason", body.get("finish_reason", self.finish_reason))
                    if int(attrs.get("index", body.get("index", 0)) or 0) == 0:
                        outputs.append({"role": "assistant", "content": message})
                else:
                    content = _structured(attrs.get("content", body.get("content")))
                    inputs.append(
                        {"role": attrs.get("role", body.get("role", _MESSAGE_EVENTS[name])), "content": content}
                    )
            elif name == "gen_ai.content.prompt":
                inputs.extend(
                    {"role": r, "content": t}
                    for r, t in _turns(attributes(event.attributes).get("gen_ai.prompt"), "user")
                )
            elif name == "gen_ai.content.completion":
                outputs.extend(
                    {"role": r, "content": t}
                    for r, t in _turns(attributes(event.attributes).get("gen_ai.completion"), "assistant")
                )
        if inputs:
            self.inputs = inputs
        if outputs:
            self.outputs = outputs

    def _from_indexed(self, attrs: Mapping[str, Any]) -> None:
        for prefix, role, target in (
            ("gen_ai.prompt", "user", "inputs"),
            ("gen_ai.completion", "assistant", "outputs"),
        ):
            found = []
            i = 0
            while f"{prefix}.{i}.content" in attrs:
                found.append({"role": attrs.get(f"{prefix}.{i}.role", role), "content": attrs[f"{prefix}.{i}.content"]})
                i += 1
            if found:
                setattr(self, target, found)
                if target == "outputs":
                    self.finish_reason = attrs.get("gen_ai.completion.0.finish_reason")

    def prompt(self) -> str | None:
        turns = _turns(self.system, "system") + _turns(self.inputs, "user")
        if self.inputs is None or not turns:
            return None
        if len(turns) == 1:
            return turns[0][1]
        return "\n\n".join(f"{role}: {text}" for role, text in turns)

    def completion(self) -> tuple[str | None, Any]:
        """(the first choice's text, its finish reason); text None: no output messages; "": no text in them."""
        outputs = _structured(self.outputs)
        if outputs is None:
            return None, None
        if isinstance(outputs, str):
            return outputs, self.finish_reason
        first = outputs[0] if isinstance(outputs, list) and outputs else outputs
        reason = first.get("finish_reason", self.finish_reason) if isinstance(first, dict) else self.finish_reason
        return _text(first), reason


def hex_id(raw: bytes) -> str:
    return raw.hex()


def _time(nanos: int, received_at: datetime) -> datetime:
    if nanos <= 0:
        return received_at
    return _EPOCH + timedelta(microseconds=nanos // 1000)


def span_to_event(span: Span, resource: Mapping[str, Any], received_at: datetime) -> Event:
    """The generation event of one span; raises `Ignored` (not a text generation) or `InvalidEvent` (why not)."""
    attrs = span_attributes(span.attributes)
    operation = attrs.get("gen_ai.operation.name")
    if operation is None:
        raise Ignored("not_gen_ai")
    if operation in NOT_GENERATIONS:
        raise Ignored(f"operation:{operation}")
    if operation not in GENERATION_OPERATIONS:
        raise InvalidEvent(
            f"gen_ai.operation.name {str(operation)[:64]!r} is not an operation Flywheel knows; generations are"
            f" {', '.join(sorted(GENERATION_OPERATIONS))}, and {', '.join(sorted(NOT_GENERATIONS))} are ignored"
        )
    trace, span_id = hex_id(span.trace_id), hex_id(span.span_id)
    if not trace or not span_id:
        raise InvalidEvent("a span needs its trace and span ids (they make its event id)")
    content = _Content(span, attrs)
    completion, finish_reason = content.completion()
    prompt = content.prompt()
    if completion is None or prompt is None:
        missing = " and ".join(name for name, value in (("input", prompt), ("output", completion)) if value is None)
        raise InvalidEvent(
            f"span {trace}-{span_id} ({operation}) carries no {missing} messages: content capture is off in its"
            " instrumentation (e.g. OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true), or it puts them"
            " where Flywheel does not read (see the README's OTLP section)"
        )
    if completion == "":
        raise Ignored("no_text_output")
    user = attrs.get("user.id") or attrs.get("enduser.id") or resource.get("user.id") or resource.get("enduser.id")
    if not user:
        raise InvalidEvent(f"span {trace}-{span_id}: no user; set user.id or enduser.id on the span or its resource")
    requested = attrs.get("gen_ai.request.model")
    model = attrs.get("gen_ai.response.model") or requested
    if not model:
        raise InvalidEvent(f"span {trace}-{span_id}: no model; gen_ai.response.model or gen_ai.request.model is needed")
    surface = attrs.get("flywheel.surface") or resource.get("flywheel.surface") or GENERATION_OPERATIONS[operation]
    properties: dict[str, Any] = {
        "prompt": prompt,
        "completion": completion,
        "model_version": str(model),
        "surface": str(surface),
    }
    start, end = span.start_time_unix_nano, span.end_time_unix_nano  # each read of a field makes a new object
    if end > start > 0:
        properties["latency_ms"] = (end - start) / 1e6
    reasons = attrs.get("gen_ai.response.finish_reasons")
    reason = (
        reasons[0] if isinstance(reasons, list) and reasons else reasons if isinstance(reasons, str) else finish_reason
    )
    if isinstance(reason, str) and reason:
        if reason.lower() in FINISH_REASON_ALIASES:
            properties["finish_reason"] = reason  # the contract maps it, keeping what was sent
        else:
            properties["provider_finish_reason"] = reason[:64]
    temperature = attrs.get("gen_ai.request.temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        properties["temperature"] = float(temperature)
    for key, name in _ALSO_KEPT:
        if key in attrs and name not in properties:
            properties[name] = attrs[key]
    if requested and requested != model:
        properties["request_model"] = requested
    response_id = attrs.get("gen_ai.response.id")
    generation_id = str(response_id) if response_id not in (None, "") else f"{trace}-{span_id}"
    session = (
        attrs.get("gen_ai.conversation.id") or attrs.get("session.id") or resource.get("gen_ai.conversation.id")
        or resource.get("session.id")
    )  # fmt: skip
    try:
        return Event(
            event_id=f"otlp-{trace}-{span_id}",
            type=EventType.GENERATION,
            generation_id=generation_id,
            user_id=str(user),
            session_id=str(session or ""),
            ts=_time(end or start, received_at),
            received_at=received_at,
            source=OTLP_SOURCE,
            properties=properties,
        )
    except ValidationError as exc:  # the contract's reason, as the other doors give it
        raise InvalidEvent(f"span {trace}-{span_id}: {describe_validation_error(exc)}") from None
