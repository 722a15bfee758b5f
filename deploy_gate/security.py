"""Security headers on every gate response.

The dashboard loads only its own style sheet and script (no inline script, no other origin),
may not be framed (clickjacking an approve button), and no response is content-sniffed or
leaks its URL in a Referer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from flywheel.identity import Authenticator, NotAuthenticated

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    ]
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def add_security_headers(app: FastAPI) -> None:
    """Every response of `app` (errors and 404s included) carries `SECURITY_HEADERS`."""

    @app.middleware("http")
    async def security_headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        return response


def token_holder(authenticator: Authenticator) -> Callable[[str], str | None]:
    """Who holds an `Authorization` header's token (None: nobody, or a revoked token): the gate's rate limit
    counts a known token's requests per token, not per address (`flywheel.ops.rate_limit`)."""

    def holder(authorization: str) -> str | None:
        try:
            return authenticator.identify(authorization).name
        except NotAuthenticated:
            return None

    return holder
