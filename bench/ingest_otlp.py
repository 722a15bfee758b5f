"""Collector throughput through `/v1/traces` (OTLP protobuf and JSON) over `/v1/batch` (Segment) for the same
generations, in one collector process.

The baseline is the Segment door taking the same generations as track calls (`generation` events with their
text properties): both end as the same events, validated by the same contract, produced to the embedded broker
and acknowledged by Kafka before the answer. Each app is driven in-process over ASGI (httpx.ASGITransport) with
several requests in flight, as `bench/ingest_collector.py` does; the figure is OTLP events/s over Segment events/s,
per round (the three in turn) and its median over rounds. On a loaded machine wall-clock rates swing with the
others' work: the same ratio by the process's CPU time (events per CPU-second) is printed beside it.

    python bench/ingest_otlp.py [--requests N] [--batch M] [--concurrency C]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from flywheel.bus import ensure_topics
from flywheel.settings import Settings
from ingest.collector.app import create_app
from launcher.embedded import free_port, start_broker

KEY = "dev-write-key"
START_NS = 1_777_000_000_000_000_000


def generation(k: int) -> dict[str, object]:
    """One generation, as both doors will carry it."""
    return {
        "id": f"chatcmpl-{k}",
        "user": f"user-{k % 100}",
        "model": "acme-chat-7b",
        "prompt": f"How do I reverse a list in Python? (question {k})",
        "completion": "Use `reversed(xs)` for an iterator, or `xs[::-1]` for a new list.",
    }


def segment_body(batch: int, start: int) -> bytes:
    messages = []
    for k in range(start, start + batch):
        g = generation(k)
        messages.append({
            "type": "track", "event": "generation", "messageId": f"seg-{k}", "userId": g["user"],
            "properties": {"generation_id": g["id"], "prompt": g["prompt"], "completion": g["completion"],
                           "model_version": g["model"], "surface": "chat", "finish_reason": "stop"},
            "timestamp": "2026-11-26T09:00:00.000Z",
        })  # fmt: skip
    return json.dumps({"batch": messages, "sentAt": "2026-11-26T09:00:01.000Z"}).encode()


def _kv(key: str, value: str | list[str]) -> KeyValue:
    if isinstance(value, list):
        any_value = AnyValue()
        any_value.array_value.values.extend(AnyValue(string_value=v) for v in value)
        return KeyValue(key=key, value=any_value)
    return KeyValue(key=key, value=AnyValue(string_value=value))


def otlp_request(batch: int, start: int) -> ExportTraceServiceRequest:
    """The same generations as GenAI chat spans (latest conventions, content as span attributes)."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.append(_kv("service.name", "acme-chat"))
    scope = resource_spans.scope_spans.add()
    scope.scope.name = "opentelemetry.instrumentation.openai_v2"
    for k in range(start, start + batch):
        g = generation(k)
        span = scope.spans.add(
            trace_id=k.to_bytes(16, "big"),
            span_id=(k + 1).to_bytes(8, "big"),
            name="chat acme-chat-7b",
            kind=3,  # CLIENT
            start_time_unix_nano=START_NS + k,
            end_time_unix_nano=START_NS + k + 900_000_000,
        )
        user_message = [{"role": "user", "parts": [{"type": "text", "content": g["prompt"]}]}]
        output = [
            {"role": "assistant", "parts": [{"type": "text", "content": g["completion"]}], "finish_reason": "stop"}
        ]
        span.attributes.extend([
            _kv("gen_ai.operation.name", "chat"), _kv("gen_ai.provider.name", "openai"),
            _kv("gen_ai.request.model", str(g["model"])), _kv("gen_ai.response.model", str(g["model"])),
            _kv("gen_ai.response.id", str(g["id"])), _kv("user.id", str(g["user"])),
            _kv("gen_ai.response.finish_reasons", ["stop"]),
            _kv("gen_ai.input.messages", json.dumps(user_message)),
            _kv("gen_ai.output.messages", json.dumps(output)),
        ])  # fmt: skip
    return request


