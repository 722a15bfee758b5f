"""The ingest worker's operational endpoints: Prometheus metrics, liveness and readiness.

A worker has no web framework of its own, so a standard-library `ThreadingHTTPServer` in a daemon
thread serves, on the host it is given (`settings.bind_host`, 127.0.0.1 by default):

- `GET /metrics`: every metric of the process's default registry (`ingest.metrics` among them);
- `GET /healthz`: 200 while the process runs;
- `GET /readyz`: 200 when `ready()` says so, else 503 with `{"ready": false, "reason": ...}`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

log = logging.getLogger(__name__)

Readiness = Callable[[], tuple[bool, str]]


class OpsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, ready: Readiness, host: str = "127.0.0.1") -> None:
        super().__init__((host, port), _Handler)
        self.ready = ready

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class _Handler(BaseHTTPRequestHandler):
    server: OpsServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._json(200, {"status": "ok"})
        elif path == "/readyz":
            try:
                ready, reason = self.server.ready()
            except Exception as exc:  # a readiness check that fails says not ready, with why
                ready, reason = False, f"readiness check failed: {exc}"
            self._json(200 if ready else 503, {"ready": ready, "reason": reason})
        else:
            self._json(404, {"error": f"no such endpoint {path}; try /metrics, /healthz or /readyz"})

    def _json(self, status: int, doc: dict[str, object]) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        # Scrapes every few seconds would drown the worker's own log lines.
        log.debug("ops http: " + format, *args)


def serve_ops(port: int, ready: Readiness, host: str = "127.0.0.1") -> OpsServer:
    """Start serving in a daemon thread and return the server (`shutdown()` stops it)."""
    server = OpsServer(port, ready, host)
    threading.Thread(target=server.serve_forever, name="ingest-ops-http", daemon=True).start()
    log.info("ingest worker metrics at http://%s:%d/metrics, health at /healthz and /readyz", host, server.port)
    return server
