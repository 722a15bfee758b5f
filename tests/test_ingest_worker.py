"""Ingest worker: Kafka to lake, exactly once, with dead letters (real broker, Redis, lake)."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from pathlib import Path

import pytest
import uvicorn

from flywheel.bus import Outgoing, ensure_topics, make_consumer, make_producer
from flywheel.bus.reader import read_topic
from flywheel.contract import Event
from flywheel.lake.tables import DEAD_LETTERS, EVENTS
from flywheel.settings import Settings
from ingest.collector.app import create_app
from ingest.dead_letters import DeadLetter
from ingest.worker.loop import IngestWorker
from launcher.embedded import free_port, start_broker, wait_for_port
from tests.helpers import SmallPolls


def drain(worker: IngestWorker, until_rows: int, settings: Settings, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while EVENTS.read(EVENTS.at(settings.lake_root)).height < until_rows and time.monotonic() < deadline:
        worker.run_once()


def event(i: int, **over: object) -> Event:
    return Event(event_id=f"e{i}", type="accepted", generation_id=f"g{i % 7}", user_id="u", **over)


@pytest.fixture
def collector_url(settings: Settings):
    ensure_topics(settings)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for_port("127.0.0.1", port)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.mark.parametrize("library", ["segment-analytics-python", "rudder-sdk-python"])
def test_segment_library_delivers_n_track_events_exactly_n_rows(settings, collector_url, library):
    """The official Segment library, and RudderStack's (the same HTTP Tracking API), pointed at the collector."""
    if library == "segment-analytics-python":
        from segment.analytics import Client
    else:
        from rudderstack.analytics import Client

    n = 120
    client = Client(write_key="dev-write-key", host=collector_url, gzip=True, upload_size=50, max_retries=2)
    for i in range(n):
        client.track(
            user_id=f"user-{i % 5}",
            event="accepted",
            properties={"generation_id": f"gen-{i}", "accepted_chars": i},
            message_id=f"msg-{i}",
        )
    client.flush()
    client.shutdown()

    worker = IngestWorker(settings, group_id=f"g-{library}", poll_timeout_s=0.3)
    drain(worker, n, settings)
    worker.run_once()  # nothing more arrives
    worker.close()
    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    assert lake.height == n
    assert sorted(lake["event_id"].to_list()) == sorted(f"msg-{i}" for i in range(n))
    row = lake.filter(lake["event_id"] == "msg-7").row(0, named=True)
    assert row["generation_id"] == "gen-7" and row["user_id"] == "user-2" and row["source"] == "segment"
    assert json.loads(row["properties"]) == {"accepted_chars": 7}
    # Partitioned by the event's date and hour.
    files = list(Path(EVENTS.at(settings.lake_root)).rglob("*.parquet"))
    assert files and all(
        f.parent.name.startswith("hour=") and f.parent.parent.name.startswith("date=") for f in files
    )


def test_poison_messages_go_to_dead_letters_and_the_worker_keeps_consuming(settings):
    ensure_topics(settings)
    good = [event(i) for i in range(5)]
    wrong_types = json.loads(event(100).to_bytes())
    wrong_types["user_id"] = {"not": "a string"}
    unknown_version = json.loads(event(101).to_bytes())
    unknown_version["schema_version"] = 7
    huge = event(102, properties={"blob": "x" * 300_000}).to_bytes()
    poison = [
        b"\x00\xffnot json",
        json.dumps(wrong_types).encode(),
        json.dumps(unknown_version).encode(),
        huge,
    ]
    producer = make_producer(settings, max_request_size=2_000_000)
    t = settings.events_topic
    producer.send_all([Outgoing(t, good[0].to_bytes())] + [Outgoing(t, p) for p in poison])
    producer.send_all([Outgoing(t, e.to_bytes()) for e in good[1:]])

    worker = IngestWorker(settings, group_id="g-poison", poll_timeout_s=0.3)
    drain(worker, 5, settings)
    worker.close()
    assert sorted(EVENTS.read(EVENTS.at(settings.lake_root))["event_id"].to_list()) == [f"e{i}" for i in range(5)]

    letters = [DeadLetter.from_bytes(r.value) for r in read_topic(settings, settings.dead_letter_topic)]
    assert sorted(d.original for d in letters) == sorted(poison)
    reasons = {d.original: d.reason for d in letters}
    assert "JSON" in reasons[poison[0]]
    assert reasons[poison[1]].startswith("user_id:")
    assert "unknown schema_version 7" in reasons[poison[2]]
    assert "limit is" in reasons[poison[3]]
    assert all(d.source.startswith(f"kafka:{t}/") for d in letters)
    # The dead-letter table holds each refused record once, with its bytes and reason.
    table = DEAD_LETTERS.read(DEAD_LETTERS.at(settings.lake_root))
    assert sorted(table["original"].to_list()) == sorted(poison)
    assert dict(zip(table["original"], table["reason"], strict=True)) == reasons
    producer.close()


