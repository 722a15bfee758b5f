"""Collector throughput through `/v1/batch` over a bare FastAPI endpoint that only parses the body.

Both apps are driven in-process over ASGI (httpx.ASGITransport) with the same Segment
batch body; the collector validates, maps, produces to the embedded broker and waits
for Kafka's acknowledgement before answering.

    python bench/ingest_collector.py [--requests N] [--batch M] [--clients kafka-python,confluent]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request

from flywheel.bus import ensure_topics
from flywheel.embedded import free_port, start_broker
from flywheel.settings import Settings
from ingest.collector import create_app

AUTH = {
    "Authorization": "Basic " + base64.b64encode(b"dev-write-key:").decode(),
    "Content-Type": "application/json",
}


def bare_app() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/batch")
    async def batch(request: Request) -> dict[str, object]:
        doc = json.loads(await request.body())
        return {"success": True, "accepted": len(doc["batch"])}

    return app


def body(batch: int, start: int) -> bytes:
    messages = [
        {
            "type": "track",
            "event": "accepted",
            "messageId": f"m-{start + i}",
            "userId": f"user-{i % 100}",
            "properties": {"generation_id": f"g-{start + i}", "accepted_chars": i % 40},
            "timestamp": "2024-05-01T12:00:00.000+00:00",
            "context": {"library": {"name": "analytics-python", "version": "2.4.0"}},
        }
        for i in range(batch)
    ]
    return json.dumps({"batch": messages, "sentAt": "2024-05-01T12:00:01.000+00:00"}).encode()


async def drive(app: FastAPI, bodies: list[bytes], concurrency: int) -> float:
    """Post `bodies[1:]` with `concurrency` requests in flight (as several SDK clients would); seconds taken."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
        r = await client.post("/v1/batch", content=bodies[0], headers=AUTH)  # warm up
        assert r.status_code == 200, r.text
        queue = list(reversed(bodies[1:]))

        async def sender() -> None:
            while queue:
                r = await client.post("/v1/batch", content=queue.pop(), headers=AUTH)
                assert r.status_code == 200 and not r.json().get("refused"), r.text

        started = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--clients", default="kafka-python,confluent", help="Kafka clients the collector produces with")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-collector-"))
    port = free_port()
    broker = start_broker(port, tmp / "broker.log")
    try:
        settings = Settings(data_dir=tmp, kafka_bootstrap_servers=f"127.0.0.1:{port}", topic_partitions=4)
        ensure_topics(settings)
        bodies = [body(args.batch, i * args.batch) for i in range(args.requests + 1)]
        gc.freeze()  # as the service does at start-up (both sides of the ratio run after it)
        events = args.requests * args.batch
        bare = events / asyncio.run(drive(bare_app(), bodies, args.concurrency))
        print(f"/v1/batch, {args.batch} events per request, {len(bodies[0])} bytes per body, "
              f"{args.concurrency} requests in flight")
        for client in args.clients.split(","):
            app = create_app(settings.model_copy(update={"kafka_client": client}))
            coll = events / asyncio.run(drive(app, bodies, args.concurrency))
            app.state.producer_holder.close()
            print(f"{client:>13}: bare parse {bare:,.0f} ev/s | collector {coll:,.0f} ev/s | ratio {coll / bare:.2f}")
    finally:
        broker.terminate()
        broker.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
