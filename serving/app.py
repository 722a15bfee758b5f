"""The model server: an OpenAI-compatible `POST /v1/completions`.

Each request is routed to champion or challenger by the traffic split (sticky per
user), answered by that version, and each of its `n` choices is logged as a `generation`
event of its own on Kafka with the completion's token ids and behaviour log-probs, *before*
the answer returns: a completion whose generation record could not be logged is never shown,
streamed or not (a stream starts once its choices are logged). Each generation event carries
serving's signature (flywheel.signing), the trainer's proof that serving, and not some other
holder of a write key, produced it.

Concurrent requests share forward passes: the route picks a `Generator` (serving.generator, one
model version) and serving.batching batches the requests queued for it. Client errors are answered
400/413/422 in OpenAI's error shape (serving.errors); the body is read and checked by serving.request.

Outages (Kafka, Redis, MLflow; at start too) are waited out, never a reason to exit: completions are
503 while Kafka is down, the split refresher keeps the split it has while Redis or the registry is
down (one log line per outage, retries with backoff), and `/readyz` (`flywheel.ops`) names what is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool

from flywheel.bus import BrokerUnavailable, Outgoing, Producer
from flywheel.contract import Event, EventType, GenerationRecord
from flywheel.ops import ProcessHealth, add_ops
from flywheel.ops.deps import Dependency, describe
from flywheel.signing import sign_generation
from serving.batching import Batcher
from serving.errors import ContextExceeded, GenerationNotLogged, InvalidApiKey, ServingError
from serving.generator import Generation, Generator
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
        # Refused requests by status and code: the 5xx ones are serving's own errors (an alert reads them).
        self.errors = Counter("flywheel_serving_errors", "Requests answered with an error", ["status", "code"],
                              registry=self.registry)
        self.latency = Histogram("flywheel_serving_latency_seconds", "Generation latency", ["arm"],
                                 registry=self.registry)
        self.batch_size = Histogram("flywheel_serving_batch_size", "Requests per shared generation batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)


def create_app(
    pool: PolicyPool,
    producer: Producer,
    events_topic: str,
    *,
    signing_key: str,
    refresh_interval_s: float = 1.0,
    max_body_bytes: int = MAX_BODY_BYTES,
    health: ProcessHealth | None = None,
    max_batch: int = 16,
    max_batch_wait_s: float = 0.002,
    batch_workers: int = 1,
    on_shutdown: Callable[[], None] | None = None,
    api_keys: frozenset[str] = frozenset(),
    metrics_port: int = 0,
    bind_host: str = "127.0.0.1",
) -> FastAPI:
    """The serving app; `signing_key` is `Settings.serving_key`, shared with the trainer. `health`: the
    process's dependencies (`serving.build_serving_app` gives Kafka, Redis and MLflow); a `split` check is
    added to it. `max_batch` choices at most share a forward pass, after waiting at most
    `max_batch_wait_s` for each other (serving.batching); `batch_workers` batches are in flight at once (1 for the
    in-process back end; more for a back end that batches continuously itself, such as vLLM). `api_keys`: the
    keys `/v1/...` accepts as `Authorization: Bearer` (`Settings.serving_api_keys`); empty, it answers anyone.
    `metrics_port`: `/metrics` there (on `bind_host`) instead of the app's port (`Settings.serving_metrics_port`)."""
    metrics = ServingMetrics()
    batcher = Batcher(max_batch=max_batch, max_wait_s=max_batch_wait_s, workers=batch_workers,
                      on_batch=metrics.batch_size.observe)
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
        batcher.start()
        yield
        stop.set()
        batcher.stop()
        thread.join(timeout=5)
        if on_shutdown is not None:  # what the caller opened for the app (its producer, its split watcher)
            on_shutdown()

    app = FastAPI(title="Flywheel serving", lifespan=lifespan)
    app.state.pool = pool
    app.state.max_body_bytes = max_body_bytes
    app.state.health = health

    @app.exception_handler(ServingError)
    async def _refused(_: Request, exc: ServingError) -> JSONResponse:
        metrics.errors.labels(str(exc.status_code), exc.code).inc()
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    def caller(authorization: Annotated[str | None, Header()] = None) -> None:
        """With keys set, a `/v1` request must carry one of them (compared in constant time, each)."""
        if not api_keys:
            return
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip().encode(), k.encode())
                                                 for k in api_keys):  # fmt: skip
            raise InvalidApiKey("a valid API key is required: Authorization: Bearer <key>")

    @app.post("/v1/completions", openapi_extra={"requestBody": request_schema()}, dependencies=[Depends(caller)])
    async def completions(req: Annotated[CompletionRequest, Depends(completion_request)]) -> Response:
        route = pool.route(req.user)
        generator: Generator = route.policy
        check_fits_context(generator, route.version, req)
        started = time.perf_counter()
        gens = [await asyncio.wrap_future(f) for f in batcher.submit(generator, req.generation_requests())]
        latency_ms = (time.perf_counter() - started) * 1000
        choices = [_LoggedChoice.sign(signing_key, req, route, gen, latency_ms) for gen in gens]
        try:
            await run_in_threadpool(producer.send_all, [c.outgoing(events_topic) for c in choices])
        except BrokerUnavailable as exc:
            metrics.log_failures.inc()
            # Not a line per request: the Kafka dependency logs the outage once (`flywheel.ops`).
            log.debug("generations not logged, not shown",
                      extra={"generation_ids": [c.generation_id for c in choices], "detail": str(exc)})
            raise GenerationNotLogged("the generation could not be logged; retry later") from None
        metrics.requests.labels(route.arm, route.version).inc(len(choices))
        metrics.latency.labels(route.arm).observe(latency_ms / 1000)
        metrics.declined.labels(route.arm).inc(sum(g.finish_reason == "declined" for g in gens))
        answer = _Answer(req, route, generator, choices)
        if req.stream:
            return StreamingResponse(answer.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(answer.body())

    @app.get("/v1/models", dependencies=[Depends(caller)])
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": v, "object": "model"} for v in pool.loaded_versions]}

    add_ops(app, health, lambda: generate_latest(metrics.registry) + generate_latest(REGISTRY),
            metrics_port=metrics_port, host=bind_host)

    return app


def check_fits_context(generator: Generator, version: str, req: CompletionRequest) -> None:
    """Prompt plus max_tokens must fit the context of the version that will answer (OpenAI's rule)."""
    context = generator.context
    n_prompt = generator.count_prompt_tokens(req.prompt)
    if n_prompt + req.max_tokens > context:
        raise ContextExceeded(
            f"model version {version} has a {context}-token context, but the prompt is {n_prompt} "
            f"tokens and max_tokens is {req.max_tokens}; shorten the prompt or lower max_tokens",
            param="max_tokens",
        )


@dataclass(frozen=True)
class _LoggedChoice:
    """One choice: its generation and the signed event that logs it."""

    generation_id: str
    generation: Generation
    event: Event

    @classmethod
    def sign(cls, key: str, req: CompletionRequest, route: Route, gen: Generation, latency_ms: float) -> _LoggedChoice:
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
        record.signature = sign_generation(key, generation_id, req.user, record)
        event = Event(
            type=EventType.GENERATION,
            generation_id=generation_id,
            user_id=req.user,
            session_id=req.session_id,
            source="serving",
            properties=record.model_dump(),
        )
        return cls(generation_id, gen, event)

    def outgoing(self, topic: str) -> Outgoing:
        return Outgoing(topic, self.event.to_bytes(), key=self.generation_id.encode())


@dataclass(frozen=True)
class _Answer:
    """The OpenAI-shaped answer to a request whose choices are logged: one JSON body, or a stream."""

    req: CompletionRequest
    route: Route
    generator: Generator
    choices: list[_LoggedChoice]

    def _head(self) -> dict[str, Any]:
        return {"id": self.choices[0].generation_id, "object": "text_completion", "created": int(time.time()),
                "model": self.route.version}

    def _usage(self) -> dict[str, int]:
        n_prompt = len(self.choices[0].generation.prompt_token_ids)
        n_completion = sum(len(c.generation.completion_token_ids) for c in self.choices)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}

    def _flywheel(self) -> dict[str, Any]:
        ids = [c.generation_id for c in self.choices]
        return {"generation_id": ids[0], "generation_ids": ids, "model_version": self.route.version,
                "arm": self.route.arm, "experiment": self.route.experiment}

    def body(self) -> dict[str, Any]:
        return {
            **self._head(),
            "choices": [
                {"text": c.generation.completion, "index": i, "logprobs": self._logprobs(c.generation),
                 "finish_reason": c.generation.finish_reason, "generation_id": c.generation_id}
                for i, c in enumerate(self.choices)
            ],
            "usage": self._usage(),
            "flywheel": self._flywheel(),
        }

    def _logprobs(self, gen: Generation, start: int = 0, stop: int | None = None) -> dict[str, Any] | None:
        """OpenAI's completions `logprobs` for tokens [start:stop]: the behaviour log-probs as logged."""
        if self.req.logprobs is None:
            return None
        ids = gen.completion_token_ids
        texts = self.generator.token_texts(ids)
        offsets, at = [], len(self.req.prompt)
        for text in texts:
            offsets.append(at)
            at += len(text)
        top = None
        if gen.top_logprobs is not None:
            top = []
            for position in gen.top_logprobs:
                names = self.generator.token_texts([t for t, _ in position])
                entry: dict[str, float] = {}
                for name, (_, value) in zip(names, position, strict=True):
                    entry.setdefault(name, value)  # two ids with one text: the likelier one
                top.append(entry)
        cut = slice(start, stop)
        return {"tokens": texts[cut], "token_logprobs": gen.logprobs[cut],
                "top_logprobs": top[cut] if top is not None else None, "text_offset": offsets[cut]}

    def events(self) -> Iterator[str]:
        """Server-sent events: a chunk per sampled token, a last chunk per choice with its finish reason,
        the usage when asked for, then `[DONE]`. Each choice's chunks join to exactly its `text`."""
        head = self._head()
        for i, c in enumerate(self.choices):
            pieces = _pieces(c.generation.completion, self.generator.token_texts(c.generation.completion_token_ids))
            for k, piece in enumerate(pieces):
                last = k == len(pieces) - 1
                choice = {"text": piece, "index": i, "logprobs": self._logprobs(c.generation, k, k + 1),
                          "finish_reason": c.generation.finish_reason if last else None,
                          "generation_id": c.generation_id}
                yield _sse({**head, "choices": [choice]})
        if self.req.stream_options is not None and self.req.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": self._usage(), "flywheel": self._flywheel()})
        yield "data: [DONE]\n\n"


def _pieces(text: str, token_texts: list[str]) -> list[str]:
    """`text` split into one piece per token; a token whose text is not next in `text` (end-of-text, a
    token a stop sequence cut) gets an empty piece, and what is left joins the last piece."""
    pieces, at = [], 0
    for token in token_texts:
        piece = token if token and text.startswith(token, at) else ""
        pieces.append(piece)
        at += len(piece)
    pieces[-1] += text[at:]
    return pieces


def _sse(doc: dict[str, Any]) -> str:
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n"


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
