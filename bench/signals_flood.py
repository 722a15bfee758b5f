"""One generation flooded with feedback: how long another generation on its partition waits for its reward.

One partition holds, in order: a generation whose window closed long ago, `--flood` distinct feedback events
for it (every one late), then another generation with its accept. A SignalsWorker (real broker, Redis) runs
until the other generation's first record is committed (timed from the end of its first batch that read
events, so the consumer group's join is left out); the baseline, in the same run, is the same stream without
the flood. The other generation's window is over when it arrives, so it is due at once. Printed: both times,
the batches between, the records emitted, the flooded generation's state in Redis and the events capped.
Before the per-generation bounds, 20,000 such events took 295 s, each emitting a full revision.

    python bench/signals_flood.py [--flood 20000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

from flywheel.bus import Outgoing, ensure_topics, make_producer
from flywheel.contract import Event, utcnow
from flywheel.settings import Settings
from launcher.embedded import free_port, start_broker
from signals.config import SignalsConfig
from signals.reward import DEFAULT_DEFINITION
from signals.worker import SignalsWorker
from simulator.telemetry import feedback_event, generation_event


def stream(flood: int) -> list[Event]:
    now = utcnow()
    old = now - timedelta(minutes=10)
    events = [generation_event("flooded", old, received_at=old)]
    events += [feedback_event("flooded", "copied", old + timedelta(seconds=1), received_at=now, n=i)
               for i in range(flood)]  # fmt: skip
    # the other generation's window is over when it arrives: the next event's arrival (the tick) closes it
    then = now - timedelta(minutes=1)
    other = [generation_event("other", then, received_at=then),
             feedback_event("other", "accepted", then + timedelta(seconds=1), received_at=then)]  # fmt: skip
    return [*events, *other, feedback_event("tick", "shown", now, received_at=now)]


def run(base: Settings, flood: int) -> dict[str, float]:
    tag = uuid.uuid4().hex[:6]
    settings = base.model_copy(update={"redis_prefix": f"bench:{tag}:", "events_topic": f"ev-{tag}",
                                       "rewards_topic": f"rw-{tag}", "dead_letter_topic": f"dl-{tag}"})  # fmt: skip
    ensure_topics(settings)
    producer = make_producer(settings)
    producer.send_all([Outgoing(settings.events_topic, e.to_bytes(), b"flooded") for e in stream(flood)], 120)
    producer.close()
    worker = SignalsWorker(settings, SignalsConfig(idle_after_s=60, poll_timeout_s=0.2))
    marker = worker.keys.marker(DEFAULT_DEFINITION.version, "other", 0)
    started = time.perf_counter()
    first_read: float | None = None  # the end of the first batch that read events (the group join is not timed)
    batches = 0
    try:
        while not worker.redis.exists(marker):
            worker.run_once()
            if worker.stats.events and first_read is None:
                first_read = time.perf_counter()
            batches += first_read is not None
            assert time.perf_counter() - started < 900, worker.stats
        took = time.perf_counter() - (first_read or started)
        state = worker.redis.get(worker.keys.gen("flooded")) or b""
    finally:
        worker.close()
    return {"seconds": took, "batches": batches, "records": worker.stats.records + worker.stats.revisions,
            "capped": worker.stats.capped, "state_bytes": len(state)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood", type=int, default=20_000, help="distinct feedback events for the flooded generation")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        broker = start_broker(port, Path(tmp) / "broker.log")
        try:
            base = Settings(data_dir=Path(tmp) / "data", kafka_bootstrap_servers=f"127.0.0.1:{port}",
                            topic_partitions=1, reward_window_s=2.0, allowed_lateness_s=0.5)  # fmt: skip
            bare = run(base, 0)
            flooded = run(base, args.flood)
        finally:
            broker.terminate()
            broker.wait(timeout=10)
    print(f"{args.flood:,} feedback events for one closed generation, then another generation, one partition")
    per_batch = flooded["seconds"] / max(1, flooded["batches"])
    print(f"  the other generation's record: {flooded['seconds']:.1f} s after the end of the worker's first batch, "
          f"{flooded['batches']:.0f} batches of at most {SignalsConfig().poll_max_records} events later "
          f"({per_batch:.2f} s a batch); without the flood {bare['seconds']:.2f} s, {bare['batches']:.0f} batch(es)")
    print(f"  records emitted in all: {flooded['records']:.0f} (without the flood {bare['records']:.0f}); the flooded "
          f"generation's state {flooded['state_bytes']:,.0f} bytes in Redis; {flooded['capped']:,.0f} events capped "
          f"(dead-lettered)")


if __name__ == "__main__":
    main()
