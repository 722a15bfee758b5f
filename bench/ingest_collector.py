"""Collector throughput through `/v1/batch` over a bare FastAPI endpoint that only parses the body.

Both apps are driven in-process over ASGI (httpx.ASGITransport) with the same Segment
batch body; the collector validates, maps, produces to the embedded broker and waits
for Kafka's acknowledgement before answering.

With `--processes N`, both apps are served over real HTTP instead, each by N processes on one
port as `flywheel ingest collector --workers N` serves it (`ingest.collector.procs`), and every
request opens a new connection, so the kernel spreads them over the processes.

    python bench/ingest_collector.py [--requests N] [--batch M] [--clients kafka-python,confluent]
                                     [--processes N]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request

from flywheel.bus import ensure_topics
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.collector.procs import COLLECTOR_APP, serve
from launcher.embedded import free_port, settings_env, start_broker

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


async def drive(app: FastAPI | str, bodies: list[bytes], concurrency: int) -> float:
    """Post `bodies[1:]` with `concurrency` requests in flight (as several SDK clients would); seconds taken.
    `app`: an app driven in-process, or the base URL of one served over HTTP."""
    if isinstance(app, str):  # a new connection per request
        options: dict = {"base_url": app, "limits": httpx.Limits(max_keepalive_connections=0), "timeout": 60}
    else:
        options = {"base_url": "http://bench", "transport": httpx.ASGITransport(app=app)}
    async with httpx.AsyncClient(**options) as client:
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


def listeners(port: int) -> int:
    """Sockets listening on `port` on this machine (one per process under SO_REUSEPORT)."""
    hex_port = f":{port:04X}"
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            count += sum(1 for line in f.readlines()[1:] if (cols := line.split())[1].endswith(hex_port)
                         and cols[3] == "0A")
    return count


def served(app: str, processes: int) -> tuple[str, multiprocessing.process.BaseProcess]:
    """`app` ("module:factory") served by `processes` processes on a new port, once every one listens."""
    port = free_port()
    context = multiprocessing.get_context("spawn")
    parent = context.Process(target=serve, args=("127.0.0.1", port, processes, "warning", app))
    parent.start()
    deadline = time.monotonic() + 120
    while listeners(port) < processes:
        assert parent.is_alive() and time.monotonic() < deadline, f"{app} did not start"
        time.sleep(0.2)
    return f"http://127.0.0.1:{port}", parent


def over_http(settings: Settings, bodies: list[bytes], args: argparse.Namespace) -> None:
    os.environ.update(settings_env(settings))
    events = args.requests * args.batch

    def rate(app: str) -> float:
        base, parent = served(app, args.processes)
        try:
            return events / asyncio.run(drive(base, bodies, args.concurrency))
        finally:
            parent.terminate()
            parent.join(60)

    bare = rate("ingest_collector:bare_app")  # this file, found by the processes on sys.path
    print(f"/v1/batch over HTTP, {args.processes} process(es) per server, {args.batch} events per request, "
          f"{len(bodies[0])} bytes per body, {args.concurrency} requests in flight, a new connection each")
    for client in args.clients.split(","):
        os.environ["FLYWHEEL_KAFKA_CLIENT"] = client
        coll = rate(COLLECTOR_APP)
        print(f"{client:>13}: bare parse {bare:,.0f} ev/s | collector {coll:,.0f} ev/s | ratio {coll / bare:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--clients", default="kafka-python,confluent", help="Kafka clients the collector produces with")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--processes", type=int, default=0,
                        help="serve both apps over HTTP with this many processes each (0: in-process ASGI)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-collector-"))
    port = free_port()
    broker = start_broker(port, tmp / "broker.log")
    try:
        settings = Settings(data_dir=tmp, kafka_bootstrap_servers=f"127.0.0.1:{port}", topic_partitions=4)
        ensure_topics(settings)
        bodies = [body(args.batch, i * args.batch) for i in range(args.requests + 1)]
        if args.processes:
            over_http(settings, bodies, args)
            return
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