def otlp_json(request: ExportTraceServiceRequest) -> bytes:
    doc = json_format.MessageToDict(request, use_integers_for_enums=True)  # as OTLP/JSON says
    for rs in doc["resourceSpans"]:
        for ss in rs["scopeSpans"]:
            for span in ss["spans"]:
                for name in ("traceId", "spanId"):
                    span[name] = base64.b64decode(span[name]).hex()  # OTLP/JSON ids are hex
    return json.dumps(doc).encode()


def all_taken(r: httpx.Response) -> bool:
    if r.headers["content-type"].startswith("application/x-protobuf"):
        return not ExportTraceServiceResponse.FromString(r.content).partial_success.rejected_spans
    doc = r.json()
    return not doc.get("refused") and not doc.get("partialSuccess")


async def drive(
    app: object, path: str, bodies: list[bytes], headers: dict[str, str], concurrency: int
) -> tuple[float, float]:
    """Post `bodies[1:]` with `concurrency` requests in flight after one warm-up; (seconds, CPU seconds of this
    process: the collector, its producer's threads and the in-process client) taken."""
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(base_url="http://bench", transport=transport) as client:
        r = await client.post(path, content=bodies[0], headers=headers)
        assert r.status_code == 200, r.text
        queue = list(reversed(bodies[1:]))

        async def sender() -> None:
            while queue:
                r = await client.post(path, content=queue.pop(), headers=headers)
                assert r.status_code == 200 and all_taken(r), r.text

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        return time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--batch", type=int, default=200, help="generations per request")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three in turn; medians over rounds")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-otlp-"))
    port = free_port()
    broker = start_broker(port, tmp / "broker.log")
    try:
        settings = Settings(data_dir=tmp, kafka_bootstrap_servers=f"127.0.0.1:{port}", topic_partitions=4)
        ensure_topics(settings)
        n, b = args.requests + 1, args.batch
        segment = [segment_body(b, i * b) for i in range(n)]
        requests = [otlp_request(b, i * b) for i in range(n)]
        protobuf = [r.SerializeToString() for r in requests]
        as_json = [otlp_json(r) for r in requests]
        auth = {"Authorization": f"Bearer {KEY}"}
        basic = {"Authorization": "Basic " + base64.b64encode(f"{KEY}:".encode()).decode()}
        runs = {
            "segment /v1/batch": ("/v1/batch", segment, {**basic, "Content-Type": "application/json"}),
            "otlp protobuf": ("/v1/traces", protobuf, {**auth, "Content-Type": "application/x-protobuf"}),
            "otlp json": ("/v1/traces", as_json, {**auth, "Content-Type": "application/json"}),
        }  # fmt: skip
        gc.freeze()  # as the service does at start-up
        events = args.requests * b
        wall: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):  # alternated, so the machine's load falls on all three alike
            for name, (path, bodies, headers) in runs.items():
                app = create_app(settings)
                seconds, cpu_seconds = asyncio.run(drive(app, path, bodies, headers, args.concurrency))
                app.state.producer_holder.close()
                wall[name].append(events / seconds)
                cpu[name].append(events / cpu_seconds)
        sizes = f"segment {len(segment[0])}, protobuf {len(protobuf[0])}, json {len(as_json[0])}"
        print(f"{args.requests} requests of {b} generations, {args.concurrency} in flight, one collector process,"
              f" {args.rounds} rounds; bytes per body: {sizes}")  # fmt: skip
        base = "segment /v1/batch"
        for name in runs:
            # Per round, against the baseline of the same round; the median over rounds.
            by_wall = statistics.median(w / s for w, s in zip(wall[name], wall[base], strict=True))
            by_cpu = statistics.median(c / s for c, s in zip(cpu[name], cpu[base], strict=True))
            print(f"{name:>18}: {statistics.median(wall[name]):,.0f} events/s, ratio {by_wall:.2f} | "
                  f"{statistics.median(cpu[name]):,.0f} events per CPU-second, ratio {by_cpu:.2f}")  # fmt: skip
    finally:
        broker.terminate()
        broker.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
