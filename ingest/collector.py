"""The collector: HTTP in, Kafka out, acknowledged only after Kafka acknowledged.

- `POST /v1/events`: the native contract, `{"events": [<Event>...]}`.
- `POST /v1/track`, `POST /v1/batch`: Segment's HTTP Tracking API (what the Segment and
  RudderStack libraries send: gzip bodies, write key as HTTP basic auth user name).
- `GET /v1/schema`: the published JSON Schema of the envelope.
- `/healthz`, `/readyz`, `/metrics` (`flywheel.ops`: the body every process answers; ready while Kafka answers).

Refused events are answered item by item and also produced to the dead-letter
topic with their bytes, the reason and the endpoint. Unknown write key: 401 and
nothing is produced. Kafka unreachable: 503 with Retry-After. Requests in flight at the
same time share one send to Kafka (`ingest.group_send`).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import threading
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.concurrency import run_in_threadpool

from flywheel.bus import BrokerUnavailable, Outgoing, Producer, make_producer
from flywheel.contract import MAX_EVENT_BYTES, event_json_schema
from flywheel.ops import ProcessHealth, freeze_startup, kafka_dependency, ops_router
from flywheel.settings import Settings, get_settings
from ingest import metrics
from ingest.dead_letters import dead_letter
from ingest.group_send import GroupSender
from ingest.intake import BodyError, Intake, decode_body, native_intake, parse_json, segment_intake

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
RETRY_AFTER_S = 5


class ProducerHolder:
    """Creates the producer on first use, so a collector started before Kafka still answers (503)."""

    def __init__(self, settings: Settings, producer: Producer | None, send_timeout_s: float) -> None:
        self._settings = settings
        self._producer = producer
        self._lock = threading.Lock()
        self.send_timeout_s = send_timeout_s
        self._group = GroupSender(lambda messages: self.get().send_all(messages, timeout_s=self.send_timeout_s))

    def get(self) -> Producer:
        with self._lock:
            if self._producer is None:
                try:
                    self._producer = make_producer(
                        self._settings, max_block_ms=int(self.send_timeout_s * 1000)
                    )
                except Exception as exc:  # kafka-python raises NoBrokersAvailable from the constructor
                    raise BrokerUnavailable(
                        f"cannot connect to Kafka at {self._settings.kafka_bootstrap_servers}: {exc}"
                    ) from exc
            return self._producer

    def send_all(self, messages: list[Outgoing]) -> None:
        """Returns once Kafka acknowledged `messages`; concurrent requests share one send (`GroupSender`)."""
        self._group.send_all(messages)

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.close()
                self._producer = None


def write_key_from_header(authorization: str | None) -> str | None:
    """The user name of HTTP basic auth (Segment: `base64("<writeKey>:")`)."""
    if not authorization or not authorization.lower().startswith("basic "):
        return None
    try:
        decoded = base64.b64decode(authorization[6:].strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.split(":", 1)[0] or None


def create_app(
    settings: Settings,
    *,
    producer: Producer | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_event_bytes: int = MAX_EVENT_BYTES,
    send_timeout_s: float = 5.0,
) -> FastAPI:
    holder = ProducerHolder(settings, producer, send_timeout_s)
    write_keys = settings.write_key_set
    kafka = kafka_dependency(settings)
    health = ProcessHealth("collector", [kafka])

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        # Everything alive at start-up lives as long as the process: keep it out of the collector's way.
        # Without this, each request's few thousand new objects make Python's cyclic GC walk all of it
        # again; measured, half the time of mapping a Segment batch.
        freeze_startup()
        yield
        await run_in_threadpool(holder.close)

    app = FastAPI(title="Flywheel collector", lifespan=lifespan)
    app.state.producer_holder = holder

    @app.exception_handler(BodyError)
    async def _body_error(request: Request, exc: BodyError) -> JSONResponse:
        metrics.REQUESTS.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse({"error": exc.reason}, status_code=exc.status)

    @app.exception_handler(BrokerUnavailable)
    async def _broker_down(request: Request, exc: BrokerUnavailable) -> JSONResponse:
        metrics.BROKER_UNAVAILABLE.labels("collector").inc()
        metrics.REQUESTS.labels(request.url.path, "503").inc()
        kafka.failed(exc)  # one log line per outage, not one per refused request
        return JSONResponse(
            {"error": "Kafka is unreachable; nothing was accepted, retry later"},
            status_code=503,
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > max_body_bytes:
            raise BodyError(413, f"body is {declared} bytes; the limit is {max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise BodyError(413, f"body is over the {max_body_bytes}-byte limit")
            chunks.append(chunk)
        return decode_body(b"".join(chunks), request.headers.get("content-encoding"), max_body_bytes)

    def authorised(header_key: str | None, intake_key: Any) -> bool:
        key = header_key or (intake_key if isinstance(intake_key, str) else None)
        return key is not None and key in write_keys

    async def take(request: Request, endpoint: str, build: Any) -> dict[str, Any]:
        header_key = write_key_from_header(request.headers.get("authorization"))
        if header_key is not None and header_key not in write_keys:
            # Checked before reading the body: an unknown key costs us nothing.
            raise BodyError(401, "unknown write key")
        received_at = datetime.now(UTC)
        body = await read_body(request)
        try:
            doc = parse_json(body)
            intake: Intake = build(doc, received_at)
        except BodyError as exc:
            if exc.status == 400 and header_key is not None:
                # A body we cannot read is still kept (as a dead letter) for the sender to inspect.
                letter = dead_letter(exc.reason, f"http:{endpoint}", body, received_at)
                await run_in_threadpool(holder.send_all, [letter.outgoing(settings.dead_letter_topic)])
                metrics.DEAD_LETTERED.labels("collector").inc()
            raise
        if not authorised(header_key, intake.write_key):
            raise BodyError(401, "missing or unknown write key (send it as the HTTP basic auth user name)")
        source = f"http:{endpoint}"
        messages = [
            Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode())
            for e in intake.accepted
        ]
        messages += [
            dead_letter(r.reason, source, r.original, received_at, r.sent_at).outgoing(settings.dead_letter_topic)
            for r in intake.refused
        ]
        metrics.EVENTS_IN.labels("collector", endpoint).inc(len(intake.accepted) + len(intake.refused))
        if messages:
            await run_in_threadpool(holder.send_all, messages)
        metrics.EVENTS_ACCEPTED.labels("collector").inc(len(intake.accepted))
        metrics.EVENTS_REFUSED.labels("collector").inc(len(intake.refused))
        metrics.DEAD_LETTERED.labels("collector").inc(len(intake.refused))
        metrics.REQUESTS.labels(endpoint, "200").inc()
        return {
            "success": True,
            "accepted": len(intake.accepted),
            "refused": [r.public() for r in intake.refused],
        }

    @app.post("/v1/events")
    async def events(request: Request) -> dict[str, Any]:
        return await take(request, "/v1/events", lambda doc, at: native_intake(doc, at, max_event_bytes))

    @app.post("/v1/batch")
    async def batch(request: Request) -> dict[str, Any]:
        return await take(
            request,
            "/v1/batch",
            lambda doc, at: segment_intake(doc, at, single=False, max_event_bytes=max_event_bytes),
        )

    @app.post("/v1/track")
    async def track(request: Request) -> Any:
        result = await take(
            request,
            "/v1/track",
            lambda doc, at: segment_intake(doc, at, single=True, max_event_bytes=max_event_bytes),
        )
        # A single refused track call is the caller's error (and a 4xx stops Segment's retries).
        return JSONResponse(result, status_code=400 if result["refused"] else 200)

    @app.get("/v1/schema")
    async def schema() -> dict[str, Any]:
        return event_json_schema()

    app.include_router(ops_router(health, metrics_text))

    return app


def app_from_env() -> FastAPI:
    """The collector for the settings in the environment: what each process of `--workers N` builds."""
    return create_app(get_settings())


def metrics_text() -> bytes:
    """This process's metrics; under `flywheel ingest collector --workers N`, the sum over its N processes
    (prometheus-client's multiprocess mode, on when PROMETHEUS_MULTIPROC_DIR is set)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest()
