"""The streaming worker against the real broker and Redis: parity with the batch recompute,
restart safety, and a reward appearing soon after its window closes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest

from flywheel.bus import Outgoing, ensure_topics, make_consumer, make_producer
from flywheel.bus.reader import read_topic
from flywheel.contract import RewardRecord, utcnow
from flywheel.lake.tables import REWARDS
from flywheel.settings import Settings
from signals.config import SignalsConfig
from signals.recompute import parity, recompute_records
from signals.reward import DEFAULT_DEFINITION
from signals.sink import read_rewards, write_rewards
from signals.worker import SignalsWorker
from simulator.telemetry import feedback_event, generation_event, history, lake_events_from_topic, send
from tests.helpers import SmallPolls

CONFIG = SignalsConfig(idle_after_s=1.5, poll_timeout_s=0.2)


def rewards_on_topic(settings: Settings) -> list[RewardRecord]:
    return [RewardRecord.model_validate_json(r.value) for r in read_topic(settings, settings.rewards_topic)]


def run_until(worker: SignalsWorker, done, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"worker did not finish in {timeout_s}s: {worker.stats}"
        worker.run_once()


def comparable(r: RewardRecord) -> tuple:
    d = r.model_dump(exclude={"emitted_at"})
    return tuple(sorted((k, str(v)) for k, v in d.items()))


def final_records(records: list[RewardRecord]) -> dict[tuple[str, str], tuple]:
    """Each generation's last revision per reward version, comparable."""
    return {(r.generation_id, r.reward_version): comparable(r) for r in sorted(records, key=lambda r: r.revision)}


def test_stream_and_batch_agree_on_history_with_late_and_duplicate_events(settings: Settings) -> None:
    ensure_topics(settings)
    start = utcnow() - timedelta(hours=1)
    hist = history(
        60, start=start, seed=7, late_share=0.25, duplicate_share=0.1, window_s=settings.reward_window_s
    )
    send(settings, hist.events)
    worker = SignalsWorker(settings, CONFIG)
    try:
        run_until(worker, lambda: worker.stats.records >= len(hist.generation_ids))
        for _ in range(3):  # drain anything still in flight
            worker.run_once()
    finally:
        worker.close()
    assert worker.stats.duplicates > 0, "the history must exercise duplicates"
    # late events of one micro-batch make one revision for their generation
    assert worker.stats.late_events > 0 and 0 < worker.stats.revisions <= worker.stats.late_events

    streamed = rewards_on_topic(settings)
    keys = Counter((r.generation_id, r.reward_version, r.revision) for r in streamed)
    assert max(keys.values()) == 1, "one record per generation, version and revision"
    assert {r.generation_id for r in streamed if r.revision == 0} == set(hist.generation_ids)
    assert len(read_rewards(REWARDS.at(settings.lake_root))) == len(streamed)

    lake_events_from_topic(settings)
    batch = recompute_records(settings, DEFAULT_DEFINITION, config=CONFIG)
    b, s_ = set(map(comparable, batch)), set(map(comparable, streamed))
    # every streamed record is the recompute's of the same revision, and each generation ends on the same one
    assert s_ <= b, sorted(dict(x) for x in s_ - b)[:3]
    assert final_records(batch) == final_records(streamed)
    assert {r.label_source for r in batch} == {"explicit", "implicit", "default"}
    # coalesced or not, a generation's final revision is the number of its late events on both paths
    n = len(hist.generation_ids)
    assert parity(settings, "rules-v1") == {"generations": n, "agree": n, "revision_differs": 0, "reward_differs": 0,
                                            "only_stream": 0, "only_recompute": 0, "window_differs": 0}  # fmt: skip


