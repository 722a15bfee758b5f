"""The streaming extractor: events in, one reward record per generation window out.

Event-time windows: a generation's window is [ts, ts + reward_window_s]. Each
partition has a watermark, the largest event clock seen minus
`allowed_lateness_s`, where an event's clock is max(ts, received_at): the arrival
time keeps the watermark moving when events carry old timestamps, and it is what
lets the batch recompute replay the stream exactly from the lake (same
partition order, same clocks). When the whole stream has been empty for
`idle_after_s`, watermarks also advance with the wall clock (now - lateness -
`idle_grace_s`), so windows close in a quiet system.

Per event, in partition order: skip it if its id was seen; advance the watermark;
close every window ending at or before it (record revision 0); then add the event.
A feedback event in a window already closed is late: it yields a corrected
record, revision + 1, holding everything seen so far. Feedback timed after its
window's end is ignored.

Delivery: a batch's state, watermarks, emitted markers and outbox are written in
one Redis script; offsets are committed after that; the outbox then goes to Kafka
and the lake and is popped. A restarted worker re-reads uncommitted events (their
ids are already seen, so nothing counts twice) and first flushes any outbox left
behind. The lake write is idempotent (deterministic file name); a crash between
Kafka's acknowledgement and the pop can repeat a Kafka message, which carries a
`record_id` header for consumers to drop it.

Outages: Kafka (at start too), Redis and MLflow are waited out (`flywheel.ops.run_loop`: one log
line when one goes down, one when it is back); a batch that failed half-way is read again from its
first offset (the consumer is moved back), so nothing is skipped, and its events' ids make the
second read count nothing twice. `/readyz` says which dependency is down.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from flywheel.bus import (
    BrokerUnavailable,
    Consumer,
    Producer,
    Record,
    make_consumer,
    make_producer,
    next_offsets,
)
from flywheel.connections import redis_client
from flywheel.contract import Event, EventType, RewardRecord
from flywheel.lake import TempFileSweeper
from flywheel.lake.tables import REWARDS
from flywheel.ops import (
    ProcessHealth,
    kafka_dependency,
    lake_dependency,
    mlflow_dependency,
    redis_dependency,
    run_loop,
)
from flywheel.ops.deps import describe
from flywheel.settings import Settings
from signals import metrics
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore
from signals.events import FeedbackEvent, GenerationInfo, decode_event, to_us
from signals.reward import RewardDefinition
from signals.sink import produce_rewards, write_rewards
from signals.state import NOT_EMITTED, CommitPlan, GenState, Keys, StateStore

log = logging.getLogger(__name__)

_Part = TypeVar("_Part", Consumer, Producer)


@dataclass
class WorkerStats:
    events: int = 0
    duplicates: int = 0
    invalid: int = 0
    out_of_window: int = 0
    late_events: int = 0
    records: int = 0
    revisions: int = 0


def event_clock_us(e: Event) -> int:
    return max(to_us(e.ts), to_us(e.received_at))


class _Batch:
    """The per-event logic over one poll's events (or an idle tick), against loaded state."""

    def __init__(
        self,
        worker: SignalsWorker,
        wms: dict[int, int],
        due: dict[int, list[tuple[str, int]]],
        states: dict[str, GenState],
    ) -> None:
        self.w = worker
        self.wms = wms
        self.states = states
        self.heaps: dict[int, list[tuple[int, str]]] = {
            p: sorted((end, g) for g, end in rows) for p, rows in due.items()
        }
        self.dirty: set[str] = set()
        self.plan = CommitPlan()
        self.emitted: dict[int, list[RewardRecord]] = defaultdict(list)
        self.now_us = to_us(_now())

    def advance(self, p: int, wm: int) -> None:
        if wm > self.wms.get(p, -(2**62)):
            self.wms[p] = wm
        heap = self.heaps.setdefault(p, [])
        while heap and heap[0][0] <= self.wms[p]:
            end, gid = heapq.heappop(heap)
            st = self.states.get(gid)
            if st is None:  # state expired: nothing left to score
                self.plan.zrem.append((self.w.keys.open(p), gid))
            elif st.revision == NOT_EMITTED and st.window_end_us == end:
                self.emit(gid, st, 0)

    def add(self, p: int, e: Event) -> None:
        st = self.states.get(e.generation_id)
        if st is None:
            st = self.states[e.generation_id] = GenState(partition=p)
        if e.event_id in st.seen:
            self.w.stats.duplicates += 1
            metrics.EVENTS.labels("duplicate").inc()
            return
        st.seen.add(e.event_id)
        self.dirty.add(e.generation_id)
        self.advance(p, event_clock_us(e) - self.w.lateness_us)
        if e.type == EventType.GENERATION:
            if st.gen is None:
                st.gen = GenerationInfo.from_event(e)
                st.window_end_us = st.gen.ts_us + self.w.window_us
                if st.window_end_us <= self.wms[p]:
                    self.emit(e.generation_id, st, 0)
                else:
                    heapq.heappush(self.heaps[p], (st.window_end_us, e.generation_id))
                    self.plan.zadd.append((self.w.keys.open(p), e.generation_id, str(st.window_end_us)))
            return
        fe = FeedbackEvent.from_event(e)
        if st.window_end_us is not None and fe.ts_us > st.window_end_us:
            self.w.stats.out_of_window += 1
            metrics.EVENTS.labels("out_of_window").inc()
            return
        st.events.append(fe)
        if st.revision != NOT_EMITTED:
            st.late += 1
            self.w.stats.late_events += 1
            metrics.LATE_EVENTS.inc()
            self.emit(e.generation_id, st, st.revision + 1)

    def emit(self, gid: str, st: GenState, revision: int) -> None:
        assert st.gen is not None and st.window_end_us is not None
        definition = self.w.definition(st.version)
        st.version = definition.version
        record = definition.record(
            st.gen, st.events, window_end_us=st.window_end_us, revision=revision, late_events=st.late
        )
        st.revision = revision
        self.dirty.add(gid)
        self.emitted[st.partition].append(record)
        if revision == 0:
            self.plan.zrem.append((self.w.keys.open(st.partition), gid))
            lag_s = (self.now_us - st.window_end_us - self.w.lateness_us) / 1e6
            metrics.CLOSE_LAG.observe(max(0.0, lag_s))

    def finish(self) -> CommitPlan:
        ttl = int(self.w.config.state_ttl_s)
        for gid in sorted(self.dirty):
            self.plan.states.append((self.w.keys.gen(gid), self.states[gid].to_json(), ttl))
        for p, wm in self.wms.items():
            self.plan.wm.append((self.w.keys.wm, str(p), str(wm)))
        for p, records in self.emitted.items():
            entry_id = f"{p}-{uuid.uuid4().hex}"
            pairs = [
                (self.w.keys.marker(r.reward_version, r.generation_id, r.revision), r.model_dump_json())
                for r in records
            ]
            self.plan.outbox.append((self.w.keys.outbox(p), entry_id, ttl, pairs))
        return self.plan


