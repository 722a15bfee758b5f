"""What a client may claim, bounded: event times by arrival, users and sources by its write key.

A client's clock may be skewed or forged; the collector's arrival time is not.
An accepted event's `ts` must lie in [received_at - behind, received_at + ahead]
(`Settings.event_time_behind_s`, `event_time_ahead_s`: five years of history behind, 24 h of clock skew
ahead, by default). Segment's own correction (`received_at - (sentAt - timestamp)`) is applied first, so a client
whose clock is merely wrong lands inside; what is still outside is dead-lettered with the reason (not
clamped: a clamped time would be a time nobody sent, and the letter can be replayed once corrected). This is
what keeps one far-future event from closing every reward window at once downstream.

A write key limited to sources or user-id prefixes (`flywheel.write_keys`) has every event outside them
dead-lettered with the reason: a key's holder cannot state another team's users' consent.
"""

from __future__ import annotations

from datetime import datetime

from flywheel.write_keys import KeyScope
from ingest.collector.intake import Intake, Refusal


def time_refusal(ts: datetime, received_at: datetime, ahead_s: float, behind_s: float) -> str | None:
    """Why `ts` is outside the window around `received_at`, or None when it is inside.

    >>> from datetime import UTC, timedelta
    >>> at = datetime(2026, 1, 1, tzinfo=UTC)
    >>> time_refusal(at + timedelta(hours=1), at, 86400, 86400) is None
    True
    >>> time_refusal(at + timedelta(days=2), at, 86400, 86400)[:38]
    'ts 2026-01-03T00:00:00+00:00 is 172800'
    """
    gap = (ts - received_at).total_seconds()
    if gap > ahead_s:
        return (f"ts {ts.isoformat()} is {gap:.0f} s after its arrival ({received_at.isoformat()}); "
                f"event times may be at most {ahead_s:.0f} s ahead (FLYWHEEL_EVENT_TIME_AHEAD_S)")
    if -gap > behind_s:
        return (f"ts {ts.isoformat()} is {-gap:.0f} s before its arrival ({received_at.isoformat()}); "
                f"event times may be at most {behind_s:.0f} s behind (FLYWHEEL_EVENT_TIME_BEHIND_S)")
    return None


def bound_by_arrival(
    intake: Intake, received_at: datetime, ahead_s: float, behind_s: float, scope: KeyScope | None = None
) -> Intake:
    """`intake` with every accepted event whose time is outside the window, or that its write key's `scope`
    may not speak for (`flywheel.write_keys`), moved to its refusals."""
    refused_at = {r.index for r in intake.refused}
    indices = (i for i in range(len(intake.accepted) + len(intake.refused)) if i not in refused_at)
    out = Intake(refused=list(intake.refused))
    for index, event in zip(indices, intake.accepted, strict=True):
        reason = time_refusal(event.ts, received_at, ahead_s, behind_s)
        if reason is None and scope is not None:
            reason = scope.refusal(event.source, event.user_id)
        if reason is None:
            out.accepted.append(event)
        else:
            out.refused.append(Refusal(index, event.event_id, reason, event.to_bytes()))
    out.refused.sort(key=lambda r: r.index)
    return out
