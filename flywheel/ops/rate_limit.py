"""Per-client request rates for an HTTP service (the collector, the gate), and a log that cannot be flooded.

`add_rate_limit(app, "200/second", service=...)` answers 429 with `Retry-After` to a client (its address)
past its rate, before the request reaches any route: nothing of its body is read, nothing is logged per
request, and `flywheel_rate_limited_total{service}` counts it. The health and metrics endpoints are never
limited (probes must answer). The window is `limits`' moving window in memory, whose per-client counters
expire, so many distinct clients cost bounded memory. Each process counts alone: under
`flywheel ingest collector --workers N` a client may send N times the rate in all.

`ThrottledLog` writes at most one line per interval for a noisy kind of event, saying how many it left out.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from limits import RateLimitItem, parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from prometheus_client import Counter
from starlette.types import ASGIApp, Receive, Scope, Send

RATE_LIMITED = Counter("flywheel_rate_limited_total", "Requests refused for their client's rate (429)", ["service"])
UNLIMITED_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


def parse_rate(text: str) -> RateLimitItem:
    """`"200/second"`, `"20 per second"`, `"1000/minute"`: `ValueError` saying how to write one."""
    try:
        return parse(text)
    except ValueError:
        raise ValueError(f"rate {text!r} is not a rate; write e.g. '200/second' or '1000/minute'") from None


class RateLimit:
    """ASGI middleware: a moving-window rate per client address (see the module docstring)."""

    def __init__(self, app: ASGIApp, rate: str, service: str) -> None:
        self.app = app
        self.item = parse_rate(rate)
        self.limiter = MovingWindowRateLimiter(MemoryStorage())
        self.service = service
        RATE_LIMITED.labels(service)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        who = client[0] if client else "unknown"
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


def add_rate_limit(app: Any, rate: str, *, service: str) -> None:
    """Limit every client of `app` (a Starlette / FastAPI app) to `rate`."""
    app.add_middleware(RateLimit, rate=rate, service=service)


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
