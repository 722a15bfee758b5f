"""Per-client request rates for an HTTP service (the collector, the gate), and a log that cannot be flooded.

`add_rate_limit(app, "200/second", service=...)` answers 429 with `Retry-After` to a client past its rate,
before the request reaches any route: nothing of its body is read, nothing is logged per request, and
`flywheel_rate_limited_total{service}` counts it. The client is what cannot be forged: the peer's address, unless
the peer is a trusted proxy (`Settings.trusted_proxies`, the Ingress), whose `X-Forwarded-For` then names the
client as its first untrusted hop from the right (what the proxies appended; whatever a client wrote to the left
of it is not read). A request with a token the service knows (`token_of`) is counted per token instead, so
approvers behind one address are not refused for another client's rate. Servers run uvicorn without its own
proxy-header handling, so the peer seen here is the socket's. The health and metrics endpoints are never
limited (probes must answer). The window is `limits`' moving window in memory, whose per-client counters
expire, so many distinct clients cost bounded memory. Each process counts alone: under
`flywheel ingest collector --workers N` a client may send N times the rate in all.

`ThrottledLog` writes at most one line per interval for a noisy kind of event, saying how many it left out.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from limits import RateLimitItem, parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from prometheus_client import Counter
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

RATE_LIMITED = Counter("flywheel_rate_limited_total", "Requests refused for their client's rate (429)", ["service"])
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def parse_rate(text: str) -> RateLimitItem:
    """`"200/second"`, `"20 per second"`, `"1000/minute"`: `ValueError` saying how to write one."""
    try:
        return parse(text)
    except ValueError:
        raise ValueError(f"rate {text!r} is not a rate; write e.g. '200/second' or '1000/minute'") from None


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(addresses: Sequence[str]) -> tuple[Network, ...]:
    """`Settings.trusted_proxies` as networks (an address alone is a network of one)."""
    return tuple(ipaddress.ip_network(a, strict=False) for a in addresses)


def _trusted(address: str, proxies: tuple[Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address.strip())
    except ValueError:
        return False
    return any(ip in net for net in proxies)


def client_address(scope: Scope, proxies: tuple[Network, ...]) -> str:
    """The client of an ASGI request: the peer, or behind trusted `proxies` the first untrusted hop of
    `X-Forwarded-For` from the right (the address the outermost trusted proxy saw).

    >>> proxies = networks(["10.0.0.0/8"])
    >>> scope = {"client": ("10.1.2.3", 1), "headers": [(b"x-forwarded-for", b"6.6.6.6, 203.0.113.9, 10.9.9.9")]}
    >>> client_address(scope, proxies), client_address({**scope, "client": ("198.51.100.1", 1)}, proxies)
    ('203.0.113.9', '198.51.100.1')
    """
    client = scope.get("client")
    peer = client[0] if client else "unknown"
    if not proxies or not _trusted(peer, proxies):
        return peer
    hops = [hop.strip() for name, value in scope.get("headers", ()) if name == b"x-forwarded-for"
            for hop in value.decode("latin-1").split(",")]  # fmt: skip
    for hop in reversed(hops):
        if not _trusted(hop, proxies):
            return hop[:64]
    return hops[0][:64] if hops else peer


def _authorization(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return None


class RateLimit:
    """ASGI middleware: a moving-window rate per client (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        rate: str,
        service: str,
        trusted_proxies: Sequence[str] = (),
        token_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.app = app
        self.item = parse_rate(rate)
        self.limiter = MovingWindowRateLimiter(MemoryStorage())
        self.service = service
        self.proxies = networks(trusted_proxies)
        self.token_of = token_of
        RATE_LIMITED.labels(service)

    async def _client(self, scope: Scope) -> str:
        authorization = _authorization(scope) if self.token_of is not None else None
        if authorization and self.token_of is not None:
            # whose token it is (a lookup: off the event loop); a token nobody holds counts as its address
            holder = await run_in_threadpool(self.token_of, authorization)
            if holder is not None:
                return "token:" + hashlib.sha256(holder.encode()).hexdigest()[:32]
        return client_address(scope, self.proxies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        who = await self._client(scope)
        if self.limiter.hit(self.item, self.service, who):
            await self.app(scope, receive, send)
            return
        RATE_LIMITED.labels(self.service).inc()
        retry = max(1, int(self.item.get_expiry()))
        body = json.dumps({"error": "rate_limited", "detail": f"more than {self.item} from this client; "
                           f"retry after {retry} s"}).encode()
        await send({"type": "http.response.start", "status": 429, "headers": [
            (b"content-type", b"application/json"), (b"retry-after", str(retry).encode()),
            (b"content-length", str(len(body)).encode()),
        ]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


def add_rate_limit(
    app: Any,
    rate: str,
    *,
    service: str,
    trusted_proxies: Sequence[str] = (),
    token_of: Callable[[str], str | None] | None = None,
) -> None:
    """Limit every client of `app` (a Starlette / FastAPI app) to `rate`: see the module docstring for who a
    client is. `token_of`: the holder of an `Authorization` header's token, None when nobody holds it."""
    app.add_middleware(RateLimit, rate=rate, service=service, trusted_proxies=trusted_proxies, token_of=token_of)


class ThrottledLog:
    """At most one log line per `every_s` for one kind of event; the next line counts those left out."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0) -> None:
        self._log = logger
        self._every = every_s
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._skipped = 0

    def warning(self, message: str, **extra: object) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._every:
                self._skipped += 1
                return
            skipped, self._skipped, self._last = self._skipped, 0, now
        self._log.warning(message, extra={**extra, "left_out_since_last_line": skipped})
