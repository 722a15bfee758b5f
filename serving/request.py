"""The body of `POST /v1/completions`: read within a size cap, parsed strictly, checked field by field.

What must hold: nothing a client sends makes serving answer 5xx. A body over the cap is a 413;
a body that is not strict JSON (NaN, Infinity, overflowing numbers, bad UTF-8) or not an
object is a 400; a field of the wrong type or out of range is a 422 naming the field.
Every OpenAI completions parameter is declared: the ones serving honours take effect (`n`,
`stop`, `logprobs`, `stream`, `stream_options`, `seed` among them), the others are accepted only
at the value that means "off" and refused otherwise with a 400 that names the parameter, and an
unknown field is refused the same way, so no request is ever answered as if a parameter it sent
had been applied.

`model` is accepted and not used to route: the traffic split picks the version (sticky per
`user`) and the answer's `model` names the version that served.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request

from flywheel.contract import describe_validation_error
from serving.errors import BodyTooLarge, InvalidField, InvalidRequest, UnsupportedParameter
from serving.generator import GenerationRequest

MAX_BODY_BYTES = 128 * 1024  # a 20k-character prompt, JSON-escaped, fits with room to spare
MAX_SEED = 2**63 - 1  # torch's generator takes a 64-bit seed
MAX_N = 16  # choices per request; each is a generation of its own
MAX_LOGPROBS = 5  # OpenAI's own limit for completions
MAX_STOP = 4  # stop sequences per request, as OpenAI allows

StopSequence = Annotated[str, Field(min_length=1, max_length=64)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = Field(default=False, description="A last chunk with the request's usage.")


class CompletionRequest(BaseModel):
    """The parameters serving honours (the others are checked by `refuse_unsupported`)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    prompt: str = Field(max_length=20_000)
    max_tokens: int = Field(default=16, ge=1, le=256, description="Also bounded by the model's context.")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    user: str = Field(min_length=1, max_length=256, description="Pseudonymous user id: the sticky A/B key.")
    session_id: str = Field(default="", max_length=256)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    model: str | None = Field(default=None, max_length=256, description="Informational: the split routes.")
    n: int = Field(default=1, ge=1, le=MAX_N, strict=True,
                   description="Choices to sample; each is logged as a generation of its own.")
    stop: list[StopSequence] | None = Field(
        default=None, max_length=MAX_STOP,
        description="Up to 4 strings; the text shown ends before the first one. A completion also ends "
                    "at the end of its line.",
    )
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, strict=True,
        description="Return each sampled token's behaviour log-prob (the logged one) and the k likeliest.",
    )
    stream: bool = Field(default=False, strict=True,
                         description="Server-sent events in OpenAI's format, sent once the choices are logged.")
    stream_options: StreamOptions | None = None

    @field_validator("prompt", "user", "session_id", "model")
    @classmethod
    def _encodable(cls, value: str | None) -> str | None:
        # JSON can carry lone UTF-16 surrogates ("\ud800"), which no tokenizer or log line can hold.
        if value is not None:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode text (no lone surrogates)") from None
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list_of_one(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def generation_requests(self) -> list[GenerationRequest]:
        """One request per choice. Choice 0 samples with `seed` itself, choice i with a seed derived from
        (seed, i), so a seeded request is reproducible choice by choice and its choices differ."""
        return [
            GenerationRequest(
                prompt=self.prompt,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=choice_seed(self.seed, i),
                stop=self.stop_sequences,
                top_logprobs=self.logprobs or 0,
            )
            for i in range(self.n)
        ]


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed choice `index` samples with (None: a fresh random one)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"flywheel.choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & MAX_SEED


def _is(*allowed: Any) -> Callable[[Any], bool]:
    # `type(v) is type(a)` so that true is not taken for 1, nor 1.0 for true.
    return lambda v: any(type(v) is type(a) and v == a for a in allowed)


def _empty(v: Any) -> bool:
    return v in ("", [], {}) and type(v) in (str, list, dict)


# Parameter -> (is the value one that asks for nothing, why other values are refused).
_OFF_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (_is(1), "best_of is not supported: send 1 or leave it out (n samples several choices)"),
    "echo": (_is(False), "echo is not supported: send echo=false or leave it out"),
    "suffix": (_empty, "suffix (fill-in-the-middle) is not supported"),
    "top_p": (_is(1, 1.0), "nucleus sampling is not supported: send top_p=1 or leave it out"),
    "presence_penalty": (_is(0, 0.0), "presence_penalty is not supported: send 0 or leave it out"),
    "frequency_penalty": (_is(0, 0.0), "frequency_penalty is not supported: send 0 or leave it out"),
    "logit_bias": (_empty, "logit_bias is not supported"),
}
KNOWN_PARAMETERS = frozenset(CompletionRequest.model_fields) | frozenset(_OFF_ONLY)


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise InvalidRequest(f"Content-Encoding {encoding!r} is not supported; send the body uncompressed")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Strict JSON -> a checked request, or the `ServingError` that says what is wrong."""
    try:
        doc = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        reason = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        raise InvalidRequest(f"the body is not valid JSON: {reason[:200]}") from None
    if not isinstance(doc, dict):
        raise InvalidRequest(f"the body must be a JSON object, not {type(doc).__name__}")
    refuse_unsupported(doc)
    try:
        req = CompletionRequest.model_validate(doc)
    except ValidationError as exc:
        # The reason names the field and the rule, never echoes the value back.
        first = exc.errors()[0]["loc"]
        raise InvalidField(describe_validation_error(exc), param=".".join(map(str, first)) or None) from None
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed with stream=true", param="stream_options")
    return req


def refuse_unsupported(doc: dict[str, Any]) -> None:
    """400 naming the first parameter that asks for something serving does not do."""
    for name in doc:
        if name not in KNOWN_PARAMETERS:
            raise UnsupportedParameter(f"unknown parameter {name[:64]!r}", param=name[:64])
    for name, (is_off, why) in _OFF_ONLY.items():
        if name in doc and doc[name] is not None and not is_off(doc[name]):
            raise UnsupportedParameter(why, param=name)


def request_schema() -> dict[str, Any]:
    """The OpenAPI request body (the route reads the body itself, so FastAPI cannot infer it)."""
    schema = CompletionRequest.model_json_schema()
    for name in _OFF_ONLY:
        schema["properties"][name] = {"description": _OFF_ONLY[name][1]}
    return {"required": True, "content": {"application/json": {"schema": schema}}}
