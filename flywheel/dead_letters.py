"""Dead letters: what failed validation, with its original bytes, the reason and where it came from.

The message value on `settings.dead_letter_topic` is JSON
`{"reason", "source", "original" (base64), "received_at"}`, plus `"sent_at"` for an item of a
Segment batch whose body carried one (the clock-skew correction needs it on replay). Nothing
that fails validation is dropped silently: the collector and the workers turn every
refusal into one of these and produce it before acknowledging / committing. It lives in the
core because more than one component writes them (ingest for bad input, signals for a
generation it cannot score).

Bounded: a letter is at most about `MAX_LETTER_BYTES`, far below Kafka's default 1 MiB message limit, so a
letter is never too large for the broker whatever it was refused for (a junk body of megabytes, one oversized
item). Original bytes past `MAX_ORIGINAL_BYTES` are cut; the letter then says so (`"truncated": true`) and
carries the whole original's size and SHA-256 (`original_bytes`, `original_sha256`), so the sender can match it.
A reason and a `sentAt` past their own limits are cut the same way. A cut letter cannot be replayed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import reprlib
from dataclasses import dataclass
from datetime import UTC, datetime

from flywheel.bus import Outgoing

# What a letter keeps: its original bytes (base64: 4/3 of them on the topic), its reason and its `sentAt` at most
# these sizes. With the rest of the letter, `MAX_LETTER_BYTES` at most. Twice the event limit: an item refused for
# being a little past it is kept whole.
MAX_ORIGINAL_BYTES = 512 * 1024
MAX_REASON_CHARS = 4096
MAX_SENT_AT_BYTES = 4096
MAX_LETTER_BYTES = MAX_ORIGINAL_BYTES * 4 // 3 + 6 * MAX_REASON_CHARS + MAX_SENT_AT_BYTES + 1024


def _cut_text(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"...[{len(text) - limit} characters cut]"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    reason: str
    source: str  # "http:/v1/batch" or "kafka:<topic>/<partition>/<offset>"
    original: bytes
    received_at: datetime
    # The `sentAt` of the Segment batch body the refused item came in (any JSON value, as sent), if any.
    sent_at: object = None
    # Read back from a cut letter (`to_bytes`): the whole original's size and digest; `original` is its start.
    original_size: int | None = None
    original_sha256: str | None = None

    @property
    def truncated(self) -> bool:
        """Whether `original` is only the start of what was refused (it cannot be replayed)."""
        return self.original_size is not None and self.original_size > len(self.original)

    def to_bytes(self) -> bytes:
        """The letter as produced, at most about `MAX_LETTER_BYTES` whatever it holds (see the module docstring)."""
        original = self.original
        doc: dict[str, object] = {
            "reason": _cut_text(self.reason, MAX_REASON_CHARS),
            "source": _cut_text(self.source, 512),
            "original": base64.b64encode(original[:MAX_ORIGINAL_BYTES]).decode("ascii"),
            "received_at": self.received_at.isoformat(),
        }
        if len(original) > MAX_ORIGINAL_BYTES or self.truncated:
            doc["truncated"] = True
            doc["original_bytes"] = self.original_size if self.truncated else len(original)
            doc["original_sha256"] = self.original_sha256 if self.truncated else hashlib.sha256(original).hexdigest()
        if self.sent_at is not None:
            try:
                sent_at = json.dumps(self.sent_at)
            except (ValueError, RecursionError):
                # A `sentAt` no JSON writer takes back (nested past its depth): it made every item of its batch
                # invalid anyway; the letter keeps its repr rather than failing the request.
                sent_at = json.dumps(reprlib.repr(self.sent_at))
            if len(sent_at) > MAX_SENT_AT_BYTES:
                sent_at = json.dumps(_cut_text(sent_at, MAX_SENT_AT_BYTES))
            # spliced in as written: written again one level deeper, a value at the writer's depth limit would fail
            return (json.dumps(doc)[:-1] + ', "sent_at": ' + sent_at + "}").encode()
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
            original_size=doc.get("original_bytes") if doc.get("truncated") else None,
            original_sha256=doc.get("original_sha256") if doc.get("truncated") else None,
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
