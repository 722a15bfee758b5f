"""The model server: an OpenAI-compatible `POST /v1/completions`.

Each request is routed to champion or challenger by the traffic split (sticky per
user), answered by that version, and logged as a `generation` event on Kafka with
the completion's token ids and behaviour log-probs, *before* the answer returns:
a completion whose generation record could not be logged is never shown. Each generation
event carries serving's signature (flywheel.signing), the trainer's proof that serving, and
not some other holder of a write key, produced it.

Client errors are answered 400/413/422 in OpenAI's error shape (serving.errors); the body is
read and checked by serving.request.

Outages (Kafka, Redis, MLflow; at start too) are waited out, never a reason to exit: completions are
503 while Kafka is down, the split refresher keeps the split it has while Redis or the registry is
down (one log line per outage, retries with backoff), and `/readyz` (`flywheel.ops`) names what is down.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest

from flywheel.bus import BrokerUnavailable, Outgoing, Producer
from flywheel.contract import Event, EventType, GenerationRecord
from flywheel.ops import ProcessHealth, ops_router
from flywheel.ops.deps import Dependency, describe
from flywheel.signing import sign_generation
from serving.errors import ContextExceeded, GenerationNotLogged, ServingError
from serving.pool import PolicyPool, Route
from serving.request import MAX_BODY_BYTES, CompletionRequest, parse_completion_request, read_body, request_schema

log = logging.getLogger(__name__)


async def completion_request(request: Request) -> CompletionRequest:
    """The checked body (read within the app's size cap), or the ServingError that refuses it."""
    return parse_completion_request(await read_body(request, request.app.state.max_body_bytes))


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("flywheel_serving_requests", "Completions served", ["arm", "version"],
                                registry=self.registry)
        self.declined = Counter("flywheel_serving_declined", "Empty completions (nothing shown)", ["arm"],
                                registry=self.registry)
        self.log_failures = Counter("flywheel_serving_log_failures", "Generation events Kafka refused",
                                    registry=self.registry)
        self.latency = Histogram("flywheel_serving_latency_seconds", "Generation latency", ["arm"],
                                 registry=self.registry)


def create_app(
    pool: PolicyPool,
    producer: Producer,
    events_topic: str,
    *,
    signing_key: str,
    refresh_interval_s: float = 1.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    health: ProcessHealth | None = None,
) -> FastAPI:
    """The serving app; `signing_key` is `Settings.serving_key`, shared with the trainer. `health`: the
    process's dependencies (`serving.build_serving_app` gives Kafka, Redis and MLflow); a `split` check is
    added to it."""
    metrics = ServingMetrics()
    stop = threading.Event()
    health = health or ProcessHealth("serving")
    health.add_check("split", lambda: _split_check(pool))
    refresh = _Refresher(pool, health)

    def refresher() -> None:
        while not stop.wait(refresh.delay(refresh_interval_s)):
            refresh()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        refresh()
        thread = threading.Thread(target=refresher, name="split-refresher", daemon=True)
        thread.start()
        yield
        stop.set()
        thread.join(timeout=5)

    app = FastAPI(title="Flywheel serving", lifespan=lifespan)
    app.state.pool = pool
    app.state.max_body_bytes = max_body_bytes
    app.state.health = health

    @app.exception_handler(ServingError)
    async def _refused(_: Request, exc: ServingError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.post("/v1/completions", openapi_extra={"requestBody": request_schema()})
    def completions(req: Annotated[CompletionRequest, Depends(completion_request)]) -> dict[str, Any]:
        route = pool.route(req.user)
        check_fits_context(route, req)
        started = time.perf_counter()
        gen = route.policy.generate(req.prompt, max_tokens=req.max_tokens, temperature=req.temperature, seed=req.seed)
        latency_ms = (time.perf_counter() - started) * 1000
        generation_id = f"gen-{uuid.uuid4().hex}"
        record = GenerationRecord(
            prompt=req.prompt,
            prompt_token_ids=gen.prompt_token_ids,
            completion=gen.completion,
            completion_token_ids=gen.completion_token_ids,
            behaviour_logprobs=gen.logprobs,
            model_version=route.version,
            experiment=route.experiment,
            arm=route.arm,  # type: ignore[arg-type]
            latency_ms=latency_ms,
            finish_reason=gen.finish_reason,
            temperature=req.temperature,
        )
        record.signature = sign_generation(signing_key, generation_id, req.user, record)
        event = Event(
            type=EventType.GENERATION,
            generation_id=generation_id,
            user_id=req.user,
            session_id=req.session_id,
            source="serving",
            properties=record.model_dump(),
        )
        try:
            producer.send_all([Outgoing(events_topic, event.to_bytes(), key=generation_id.encode())])
        except BrokerUnavailable as exc:
            metrics.log_failures.inc()
            # Not a line per request: the Kafka dependency logs the outage once (`flywheel.ops`).
            log.debug("generation not logged, not shown", extra={"generation_id": generation_id,
                                                                  "detail": str(exc)})
            raise GenerationNotLogged("the generation could not be logged; retry later") from None
        metrics.requests.labels(route.arm, route.version).inc()
        metrics.latency.labels(route.arm).observe(latency_ms / 1000)
        if gen.finish_reason == "declined":
            metrics.declined.labels(route.arm).inc()
        n_prompt, n_completion = len(gen.prompt_token_ids), len(gen.completion_token_ids)
        return {
            "id": generation_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": route.version,
            "choices": [{"text": gen.completion, "index": 0, "logprobs": None, "finish_reason": gen.finish_reason}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                      "total_tokens": n_prompt + n_completion},
            "flywheel": {"generation_id": generation_id, "model_version": route.version, "arm": route.arm,
                         "experiment": route.experiment},
        }

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": v, "object": "model"} for v in pool.loaded_versions]}

    app.include_router(ops_router(health, lambda: generate_latest(metrics.registry) + generate_latest(REGISTRY)))

    return app


def check_fits_context(route: Route, req: CompletionRequest) -> None:
    """Prompt plus max_tokens must fit the context of the version that will answer (OpenAI's rule)."""
    context = route.policy.context
    n_prompt = max(1, len(route.policy.tokenizer(req.prompt)["input_ids"]))  # an empty prompt is one token
    if n_prompt + req.max_tokens > context:
        raise ContextExceeded(
            f"model version {route.version} has a {context}-token context, but the prompt is {n_prompt} "
            f"tokens and max_tokens is {req.max_tokens}; shorten the prompt or lower max_tokens",
            param="max_tokens",
        )


def _split_check(pool: PolicyPool) -> tuple[bool, str]:
    split = pool.split
    if split is None:
        return False, "no traffic split loaded yet"
    challenger = f", challenger {split.challenger_version} at {split.challenger_share:.0%}" \
        if split.challenger_version else ""
    return True, f"champion {split.champion_version}{challenger}"


class _Refresher:
    """One split refresh; an outage marks its dependency down (one line) and backs off, never a traceback."""

    def __init__(self, pool: PolicyPool, health: ProcessHealth) -> None:
        self._pool = pool
        self._health = health
        self._blamed: set[Dependency] = set()
        self._failures = 0
        self._last_error = ""

    def delay(self, interval_s: float) -> float:
        return min(5.0, interval_s * 2 ** min(self._failures, 8)) if self._failures else interval_s

    def __call__(self) -> None:
        try:
            self._pool.refresh()
        except Exception as exc:  # keep serving the current split; the next tick retries
            self._failures += 1
            dep = self._health.blame(exc)
            if dep is not None:
                dep.failed(exc)
                self._blamed.add(dep)
            elif describe(exc) != self._last_error:  # a new error: once, with its traceback
                log.exception("traffic split refresh failed")
            self._last_error = describe(exc)
            return
        for dep in self._blamed:
            dep.recovered()
        self._blamed.clear()
        self._failures = 0
        self._last_error = ""
