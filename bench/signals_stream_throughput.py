"""Streaming signals worker throughput, in events/s, over the ingest worker's on the same topic.

Starts the embedded broker, uses the local Redis, fills one events topic with generations (generation,
shown, accepted; timed ten minutes ago, so every window closes as it is read), then drains it twice,
each with a consumer group of its own: (a) the ingest worker (validate, de-duplicate, write the lake,
commit), (b) the signals worker (watermarks, window state in Redis, scoring each micro-batch's closed
windows with the column expressions, records to Kafka and the lake). Each is timed from the end of its first
batch to the batch holding the topic's last event, records of every window closed by then sent (the group join is
not counted, nor the signals worker's idle wait that closes the windows still open at the end of the topic).

    python bench/signals_stream_throughput.py [--generations 20000] [--rounds 3] [--floor]

With `--floor`, each round also drains the topic with (c) the signals worker's floor: the worker with its window
rules and scoring taken out (`_FloorWorker`), keeping what its contract asks of any rules: the same poll and
validation (an event is taken exactly when ingest takes it), each generation's state (its generation, feedback
and event ids) in Redis by the same Lua commit, one record per generation on the rewards topic (one Kafka message
a record, kafka-python's `send` by default) and in the lake, through the same outbox. Its ratio over ingest is the
most the signals worker could reach with any window logic and scoring, however cheap.

With `--rounds`, the workers drain the topic in turns (ingest, signals, ingest, ...), each with fresh groups, and the
median ratio is printed: on a shared machine one pass of each can land in different moments of load. Beside it, the
same ratio by this process's CPU time (events per CPU-second, client threads included), which load moves far less:
the signals worker also waits on Redis, the broker and the lake, so where a core is free its wall ratio can exceed
the CPU one, and on a busy machine falls below it.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

from flywheel.bus import Outgoing, RecordBatch, ensure_topics, make_producer
from flywheel.connections import delete_prefix, redis_client
from flywheel.contract import EventType, utcnow
from flywheel.settings import Settings
from ingest.worker.loop import IngestWorker
from launcher.embedded import free_port, start_broker
from signals.config import SignalsConfig
from signals.events import FeedbackEvent, GenerationInfo, decode_batch, from_us
from signals.sink import RecordLine, encode_line
from signals.state import CommitPlan, GenState
from signals.worker import SignalsWorker
from simulator.telemetry import feedback_event, generation_event


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--generations", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=1, help="ingest then signals, this many times (median ratio)")
    ap.add_argument("--floor", action="store_true", help="also drain with the floor worker (no rules, no scoring)")
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
                rounds = [_round(settings, Path(tmp), f"{tag}-{k}", n, args.generations, args.poll_max_records,
                                 args.floor) for k in range(args.rounds)]  # fmt: skip
            finally:
                delete_prefix(redis_client(settings), settings.redis_prefix)  # the workers' window state
        finally:
            broker.terminate()
            broker.wait(timeout=10)
    print(f"{n:,} events ({args.generations:,} generations), one topic; the signals worker's batch "
          f"{args.poll_max_records:,} events, the ingest worker's "
          f"{inspect.signature(IngestWorker).parameters['batch_size'].default:,}")
    for k, r in enumerate(rounds):
        print(f"round {k + 1}: ingest worker {r.ingest:,.0f} events/s, signals worker {r.signals:,.0f} events/s "
              f"({r.timed_records:,} records in the timed part): {r.signals / r.ingest:.2f}; per CPU-second "
              f"{r.ingest_cpu:,.0f} and {r.signals_cpu:,.0f}: {r.signals_cpu / r.ingest_cpu:.2f}")  # fmt: skip
        if r.floor is not None:
            print(f"         floor worker {r.floor[0]:,.0f} events/s: {r.floor[0] / r.ingest:.2f} of ingest's; "
                  f"per CPU-second {r.floor[1]:,.0f}: {r.floor[1] / r.ingest_cpu:.2f}")  # fmt: skip
    ratios_of = [("ratio signals/ingest", sorted(r.signals / r.ingest for r in rounds)),
                 ("by CPU time", sorted(r.signals_cpu / r.ingest_cpu for r in rounds))]  # fmt: skip
    floored = [(r.floor, r) for r in rounds if r.floor is not None]
    if floored:
        ratios_of += [("floor/ingest", sorted(f[0] / r.ingest for f, r in floored)),
                      ("floor/ingest by CPU time", sorted(f[1] / r.ingest_cpu for f, r in floored))]  # fmt: skip
    for what, ratios in ratios_of:
        print(f"{what}: {statistics.median(ratios):.2f} (median of {len(ratios)}; {ratios[0]:.2f}-{ratios[-1]:.2f})")


class Round(NamedTuple):
    """One drain by each worker: events/s of wall time and of this process's CPU time (its client threads' too),
    and the records the signals worker sent in its timed part."""

    ingest: float
    signals: float
    timed_records: int
    ingest_cpu: float
    signals_cpu: float
    floor: tuple[float, float] | None  # the floor worker's events/s of wall and of CPU time (`--floor`)


def _round(settings: Settings, tmp: Path, tag: str, n: int, generations: int, batch: int, floor: bool) -> Round:
    """Each worker reads the whole topic with a consumer group, a lake and (signals) a Redis prefix of its own."""
    ingest = IngestWorker(settings.model_copy(update={"data_dir": tmp / f"ingest-{tag}"}), group_id=f"i-{tag}")
    polled = 0
    while polled == 0:
        polled += ingest.run_once().polled
    first, t, cpu = polled, time.perf_counter(), time.process_time()
    while polled < n:
        polled += ingest.run_once().polled
    ingest_rate = (n - first) / (time.perf_counter() - t)
    ingest_cpu = (n - first) / (time.process_time() - cpu)
    ingest.close()

    signals_rate, signals_cpu, timed_records = _drain(SignalsWorker, settings, tmp, tag, n, generations, batch)
    floor_rates = _drain(_FloorWorker, settings, tmp, f"{tag}f", n, generations, batch)[:2] if floor else None
    return Round(ingest_rate, signals_rate, timed_records, ingest_cpu, signals_cpu, floor_rates)


def _drain(
    kind: type[SignalsWorker], settings: Settings, tmp: Path, tag: str, n: int, generations: int, batch: int
) -> tuple[float, float, int]:
    """A signals worker of `kind` drains the topic: its events/s of wall and CPU time, and records sent while timed."""
    own = settings.model_copy(
        update={"data_dir": tmp / f"signals-{tag}", "redis_prefix": f"{settings.redis_prefix}{tag}:"}
    )
    worker = kind(own, SignalsConfig(group_id=f"s-{tag}", poll_max_records=batch))
    while worker.stats.events == 0:
        worker.run_once()
    first, t, cpu = worker.stats.events, time.perf_counter(), time.process_time()
    while worker.stats.events < n:
        worker.run_once()
    signals_rate = (n - first) / (time.perf_counter() - t)
    signals_cpu = (n - first) / (time.process_time() - cpu)
    timed_records = worker.stats.records
    # Not timed: the last windows (the final reward_window_s of event time) close by the idle tick, after
    # `idle_after_s` of an empty topic; the ingest worker has no such wait either.
    while worker.stats.records < generations:
        worker.run_once()
    worker.close()
    return signals_rate, signals_cpu, timed_records


class _FloorWorker(SignalsWorker):
    """The signals worker less its window rules and scoring: each batch's events validated as the worker's are,
    each generation's state (generation, feedback, event ids) written by the same Lua commit, and one record per
    generation event, a fixed reward with the signals such a window gives, sent on through the same outbox (one
    Kafka message a record, a lake row). No state is read back, no watermark kept, no window closed: what it
    costs, any rules cost at least."""

    _SIGNALS = {"declined": 0.0, "feedback_events": 2.0, "shown": 1.0, "accepted": 1.0, "accepted_fraction": 0.6,
                "accepted_chars": 12.0, "dwell_s": 0.3}  # fmt: skip

    def _process(self, records: RecordBatch) -> None:
        events, _ = decode_batch(records, self.max_window_us())
        self.stats.events += len(events)
        states: dict[str, GenState] = {}
        lines: dict[int, list[RecordLine]] = defaultdict(list)
        now = utcnow()
        for e in events:
            st = states.get(e.generation_id) or states.setdefault(e.generation_id, GenState(partition=e.partition))
            st.seen.add(e.event_id)
            if e.type != EventType.GENERATION:
                st.events.append(FeedbackEvent(e.event_id, e.type, e.ts_us, e.properties))
                continue
            g = st.gen = GenerationInfo.from_properties(e.generation_id, e.ts_us, e.user_id, e.properties)
            lines[e.partition].append(RecordLine(
                generation_id=g.generation_id, reward_version="builtin-v1", revision=0, reward=0.45, confidence=0.5,
                label_source="implicit", signals=dict(self._SIGNALS), user_id=g.user_id, model_version=g.model_version,
                arm=g.arm, experiment=g.experiment, window_start=from_us(g.ts_us),
                window_end=from_us(g.ts_us + 2_000_000), late_events=0, emitted_at=now,
            ))  # fmt: skip
        plan, ttl = CommitPlan(), int(self.config.state_ttl_s)
        plan.states = [(self.keys.gen(gid), st.to_json(), ttl) for gid, st in states.items()]
        for p, batch in lines.items():
            pairs = [(self.keys.marker(r.reward_version, r.generation_id, 0), encode_line(r).decode()) for r in batch]
            plan.outbox.append((self.keys.outbox(p), f"{p}-{uuid.uuid4().hex}", ttl, pairs))
        self.store.commit(plan)


if __name__ == "__main__":
    main()
