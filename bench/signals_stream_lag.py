"""Streaming lag: a window's close (window end + allowed lateness) -> its reward record on Kafka.

Starts the embedded broker, uses the local Redis, runs one SignalsWorker (in this process, alone with the
broker's client work) and, in processes of their own so they take none of its interpreter:
- a load generator sending generations (generation + shown + accepted, event time = now) at a steady rate,
  every 10 ms; events are written from byte templates and sent with librdkafka, so it reaches rates a
  pydantic model and a Python client per event could not (a few hundred generations/s on this machine);
- a reader noting when each reward arrives on the rewards topic, and the baseline, measured in the same run:
  a bare produce/consume round trip, a probe message sent with each tick to a topic of its own and read back.
Only windows closed while events still flowed count (the last window's worth closes by the idle tick,
`idle_after_s` after the topic goes quiet: reported apart). If the worker cannot keep up, its lag grows
through the run: compare the rate sent with the worker's rate, printed beside the lag.

    python bench/signals_stream_lag.py [--rate 100] [--seconds 15] [--kafka-client kafka-python|confluent]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import msgspec

from flywheel.bus import Outgoing, ensure_topics, make_producer
from flywheel.bus.reader import topic_reader
from flywheel.connections import delete_prefix, redis_client
from flywheel.settings import Settings
from launcher.embedded import free_port, start_broker
from signals.config import SignalsConfig
from signals.worker import SignalsWorker
from simulator.telemetry import feedback_event, generation_event

TICK_S = 0.01
_T0 = datetime(2001, 1, 1, tzinfo=UTC)
_T0_TEXT = b'"2001-01-01T00:00:00Z"'


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _templates() -> list[bytes]:
    """One generation's three events with `GID` for its id, `EID` in the event id and `_T0` for both times."""
    events = [generation_event("GID", _T0), feedback_event("GID", "shown", _T0), feedback_event("GID", "accepted", _T0)]
    out = []
    for k, e in enumerate(events):
        raw = e.to_bytes().replace(e.event_id.encode(), f"EID-{k}".encode())
        assert raw.count(_T0_TEXT) == 2, "both times are written as _T0"
        out.append(raw)
    return out


def produce(settings: dict[str, Any], probe_topic: str, rate: float, seconds: float, sent: Any, span: Any) -> None:
    """Send `rate` generations a second for `seconds` (plus a probe per tick); `sent`: generations sent, `span`:
    the wall-clock start and end of the sending."""
    s = Settings(**settings).model_copy(update={"kafka_client": "confluent"})
    producer = make_producer(s)
    templates = _templates()
    n, owed = 0, 0.0
    start = time.monotonic()
    span[0] = time.time()
    while (elapsed := time.monotonic() - start) < seconds:
        owed = rate * elapsed - n  # catch up after a slow tick: the rate is kept over the run
        now = datetime.now(UTC)
        ts = f'"{now:%Y-%m-%dT%H:%M:%S.%f}Z"'.encode()
        batch = [Outgoing(probe_topic, repr(time.time()).encode())]
        for _ in range(int(owed)):
            gid = f"b{n:08d}".encode()
            batch += [
                Outgoing(s.events_topic, t.replace(b"GID", gid).replace(b"EID", gid).replace(_T0_TEXT, ts), gid)
                for t in templates
            ]
            n += 1
        producer.send_all(batch, timeout_s=30)
        time.sleep(max(0.0, TICK_S - (time.monotonic() - start - elapsed)))
    span[1] = time.time()
    sent.value = n
    producer.close()


class _Line(msgspec.Struct):
    window_end: datetime


