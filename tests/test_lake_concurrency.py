"""Racing writers, compaction and readers on one Delta table, on a local disk and on S3-compatible storage.

- Two spawned processes commit for the same Kafka partition round after round, each reloading, waiting a
  random while (a stale snapshot: the other may commit meanwhile) and committing: no offset is ever
  written twice and none is skipped.
- While a writer appends, compaction (`optimize`) and vacuum run and readers read through polars and
  through DuckDB (over `DeltaTable.to_pyarrow_dataset()`): every read sees each row once, a prefix of
  what was written.
- The ingest worker itself, from the real broker into a lake on S3.

S3 is moto's server mode (`moto[server]`), started by the `s3_lake` fixture on a loopback port: the
real protocol delta-rs speaks to AWS (conditional-put commits), served locally; no S3 is reachable here.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.synchronize
import random
import threading
import time
import uuid
from collections.abc import Iterator
from queue import Empty

import duckdb
import pytest
from deltalake.exceptions import CommitFailedError

from flywheel.bus import Outgoing, ensure_topics, make_producer
from flywheel.contract import Event
from flywheel.lake.maintenance import compact, vacuum
from flywheel.lake.tables import EVENTS, CommitRefused
from flywheel.settings import Settings
from ingest.worker.dedup import PartitionLedger
from ingest.worker.loop import IngestWorker
from launcher.embedded import free_port
from tests.test_lake import KEY, events

ROUNDS = {"local": 150, "s3": 10}  # S3: every reload lists and reads the log over HTTP


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_lake(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the local S3 server; the AWS_* variables (read by delta-rs, inherited by spawned
    processes) point at it. Returns the lake's root URI."""
    import boto3

    for name, value in {
        "AWS_ENDPOINT_URL": moto_endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    bucket = f"lake-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/lake"


@pytest.fixture(params=["local", "s3"])
def lake(request: pytest.FixtureRequest, tmp_path) -> tuple[str, str]:  # noqa: ANN001
    """(kind, lake root URI)."""
    if request.param == "s3":
        return "s3", request.getfixturevalue("s3_lake")
    return "local", str(tmp_path / "lake")


def offsets(location: str) -> list[int]:
    return sorted(EVENTS.read(location)["kafka_offset"].to_list())


# ------------------------------------------------------------ racing writers


def race(
    location: str, rounds: int, seed: int, out: multiprocessing.Queue, start: multiprocessing.synchronize.Barrier  # type: ignore[type-arg]
) -> None:
    """One worker's rounds: read the partition's offset, wait (the other may commit meanwhile), commit the next
    few offsets on the snapshot it read. Puts (commits won, commits refused). Both start their rounds together
    (`start`, a barrier): on a loaded machine one spawned process can otherwise finish before the other starts."""
    rng = random.Random(seed)
    ledger = PartitionLedger(EVENTS, location, "ingest")
    ledger.reload([KEY])  # the imports and the first read behind it, before the race
    start.wait(timeout=240)
    won = lost = 0
    for _ in range(rounds):
        stored = ledger.reload([KEY])[KEY]
        start = -1 if stored is None else stored
        n = rng.randint(1, 4)
        time.sleep(rng.random() * 0.02)
        try:
            ledger.commit(events(range(start + 1, start + 1 + n)), {KEY: start + n})
            won += 1
        except (CommitFailedError, CommitRefused):
            lost += 1
    out.put((won, lost))


def test_two_processes_committing_for_one_partition_never_write_an_offset_twice(lake: tuple[str, str]) -> None:
    kind, root = lake
    location = EVENTS.at(root)
    EVENTS.create(location)
    context = multiprocessing.get_context("spawn")  # deltalake panics in a forked child
    out = context.Queue()
    start = context.Barrier(2)
    procs = [context.Process(target=race, args=(location, ROUNDS[kind], seed, out, start)) for seed in (1, 2)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:
            results.append(out.get(timeout=240))
    except Empty:
        pytest.fail("a racing writer did not finish")
    finally:
        for p in procs:
            p.join(timeout=30)
    won = sum(w for w, _ in results)
    lost = sum(x for _, x in results)
    written = offsets(location)
    assert written == list(range(len(written))), "an offset written twice, or one skipped"
    table = EVENTS.open(location)
    assert table is not None and table.transaction_version("ingest:events/0") == len(written) - 1
    assert won + lost == 2 * ROUNDS[kind] and lost > 0, "the writers never raced"


# ------------------------------------------------------------ readers during writes, compaction and vacuum


def test_readers_see_each_row_once_while_writes_compaction_and_vacuum_run(lake: tuple[str, str]) -> None:
    kind, root = lake
    location = EVENTS.at(root)
    batches = 40 if kind == "local" else 12
    ledger = PartitionLedger(EVENTS, location, "ingest")
    ledger.reload([KEY])
    ledger.commit(events(range(5)), {KEY: 4})
    done = threading.Event()
    problems: list[str] = []
    seen = {"polars": 0, "duckdb": 0}

    def check(engine: str, found: list[int]) -> None:
        if found != list(range(len(found))):
            problems.append(f"{engine} read {len(found)} rows, not each of a prefix once")
        elif len(found) < seen[engine]:
            problems.append(f"{engine} read {len(found)} rows after reading {seen[engine]}")
        seen[engine] = max(seen[engine], len(found))

    def read() -> None:
        while not done.is_set():
            table = EVENTS.open(location)
            assert table is not None
            check("polars", sorted(EVENTS.scan_table(table).collect()["kafka_offset"].to_list()))
            dataset = table.to_pyarrow_dataset()
            con = duckdb.connect()
            con.register("events", dataset)
            check("duckdb", [o for (o,) in con.sql("select kafka_offset from events order by 1").fetchall()])
            con.close()

    def maintain() -> None:
        while not done.is_set():
            compact(EVENTS, location)
            vacuum(EVENTS, location, retention_hours=1, full=True)
            time.sleep(0.05)

    threads = [threading.Thread(target=read), threading.Thread(target=maintain)]
    for t in threads:
        t.start()
    try:
        for i in range(1, batches):
            ledger.commit(events(range(i * 5, i * 5 + 5)), {KEY: i * 5 + 4})
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
    assert not problems, problems[:5]
    assert offsets(location) == list(range(batches * 5))
    assert seen["polars"] > 0 and seen["duckdb"] > 0


# ------------------------------------------------------------ the ingest worker on S3


def test_ingest_worker_writes_each_event_once_to_a_lake_on_s3(settings: Settings, s3_lake: str) -> None:
    s3 = settings.model_copy(update={"lake_uri": s3_lake})
    ensure_topics(s3)
    sent = [Event(event_id=f"s{i}", type="accepted", generation_id=f"g{i % 7}", user_id="u") for i in range(40)]
    producer = make_producer(s3)
    producer.send_all([Outgoing(s3.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in sent])
    producer.send_all([Outgoing(s3.events_topic, sent[3].to_bytes(), key=sent[3].generation_id.encode())])
    producer.close()
    worker = IngestWorker(s3, group_id="g-s3", poll_timeout_s=0.3, linger_s=0.2)
    deadline = time.monotonic() + 60
    try:
        while EVENTS.read(EVENTS.at(s3.lake_root)).height < len(sent) and time.monotonic() < deadline:
            worker.run_once()
    finally:
        worker.close()
    lake = EVENTS.read(EVENTS.at(s3.lake_root))
    assert sorted(lake["event_id"].to_list()) == sorted(e.event_id for e in sent)
    assert not (s3.lake_dir / "events").exists(), "the lake went to S3, not to the local folder"
