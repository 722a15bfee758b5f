"""The lake on Delta: what its commits, its exactly-once bookkeeping and its compaction cost.

Four figures, each against a baseline measured in the same run:

1. pipeline: the ingest worker (consume, validate, de-duplicate, commit) with its Delta commits, over the
   same worker whose commit is swapped for the former Parquet sink (one file per batch and hour, written
   under a temporary name, fsynced, renamed into place: `flywheel.lake.legacy`), for each Kafka client,
   from the same pre-filled topic, fresh consumer groups, alternated, median ratio over the rounds; beside it,
   the write stage alone: the Parquet run's time an event with the Delta write stage's extra time added (what
   the sink costs, apart from the client's poll stage, whose run-to-run spread is larger than the sink's cost);
2. commit latency per batch against batch size: a Delta commit of the batch with its partition's
   transaction (`PartitionLedger.commit`) over writing the same rows as one former Parquet file;
3. the sink over a bare loop of `write_deltalake` calls on the same batches (already in Arrow, no
   transaction): what the exactly-once bookkeeping (the check on the snapshot, the partition columns,
   the transaction) costs;
4. compaction of an hour of batches (one commit every 10 s for an hour, so 360 files): time, and the
   file count before and after.

    python bench/lake_delta.py [--events N] [--rounds R] [--clients kafka-python,confluent] [--only lake|pipeline]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
from deltalake import write_deltalake

sys.path.insert(0, str(Path(__file__).parent))
from ingest_pipeline import fill, stage_seconds  # noqa: E402 - a sibling script, not a package

from flywheel.bus import ensure_topics, make_consumer  # noqa: E402
from flywheel.lake import legacy  # noqa: E402
from flywheel.lake.maintenance import compact  # noqa: E402
from flywheel.lake.tables import (
    EVENTS,  # noqa: E402
    rows_frame,  # noqa: E402
)
from flywheel.settings import Settings  # noqa: E402
from ingest.worker.dedup import PartitionLedger  # noqa: E402
from ingest.worker.loop import IngestWorker  # noqa: E402
from launcher.embedded import free_port, start_broker  # noqa: E402

KEY = ("events", 0)


def run_worker(
    settings: Settings, client: str, n: int, batch: int, sink: str, tag: str
) -> tuple[float, dict[str, float]]:
    """(events/s, microseconds an event in each stage) of one worker over the whole topic, timed from its first
    write; `sink` "delta" or "parquet"."""
    s = settings.model_copy(update={"kafka_client": client, "data_dir": settings.data_dir / f"{sink}-{tag}"})
    consumer = make_consumer(s, [s.events_topic], f"{sink}-{client}-{tag}")
    worker = IngestWorker(s, consumer=consumer, batch_size=batch, poll_timeout_s=0.5)
    if sink == "parquet":
        table_dir = s.lake_dir / "events"

        def parquet_commit(rows: pl.DataFrame, ends: dict[tuple[str, int], int]) -> int:
            legacy.write_partitioned(rows, table_dir, f"part-{int(time.time() * 1000)}-{uuid.uuid4().hex[:12]}")
            worker._events.committed.update(ends)
            return 0

        worker._events.commit = parquet_commit  # type: ignore[method-assign]
    written = 0
    while written == 0:  # the group join, and the first batch re-read from the table's offsets: not timed
        written += worker.run_once().written
    started, first, stages = time.perf_counter(), written, stage_seconds()
    deadline = started + 600
    while written < n and time.perf_counter() < deadline:
        written += worker.run_once().written
    events_per_s = (written - first) / (time.perf_counter() - started)
    per_event = {k: (v - stages[k]) / (written - first) * 1e6 for k, v in stage_seconds().items()}
    worker.close()
    assert written == n, f"the {sink} pipeline wrote {written} of {n}"
    return events_per_s, per_event


def pipeline(settings: Settings, clients: list[str], n: int, batch: int, rounds: int) -> None:
    for client in clients:
        ratios, sink_ratios = [], []
        for r in range(rounds):
            tag = f"{client}-{r}-{uuid.uuid4().hex[:4]}"
            order = ["parquet", "delta"] if r % 2 == 0 else ["delta", "parquet"]  # alternated: the machine is shared
            runs = {sink: run_worker(settings, client, n, batch, sink, tag) for sink in order}
            (parquet, p_us), (delta, d_us) = runs["parquet"], runs["delta"]
            ratios.append(delta / parquet)
            # The sink's own share: the Parquet run's time an event plus what the Delta write stage added to it. The
            # end-to-end ratio also moves with the client's poll stage, which varies between runs on a shared machine
            # by more than the whole write stage costs (kafka-python's by several microseconds an event).
            sink_ratios.append(1 / (1 + (d_us["write"] - p_us["write"]) * parquet / 1e6))
            print(f"{client:>13}: Parquet sink {parquet:>9,.0f} ev/s | Delta sink {delta:>9,.0f} ev/s "
                  f"| ratio {delta / parquet:.2f} | the write stage alone {sink_ratios[-1]:.2f}")  # fmt: skip
            for name, us in (("Parquet", p_us), ("Delta", d_us)):
                print(f"{'':>13}  {name} sink, us an event: " + ", ".join(f"{k} {v:.2f}" for k, v in us.items() if v))
        print(f"{client:>13}: median ratio {statistics.median(ratios):.2f} over {rounds} round(s) "
              f"({min(ratios):.2f}-{max(ratios):.2f}); the write stage alone {statistics.median(sink_ratios):.2f} "
              f"({min(sink_ratios):.2f}-{max(sink_ratios):.2f})")  # fmt: skip


def event_rows(first: int, n: int, at: datetime) -> pl.DataFrame:
    us = int(at.timestamp() * 1_000_000)
    return rows_frame([
        (f"e{o}", "accepted", 1, f"g{o}", f"u{o % 1000}", "s", us, us, "native", '{"accepted_chars":3}', "events", 0, o)
        for o in range(first, first + n)
    ])  # fmt: skip


def commit_latency(root: Path, sizes: list[int], commits: int) -> None:
    at = datetime.now(UTC)
    for size in sizes:
        location = EVENTS.at(root / f"latency-{size}")
        ledger = PartitionLedger(EVENTS, location, "ingest")
        ledger.reload([KEY])
        frames = [event_rows(i * size, size, at) for i in range(commits)]
        delta, parquet = [], []
        for i, frame in enumerate(frames):
            t = time.perf_counter()
            ledger.commit(frame, {KEY: (i + 1) * size - 1})
            delta.append(time.perf_counter() - t)
            t = time.perf_counter()
            legacy.write_partitioned(frame, root / f"parquet-{size}", f"part-{i}")
            parquet.append(time.perf_counter() - t)
        d, p = statistics.median(delta), statistics.median(parquet)
        print(f"batch {size:>7,} rows: Delta commit {d * 1e3:7.1f} ms | Parquet file {p * 1e3:7.1f} ms "
              f"| ratio {d / p:5.2f} | {size / d:>10,.0f} rows/s committed")  # fmt: skip


def sink_over_bare(root: Path, size: int, commits: int) -> None:
    at = datetime.now(UTC)
    frames = [event_rows(i * size, size, at) for i in range(commits)]
    arrow = [EVENTS.stored(f).to_arrow() for f in frames]
    bare_table = EVENTS.create(EVENTS.at(root / "bare"))
    ledger = PartitionLedger(EVENTS, EVENTS.at(root / "sink"), "ingest")
    ledger.reload([KEY])
    bare, sink = [], []
    for i, (frame, a) in enumerate(zip(frames, arrow, strict=True)):  # alternated: the machine is shared
        t = time.perf_counter()
        write_deltalake(bare_table, a, mode="append")
        bare.append(time.perf_counter() - t)
        t = time.perf_counter()
        ledger.commit(frame, {KEY: (i + 1) * size - 1})
        sink.append(time.perf_counter() - t)
    b, k = statistics.median(bare), statistics.median(sink)
    print(f"sink over bare write_deltalake, {commits} batches of {size:,} (medians): {k * 1e3:.1f} ms against "
          f"{b * 1e3:.1f} ms a batch | ratio {k / b:.2f}")  # fmt: skip


def compaction(root: Path, batches: int, size: int) -> None:
    location = EVENTS.at(root / "hour")
    ledger = PartitionLedger(EVENTS, location, "ingest")
    ledger.reload([KEY])
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    for i in range(batches):
        ledger.commit(event_rows(i * size, size, hour + timedelta(seconds=10 * i)), {KEY: (i + 1) * size - 1})
    t = time.perf_counter()
    scan_before = EVENTS.read(location).height
    read_before = time.perf_counter() - t
    done = compact(EVENTS, location)
    t = time.perf_counter()
    assert EVENTS.read(location).height == scan_before
    read_after = time.perf_counter() - t
    print(f"compaction of an hour ({batches} batches of {size} rows): {done.seconds:.2f} s, "
          f"{done.files_before} -> {done.files_after} file(s); a full read {read_before * 1e3:.0f} ms before, "
          f"{read_after * 1e3:.0f} ms after (ratio {read_after / read_before:.2f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--clients", default="kafka-python,confluent")
    parser.add_argument("--rounds", type=int, default=2, help="Parquet-then-Delta rounds per client.")
    parser.add_argument("--only", choices=["lake", "pipeline"], help="Only the lake figures, or only the pipeline.")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-lake-"))
    try:
        if args.only != "pipeline":
            commit_latency(tmp, [1_000, 10_000, 100_000], commits=10)
            sink_over_bare(tmp, 10_000, commits=20)
            compaction(tmp, batches=360, size=200)
        if args.only == "lake":
            return
        port = free_port()
        broker = start_broker(port, tmp / "broker.log")
        settings = Settings(
            data_dir=tmp, kafka_bootstrap_servers=f"127.0.0.1:{port}", topic_partitions=4,
            events_topic="bench.events", dead_letter_topic="bench.dead-letter",
        )  # fmt: skip
        try:
            ensure_topics(settings)
            size = fill(settings, args.events)
            gc.freeze()
            print(f"{args.events} events of {size} bytes in {settings.topic_partitions} partitions")
            pipeline(settings, args.clients.split(","), args.events, args.batch, args.rounds)
        finally:
            broker.terminate()
            broker.wait(timeout=10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