def read(settings: dict[str, Any], probe_topic: str, lateness_s: float, stop: MpEvent, out: Any) -> None:
    """Note each reward's lag after its window closed, and each probe's round trip, until `stop`."""
    s = Settings(**settings).model_copy(update={"kafka_client": "confluent"})
    decode = msgspec.json.Decoder(_Line).decode
    rewards: list[tuple[float, float]] = []  # (window close, arrival)
    probes: list[float] = []
    with topic_reader(s, s.rewards_topic) as rw, topic_reader(s, probe_topic) as pr:
        while not stop.is_set():
            for r in rw.poll(timeout_s=0.02):
                rewards.append((decode(r.value).window_end.timestamp() + lateness_s, time.time()))
            for r in pr.poll(timeout_s=0.005):
                probes.append(time.time() - float(r.value))
    out.put((rewards, probes))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=100.0, help="generations per second")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--kafka-client", choices=("kafka-python", "confluent"), default="kafka-python",
                    help="the signals worker's client (the load and the reader always use librdkafka)")  # fmt: skip
    args = ap.parse_args()
    tag = uuid.uuid4().hex[:6]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        broker = start_broker(port, Path(tmp) / "broker.log")
        try:
            fields: dict[str, Any] = dict(
                data_dir=str(Path(tmp) / "data"), kafka_bootstrap_servers=f"127.0.0.1:{port}",
                redis_prefix=f"bench:{tag}:", events_topic=f"ev-{tag}", rewards_topic=f"rw-{tag}",
                dead_letter_topic=f"dl-{tag}", reward_window_s=2.0, allowed_lateness_s=0.5,
                kafka_client=args.kafka_client,
            )  # fmt: skip
            settings = Settings(**fields)
            probe_topic = f"probe-{tag}"
            ensure_topics(settings, [settings.events_topic, settings.rewards_topic, settings.dead_letter_topic,
                                     probe_topic])  # fmt: skip
            stop, worker_stop = ctx.Event(), threading.Event()
            results, sent, span = ctx.Queue(), ctx.Value("q", 0), ctx.Array("d", 2)
            reader = ctx.Process(target=read, args=(fields, probe_topic, settings.allowed_lateness_s, stop, results))
            reader.start()
            worker = SignalsWorker(settings, SignalsConfig(group_id=f"s-{tag}"))
            thread = threading.Thread(target=worker.run, args=(worker_stop,), daemon=True)
            thread.start()
            deadline = time.monotonic() + 60
            while not worker._assigned:  # wait for the worker's group join before timing anything
                assert time.monotonic() < deadline, "the worker never got partitions"
                time.sleep(0.1)
            time.sleep(2.0)  # the reader's assignment, and the worker's first empty polls
            load = ctx.Process(target=produce, args=(fields, probe_topic, args.rate, args.seconds, sent, span))
            load.start()
            load.join()
            started, load_end = span[0], span[1]
            n = sent.value
            events_at_end = worker.stats.events
            deadline = time.monotonic() + 120
            while worker.stats.records < n:
                assert time.monotonic() < deadline, f"only {worker.stats.records} of {n} rewards were emitted"
                time.sleep(0.2)
            drained = time.time()
            time.sleep(1.0)  # the last records reach the reader
            stop.set()
            rewards, probes = results.get(timeout=60)
            reader.join(timeout=30)
            worker_stop.set()
            thread.join(timeout=10)
            delete_prefix(redis_client(settings), settings.redis_prefix)  # the worker's window state
        finally:
            broker.terminate()
            broker.wait(timeout=10)
    lateness = settings.allowed_lateness_s
    flowing = [arrival - close for close, arrival in rewards if close <= load_end]
    tail = [arrival - close for close, arrival in rewards if close > load_end]
    sent_rate = n / (load_end - started)
    print(
        f"load: {n:,} generations ({3 * n:,} events) in {load_end - started:.1f} s = {sent_rate:,.0f}/s "
        f"(asked {args.rate:,.0f}/s); window 2 s, lateness {lateness} s; worker client {args.kafka_client}"
    )
    print(
        f"worker: {events_at_end:,} of {3 * n:,} events read by the end of the load; all {n:,} records out "
        f"{drained - load_end:.1f} s after it"
    )
    print(
        f"window close -> reward on Kafka (windows closed while events flowed): p50 {pct(flowing, 0.5) * 1000:.0f} ms, "
        f"p99 {pct(flowing, 0.99) * 1000:.0f} ms, max {max(flowing, default=float('nan')) * 1000:.0f} ms "
        f"(n={len(flowing):,}); closed by the idle tick after the load: {len(tail):,}"
    )
    print(
        f"bare produce -> consume round trip: p50 {pct(probes, 0.5) * 1000:.0f} ms, "
        f"p99 {pct(probes, 0.99) * 1000:.0f} ms (n={len(probes):,})"
    )
    print(f"ratio p99 lag / p99 round trip: {pct(flowing, 0.99) / max(1e-6, pct(probes, 0.99)):.1f}x")


if __name__ == "__main__":
    main()
