"""No configured secret in a dead letter, wherever a client put it.

`ingest.intake.without_credentials` redacts credential fields by their parsed names at any depth; this is the
second, value-based line behind it: every write key the collector knows (and its URL-encoded, JSON-escaped and
HTTP basic auth forms) is replaced in a letter's original bytes, its reason and its `sentAt` before the letter
is produced. So a key sent under a name nobody expects, in a form body, inside `sentAt` or in a body that is not
JSON at all still never reaches the dead-letter topic.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import replace
from typing import Any
from urllib.parse import quote, quote_plus

from flywheel.dead_letters import DeadLetter
from ingest.intake import REDACTED


class SecretScrubber:
    """Replaces `secrets` in bytes, text and JSON-like values.

    >>> s = SecretScrubber(["k3y-secret"])
    >>> s.text("a k3y-secret b"), s.value({"x": ["k3y-secret"]})
    ('a [redacted] b', {'x': ['[redacted]']})
    """

    def __init__(self, secrets: Iterable[str]) -> None:
        forms: set[str] = set()
        for secret in secrets:
            if not secret:
                continue
            forms |= {secret, quote(secret, safe=""), quote_plus(secret), json.dumps(secret)[1:-1],
                      base64.b64encode(f"{secret}:".encode()).decode(), base64.b64encode(secret.encode()).decode()}
        # longest first: a form that contains another is replaced whole
        self._forms = sorted(forms, key=len, reverse=True)
        self._bytes = [f.encode() for f in self._forms]

    def bytes(self, raw: bytes) -> bytes:
        for form in self._bytes:
            if form in raw:
                raw = raw.replace(form, REDACTED.encode())
        return raw

    def text(self, text: str) -> str:
        for form in self._forms:
            if form in text:
                text = text.replace(form, REDACTED)
        return text

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.value(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value

    def letter(self, letter: DeadLetter) -> DeadLetter:
        return replace(letter, reason=self.text(letter.reason), original=self.bytes(letter.original),
                       sent_at=self.value(letter.sent_at))
