"""Dead letters: what failed validation, with its original bytes, the reason and where it came from.

The message value on `settings.dead_letter_topic` is JSON
`{"reason", "source", "original" (base64), "received_at"}`, plus `"sent_at"` for an item of a
Segment batch whose body carried one (the clock-skew correction needs it on replay). Nothing
that fails validation is dropped silently: the collector and the workers turn every
refusal into one of these and produce it before acknowledging / committing. It lives in the
core because more than one component writes them (ingest for bad input, signals for a
generation it cannot score).
"""

from __future__ import annotations

import base64
import json
import reprlib
from dataclasses import dataclass
from datetime import UTC, datetime

from flywheel.bus import Outgoing


@dataclass(frozen=True, slots=True)
class DeadLetter:
    reason: str
    source: str  # "http:/v1/batch" or "kafka:<topic>/<partition>/<offset>"
    original: bytes
    received_at: datetime
    # The `sentAt` of the Segment batch body the refused item came in (any JSON value, as sent), if any.
    sent_at: object = None

    def to_bytes(self) -> bytes:
        doc: dict[str, object] = {
            "reason": self.reason,
            "source": self.source,
            "original": base64.b64encode(self.original).decode("ascii"),
            "received_at": self.received_at.isoformat(),
        }
        if self.sent_at is not None:
            doc["sent_at"] = self.sent_at
        try:
            return json.dumps(doc).encode()
        except (ValueError, RecursionError):
            # A `sentAt` no JSON writer takes back (nested past its depth): it made every item of its batch
            # invalid anyway; the letter keeps its repr rather than failing the request.
            doc["sent_at"] = reprlib.repr(self.sent_at)
            return json.dumps(doc).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> DeadLetter:
        doc = json.loads(raw)
        return cls(
            reason=str(doc["reason"]),
            source=str(doc["source"]),
            original=base64.b64decode(doc["original"]),
            received_at=datetime.fromisoformat(doc["received_at"]),
            sent_at=doc.get("sent_at"),
        )

    def outgoing(self, topic: str, key: bytes | None = None) -> Outgoing:
        return Outgoing(topic=topic, value=self.to_bytes(), key=key)


def dead_letter(
    reason: str, source: str, original: bytes, received_at: datetime | None = None, sent_at: object = None
) -> DeadLetter:
    return DeadLetter(
        reason=reason,
        source=source,
        original=original,
        received_at=received_at or datetime.now(UTC),
        sent_at=sent_at,
    )
