"""Write keys and what each may speak for.

`FLYWHEEL_WRITE_KEYS` is a comma-separated list of entries; an entry is a key alone (it may send any event)
or a key followed by `;`-separated limits: `source=<name>` (the event's `source` must be one of those named)
and `user=<prefix>` (its `user_id` must start with one of those named), e.g.
`k-web-Zx8...;source=web;user=acme:,k-ops-Q2v...`. The limits live beside the key in the secret, so a
deployment that gives a product team a key gives it only that team's users and sources, and so its
holder cannot state, for example, another user's consent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KeyScope:
    """What one write key may speak for; empty: anything.

    >>> KeyScope(sources=("web",), user_prefixes=("acme:",)).refusal("web", "acme:42") is None
    True
    >>> KeyScope(user_prefixes=("acme:",)).refusal("web", "other:1")
    "this write key may not speak for user 'other:1' (allowed prefixes: acme:)"
    """

    sources: tuple[str, ...] = ()
    user_prefixes: tuple[str, ...] = ()

    def refusal(self, source: str, user_id: str) -> str | None:
        if self.sources and source not in self.sources:
            return f"this write key may not send events of source {source!r} (allowed: {', '.join(self.sources)})"
        if self.user_prefixes and not user_id.startswith(self.user_prefixes):
            return (f"this write key may not speak for user {user_id!r} "
                    f"(allowed prefixes: {', '.join(self.user_prefixes)})")
        return None


def parse_write_keys(entries: list[str]) -> dict[str, KeyScope]:
    """`{key: scope}` from `FLYWHEEL_WRITE_KEYS` entries; `ValueError` naming the limit for a malformed one
    (never the key)."""
    out: dict[str, KeyScope] = {}
    for entry in entries:
        key, *limits = (part.strip() for part in entry.split(";"))
        sources: list[str] = []
        users: list[str] = []
        for limit in limits:
            name, sep, value = limit.partition("=")
            if not sep or not value or name not in ("source", "user"):
                raise ValueError(
                    f"FLYWHEEL_WRITE_KEYS: limit {name!r} of a key is not `source=<name>` or `user=<prefix>`"
                )
            (sources if name == "source" else users).append(value)
        out[key] = KeyScope(tuple(sources), tuple(users))
    return out
