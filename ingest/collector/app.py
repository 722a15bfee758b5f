"""The collector: HTTP in, Kafka out, acknowledged only after Kafka acknowledged.

- `POST /v1/events`: the native contract, `{"events": [<Event>...]}`.
- `POST /v1/track`, `POST /v1/batch`: Segment's HTTP Tracking API (what the Segment and
  RudderStack libraries send: gzip bodies, write key as HTTP basic auth user name).
- `POST /v1/traces`: OTLP/HTTP traces, protobuf or JSON; GenAI generation spans become `generation` events
  (ingest/collector/otlp.py, ingest/collector/otlp_genai.py).
- `POST /batch/`, `/capture/`: PostHog's capture API, as posthog-python sends it (ingest/collector/posthog.py).
- `GET /v1/schema`: the published JSON Schema of the envelope, with each event type's properties under
  `x-event-properties` (flywheel/event_properties.py: names, types, ranges, required or not).
- `/healthz`, `/readyz`, `/metrics` (`flywheel.ops`: the body every process answers; ready while Kafka answers).

Credentials come first: a write key in the Authorization header is checked before the
body is read, one carried only in the body before the body is parsed (a scan for that one
field); unknown or missing: 401 and nothing is produced. Bodies are capped as sent and as
inflated (413). Every client error is a 4xx with a reason, never a 500: a body that cannot
be read is a 400, an item that cannot be an event is refused alone (the rest of its batch
is taken). Refused items and bodies are answered and also produced to the dead-letter topic
with their bytes (less any credential field at any depth, and any configured write key wherever it
sits: `ingest.collector.redact`), the reason and the endpoint;
so is an event whose time is outside the window around its arrival (`arrival`). A dead letter is bounded
(`flywheel.dead_letters`: a cut original with its size and digest), so no refusal is too large for Kafka; a
message Kafka still finds too large (`MessageTooLarge`: a broker with a lower limit) is the request's fault, a 413,
and leaves readiness alone. Readiness follows the broker: a send that succeeds marks Kafka up again at once.
Parsing and validation run in a worker thread, never on the event loop, so a small request does
not wait behind a large batch's parse (`bench/collector_latency.py`). Kafka unreachable: 503 with
Retry-After. A client past `Settings.collector_rate_limit` gets 429 (`flywheel.ops.rate_limit`).
Requests in flight at the same time share one send to Kafka (`ingest.collector.group_send`).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.concurrency import run_in_threadpool

from flywheel.bus import BrokerUnavailable, MessageTooLarge, Outgoing, Producer, make_producer
from flywheel.contract import MAX_EVENT_BYTES, event_json_schema
from flywheel.logs import redact_access_log
from flywheel.ops import ProcessHealth, add_ops, freeze_startup, kafka_dependency
from flywheel.ops.rate_limit import add_rate_limit
from flywheel.settings import Settings, get_settings
from ingest import metrics
from ingest.collector.arrival import bound_by_arrival
from ingest.collector.doors import Door, read_limited
from ingest.collector.group_send import GroupSender
from ingest.collector.intake import (
    Body,
    BodyError,
    Intake,
    body_without_credentials,
    body_write_key,
    decode_body,
    native_intake,
    parse_json,
    segment_intake,
)
from ingest.collector.otlp import otlp_router
from ingest.collector.posthog import posthog_router
from ingest.collector.redact import SecretScrubber
from ingest.collector.surfaces import SurfaceCap
from ingest.dead_letters import dead_letter

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024
MISSING_KEY = "missing or unknown write key (send it as the HTTP basic auth user name)"
RETRY_AFTER_S = 5


# A request of at most this many messages is sent on a producer of its own: a producer's flush waits for
# everything buffered in it, so on a shared one a one-event request waited for a 4 MB batch's whole send.
SMALL_SEND = 100


class ProducerHolder:
    """Creates the producers on first use, so a collector started before Kafka still answers (503). Two lanes,
    each a producer and a group sender: small requests and the rest (`SMALL_SEND`); an injected producer
    serves both."""

    def __init__(self, settings: Settings, producer: Producer | None, send_timeout_s: float) -> None:
        self._settings = settings
        self._injected = producer
        self._producers: dict[str, Producer] = {}
        self._lock = threading.Lock()
        self.send_timeout_s = send_timeout_s
        self._groups = {lane: GroupSender(self._sender(lane)) for lane in ("bulk", "small")}

    def _sender(self, lane: str) -> Callable[[list[Outgoing]], None]:
        return lambda messages: self.get(lane).send_all(messages, timeout_s=self.send_timeout_s)

    def get(self, lane: str = "bulk") -> Producer:
        with self._lock:
            if self._injected is not None:
                return self._injected
            if lane not in self._producers:
                try:
                    self._producers[lane] = make_producer(
                        self._settings, max_block_ms=int(self.send_timeout_s * 1000)
                    )
                except Exception as exc:  # kafka-python raises NoBrokersAvailable from the constructor
                    raise BrokerUnavailable(
                        f"cannot connect to Kafka at {self._settings.kafka_bootstrap_servers}: {exc}"
                    ) from exc
            return self._producers[lane]

    def send_all(self, messages: list[Outgoing]) -> None:
        """Returns once Kafka acknowledged `messages`; concurrent requests of a lane share one send
        (`GroupSender`)."""
        self._groups["small" if len(messages) <= SMALL_SEND else "bulk"].send_all(messages)

    def close(self) -> None:
        with self._lock:
            for producer in [*self._producers.values(), *([self._injected] if self._injected else [])]:
                producer.close()
            self._producers.clear()
            self._injected = None


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
    key_scopes = settings.write_key_scopes
    # the last step of every dead letter (`ingest.collector.redact`): no configured secret leaves in one
    scrub = SecretScrubber([*write_keys, settings.serving_key.get_secret_value(),
                            settings.approval_token.get_secret_value()])  # fmt: skip
    redact_access_log()
    kafka = kafka_dependency(settings)
    health = ProcessHealth("collector", [kafka])
    surfaces = SurfaceCap(settings.collector_max_surfaces_per_key)  # new surface names per write key (`surfaces`)

    def send_all(messages: list[Outgoing]) -> None:
        """`holder.send_all`, and Kafka marked up once it acknowledged: readiness reflects the broker's state, so a
        failure reported moments ago is not held against it once a send succeeds."""
        holder.send_all(messages)
        kafka.recovered()

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        # Everything alive at start-up lives as long as the process: keep it out of the collector's way.
        # Without this, each request's few thousand new objects make Python's cyclic GC walk all of it
        # again; measured, half the time of mapping a Segment batch.
        freeze_startup()
        yield
        await run_in_threadpool(holder.close)

    app = FastAPI(title="Flywheel collector", lifespan=lifespan)
    add_rate_limit(app, settings.collector_rate_limit, service="collector", trusted_proxies=settings.trusted_proxies)
    app.state.producer_holder = holder

    @app.exception_handler(BodyError)
    async def _body_error(request: Request, exc: BodyError) -> JSONResponse:
        metrics.REQUESTS.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse({"error": exc.reason}, status_code=exc.status)

    @app.exception_handler(MessageTooLarge)
    async def _too_large(request: Request, exc: MessageTooLarge) -> JSONResponse:
        # The request's fault: Kafka is as up as it was (readiness untouched), and the same body fails the same way.
        metrics.REQUESTS.labels(request.url.path, "413").inc()
        log.warning("a message was too large for Kafka", extra={"path": request.url.path, "detail": str(exc)[:200]})
        return JSONResponse(
            {"error": "an event or dead letter of this request is larger than Kafka takes; the request is not "
                      "accepted: send smaller events (a retry is de-duplicated by event id)"},
            status_code=413,
        )  # fmt: skip

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

    def digest(
        sent: bytes, encoding: str | None, header_key: str | None, build: Any, received_at: datetime, source: str
    ) -> tuple[Intake, list[Outgoing]]:
        """Everything CPU-bound of one request: inflate, find a body's key, parse, validate, bound. Run in a
        worker thread, so a 4 MB batch never holds the event loop (and every small request behind it) for its
        whole parse; a body refused whole has its dead letter sent from here too."""
        body = sent
        parsed: Body | None = None
        try:
            # Inflated at most to the same limit as sent (a gzip bomb is a 413).
            body = decode_body(sent, encoding, max_body_bytes)
        except BodyError as exc:
            if header_key is None:  # no key could be read from it: the sender is unknown
                raise BodyError(401, MISSING_KEY) from None
            if exc.status == 400:
                letter = scrub.letter(dead_letter(exc.reason, source, body_without_credentials(sent), received_at))
                send_all([letter.outgoing(settings.dead_letter_topic)])
                metrics.DEAD_LETTERED.labels("collector").inc()
            raise
        body_key: str | None = None
        if header_key is None:
            body_key, parsed = body_write_key(body)
            if body_key is None or body_key not in write_keys:
                raise BodyError(401, MISSING_KEY)
        try:
            parsed = parsed or parse_json(body)
            try:
                intake: Intake = build(parsed.doc, received_at, parsed.lenient)
            except (ValueError, TypeError, OverflowError, RecursionError) as exc:
                # Items are judged one by one (a bad one is refused alone); this is a body no item reached.
                raise BodyError(400, f"body cannot be read: {type(exc).__name__}: {exc}") from None
            intake = bound_by_arrival(intake, received_at, settings.event_time_ahead_s, settings.event_time_behind_s,
                                      key_scopes.get(header_key or body_key or ""))
            intake = surfaces.bound(intake, header_key or body_key)
        except BodyError as exc:
            if exc.status == 400:
                # A body we cannot read is still kept (as a dead letter) for the sender to inspect, less its keys.
                letter = scrub.letter(
                    dead_letter(exc.reason, source, body_without_credentials(body, parsed), received_at)
                )
                send_all([letter.outgoing(settings.dead_letter_topic)])
                metrics.DEAD_LETTERED.labels("collector").inc()
            raise
        messages = [
            Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode())
            for e in intake.accepted
        ]
        messages += [
            scrub.letter(dead_letter(r.reason, source, r.original, received_at, r.sent_at)).outgoing(
                settings.dead_letter_topic
            )
            for r in intake.refused
        ]
        return intake, messages

    async def take(request: Request, endpoint: str, build: Any) -> dict[str, Any]:
        # Credentials first: nothing of a body is parsed or validated for a sender without a known write key.
        header_key = write_key_from_header(request.headers.get("authorization"))
        if header_key is not None and header_key not in write_keys:
            raise BodyError(401, "unknown write key")  # before reading the body: an unknown key costs nothing
        received_at = datetime.now(UTC)
        sent = await read_limited(request, max_body_bytes)
        intake, messages = await run_in_threadpool(
            digest, sent, request.headers.get("content-encoding"), header_key, build, received_at, f"http:{endpoint}"
        )
        metrics.EVENTS_IN.labels("collector", endpoint).inc(len(intake.accepted) + len(intake.refused))
        if messages:
            await run_in_threadpool(send_all, messages)
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
        return await take(
            request, "/v1/events", lambda doc, at, lenient: native_intake(doc, at, max_event_bytes, lenient=lenient)
        )

    @app.post("/v1/batch")
    async def batch(request: Request) -> dict[str, Any]:
        return await take(
            request,
            "/v1/batch",
            lambda doc, at, lenient: segment_intake(
                doc, at, single=False, max_event_bytes=max_event_bytes, lenient=lenient
            ),
        )

    @app.post("/v1/track")
    async def track(request: Request) -> Any:
        result = await take(
            request,
            "/v1/track",
            lambda doc, at, lenient: segment_intake(
                doc, at, single=True, max_event_bytes=max_event_bytes, lenient=lenient
            ),
        )
        # A single refused track call is the caller's error (and a 4xx stops Segment's retries).
        return JSONResponse(result, status_code=400 if result["refused"] else 200)

    @app.get("/v1/schema")
    async def schema() -> dict[str, Any]:
        return event_json_schema()

    # The doors for telemetry products already send: OpenTelemetry GenAI traces, PostHog's capture API.
    door = Door(
        settings, send_all, write_keys, max_body_bytes, max_event_bytes,
        bound=lambda intake, at, key: surfaces.bound(bound_by_arrival(intake, at, settings.event_time_ahead_s,
                                                       settings.event_time_behind_s, key_scopes.get(key or "")), key),
        scrub=scrub.letter,
    )  # fmt: skip
    app.include_router(otlp_router(door))
    app.include_router(posthog_router(door))

    # Under --workers N each process answers the metrics port too (SO_REUSEPORT), with the sum over all of them.
    add_ops(app, health, metrics_text, metrics_port=settings.collector_metrics_port, host=settings.bind_host,
            reuse_port=bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")))

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
