"""Streaming lag: a window's close (window end + allowed lateness) -> its reward record on Kafka.

Starts the embedded broker, uses the local Redis, runs one SignalsWorker in a thread and sends
generations (generation + shown + accepted, event time = now) at a steady rate. A reader thread
notes when each reward arrives on the rewards topic. The baseline, measured in the same run, is the
bare transport: the lag from an event's `received_at` to the moment a plain consumer of the events
topic sees it.

    python bench/signals_stream_lag.py [--rate 100] [--seconds 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

from flywheel.bus import Outgoing, ensure_topics, make_producer
from flywheel.bus.reader import topic_reader
from flywheel.contract import Event, RewardRecord, utcnow
from flywheel.settings import Settings
from launcher.embedded import free_port, start_broker
from signals.config import SignalsConfig
from signals.worker import SignalsWorker
from simulator.telemetry import feedback_event, generation_event


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def reader(settings: Settings, topic: str, stop: threading.Event, out: list[tuple[float, bytes]]) -> None:
    # Partitions assigned by hand (no group): a consumer-group join would delay the first reads by seconds.
    with topic_reader(settings, topic) as records:
        while not stop.is_set():
            polled = records.poll(timeout_s=0.1)
            now = time.time()
            out += [(now, r.value) for r in polled]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=100.0, help="generations per second")
    ap.add_argument("--seconds", type=float, default=15.0)
    args = ap.parse_args()
    tag = uuid.uuid4().hex[:6]
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        broker = start_broker(port, Path(tmp) / "broker.log")
        try:
            settings = Settings(
                data_dir=Path(tmp) / "data",
                kafka_bootstrap_servers=f"127.0.0.1:{port}",
                redis_prefix=f"bench:{tag}:",
                events_topic=f"ev-{tag}",
                rewards_topic=f"rw-{tag}",
                dead_letter_topic=f"dl-{tag}",
                reward_window_s=2.0,
                allowed_lateness_s=0.5,
            )
            ensure_topics(settings)
            stop = threading.Event()
            rewards: list[tuple[float, bytes]] = []
            events: list[tuple[float, bytes]] = []
            threads = [
                threading.Thread(target=reader, args=(settings, t, stop, out), daemon=True)
                for t, out in ((settings.rewards_topic, rewards), (settings.events_topic, events))
            ]
            worker = SignalsWorker(settings, SignalsConfig())
            threads.append(threading.Thread(target=worker.run, args=(stop,), daemon=True))
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while not worker._assigned:  # wait for the worker's group join before timing anything
                assert time.monotonic() < deadline, "the worker never got partitions"
                time.sleep(0.1)
            producer = make_producer(settings)
            n = 0
            t_end = time.monotonic() + args.seconds
            while time.monotonic() < t_end:
                tick = time.monotonic()
                batch = []
                for _ in range(max(1, int(args.rate / 10))):
                    now = utcnow()
                    gid = f"b{n:07d}"
                    n += 1
                    batch += [
                        generation_event(gid, now),
                        feedback_event(gid, "shown", now),
                        feedback_event(gid, "accepted", now),
                    ]
                producer.send_all(
                    [Outgoing(settings.events_topic, e.to_bytes(), e.generation_id.encode()) for e in batch]
                )
                time.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))
            deadline = time.monotonic() + 30
            while len({RewardRecord.model_validate_json(v).generation_id for _, v in rewards}) < n:
                assert time.monotonic() < deadline, f"only {len(rewards)} of {n} rewards arrived"
                time.sleep(0.2)
            stop.set()
            producer.close()
            for t in threads:
                t.join(timeout=10)
        finally:
            broker.terminate()
            broker.wait(timeout=10)
    lateness = settings.allowed_lateness_s
    lags = [t - (RewardRecord.model_validate_json(v).window_end.timestamp() + lateness) for t, v in rewards]
    transport = [t - Event.from_bytes(v).received_at.timestamp() for t, v in events]
    print(
        f"load: {n} generations ({3 * n} events) at {args.rate:.0f}/s for {args.seconds:.0f}s; window 2 s, "
        f"lateness {lateness} s"
    )
    print(
        f"window close -> reward on Kafka: p50 {pct(lags, 0.5) * 1000:.0f} ms, "
        f"p99 {pct(lags, 0.99) * 1000:.0f} ms, "
        f"max {max(lags) * 1000:.0f} ms (n={len(lags)})"
    )
    print(
        f"bare transport (received_at -> plain consumer): p50 {pct(transport, 0.5) * 1000:.0f} ms, "
        f"p99 {pct(transport, 0.99) * 1000:.0f} ms"
    )
    print(
        f"ratio p50 lag / p50 transport: {pct(lags, 0.5) / max(1e-6, pct(transport, 0.5)):.1f}x; "
        f"mean lag {statistics.mean(lags) * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
