"""Find and redact secrets and personal data in text before it reaches training.

Patterns are deliberately conservative (high precision): e-mail addresses, phone numbers,
payment-card numbers (Luhn-checked), IP addresses, and common credential shapes (cloud
keys, API tokens, private-key blocks, JWTs, `password=...` assignments).

>>> scrub("mail bob@example.com, key AKIAABCDEFGHIJKLMNOP")
('mail <EMAIL>, key <SECRET>', ['email', 'secret'])
>>> scrub("x = 1")
('x = 1', [])
"""

from __future__ import annotations

import re

_SECRET_PATTERNS = [
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)",
    r"\bAKIA[0-9A-Z]{16}\b",  # AWS access key id
    r"\bgh[pousr]_[A-Za-z0-9]{36,}\b",  # GitHub tokens
    r"\bsk-[A-Za-z0-9_-]{20,}\b",  # OpenAI-style keys
    r"\bxox[abposr]-[A-Za-z0-9-]{10,}\b",  # Slack tokens
    r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\b",  # JWT
    r"(?i:\b(?:password|passwd|pwd|secret|api[_-]?key|access[_-]?token|auth[_-]?token)\b)\s*[:=]\s*"
    r"['\"]?[^\s'\"]{6,}['\"]?",
]
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("secret", re.compile("|".join(f"(?:{p})" for p in _SECRET_PATTERNS))),
    ("email", re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")),
    ("card", re.compile(r"\b(?:\d[ -]?){13,19}\b")),
    ("phone", re.compile(r"(?<![\w.])\+?\(?\d{1,4}\)?[ .-]\d{2,4}[ .-]\d{3,4}(?:[ .-]\d{2,4})?(?![\w.])")),
    ("ip", re.compile(r"\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b")),
]


def _luhn_ok(candidate: str) -> bool:
    digits = [int(c) for c in candidate if c.isdigit()]
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2 == 1:
            d = d * 2 - 9 if d * 2 > 9 else d * 2
        total += d
    return len(digits) >= 13 and total % 10 == 0


def scrub(text: str) -> tuple[str, list[str]]:
    """`text` with every finding replaced by `<KIND>`, and the kinds found (sorted, unique)."""
    found: set[str] = set()
    for kind, pattern in _PATTERNS:

        def _replace(match: re.Match[str], kind: str = kind) -> str:
            if kind == "card" and not _luhn_ok(match.group(0)):
                return match.group(0)  # long digit runs in code are usually not card numbers
            found.add(kind)
            return f"<{kind.upper()}>"

        text = pattern.sub(_replace, text)
    return text, sorted(found)