def test_a_batch_failing_between_its_dead_letter_and_event_commits_is_replayed_once(settings):
    """The dead letters are committed first: the batch read again from the table's offsets skips them, and its
    events are written once."""
    ensure_topics(settings)
    producer = make_producer(settings)
    t = settings.events_topic
    records = [b"{broken", *(event(i).to_bytes() for i in range(4))]
    producer.send_all([Outgoing(t, raw, key=b"g0") for raw in records])
    producer.close()
    worker = IngestWorker(settings, group_id="g-between", poll_timeout_s=0.3, linger_s=0.2)
    real, failed = worker._events.commit, []

    def crash_once(rows, ends):  # noqa: ANN001, ANN202 - stands in for a process dying between the two commits
        if not failed:
            failed.append(True)
            raise OSError("the lake went away")
        return real(rows, ends)

    worker._events.commit = crash_once  # type: ignore[method-assign]
    deadline = time.monotonic() + 30
    while EVENTS.read(EVENTS.at(settings.lake_root)).height < 4 and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            worker.run_once()
    worker.close()
    assert failed
    assert sorted(EVENTS.read(EVENTS.at(settings.lake_root))["event_id"].to_list()) == [f"e{i}" for i in range(4)]
    assert DEAD_LETTERS.read(DEAD_LETTERS.at(settings.lake_root))["original"].to_list() == [b"{broken"]


def test_two_workers_writing_the_same_partitions_commit_each_offset_once(settings, caplog):
    """Two workers in different groups both own every partition (as a stale worker still believes it does):
    each checks the table's offsets on the snapshot it commits with, so every record lands once, and the
    loser of each race reloads the table and goes on from its offsets."""
    ensure_topics(settings)
    workers = [IngestWorker(settings, group_id=f"g-twin-{n}", batch_size=20, poll_timeout_s=0.2, linger_s=0.05,
                            pause_before_commit_s=0.05)
               for n in range(2)]  # fmt: skip
    done = threading.Event()

    def run(worker: IngestWorker) -> None:
        while not done.is_set():
            worker.run_once()

    caplog.set_level(logging.WARNING, logger="ingest.worker.loop")
    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    # The records are sent once both own the partitions, so both read them from the same table version (a worker
    # joining after everything is written would seek past it and never race).
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(w._consumer is not None and w._consumer.assignment()
                                                  for w in workers):  # fmt: skip
        time.sleep(0.1)
    producer = make_producer(settings)
    sent = [event(i) for i in range(400)]
    producer.send_all([Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in sent])
    producer.close()
    deadline = time.monotonic() + 60
    while EVENTS.read(EVENTS.at(settings.lake_root)).height < len(sent) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # anything written twice would land now
    done.set()
    for t in threads:
        t.join(timeout=30)
    for w in workers:
        w.close()
    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    assert sorted(lake["event_id"].to_list()) == sorted(e.event_id for e in sent)
    positions = lake.select("kafka_partition", "kafka_offset")
    assert positions.n_unique() == positions.height == len(sent)
    assert "lake commit refused" in caplog.text, "the workers never raced"