def test_worker_restarted_mid_window_loses_nothing_and_duplicates_nothing(settings: Settings) -> None:
    ensure_topics(settings)
    now = utcnow()
    # closed before the crash: old timestamps, so their windows close in the first batch
    old = [generation_event(f"old{i}", now - timedelta(minutes=5), user_id="u") for i in range(3)]
    old += [
        feedback_event(f"old{i}", "accepted", now - timedelta(minutes=5) + timedelta(seconds=1))
        for i in range(3)
    ]
    # open across the restart: generated and shown now, accepted only after the restart
    fresh = [generation_event(f"new{i}", now, user_id="u") for i in range(4)]
    fresh += [feedback_event(f"new{i}", "shown", now + timedelta(milliseconds=100)) for i in range(4)]
    send(settings, old + fresh)

    first = SignalsWorker(settings, CONFIG)

    def crash(_offsets: object) -> None:
        raise RuntimeError("killed before committing offsets")

    first.consumer.commit = crash  # type: ignore[method-assign]  # the crash happens inside the real worker
    with pytest.raises(RuntimeError, match="killed"):
        run_until(first, lambda: first.stats.events >= len(old + fresh))
    first.close()
    assert first.stats.records == 0, "the crash came before anything was sent"

    # accepted inside the window (event time), delivered after the restart
    send(
        settings, [feedback_event(f"new{i}", "accepted", now + timedelta(milliseconds=500)) for i in range(4)]
    )
    second = SignalsWorker(settings, CONFIG)
    try:
        run_until(second, lambda: second.stats.records >= 7)
        for _ in range(3):
            second.run_once()
    finally:
        second.close()
    assert second.stats.duplicates >= len(old + fresh), "uncommitted events were re-read, and recognised"

    streamed = rewards_on_topic(settings)
    assert sorted(r.generation_id for r in streamed) == sorted(
        [f"old{i}" for i in range(3)] + [f"new{i}" for i in range(4)]
    )
    # the shown from before the restart and the accept after it both count
    assert all(r.reward == 0.75 and r.signals["shown"] == 1.0 for r in streamed)
    lake = read_rewards(REWARDS.at(settings.lake_root))
    assert lake.height == 7 and lake["generation_id"].n_unique() == 7


def test_a_worker_killed_after_its_flush_reached_the_lake_leaves_each_record_there_once(settings: Settings) -> None:
    """A flush sends the outbox entries of every partition at once, one Kafka send and one lake commit; killed before
    they are popped, the worker that comes next flushes them again: the lake still holds each record once, and the
    repeats on Kafka are the same records (with the `record_id` header a consumer drops them by)."""
    ensure_topics(settings)
    old = utcnow() - timedelta(minutes=5)
    gids = [f"g{i:02d}" for i in range(12)]
    send(settings, [generation_event(g, old) for g in gids] + [feedback_event(g, "accepted", old) for g in gids])

    first = SignalsWorker(settings, CONFIG)

    def killed(*_args: object) -> None:
        raise RuntimeError("killed before popping the outbox")

    first.store.pop_outbox = killed  # type: ignore[method-assign]  # the crash happens inside the real worker
    with pytest.raises(RuntimeError, match="killed"):
        run_until(first, lambda: False)
    left = first.store.outbox_entries(first.keys, range(settings.topic_partitions))
    first.close()
    assert len(left) > 1, "the flush spanned several partitions' entries"

    second = SignalsWorker(settings, CONFIG)
    try:
        run_until(second, lambda: second.stats.records >= len(gids))
    finally:
        second.close()
    lake = read_rewards(REWARDS.at(settings.lake_root))
    assert sorted(lake["generation_id"].to_list()) == gids
    sent = Counter(f"{r.reward_version}:{r.generation_id}:{r.revision}" for r in rewards_on_topic(settings))
    assert sorted(sent) == [f"{DEFAULT_DEFINITION.version}:{g}:0" for g in gids] and set(sent.values()) == {2}


