"""The deploy gate's one error root: every refusal knows its HTTP status.

The API maps `GateError` to a JSON answer in one exception handler. Errors raised below
the gate become gate errors in `as_gate_error`: an unknown version is 404, a refused
token 401/403, a dependency that does not answer (Redis, MLflow, the token store) 503.
Anything else is an internal error whose text never reaches a client.
"""

from __future__ import annotations

import redis
import sqlalchemy.exc

from flywheel.identity import NotAllowed, NotAuthenticated
from model_registry import RegistryUnavailable, UnknownVersion


class GateError(Exception):
    """A gate action that cannot go ahead; `str(err)` is safe to show to the caller."""

    status_code: int = 400
    code: str = "gate_error"


class Unauthorized(GateError):
    """No bearer token, or one that identifies nobody."""

    status_code = 401
    code = "unauthorized"


class Forbidden(GateError):
    """A valid token whose role does not allow the action."""

    status_code = 403
    code = "forbidden"


class NotFound(GateError):
    status_code = 404
    code = "unknown_version"


class CorruptArtifact(GateError):
    """The version's stored files do not match its manifest; no user may receive it."""

    status_code = 409
    code = "artifact_corrupt"


class NotPending(GateError):
    """Only a pending candidate can be approved or rejected."""

    status_code = 409
    code = "not_pending"


class OfflineGateFailed(GateError):
    """The candidate failed an offline gate (deploy_gate.offline); the message names which and why."""

    status_code = 409
    code = "offline_gate_failed"


class NoChampion(GateError):
    status_code = 409
    code = "no_champion"


class NoChallenger(GateError):
    status_code = 409
    code = "no_challenger"


class ChallengerRunning(GateError):
    """One experiment at a time: the running challenger must be promoted or rolled back first."""

    status_code = 409
    code = "challenger_running"


class StalePlan(GateError):
    """The gate changed between planning and applying; plan again."""

    status_code = 409
    code = "stale_plan"


class ApplyFailed(GateError):
    """A step failed part-way; the message names the steps already applied."""

    status_code = 500
    code = "apply_failed"


class InvalidRequest(GateError):
    status_code = 422
    code = "invalid_request"


class GateBusy(GateError):
    """Another gate action holds the lock."""

    status_code = 409
    code = "gate_busy"


class DependencyUnavailable(GateError):
    """Redis, the registry or the token store does not answer; the request may be retried."""

    status_code = 503
    code = "dependency_unavailable"


def dependency_down(exc: BaseException) -> str | None:
    """Which dependency `exc` says is down, or None when it says something else."""
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return "Redis (the traffic split and the gate lock)"
    if isinstance(exc, RegistryUnavailable):
        return "the model registry (MLflow)"
    if isinstance(exc, sqlalchemy.exc.OperationalError):
        return "the token store"
    return None


# Every exception class `as_gate_error` answers for (the app registers one handler for each).
MAPPED: tuple[type[Exception], ...] = (
    GateError,
    UnknownVersion,
    NotAuthenticated,
    NotAllowed,
    RegistryUnavailable,
    redis.ConnectionError,
    redis.TimeoutError,
    sqlalchemy.exc.OperationalError,
)


def as_gate_error(exc: BaseException) -> GateError | None:
    """The gate's answer for `exc`, or None for a bug (an internal error).

    Messages come from errors whose text is known to be safe; a dependency's own error text
    (which may hold a URI with a password) is never used.
    """
    if isinstance(exc, GateError):
        return exc
    if isinstance(exc, UnknownVersion):
        return NotFound(str(exc))
    if isinstance(exc, NotAuthenticated):
        return Unauthorized(str(exc))
    if isinstance(exc, NotAllowed):
        return Forbidden(str(exc))
    down = dependency_down(exc)
    if down is not None:
        return DependencyUnavailable(f"{down} does not answer; try again shortly")
    return None
