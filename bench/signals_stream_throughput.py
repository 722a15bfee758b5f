"""Streaming signals worker throughput, in events/s, over the ingest worker's on the same topic.

Starts the embedded broker, uses the local Redis, fills one events topic with generations (generation,
shown, accepted; timed ten minutes ago, so every window closes as it is read), then drains it twice,
each with a consumer group of its own: (a) the ingest worker (validate, de-duplicate, write the lake,
commit), (b) the signals worker (watermarks, window state in Redis, scoring each micro-batch's closed
windows with the column expressions, records to Kafka and the lake). Each is timed from the end of its first
batch to the batch holding the topic's last event, records of every window closed by then sent (the group join is
not counted, nor the signals worker's idle wait that closes the windows still open at the end of the topic).

    python bench/signals_stream_throughput.py [--generations 20000] [--rounds 3]

With `--rounds`, the two drain the topic in turns (ingest, signals, ingest, ...), each with fresh groups, and the
median ratio is printed: on a shared machine one pass of each can land in different moments of load.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

from flywheel.bus import Outgoing, ensure_topics, make_producer
from flywheel.connections import delete_prefix, redis_client
from flywheel.contract import utcnow
from flywheel.settings import Settings
from ingest.worker import IngestWorker
from launcher.embedded import free_port, start_broker
from signals.config import SignalsConfig
from signals.worker import SignalsWorker
from simulator.telemetry import feedback_event, generation_event


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--generations", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=1, help="ingest then signals, this many times (median ratio)")
    ap.add_argument("--poll-max-records", type=int, default=SignalsConfig().poll_max_records,
                    help="the signals worker's batch (default: the product's)")  # fmt: skip
    args = ap.parse_args()
    if args.generations < 10_000:
        ap.error("--generations must be at least 10000: each worker's first batch (10,000 events) is not timed")
    tag = uuid.uuid4().hex[:6]
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        broker = start_broker(port, Path(tmp) / "broker.log")
        try:
            settings = Settings(
                data_dir=Path(tmp) / "data", kafka_bootstrap_servers=f"127.0.0.1:{port}",
                redis_prefix=f"bench:{tag}:", events_topic=f"ev-{tag}", rewards_topic=f"rw-{tag}",
                dead_letter_topic=f"dl-{tag}", reward_window_s=2.0, allowed_lateness_s=0.5,
            )  # fmt: skip
            ensure_topics(settings)
            t0 = utcnow() - timedelta(minutes=10)
            events = []
            for i in range(args.generations):
                gid, ts = f"t{i:07d}", t0 + timedelta(milliseconds=i)
                events += [generation_event(gid, ts), feedback_event(gid, "shown", ts),
                           feedback_event(gid, "accepted", ts + timedelta(milliseconds=300))]  # fmt: skip
            producer = make_producer(settings)
            producer.send_all([Outgoing(settings.events_topic, e.to_bytes(), e.generation_id.encode()) for e in events],
                              timeout_s=120)  # fmt: skip
            producer.close()
            n = len(events)

            try:
                rounds = [_round(settings, Path(tmp), f"{tag}-{k}", n, args.generations, args.poll_max_records)
                          for k in range(args.rounds)]  # fmt: skip
            finally:
                delete_prefix(redis_client(settings), settings.redis_prefix)  # the workers' window state
        finally:
            broker.terminate()
            broker.wait(timeout=10)
    print(f"{n:,} events ({args.generations:,} generations), one topic; the signals worker's batch "
          f"{args.poll_max_records:,} events, the ingest worker's "
          f"{inspect.signature(IngestWorker).parameters['batch_size'].default:,}")
    for k, (ingest_rate, signals_rate, timed_records) in enumerate(rounds):
        print(f"round {k + 1}: ingest worker {ingest_rate:,.0f} events/s, signals worker {signals_rate:,.0f} events/s "
              f"({timed_records:,} records in the timed part): {signals_rate / ingest_rate:.2f}")  # fmt: skip
    ratios = sorted(s / i for i, s, _ in rounds)
    spread = f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
    print(f"ratio signals/ingest: {statistics.median(ratios):.2f} (median of {len(ratios)}; {spread})")


def _round(settings: Settings, tmp: Path, tag: str, n: int, generations: int, batch: int) -> tuple[float, float, int]:
    """(ingest events/s, signals events/s, records sent in the signals worker's timed part): each worker reads the
    whole topic with a consumer group, a lake and (signals) a Redis prefix of its own."""
    ingest = IngestWorker(settings.model_copy(update={"data_dir": tmp / f"ingest-{tag}"}), group_id=f"i-{tag}")
    polled = 0
    while polled == 0:
        polled += ingest.run_once().polled
    first, t = polled, time.perf_counter()
    while polled < n:
        polled += ingest.run_once().polled
    ingest_rate = (n - first) / (time.perf_counter() - t)
    ingest.close()

    own = settings.model_copy(
        update={"data_dir": tmp / f"signals-{tag}", "redis_prefix": f"{settings.redis_prefix}{tag}:"}
    )
    worker = SignalsWorker(own, SignalsConfig(group_id=f"s-{tag}", poll_max_records=batch))
    while worker.stats.events == 0:
        worker.run_once()
    first, t = worker.stats.events, time.perf_counter()
    while worker.stats.events < n:
        worker.run_once()
    signals_rate = (n - first) / (time.perf_counter() - t)
    timed_records = worker.stats.records
    # Not timed: the last windows (the final reward_window_s of event time) close by the idle tick, after
    # `idle_after_s` of an empty topic; the ingest worker has no such wait either.
    while worker.stats.records < generations:
        worker.run_once()
    worker.close()
    return ingest_rate, signals_rate, timed_records


if __name__ == "__main__":
    main()
