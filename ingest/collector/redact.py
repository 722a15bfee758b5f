"""No configured secret in a dead letter, wherever a client put it.

`ingest.collector.intake.without_credentials` redacts credential fields by their parsed names at any depth; this is the
second, value-based line behind it: every write key the collector knows (and its URL-encoded, JSON-escaped and
HTTP basic auth forms) is replaced in a letter's original bytes, its reason and its `sentAt` before the letter
is produced. So a key sent under a name nobody expects, in a form body, inside `sentAt` or in a body that is not
JSON at all still never reaches the dead-letter topic. A form body (`data=<base64 or lz64>`, as posthog-js sends)
hides a key inside an encoding: its base64 values are decoded and scrubbed like any text, and a long value that
does not decode to text (lz64, anything compressed) is not kept, only its size and digest (`_form`).
"""

from __future__ import annotations

import base64
import binascii
import builtins
import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any
from urllib.parse import parse_qsl, quote, quote_plus, urlencode

from flywheel.dead_letters import DeadLetter
from ingest.collector.intake import REDACTED

# `name=value&...` and nothing else: what an HTML form or posthog-js's `data=` body looks like.
_FORM = re.compile(rb"^[A-Za-z0-9_.$-]+=[A-Za-z0-9%+/=_.~*-]*(?:&[A-Za-z0-9_.$-]+=[A-Za-z0-9%+/=_.~*-]*)*$")
_SHORT = 64  # a form value up to this long is kept as it is (a flag, a name); longer ones are looked into


def _base64_text(value: str) -> str | None:
    """`value` decoded as base64 (standard or URL-safe), when that gives UTF-8 text; else None."""
    padded = value + "=" * (-len(value) % 4)
    for decode in (base64.b64decode, base64.urlsafe_b64decode):
        try:
            return decode(padded.encode()).decode()
        except (binascii.Error, ValueError):
            continue
    return None


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
        return self._form(raw) if _FORM.match(raw) else raw

    def _form(self, raw: builtins.bytes) -> builtins.bytes:
        """A URL-encoded form body with each encoded value decoded and scrubbed, or left out (see the module
        docstring). Short values stay as they are (a `compression=lz64` says how the rest was encoded)."""
        try:
            pairs = parse_qsl(raw.decode("ascii"), keep_blank_values=True, strict_parsing=True)
        except (UnicodeDecodeError, ValueError):
            return raw
        out = []
        for name, value in pairs:
            if len(value) > _SHORT:
                text = _base64_text(value)
                if text is None:
                    value = f"[not kept: an encoded value of {len(value)} characters, sha256 " \
                            f"{hashlib.sha256(value.encode()).hexdigest()}]"  # fmt: skip
                else:
                    value = self.text(text)
            out.append((name, self.text(value)))
        return urlencode(out).encode()

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
