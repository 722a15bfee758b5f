"""A small request's latency at the collector while 4 MB Segment batches arrive, against the same collector idle.

The collector is served over real HTTP by one process (as `flywheel ingest collector` runs it) against the
embedded broker. One client posts a one-event `/v1/batch` every 20 ms and times each answer: first with
nothing else in flight (the bare baseline), then while `--heavy` clients post 4 MB batches back to back.
The same is measured for the collector with each request's parse and validation moved back onto the
event loop (`--compare`, the default), so the two rows say what the move bought. Both have the collector's
two producer lanes (a small request's send never waits behind a big one's flush: `SMALL_SEND`); before
those, with the parse in a thread, the small request's p99 under the same load was 8.0 s. Printed: p50 and
p99 of the small request, and p99 loaded over p99 idle.

    python bench/collector_latency.py [--small 150] [--heavy 2] [--no-compare]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from ingest_collector import AUTH, served  # this folder's collector benchmark: its HTTP serving helper

from flywheel.bus import ensure_topics
from flywheel.contract import utcnow
from flywheel.settings import Settings
from ingest.collector.procs import COLLECTOR_APP
from launcher.embedded import free_port, settings_env, start_broker

MAX_BODY = 4 * 1024 * 1024


def on_loop_app() -> FastAPI:
    """The collector with each request's parse and validation run on the event loop (as before the move)."""
    import ingest.collector.app as collector

    threaded = collector.run_in_threadpool

    async def inline(fn: Callable[..., Any], *args: Any) -> Any:
        if fn.__name__ == "digest":
            return fn(*args)
        return await threaded(fn, *args)

    collector.run_in_threadpool = inline  # type: ignore[assignment]
    return collector.app_from_env()


def big_body(tag: str) -> bytes:
    """A Segment batch just under the collector's 4 MB body limit."""
    now = utcnow().isoformat()
    messages: list[dict[str, Any]] = []
    size = 40
    while True:
        i = len(messages)
        msg = {"type": "track", "event": "accepted", "messageId": f"{tag}-{i}", "userId": f"user-{i % 500}",
               "timestamp": now, "properties": {"generation_id": f"g-{tag}-{i}", "accepted_chars": i % 40},
               "context": {"library": {"name": "analytics-python", "version": "2.4.0"}, "ip": "10.0.0.1"}}  # fmt: skip
        size += len(json.dumps(msg)) + 2
        if size > MAX_BODY - 4096:
            break
        messages.append(msg)
    return json.dumps({"batch": messages, "sentAt": now}).encode()


def small_body(i: int) -> bytes:
    msg = {"type": "track", "event": "shown", "messageId": f"small-{i}-{time.monotonic_ns()}", "userId": "u",
           "properties": {"generation_id": f"gs-{i}"}}  # fmt: skip
    return json.dumps({"batch": [msg]}).encode()


def measure(base: str, small: int, heavy: int, bodies: list[bytes]) -> list[float]:
    """Seconds each of `small` one-event requests took, with `heavy` clients posting `bodies` meanwhile."""
    stop = threading.Event()
    big_done = [0]

    def flood() -> None:
        with httpx.Client(base_url=base, timeout=120) as client:
            i = 0
            while not stop.is_set():
                r = client.post("/v1/batch", content=bodies[i % len(bodies)], headers=AUTH)
                assert r.status_code == 200, r.text[:300]
                big_done[0] += 1
                i += 1

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(heavy)]
    for t in threads:
        t.start()
    if heavy:
        time.sleep(1.0)  # the big requests are in flight before the first small one
    took: list[float] = []
    with httpx.Client(base_url=base, timeout=120) as client:
        for i in range(small):
            started = time.perf_counter()
            r = client.post("/v1/batch", content=small_body(i), headers=AUTH)
            took.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text[:300]
            time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(300)
    if heavy:
        print(f"    ({big_done[0]} big batches answered meanwhile)")
    return took


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


def run(app: str, label: str, args: argparse.Namespace, bodies: list[bytes]) -> None:
    base, parent = served(app, 1)
    try:
        idle = measure(base, args.small, 0, bodies)
        loaded = measure(base, args.small, args.heavy, bodies)
    finally:
        parent.terminate()
        parent.join(60)
    print(f"{label:>24}: idle p50 {statistics.median(idle) * 1e3:7.1f} ms, p99 {p99(idle) * 1e3:7.1f} ms | "
          f"with {args.heavy} x 4 MB in flight p50 {statistics.median(loaded) * 1e3:7.1f} ms, "
          f"p99 {p99(loaded) * 1e3:7.1f} ms | p99 ratio {p99(loaded) / p99(idle):.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=150, help="small requests timed per condition")
    parser.add_argument("--heavy", type=int, default=2, help="clients posting 4 MB batches back to back")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="skip the collector with parsing on the event loop")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-collector-latency-"))
    port = free_port()
    broker = start_broker(port, tmp / "broker.log")
    try:
        settings = Settings(data_dir=tmp, kafka_bootstrap_servers=f"127.0.0.1:{port}", topic_partitions=4,
                            collector_rate_limit="100000/second")  # fmt: skip
        ensure_topics(settings)
        os.environ.update(settings_env(settings))
        bodies = [big_body(f"b{i}") for i in range(2)]
        print(f"small: a one-event /v1/batch every 20 ms; big: {len(bodies[0]):,} bytes, "
              f"{bodies[0].count(b'messageId'):,} events each; one collector process")
        run(COLLECTOR_APP, "collector (parse in thread)", args, bodies)
        if args.compare:
            run("collector_latency:on_loop_app", "parse on the event loop", args, bodies)
    finally:
        broker.terminate()
        broker.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
