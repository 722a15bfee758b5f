"""`/metrics`, `/healthz` and `/readyz`, the same in every long-running process.

- `ops_router(health)`: a FastAPI router, for processes that are FastAPI apps already.
- `serve_ops(port, health)`: a standard-library HTTP server in a daemon thread, for plain workers.
- `add_ops(app, health, metrics_port=...)`: the router on an app; with a metrics port, `/metrics` moves off the
  app's port onto a `serve_ops` server of its own that lives as long as the app. A NetworkPolicy can then let
  monitoring reach the metrics port and nothing else (an API's port answers its callers, not Prometheus).

Both answer the `ProcessHealth` body (`flywheel.ops.health`); `/readyz` is 503 with Retry-After when
not ready, `/healthz` 503 when the worker loop's heartbeat is stale.
`/metrics` is the process's default Prometheus registry unless a process passes its own.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from flywheel.ops.health import ProcessHealth

log = logging.getLogger(__name__)

Metrics = Callable[[], bytes]
RETRY_AFTER_S = 5


def default_metrics() -> bytes:
    return generate_latest(REGISTRY)


def ops_router(health: ProcessHealth, metrics: Metrics | None = default_metrics) -> APIRouter:
    """`/healthz`, `/readyz` and, unless `metrics` is None (served on a port of its own), `/metrics`."""
    router = APIRouter(tags=["ops"])

    # Plain functions: FastAPI runs them in its thread pool, so a slow probe never blocks the event loop.
    @router.get("/healthz")
    def healthz() -> JSONResponse:
        alive, body = health.liveness()
        return JSONResponse(body, status_code=200 if alive else 503)

    @router.get("/readyz")
    def readyz() -> JSONResponse:
        ready, body = health.readiness()
        if ready:
            return JSONResponse(body)
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    if metrics is not None:
        scrape = metrics

        @router.get("/metrics")
        def prometheus() -> Response:
            return Response(scrape(), media_type=CONTENT_TYPE_LATEST)

    return router


def add_ops(app: FastAPI, health: ProcessHealth, metrics: Metrics = default_metrics, *, metrics_port: int = 0,
            host: str = "127.0.0.1", reuse_port: bool = False) -> None:
    """The ops endpoints on `app`. `metrics_port` 0: all three on the app's port. Otherwise `/metrics` is not on
    the app's port but on `host`:`metrics_port` (with `/healthz` and `/readyz`, as a worker's), served from the
    app's start-up to its shutdown. `reuse_port`: several processes of one server share the port (SO_REUSEPORT),
    each answering the same multi-process sum (the collector's `--workers N`)."""
    app.include_router(ops_router(health, None if metrics_port else metrics))
    if not metrics_port:
        return
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:  # the app's state, if its lifespan gives one
        server: OpsServer | None = None
        try:  # first: a slow start-up (serving loading its weights) is watched too
            server = serve_ops(metrics_port, health, host, metrics, reuse_port=reuse_port)
        except OSError as exc:  # another process holds the port: answering callers matters more
            log.error("%s does not serve /metrics: port taken", health.process,
                      extra={"service": health.process, "host": host, "port": metrics_port, "detail": str(exc)})
        try:
            async with inner(a) as state:
                yield state
        finally:
            if server is not None:
                server.stop()

    app.router.lifespan_context = lifespan


class OpsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, health: ProcessHealth, host: str = "127.0.0.1",
                 metrics: Metrics = default_metrics, *, reuse_port: bool = False) -> None:
        self.allow_reuse_port = reuse_port  # read by socketserver's bind, below
        super().__init__((host, port), _Handler)
        self.health = health
        self.metrics = metrics

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: OpsServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, self.server.metrics(), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            alive, body = self.server.health.liveness()
            self._json(200 if alive else 503, body)
        elif path == "/readyz":
            ready, body = self.server.health.readiness()
            self._json(200 if ready else 503, body, {} if ready else {"Retry-After": str(RETRY_AFTER_S)})
        else:
            self._json(404, {"error": f"no such endpoint {path}; try /metrics, /healthz or /readyz"})

    def _json(self, status: int, doc: dict[str, object], headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json", headers)

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        # Scrapes every few seconds would drown the process's own lines.
        log.debug("ops http: " + format, *args)


def serve_ops(port: int, health: ProcessHealth, host: str = "127.0.0.1",
              metrics: Metrics = default_metrics, *, reuse_port: bool = False) -> OpsServer:
    """Serve in a daemon thread and return the server (`stop()` ends it). Port 0 picks a free one."""
    server = OpsServer(port, health, host, metrics, reuse_port=reuse_port)
    threading.Thread(target=server.serve_forever, name=f"{health.process}-ops-http", daemon=True).start()
    log.info("%s serves /metrics, /healthz and /readyz", health.process,
             extra={"service": health.process, "url": f"http://{host}:{server.port}/readyz"})
    return server