def _now():  # noqa: ANN202 - a seam for reading the clock in one place
    from flywheel.contract import utcnow

    return utcnow()


class SignalsWorker:
    """Consumes `settings.events_topic`, emits `RewardRecord`s. See the module docstring.

    `run_once()` handles one poll; `run(stop_event)` loops until the event is set.
    """

    def __init__(
        self,
        settings: Settings,
        config: SignalsConfig | None = None,
        *,
        consumer: Consumer | None = None,
        producer: Producer | None = None,
    ) -> None:
        self.settings = settings
        self.config = config or SignalsConfig()
        self.redis = redis_client(settings)
        self.store = StateStore(self.redis)
        self.definitions = DefinitionStore(settings, self.redis)
        self.keys = Keys(settings.redis_prefix, settings.events_topic)
        self.window_us = int(round(settings.reward_window_s * 1e6))
        self.lateness_us = int(round(settings.allowed_lateness_s * 1e6))
        self.group_id = self.config.group_id or f"flywheel-signals.{settings.events_topic}"
        # Made on first use (`consumer`, `producer`): a worker started while Kafka is down waits for it.
        self._consumer = consumer
        self._producer = producer
        self.kafka = kafka_dependency(settings)
        self.health = ProcessHealth(
            "signals-worker",
            [self.kafka, redis_dependency(settings), mlflow_dependency(settings), lake_dependency(settings.lake_dir)],
            optional={"mlflow"},  # only the periodic refit needs the registry
        )
        self.stats = WorkerStats()
        self._last_data = time.monotonic()
        self._assigned: set[tuple[str, int]] = set()
        self._active: tuple[float, RewardDefinition] | None = None
        self._last_refit = time.monotonic()

    @property
    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = self._connect(
                lambda: make_consumer(self.settings, [self.settings.events_topic], self.group_id)
            )
        return self._consumer

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            self._producer = self._connect(lambda: make_producer(self.settings))
        return self._producer

    def _connect(self, make: Callable[[], _Part]) -> _Part:
        probe = self.kafka.probe()  # a TCP connect: the clients themselves block for seconds when down
        if not probe.ok:
            raise BrokerUnavailable(probe.detail)
        try:
            return make()
        except Exception as exc:  # the client libraries raise their own errors while a broker starts
            raise BrokerUnavailable(f"cannot connect to Kafka: {describe(exc)}") from exc

    def definition(self, version: str | None) -> RewardDefinition:
        """The pinned version of a generation, else the active one (re-read at most every 5 s)."""
        if version is not None:
            return self.definitions.get(version)
        if self._active is None or time.monotonic() - self._active[0] > 5.0:
            self._active = (time.monotonic(), self.definitions.active())
        return self._active[1]

    # ------------------------------------------------------------------ loop

    def run_once(self) -> int:
        """Poll once, process, commit; returns the number of records sent out."""
        sent = self.flush_outbox()
        records = self.consumer.poll_batch(self.config.poll_max_records, self.config.poll_timeout_s)
        assigned = self.consumer.assignment()
        if assigned != self._assigned:
            # a fresh assignment has not fetched anything yet: an empty poll now does not mean a quiet stream
            self._assigned = assigned
            self._last_data = time.monotonic()
        if not records:
            if time.monotonic() - self._last_data >= self.config.idle_after_s:
                self._tick_idle()
            return sent + self.flush_outbox()
        self._last_data = time.monotonic()
        try:
            self._process(records)
            self.consumer.commit(next_offsets(records))
        except BaseException:
            # Not committed: read the batch again on the next poll instead of going past it (a Redis
            # outage mid-batch must not skip events; their ids make the second read count nothing twice).
            self._rewind(records)
            raise
        return sent + self.flush_outbox()

    def _rewind(self, records: list[Record]) -> None:
        first: dict[tuple[str, int], int] = {}
        for r in records:
            key = (r.topic, r.partition)
            first[key] = min(first.get(key, r.offset), r.offset)
        try:
            for (topic, partition), offset in first.items():
                self.consumer.seek(topic, partition, offset)
        except Exception:  # noqa: BLE001 - a partition revoked meanwhile: its new owner replays from the commit
            log.warning("could not rewind after a failed batch", exc_info=True)

    def run(self, stop_event: threading.Event) -> None:
        """Poll and emit until `stop_event` is set, waiting out Kafka, Redis and MLflow outages."""
        log.info("signals worker starting",
                 extra={"topic": self.settings.events_topic, "group": self.group_id})
        sweeper = TempFileSweeper(REWARDS.at(self.settings.lake_dir))

        def step() -> None:
            sweeper.maybe()
            self.run_once()
            self._maybe_refit()

        try:
            run_loop(step, stop_event, self.health)
        finally:
            self.close()

    def close(self) -> None:
        for part in (self._consumer, self._producer):
            if part is None:
                continue
            try:
                part.close()
            except Exception:  # noqa: BLE001 - closing must not hide the error that stopped us
                log.warning("error while closing the signals worker", exc_info=True)
        self._consumer = self._producer = None

    # ------------------------------------------------------------------ steps

    def _process(self, records: list[Record]) -> None:
        by_partition: dict[int, list[Event]] = defaultdict(list)
        for r in sorted(records, key=lambda r: (r.partition, r.offset)):
            event = decode_event(r.value, self.window_us)
            if event is None:  # ingest dead-letters it; here it simply carries no signal
                self.stats.invalid += 1
                metrics.EVENTS.labels("invalid").inc()
                continue
            by_partition[r.partition].append(event)
        self.stats.events += sum(len(v) for v in by_partition.values())
        bounds = {
            p: max(event_clock_us(e) for e in evs) - self.lateness_us for p, evs in by_partition.items()
        }
        gids = {e.generation_id for evs in by_partition.values() for e in evs}
        batch = _Batch(self, *self.store.load(self.keys, bounds, gids))
        for p, evs in by_partition.items():
            for e in evs:
                batch.add(p, e)
        self._commit(batch)

    def _tick_idle(self) -> None:
        assigned = [p for t, p in self.consumer.assignment() if t == self.settings.events_topic]
        if not assigned:
            return
        wm = to_us(_now()) - self.lateness_us - int(self.config.idle_grace_s * 1e6)
        batch = _Batch(self, *self.store.load(self.keys, dict.fromkeys(assigned, wm), set()))
        for p in assigned:
            batch.advance(p, wm)
        self._commit(batch)

    def _commit(self, batch: _Batch) -> None:
        plan = batch.finish()
        queued = self.store.commit(plan)
        n = sum(len(v) for v in batch.emitted.values())
        if queued != n:
            log.warning(
                "%d of %d records were already emitted (markers set); not sending them again", n - queued, n
            )

    def flush_outbox(self) -> int:
        """Send committed records to Kafka and the lake; pop each entry only after both succeeded."""
        sent = 0
        for topic, p in sorted(self.consumer.assignment()):
            if topic != self.settings.events_topic:
                continue
            for raw in self.store.outbox_entries(self.keys, p):
                entry_id, *lines = raw.decode().split("\n")
                recs = [RewardRecord.model_validate_json(line) for line in lines]
                produce_rewards(self.producer, self.settings, recs)
                write_rewards(REWARDS.at(self.settings.lake_dir), recs, f"signals-{entry_id}")
                self.store.pop_outbox(self.keys, p)
                first = sum(1 for r in recs if r.revision == 0)
                self.stats.records += first
                self.stats.revisions += len(recs) - first
                metrics.RECORDS.labels("first").inc(first)
                metrics.RECORDS.labels("revision").inc(len(recs) - first)
                sent += len(recs)
        return sent

    def _maybe_refit(self) -> None:
        every = self.config.refit_every_s
        if every <= 0 or time.monotonic() - self._last_refit < every:
            return
        self._last_refit = time.monotonic()
        from signals.satisfaction import refit

        try:
            refit(self.settings, self.config)
        except Exception as exc:  # noqa: BLE001 - a failed refit keeps the current definition; the stream goes on
            dep = self.health.blame(exc)
            if dep is not None:  # an outage: one line per state change, and the next refit retries
                dep.failed(exc)
            else:
                log.exception("satisfaction refit failed; keeping the active reward definition")
