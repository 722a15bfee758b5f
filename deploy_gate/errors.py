"""The deploy gate's one error root: every refusal knows its HTTP status.

The API maps `GateError` to a JSON answer in one exception handler; anything else
is an internal error whose text never reaches a client.
"""

from __future__ import annotations


class GateError(Exception):
    """A gate action that cannot go ahead; `str(err)` is safe to show to the caller."""

    status_code: int = 400
    code: str = "gate_error"


class Unauthorized(GateError):
    status_code = 401
    code = "unauthorized"


class UnknownVersion(GateError):
    status_code = 404
    code = "unknown_version"


class NotPending(GateError):
    """Only a pending candidate can be approved or rejected."""

    status_code = 409
    code = "not_pending"


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