def test_a_batch_fills_over_polls_to_its_size_and_a_quiet_topic_commits_after_the_linger(settings):
    """A Delta commit has a fixed cost, so a batch gathers polls until `batch_size` records (one commit for all of
    them); when the topic goes quiet, the batch is committed `linger_s` after its first record, not full."""
    ensure_topics(settings)
    producer = make_producer(settings)
    sent = [event(i) for i in range(45)]
    producer.send_all([Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in sent[:40]])
    consumer = SmallPolls(make_consumer(settings, [settings.events_topic], "g-batching"), most=10)
    # A linger far longer than the test: only a full batch ends this one.
    worker = IngestWorker(settings, consumer=consumer, batch_size=40, poll_timeout_s=0.3, linger_s=600)
    location = EVENTS.at(settings.lake_root)
    deadline = time.monotonic() + 60
    first = worker.run_once()
    while not first.written and time.monotonic() < deadline:  # the group join, then the table's offsets sought
        first = worker.run_once()
    assert (first.polled, first.written) == (40, 40) and consumer.polls >= 4
    assert EVENTS.version(location) == 1, "the forty records went in one commit"  # version 0 is the empty table

    worker.linger_s = 0.3
    producer.send_all([Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in sent[40:]])
    producer.close()
    results = []
    while sum(r.written for r in results) < 5 and time.monotonic() < deadline:
        results.append(worker.run_once())
    worker.close()
    # Five records of a batch of forty: each batch returned after its linger, and wrote what it had.
    assert all(r.polled < 40 for r in results) and sum(r.written for r in results) == 5
    assert sorted(EVENTS.read(location)["event_id"].to_list()) == sorted(e.event_id for e in sent)


def test_duplicates_and_replays_are_written_once(settings):
    ensure_topics(settings)
    producer = make_producer(settings)
    first = [event(i) for i in range(10)]
    producer.send_all(
        [Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in first]
    )
    worker = IngestWorker(settings, group_id="g-dup", poll_timeout_s=0.3)
    drain(worker, 10, settings)
    # Client retries: the same event ids again (some inside one batch twice).
    again = [*first[:4], *first[:2], event(10)]
    producer.send_all(
        [Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in again]
    )
    drain(worker, 11, settings)
    for _ in range(2):
        worker.run_once()
    worker.close()
    # A new group (no committed offsets: it would read the topic from the start) resumes where the lake's
    # table says instead: it reads only what came after.
    producer.send_all([Outgoing(settings.events_topic, event(11).to_bytes(), key=event(11).generation_id.encode())])
    replay = IngestWorker(settings, group_id="g-dup-replay", poll_timeout_s=0.3)
    results = []
    deadline = time.monotonic() + 30
    while sum(r.written for r in results) < 1 and time.monotonic() < deadline:
        results.append(replay.run_once())
    replay.close()
    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    assert sorted(lake["event_id"].to_list()) == sorted(f"e{i}" for i in range(12))
    assert sum(r.written for r in results) == 1 and sum(r.polled for r in results) == 1
    producer.close()


def test_broker_down_at_start_waits_with_backoff_then_catches_up(tmp_path, redis_url, caplog):
    port = free_port()
    settings = Settings(
        data_dir=tmp_path / "data",
        kafka_bootstrap_servers=f"127.0.0.1:{port}",
        redis_url=redis_url,
        redis_prefix=f"test:{port}:",
        topic_partitions=2,
    )
    worker = IngestWorker(settings, group_id="g-late", poll_timeout_s=0.3)
    stop = threading.Event()
    caplog.set_level(logging.WARNING, logger="ingest.worker.loop")
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    time.sleep(1.5)
    assert any("does not answer" in r.getMessage() for r in caplog.records), (
        "the wait must be logged with why"
    )
    broker = start_broker(port, tmp_path / "broker.log")
    try:
        ensure_topics(settings)
        producer = make_producer(settings)
        producer.send_all([Outgoing(settings.events_topic, event(i).to_bytes()) for i in range(20)])
        producer.close()
        deadline = time.monotonic() + 30
        while EVENTS.read(EVENTS.at(settings.lake_root)).height < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        stop.set()
        thread.join(timeout=15)
        assert EVENTS.read(EVENTS.at(settings.lake_root)).height == 20
    finally:
        stop.set()
        broker.terminate()
        broker.wait(timeout=10)