def test_a_batch_gathers_polls_while_the_broker_already_holds_more(settings: Settings) -> None:
    """A fetch response can hold fewer records than a batch: the worker polls again while the broker already holds
    more, so a batch pays its fixed costs (the Lua commit, Kafka's flush, a lake commit) once for them all."""
    ensure_topics(settings)
    old = utcnow() - timedelta(minutes=5)
    producer = make_producer(settings)  # one partition: its fetch responses tell the whole backlog
    producer.send_all([Outgoing(settings.events_topic, generation_event(f"g{i:02d}", old).to_bytes(), b"one")
                       for i in range(24)])  # fmt: skip
    producer.close()
    consumer = SmallPolls(make_consumer(settings, [settings.events_topic], "g-gather"), most=5)
    worker = SignalsWorker(settings, CONFIG.model_copy(update={"poll_max_records": 24}), consumer=consumer)
    try:
        run_until(worker, lambda: worker.stats.events > 0)
    finally:
        worker.close()
    assert worker.stats.events == 24 and consumer.polls >= 5


def test_reward_appears_soon_after_its_window_closes(settings: Settings) -> None:
    ensure_topics(settings)
    stop = threading.Event()
    worker = SignalsWorker(settings, CONFIG)
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    try:
        # "Soon" counts from a worker that reads the topic: joining its group may take seconds on a loaded machine.
        joined = time.monotonic() + 60
        while not worker._assigned and time.monotonic() < joined:
            time.sleep(0.1)
        now = utcnow()
        send(settings, [generation_event("g-live", now), feedback_event("g-live", "accepted", now)])
        close = now + timedelta(seconds=settings.reward_window_s + settings.allowed_lateness_s)
        deadline = close + timedelta(seconds=CONFIG.idle_after_s + CONFIG.idle_grace_s + 8)
        found: list[RewardRecord] = []
        while not found and utcnow() < deadline:
            time.sleep(0.2)
            found = [r for r in rewards_on_topic(settings) if r.generation_id == "g-live"]
        assert found, "no reward within a few seconds of the window closing"
        assert found[0].reward == 0.75 and found[0].label_source == "implicit"
    finally:
        stop.set()
        thread.join(timeout=10)


def test_history_replayed_into_an_idle_worker_gives_one_final_record_per_generation(settings: Settings) -> None:
    ensure_topics(settings)
    worker = SignalsWorker(settings, CONFIG)
    try:
        run_until(worker, lambda: worker.redis.hlen(worker.keys.wm) > 0)  # idle: the idle tick has run
        wms = {k.decode(): int(v) for k, v in worker.redis.hgetall(worker.keys.wm).items()}
        assert not any(k.startswith("h") for k in wms), "the idle tick must hold the historical lane"
        now = utcnow()  # the collector stamps arrival as the replay goes
        hist = history(40, start=now - timedelta(days=30), seed=3, late_share=0.0, duplicate_share=0.1,
                       window_s=settings.reward_window_s)  # fmt: skip
        send(settings, [e.model_copy(update={"received_at": now}) for e in hist.events])
        run_until(worker, lambda: worker.stats.records >= len(hist.generation_ids))
        for _ in range(3):
            worker.run_once()
    finally:
        worker.close()
    streamed = rewards_on_topic(settings)
    assert Counter(r.generation_id for r in streamed) == Counter(hist.generation_ids), "one record per generation"
    assert worker.stats.late_events == 0 and {r.revision for r in streamed} == {0}
    assert any(r.label_source != "default" for r in streamed)
    lake_events_from_topic(settings)
    batch = recompute_records(settings, DEFAULT_DEFINITION, config=CONFIG)
    assert set(map(comparable, streamed)) == set(map(comparable, batch))
    n = len(hist.generation_ids)
    assert parity(settings, "rules-v1") == {"generations": n, "agree": n, "revision_differs": 0, "reward_differs": 0,
                                            "only_stream": 0, "only_recompute": 0, "window_differs": 0}  # fmt: skip
    # checked with another window than the stream's (as after `flywheel up`, whose windows are 60 s): it says so
    other = parity(settings.model_copy(update={"reward_window_s": settings.reward_window_s * 8}), "rules-v1")
    assert other["window_differs"] == n
    # a revision the recompute does not make is a disagreement, even with the same reward
    write_rewards(REWARDS.at(settings.lake_root), [streamed[0].model_copy(update={"revision": 1})], "extra")
    assert parity(settings, "rules-v1")["revision_differs"] == 1


