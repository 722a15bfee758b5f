"""What the collector's other doors (OTLP traces, PostHog) share with its Segment and native ones.

Each door checks credentials before it parses anything, reads the body capped as sent and as inflated
(413), turns it into an `Intake` (ingest/collector/intake.py), and answers only once Kafka acknowledged the accepted
events and the dead letters of the refused ones, produced together. A body that cannot be read at all is a
400 with its reason, and is kept as a dead letter too (less its credentials). The same counters as the
Segment door's are kept, by endpoint (ingest/metrics.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from flywheel.bus import Outgoing
from flywheel.settings import Settings
from ingest import metrics
from ingest.collector.intake import BodyError, Intake, decode_body
from ingest.dead_letters import DeadLetter, dead_letter


async def read_limited(request: Request, limit: int) -> bytes:
    """`request`'s body as sent (compressed or not), at most `limit` bytes: a larger one is a 413."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BodyError(413, f"body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass(frozen=True)
class Door:
    """Everything a door needs from the collector (ingest/collector/app.py builds one per app)."""

    settings: Settings
    send_all: Callable[[list[Outgoing]], None]  # returns once Kafka acknowledged them all
    write_keys: frozenset[str]
    max_body_bytes: int
    max_event_bytes: int
    # What the Segment and native doors do too (ingest/collector/app.py): event times bounded by arrival and
    # events by what the write key may speak for (`ingest.collector.arrival`), no configured secret in a dead letter
    # (`ingest.collector.redact`).
    bound: Callable[[Intake, datetime, str | None], Intake] = lambda intake, _at, _key: intake
    scrub: Callable[[DeadLetter], DeadLetter] = lambda letter: letter

    async def read_body(self, request: Request) -> bytes:
        """The body as sent, at most `max_body_bytes`."""
        return await read_limited(request, self.max_body_bytes)

    def inflate(self, request: Request, sent: bytes) -> bytes:
        """`sent` un-gzipped as its Content-Encoding says, to at most `max_body_bytes` (a gzip bomb is a 413)."""
        return decode_body(sent, request.headers.get("content-encoding"), self.max_body_bytes)

    async def keep_unreadable(self, exc: BodyError, endpoint: str, body: bytes, received_at: datetime) -> None:
        """A body refused as a whole with a 400 is dead-lettered (`body` already without credentials)."""
        if exc.status == 400:
            letter = self.scrub(dead_letter(exc.reason, f"http:{endpoint}", body, received_at))
            await run_in_threadpool(self.send_all, [letter.outgoing(self.settings.dead_letter_topic)])
            metrics.DEAD_LETTERED.labels("collector").inc()

    async def deliver(
        self, endpoint: str, intake: Intake, received_at: datetime, ignored: Mapping[str, int], key: str | None = None
    ) -> Intake:
        """Produce `intake`'s events (keyed by generation id) and its refusals' dead letters; count everything.
        `key`: the write key the request came with (its limits apply). Returns what was kept and refused once the
        time and scope bounds were applied: what the door's answer must count."""
        settings = self.settings
        intake = self.bound(intake, received_at, key)
        messages = [
            Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in intake.accepted
        ]
        messages += [
            self.scrub(dead_letter(r.reason, f"http:{endpoint}", r.original, received_at, r.sent_at)).outgoing(
                settings.dead_letter_topic
            )
            for r in intake.refused
        ]
        metrics.EVENTS_IN.labels("collector", endpoint).inc(len(intake.accepted) + len(intake.refused))
        if messages:
            await run_in_threadpool(self.send_all, messages)
        metrics.EVENTS_ACCEPTED.labels("collector").inc(len(intake.accepted))
        metrics.EVENTS_REFUSED.labels("collector").inc(len(intake.refused))
        metrics.DEAD_LETTERED.labels("collector").inc(len(intake.refused))
        for why, n in ignored.items():
            metrics.IGNORED.labels(endpoint, why).inc(n)
        metrics.REQUESTS.labels(endpoint, "200").inc()
        return intake