def test_confluent_client_behind_the_same_interface(settings):
    settings = settings.model_copy(update={"kafka_client": "confluent"})
    ensure_topics(settings)
    producer = make_producer(settings)
    events = [event(i) for i in range(30)]
    producer.send_all(
        [Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in events]
    )
    producer.send_all([Outgoing(settings.events_topic, b"{not json")])
    producer.close()
    worker = IngestWorker(settings, group_id="g-confluent", poll_timeout_s=0.3)
    processed, deadline = 0, time.monotonic() + 30
    while processed < 31 and time.monotonic() < deadline:
        processed += worker.run_once().polled
    worker.close()
    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    assert sorted(lake["event_id"].to_list()) == sorted(e.event_id for e in events)
    letters = read_topic(settings, settings.dead_letter_topic)
    assert [DeadLetter.from_bytes(r.value).original for r in letters] == [b"{not json"]


@pytest.mark.parametrize("client", ["kafka-python", "confluent"])
def test_commits_sent_without_waiting_are_in_place_after_close(settings, client):
    """Batches are committed without waiting for the broker; once the worker has closed, its group's
    offsets stand after the last record, so a restart in the same group does not re-read."""
    from kafka import KafkaConsumer, TopicPartition

    settings = settings.model_copy(update={"kafka_client": client})
    ensure_topics(settings)
    producer = make_producer(settings)
    events = [event(i) for i in range(12)]
    producer.send_all([Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in events])
    producer.close()
    group = f"g-close-{client}"
    worker = IngestWorker(settings, group_id=group, poll_timeout_s=0.3)
    drain(worker, 12, settings)
    worker.close()

    ends: dict[int, int] = {}
    for r in read_topic(settings, settings.events_topic):
        ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 1)
    reader = KafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers.split(","), group_id=group,
                           enable_auto_commit=False)
    try:
        committed = {p: reader.committed(TopicPartition(settings.events_topic, p)) for p in ends}
    finally:
        reader.close(autocommit=False)
    assert committed == ends


def test_a_replay_of_old_events_across_a_restart_is_stored_once(settings):
    """Events that arrived 30 days ago (past the 7-day window of ids held in memory), as a replayed dead letter
    carries them: written once, then the same records again after a restart, and once more in the same run:
    the table holds each id once, whatever its age."""
    from datetime import timedelta

    from flywheel.contract import utcnow

    ensure_topics(settings)
    long_ago = utcnow() - timedelta(days=30)
    old = [event(i, ts=long_ago, received_at=long_ago) for i in range(20)]
    records = [Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in old]
    producer = make_producer(settings)
    producer.send_all(records)
    worker = IngestWorker(settings, group_id="g-old", poll_timeout_s=0.3)
    drain(worker, 20, settings)
    worker.close()

    producer.send_all(records)  # the replay, after a restart
    restarted = IngestWorker(settings, group_id="g-old", poll_timeout_s=0.3)
    results = []
    deadline = time.monotonic() + 30
    while sum(r.polled for r in results) < 20 and time.monotonic() < deadline:
        results.append(restarted.run_once())
    producer.send_all(records[:5])  # and again, in the same run
    while sum(r.polled for r in results) < 25 and time.monotonic() < deadline:
        results.append(restarted.run_once())
    restarted.close()
    producer.close()
    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    assert sorted(lake["event_id"].to_list()) == sorted(e.event_id for e in old)
    assert sum(r.duplicates for r in results) == 25 and sum(r.written for r in results) == 0