def test_a_record_line_is_a_reward_record_in_the_same_json_and_lake_row(tmp_path) -> None:  # noqa: ANN001
    """The stream moves records as `RecordLine`s (msgspec): the text is `RewardRecord.model_dump_json`'s and the
    lake row `write_rewards`'s, so a consumer or reader cannot tell them apart."""
    from signals.events import from_us
    from signals.sink import RecordLine, decode_lines, encode_line, write_lines

    assert list(RecordLine.__struct_fields__) == list(RewardRecord.model_fields)
    fields = dict(
        generation_id="g-é", reward_version="v1", revision=2, reward=-0.25, confidence=1.0, label_source="implicit",
        signals={"shown": 1.0, "dwell_s": 1e-07, "accepted_chars": 12.0}, user_id="u", model_version="3",
        arm="champion", experiment="e", window_start=from_us(1_700_000_000_123_456),
        window_end=from_us(1_700_000_600_000_000), late_events=2, emitted_at=from_us(1_700_000_601_000_001),
    )  # fmt: skip
    line = RecordLine(**fields)
    assert encode_line(line) == RewardRecord(**fields).to_bytes()
    (back,) = decode_lines(b"[" + encode_line(line) + b"]")
    assert RewardRecord.model_validate_json(encode_line(back)) == RewardRecord(**fields)
    write_lines(str(tmp_path / "a"), [("a", [back])])
    write_rewards(str(tmp_path / "b"), [RewardRecord(**fields)], "b")
    assert read_rewards(str(tmp_path / "a")).to_dicts() == read_rewards(str(tmp_path / "b")).to_dicts()


def test_a_polled_batch_decodes_to_the_events_ingest_keeps_in_partition_order() -> None:
    """`decode_batch` takes what the contract takes, with its properties, in (partition, offset) order, and
    counts the rest: a tombstone, bytes that are no event, an event the contract refuses, and one whose window
    would end past the end of time."""
    from datetime import UTC, datetime

    from flywheel.bus import RecordBatch
    from flywheel.contract import Event
    from signals.events import decode_batch, to_us

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    gen, accepted = generation_event("g1", t0), feedback_event("g1", "accepted", t0, accepted_chars=3, total_chars=5)
    other = feedback_event("g2", "thumbs", t0, value="up")
    end_of_time = generation_event("g3", datetime(9999, 12, 31, 23, 59, tzinfo=UTC))
    refused = gen.to_bytes().replace(b'"generation"', b'"no-such-type"')
    late_gen = end_of_time.to_bytes()
    values = [accepted.to_bytes(), None, b"{not json", other.to_bytes(), refused, late_gen, gen.to_bytes()]
    partitions = [1, 0, 0, 0, 1, 1, 1]
    offsets = [7, 1, 2, 3, 8, 9, 5]
    events, skipped = decode_batch(RecordBatch(["t"] * 7, partitions, offsets, values), window_us=3_600_000_000)  # type: ignore[arg-type]
    assert skipped == 4
    in_order = [(0, other.event_id), (1, gen.event_id), (1, accepted.event_id)]
    assert [(e.partition, e.event_id) for e in events] == in_order
    for e in events:
        want = Event.from_bytes(values[e.index])
        assert (e.type, e.generation_id, e.user_id, e.ts_us, e.properties) == (
            want.type.value, want.generation_id, want.user_id, to_us(want.ts), want.properties)  # fmt: skip
