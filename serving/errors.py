"""Serving's one error root: every refusal knows its HTTP status and is answered in OpenAI's shape.

`{"error": {"message", "type", "param", "code"}}` is what OpenAI clients parse; `message` is
safe to show to the caller. Anything that is not a `ServingError` is an internal error whose
text never reaches a client.
"""

from __future__ import annotations

from typing import Any


class ServingError(Exception):
    status_code: int = 500
    type: str = "server_error"
    code: str = "internal_error"
    headers: dict[str, str] | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ServingError):
    """A body that is not a completion request we can answer (bad JSON, a value out of range)."""

    status_code = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnsupportedParameter(InvalidRequest):
    """An OpenAI parameter, or a value of one, that this server does not honour: refused, never ignored."""

    code = "unsupported_parameter"


class ContextExceeded(InvalidRequest):
    """Prompt plus `max_tokens` does not fit the serving model's context."""

    code = "context_length_exceeded"


class InvalidApiKey(ServingError):
    """No API key, or not one of `FLYWHEEL_SERVING_API_KEYS` (OpenAI's answer for a bad key)."""

    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"
    headers = {"WWW-Authenticate": "Bearer"}  # noqa: RUF012 - a class constant, never mutated


class InvalidField(ServingError):
    """A field of the right JSON but the wrong type or range (what pydantic refuses)."""

    status_code = 422
    type = "invalid_request_error"
    code = "invalid_value"


class BodyTooLarge(ServingError):
    status_code = 413
    type = "invalid_request_error"
    code = "body_too_large"


class NoModelReady(ServingError):
    """Serving has no split (and so no weights) yet."""

    status_code = 503
    type = "not_ready"
    code = "no_model_ready"
    headers = {"Retry-After": "2"}


class GenerationNotLogged(ServingError):
    """The generation event could not be written to Kafka, so the completion is not shown."""

    status_code = 503
    type = "server_error"
    code = "generation_not_logged"
    headers = {"Retry-After": "5"}
