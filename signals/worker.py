"""The streaming extractor: events in, one reward record per generation window out.

Surfaces: a generation's `surface` property picks the reward definition that scores it (the
surface's active one when the generation event arrives, pinned in its state) and so its window,
[ts, ts + the definition's window]. A definition never scores another surface.

Event-time windows. Each partition has a live watermark, the largest event clock seen minus
`allowed_lateness_s`, where an event's clock is its arrival, `received_at` (never later than this
worker's wall clock): the arrival keeps the watermark moving when events carry old timestamps, a
client's clock (fast, or forged thousands of years ahead) never moves it, and it is what lets the
batch recompute replay the stream exactly from the lake (same partition order, same clocks). A
watermark found beyond the wall clock at start (written before this rule) is lowered to it. A generation whose event
arrived more than `backfill_after_s` after its time is history being replayed: its window closes
by the partition's historical watermark instead (the largest `ts` of such events minus the
lateness), so a replay in time order gives each generation one final record rather than a
default on arrival and a revision per later event. When the whole stream has been empty for
`idle_after_s`, the windows due by the wall clock (now - lateness - `idle_grace_s`) close, so windows
close in a quiet system; the live watermark moves there, the historical one stays at the replay's event
time, so history replayed into a worker that has been idle still gives one final record per generation.

A batch is a poll, and more polls while the broker already holds more records (up to `poll_max_records`, never
waiting for new ones), decoded column-wise by the contract's batch validator (`signals.events.decode_batch`):
an event is taken exactly when ingest writes it to the lake, with the lake's properties, and a record the
contract refuses is dead-lettered here too, with its reason (every consumer of the topic guards its parser the
same way: `flywheel.fast_validate.validate_guarded`). Then per event, in
partition order: skip it if its id was seen; advance the watermarks; close every
window ending at or before them (record revision 0); then add the event. A feedback event in a
window already closed is late: the batch then yields one corrected record for its generation,
whose revision is the number of late events it holds (several late events of one batch make one
revision). Feedback timed after its window's end is ignored. Feedback whose generation has not
come yet is held; it is orphan once the watermark passes its time plus the longest window.
Every event's outcome is counted (`signals/metrics.py`) and the unusual ones logged.

Bounds: a generation keeps at most `max_feedback_per_generation` distinct feedback events, in arrival
order, each with at most `max_feedback_bytes` of properties; the rest are dead-lettered (`capped`). So
its state is bounded in bytes (about cap x (bytes + 300) plus its generation), a batch costs each of
its generations one record at most, and a flood for one generation costs its partition's other
generations at most the batch it arrived in. A generation whose reward definition cannot be found
is dead-lettered (`dead_lettered`) and the stream goes on. New surface names: at most `max_new_surfaces` are
adopted per `new_surfaces_window_s` (a generation naming one more is dead-lettered, `capped`), and a batch's are
written to the pointer together, once, before the batch commits. The periodic refit runs in a thread of its own
and reads the rewards table once for every surface (`signals.satisfaction.refit_all`): scoring never waits on it.

Delivery: a batch's state, watermarks, emitted markers and outbox are written in
one Redis script; offsets are committed after that; the outbox then goes to Kafka
and the lake and is popped. A restarted worker re-reads uncommitted events (their
ids are already seen, so nothing counts twice) and first flushes any outbox left
behind. A flush sends every assigned partition's entries together: one Kafka send, one lake
commit in which each entry is written once by its name (idempotent); a crash between
Kafka's acknowledgement and the pop can repeat a Kafka message, which carries a
`record_id` header for consumers to drop it.

Outages: Kafka (at start too), Redis and MLflow are waited out (`flywheel.ops.run_loop`: one log
line when one goes down, one when it is back); a batch that failed half-way is read again from its
first offset (the consumer is moved back), so nothing is skipped, and its events' ids make the
second read count nothing twice. `/readyz` says which dependency is down.
"""

from __future__ import annotations

import gc
import heapq
import json
import logging
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar, get_args

import msgspec
import polars as pl

from flywheel.bus import (
    BrokerUnavailable,
    Consumer,
    Producer,
    RecordBatch,
    make_consumer,
    make_producer,
)
from flywheel.compact_json import compact_json_encoder
from flywheel.connections import redis_client
from flywheel.contract import EventType, LabelSource
from flywheel.dead_letters import DeadLetter, dead_letter
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
from flywheel.reward_versions import DEFAULT_SURFACE
from flywheel.settings import Settings
from signals import metrics
from signals.columns import FEEDBACK_SCHEMA, GENERATION_SCHEMA, score_frame, signal_names, signals_column
from signals.config import SignalsConfig
from signals.definitions import DefinitionStore, UnknownRewardVersion
from signals.events import FeedbackEvent, GenerationInfo, StreamEvent, decode_batch, from_us, properties_bytes, to_us
from signals.reward import RewardDefinition, builtin_definition
from signals.sink import RecordLine, decode_lines, encode_line, produce_lines, write_lines
from signals.state import NOT_EMITTED, CommitPlan, GenState, Keys, StateStore

log = logging.getLogger(__name__)

_Part = TypeVar("_Part", Consumer, Producer)


@dataclass
class WorkerStats:
    """What became of every event read (the outcomes add up to `events` + `invalid`, once every
    feedback event's generation is known or orphaned) and of every record emitted."""

    events: int = 0
    duplicates: int = 0
    invalid: int = 0
    generations: int = 0
    on_time: int = 0
    out_of_window: int = 0
    late_events: int = 0
    orphans: int = 0
    records: int = 0
    revisions: int = 0
    dead_lettered: int = 0
    capped: int = 0

    def count(self, outcome: str, n: int = 1) -> None:
        attr = _OUTCOME_ATTR[outcome]
        setattr(self, attr, getattr(self, attr) + n)
        metrics.EVENTS.labels(outcome).inc(n)


_OUTCOME_ATTR = {
    "duplicate": "duplicates",
    "invalid": "invalid",
    "generation": "generations",
    "on_time": "on_time",
    "out_of_window": "out_of_window",
    "late": "late_events",
    "orphan": "orphans",
    "dead_lettered": "dead_lettered",
    "capped": "capped",
}


def event_clock_us(e: StreamEvent, now_us: int) -> int:
    """The clock an event moves its partition's live watermark to: its arrival, bounded by `now_us`."""
    return min(e.received_us, now_us)


def event_lane(e: StreamEvent, backfill_after_us: int) -> int:
    """1 (historical) for an event received more than `backfill_after_us` after its time, else 0 (live)."""
    return 1 if e.received_us - e.ts_us > backfill_after_us else 0


class _Closed(msgspec.Struct, frozen=True, gc=False):
    """A record to emit: a window closed (or revised) in this batch, with its events at that moment (a Struct,
    like `signals.events`' values: one is made per record)."""

    definition: RewardDefinition
    partition: int
    gen: GenerationInfo
    window_end_us: int
    events: list[FeedbackEvent]
    revision: int
    late: int


def score_closed(closed: list[_Closed]) -> list[tuple[int, RecordLine]]:
    """(partition, record) of every closed window of a micro-batch, in order, each version's windows scored
    together by its column expressions (`signals.columns`, the batch recompute's own)."""
    if not closed:
        return []
    emitted_at = _now()
    out: dict[int, tuple[int, RecordLine]] = {}
    by_version: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(closed):
        by_version[c.definition.version].append(i)
    for indices in by_version.values():
        definition = closed[indices[0]].definition
        # the key's `revision` column is the row's position: a window may close and be revised in one batch
        gens = pl.DataFrame(
            {
                "generation_id": [closed[i].gen.generation_id for i in indices],
                "revision": indices,
                "finish_reason": [closed[i].gen.finish_reason for i in indices],
                "completion_chars": [closed[i].gen.completion_chars for i in indices],
            },
            schema=GENERATION_SCHEMA,
        )
        feedback = pl.DataFrame(
            {
                "generation_id": [closed[i].gen.generation_id for i in indices for _ in closed[i].events],
                "revision": [i for i in indices for _ in closed[i].events],
                "event_id": [e.event_id for i in indices for e in closed[i].events],
                "type": [e.type for i in indices for e in closed[i].events],
                "ts_us": [e.ts_us for i in indices for e in closed[i].events],
                "properties": [_properties_json(e) for i in indices for e in closed[i].events],
            },
            schema=FEEDBACK_SCHEMA,
        )
        scored = score_frame(definition, gens, feedback)
        _check_scored(scored)
        columns = scored.select("revision", "reward", "confidence", "label_source").get_columns()
        rows = zip(*(col.to_list() for col in columns), signals_column(scored, signal_names(definition)), strict=True)
        for i, reward, confidence, label_source, signals in rows:
            c = closed[i]
            out[i] = (c.partition, RecordLine(
                generation_id=c.gen.generation_id, reward_version=definition.version, revision=c.revision,
                reward=reward, confidence=confidence, label_source=label_source, signals=signals,
                user_id=c.gen.user_id, model_version=c.gen.model_version, arm=c.gen.arm, experiment=c.gen.experiment,
                window_start=from_us(c.gen.ts_us), window_end=from_us(c.window_end_us), late_events=c.late,
                emitted_at=emitted_at,
            ))  # fmt: skip
    return [out[i] for i in range(len(closed))]


def score_guarded(
    closed: list[_Closed], unscorable: Callable[[_Closed, Exception], None]
) -> list[tuple[int, RecordLine]]:
    """`score_closed`; should a window still break it (a bug: what a client sends is held to the contract first),
    each window is scored alone and the ones that break it are handed to `unscorable` (dead-lettered), so one
    generation never stops the stream."""
    try:
        return score_closed(closed)
    except Exception:  # noqa: BLE001 - one window must not stop the worker on every restart
        log.exception("scoring %d windows failed; scoring them one by one", len(closed))
    out: list[tuple[int, RecordLine]] = []
    for c in closed:
        try:
            out += score_closed([c])
        except Exception as exc:  # noqa: BLE001
            unscorable(c, exc)
    return out


def _check_scored(scored: pl.DataFrame) -> None:
    """What `RewardRecord` would refuse (its records are `RecordLine`s, unchecked): a confidence outside [0, 1],
    a label source it does not know. A definition's expressions never make them; if one did, it is a bug."""
    bad = scored.filter(
        ~pl.col("confidence").is_between(0.0, 1.0) | ~pl.col("label_source").is_in(list(get_args(LabelSource)))
    )
    if bad.height:
        raise ValueError(f"scored records that are no RewardRecord: {bad.head(3).to_dicts()}")


_encode_properties = compact_json_encoder()


def _properties_json(e: FeedbackEvent) -> str:
    """Properties as the lake holds them (`flywheel.compact_json`), so both drivers parse the same text."""
    return _encode_properties(e.properties) if e.properties else "{}"


class _Batch:
    """The per-event logic over one poll's events (or an idle tick), against loaded state."""

    def __init__(
        self,
        worker: SignalsWorker,
        wms: dict[tuple[int, int], int],
        due: dict[tuple[int, int], list[tuple[int, int, str]]],
        states: dict[str, GenState],
        records: RecordBatch | None = None,
    ) -> None:
        self.w = worker
        self.records = records  # the polled batch its events came from (None: an idle tick)
        self.wms = wms
        self.states = states
        self.heaps: dict[tuple[int, int], list[tuple[int, int, str]]] = {k: sorted(v) for k, v in due.items()}
        self.dirty: set[str] = set()
        self.plan = CommitPlan()
        self.emitted: dict[int, list[RecordLine]] = defaultdict(list)
        self.now_us = to_us(_now())
        self.outcomes: Counter[str] = Counter()
        self.dead: list[DeadLetter] = []
        self.revise: set[str] = set()
        self.closed: list[_Closed] = []

    def refuse(self, reason: str, source: str, original: bytes, outcome: str = "dead_lettered") -> None:
        """Dead-letter what this worker will not score (sent before the batch commits: none is lost); one log
        line per batch counts them (`finish`), so a flood of them is not a flood of log lines."""
        self.dead.append(dead_letter(reason, source, original))
        self.count(outcome)

    def count(self, outcome: str, n: int = 1) -> None:
        # added to the worker's stats and metrics once per batch (`finish`): a counter per event cost more
        # than the event's own logic
        if n:
            self.outcomes[outcome] += n

    def advance(self, p: int, lane: int, wm: int, *, hold: bool = False) -> None:
        """Move the lane's watermark to `wm` (if later) and close what is due by it; `hold`: close what is
        due by `wm` but keep the watermark where it was (the idle tick's historical lane, see `_tick_idle`)."""
        key = (p, lane)
        if not hold and wm > self.wms.get(key, -(2**62)):
            self.wms[key] = wm
        bound = max(wm, self.wms.get(key, -(2**62)))
        heap = self.heaps.setdefault(key, [])
        while heap and heap[0][0] <= bound:
            end, kind, gid = heapq.heappop(heap)
            st = self.states.get(gid)
            if kind == 1:
                self.plan.zrem.append((self.w.keys.pending(p, lane), gid))
                if st is not None and st.gen is None and not st.orphaned:
                    # no generation event came for as long as any window could last: the feedback is orphan
                    st.orphaned = True
                    self.dirty.add(gid)
                    self.count("orphan", len(st.events))
                    log.warning(
                        "orphan feedback: no generation event", extra={"generation_id": gid, "events": len(st.events)}
                    )
            elif st is None:  # state expired: nothing left to score
                self.plan.zrem.append((self.w.keys.open(p, lane), gid))
            elif st.revision == NOT_EMITTED and st.window_end_us == end:
                self.emit(gid, st, 0)

    def add(self, e: StreamEvent) -> None:
        p = e.partition
        st = self.states.get(e.generation_id)
        if st is None:
            st = self.states[e.generation_id] = GenState(partition=p)
        if e.event_id in st.seen:
            self.count("duplicate")
            return
        lane = event_lane(e, self.w.backfill_after_us)
        self.advance(p, 0, event_clock_us(e, self.now_us) - self.w.lateness_us)
        if lane:
            self.advance(p, 1, e.ts_us - self.w.lateness_us)
        if e.type != EventType.GENERATION and not self._within_bounds(e, st):
            return
        st.seen.add(e.event_id)
        self.dirty.add(e.generation_id)
        if e.type == EventType.GENERATION:
            if st.gen is not None:  # another generation event for the same id: the first one counts
                self.count("duplicate")
                return
            try:
                gen = GenerationInfo.from_properties(e.generation_id, e.ts_us, e.user_id, e.properties)
                definition = self.w.definition_for(gen.surface)
            except TooManyNewSurfaces as exc:  # a flood of new names: not scored now; a replay scores it later
                st.seen.discard(e.event_id)
                self.refuse(str(exc), *self._origin(e), outcome="capped")
                return
            except UnknownRewardVersion as exc:  # the pointer names a version no store holds: not this event's fault,
                # but it cannot be scored; the stream goes on, and a replay of the letter scores it once fixed
                st.seen.discard(e.event_id)
                self.refuse(f"cannot score generation: {exc}", *self._origin(e))
                return
            self.count("generation")
            self._open(p, lane, e.generation_id, st, gen, definition)
            return
        fe = FeedbackEvent(e.event_id, e.type, e.ts_us, e.properties)
        if st.gen is None:  # its generation may still come: hold it, and watch for an orphan
            st.events.append(fe)
            if st.orphaned:
                self.count("orphan")
            elif len(st.events) == 1:
                deadline = fe.ts_us + self.w.max_window_us()
                heapq.heappush(self.heaps.setdefault((p, lane), []), (deadline, 1, e.generation_id))
                self.plan.zadd.append((self.w.keys.pending(p, lane), e.generation_id, str(deadline)))
            return
        assert st.window_end_us is not None
        if fe.ts_us > st.window_end_us:
            self.count("out_of_window")
            return
        st.events.append(fe)
        if st.revision != NOT_EMITTED:
            st.late += 1
            self.count("late")
            metrics.LATE_EVENTS.inc()
            self.revise.add(e.generation_id)  # one revision per generation per batch, emitted by `finish`
        else:
            self.count("on_time")

    def _origin(self, e: StreamEvent) -> tuple[str, bytes]:
        """The dead letter's source (topic/partition/offset) and original bytes of `e`'s record."""
        return self.source(e.index), self.records.values[e.index] if self.records is not None else b""

    def source(self, i: int) -> str:
        """A dead letter's source for record `i` of the polled batch (`kafka:<topic>/<partition>/<offset>`)."""
        assert self.records is not None, "only a polled batch has records"
        r = self.records
        return f"kafka:{r.topics[i]}/{r.partitions[i]}/{r.offsets[i]}"

    def _within_bounds(self, e: StreamEvent, st: GenState) -> bool:
        """Whether feedback event `e` may join its generation's state: at most `max_feedback_per_generation`
        distinct ones (in arrival order, whatever becomes of them), each at most `max_feedback_bytes` of
        properties. Beyond either it is dead-lettered and counted `capped`."""
        cfg = self.w.config
        if st.feedback >= cfg.max_feedback_per_generation:
            reason = (
                f"generation {e.generation_id} already has {cfg.max_feedback_per_generation} feedback events "
                "(FLYWHEEL_SIGNALS_MAX_FEEDBACK_PER_GENERATION)"
            )
        elif (
            # `properties_bytes` is at most 4 bytes a character of the lake's text (an exponent's sign, one of its
            # few differences, is ASCII): counted exactly only where the limit could be reached.
            e.properties_chars * 4 + 64 > cfg.max_feedback_bytes
            and (size := properties_bytes(e.properties)) > cfg.max_feedback_bytes
        ):
            reason = (
                f"feedback properties are {size} bytes; a generation's state keeps at most "
                f"{cfg.max_feedback_bytes} (FLYWHEEL_SIGNALS_MAX_FEEDBACK_BYTES)"
            )
        else:
            st.feedback += 1
            return True
        self.refuse(reason, *self._origin(e), outcome="capped")
        return False

    def _open(
        self, p: int, lane: int, gid: str, st: GenState, gen: GenerationInfo, definition: RewardDefinition
    ) -> None:
        """The generation is known: pin its surface's active definition and window, sort out the
        feedback that came before it, and close the window now if the watermark is already past it."""
        st.gen, st.version, st.lane = gen, definition.version, lane
        st.window_end_us = gen.ts_us + self.w.window_us(definition)
        early, st.events = st.events, [fe for fe in st.events if fe.ts_us <= st.window_end_us]
        if not st.orphaned:
            self.count("on_time", len(st.events))
            self.count("out_of_window", len(early) - len(st.events))
            if early:
                self.plan.zrem.append((self.w.keys.pending(p, lane), gid))
        if st.window_end_us <= self.wms.get((p, lane), -(2**62)):
            self.emit(gid, st, 0)
        else:
            heapq.heappush(self.heaps.setdefault((p, lane), []), (st.window_end_us, 0, gid))
            self.plan.zadd.append((self.w.keys.open(p, lane), gid, str(st.window_end_us)))

    def emit(self, gid: str, st: GenState, revision: int) -> None:
        assert st.gen is not None and st.window_end_us is not None
        try:
            if st.version is None:  # a state written before versions were pinned on arrival
                st.version = self.w.definition_for(st.gen.surface).version
            definition = self.w.definitions.get(st.version)
        except UnknownRewardVersion as exc:  # its pinned version is gone from every store
            if revision == 0:
                self.plan.zrem.append((self.w.keys.open(st.partition, st.lane), gid))
            original = st.to_json().encode()
            self.refuse(f"cannot score generation {gid}: {exc}", f"signals:{self.w.settings.events_topic}", original)
            return
        # scored with the batch's other closed windows in `finish` (the events as they stand now)
        self.closed.append(_Closed(definition, st.partition, st.gen, st.window_end_us, list(st.events), revision,
                                   st.late))  # fmt: skip
        st.revision = revision
        self.dirty.add(gid)
        if revision == 0:
            self.plan.zrem.append((self.w.keys.open(st.partition, st.lane), gid))
            lag_s = (self.now_us - st.window_end_us - self.w.lateness_us) / 1e6
            metrics.CLOSE_LAG.observe(max(0.0, lag_s))

    def _unscorable(self, c: _Closed, exc: Exception) -> None:
        original = json.dumps({"generation": c.gen.to_json(), "events": [e.to_json() for e in c.events]},
                              default=str).encode()  # fmt: skip
        reason = f"cannot score generation {c.gen.generation_id}: {type(exc).__name__}: {str(exc)[:300]}"
        self.refuse(reason, f"signals:{self.w.settings.events_topic}", original)

    def finish(self) -> CommitPlan:
        # Coalesced: a generation's late events of this batch make one revision, numbered by the late events it
        # holds (so it is the recompute's revision of that number, `signals.recompute`).
        for gid in sorted(self.revise):
            st = self.states[gid]
            self.emit(gid, st, st.late)
        for outcome, n in self.outcomes.items():
            self.w.stats.count(outcome, n)
        for partition, record in score_guarded(self.closed, self._unscorable):
            self.emitted[partition].append(record)
        ttl = int(self.w.config.state_ttl_s)
        for gid in sorted(self.dirty):
            self.plan.states.append((self.w.keys.gen(gid), self.states[gid].to_json(), ttl))
        for (p, lane), wm in self.wms.items():
            self.plan.wm.append((self.w.keys.wm, f"h{p}" if lane else str(p), str(wm)))
        for p, records in self.emitted.items():
            entry_id = f"{p}-{uuid.uuid4().hex}"
            pairs = [
                (self.w.keys.marker(r.reward_version, r.generation_id, r.revision), encode_line(r).decode())
                for r in records
            ]
            self.plan.outbox.append((self.w.keys.outbox(p), entry_id, ttl, pairs))
        noted = {k: v for k, v in self.outcomes.items() if k in _NOTED}
        if noted:
            log.info("signals batch: events outside the normal path", extra=noted)
        return self.plan


# Outcomes worth a log line (the counters have them all).
_NOTED = frozenset({"duplicate", "out_of_window", "late", "orphan", "dead_lettered", "capped"})


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused: a poll makes several objects an event (the client's records, the
    decoded events, states, records), nearly all freed by reference counting, which the collector, set off every
    few hundred allocations, would only walk (a fifth of a batch's time, measured). It runs again after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _now():  # noqa: ANN202 - a seam for reading the clock in one place
    from flywheel.contract import utcnow

    return utcnow()


class TooManyNewSurfaces(UnknownRewardVersion):
    """A generation names a surface past this window's cap on new ones (`SignalsConfig.max_new_surfaces`): like
    a version no store holds, it cannot be scored now; its generation is dead-lettered and the stream goes on."""

    def __str__(self) -> str:
        return str(self.args[0])


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
        self.definitions.ensure_pointer()
        self.keys = Keys(settings.redis_prefix, settings.events_topic)
        self.lateness_us = int(round(settings.allowed_lateness_s * 1e6))
        self._repaired = False  # watermarks checked against the wall clock (`_repair_watermarks`)
        self.backfill_after_us = int(round(self.config.backfill_after_s * 1e6))
        self.group_id = self.config.group_id or f"flywheel-signals.{settings.events_topic}"
        # Made on first use (`consumer`, `producer`): a worker started while Kafka is down waits for it.
        self._consumer = consumer
        self._producer = producer
        self.kafka = kafka_dependency(settings)
        self.health = ProcessHealth(
            "signals-worker",
            [self.kafka, redis_dependency(settings), mlflow_dependency(settings), lake_dependency(settings.lake_root)],
            optional={"mlflow"},  # only the periodic refit needs the registry
        )
        self.stats = WorkerStats()
        self._last_data = time.monotonic()
        self._assigned: set[tuple[str, int]] = set()
        self._active: tuple[float, dict[str, RewardDefinition]] | None = None
        self._warned: set[str] = set()
        self._last_refit = time.monotonic()
        self._refitting: threading.Thread | None = None
        # New surfaces of the batch in progress, written to the pointer once, before the batch commits.
        self._adopted: dict[str, str] = {}
        self._new_surfaces: list[float] = []  # when each new surface of the current window was adopted

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

    def active_definitions(self) -> dict[str, RewardDefinition]:
        """The active definition of each surface (re-read at most every 5 s)."""
        if self._active is None or time.monotonic() - self._active[0] > 5.0:
            found: dict[str, RewardDefinition] = {}
            for s in self.definitions.active_map():
                try:
                    found[s] = self.definitions.active(s)
                except UnknownRewardVersion:  # left out: `definition_for` raises, and its generations are dead-lettered
                    if s not in self._warned:
                        self._warned.add(s)
                        log.error(
                            "the active reward version of a surface cannot be found; its generations are "
                            "dead-lettered until it is activated again",
                            extra={"surface": s},
                        )
            self._active = (time.monotonic(), found)
            for surface, d in found.items():
                window = d.window(self.settings.window_for(d.surface))
                if window < d.latest_checkpoint_s and d.version not in self._warned:
                    self._warned.add(d.version)  # once per version, not at every re-read
                    log.warning(
                        "the feedback window is shorter than the latest checkpoint its definition reads: "
                        "later checks are counted out-of-window",
                        extra={
                            "surface": surface,
                            "version": d.version,
                            "window_s": window,
                            "latest_checkpoint_s": d.latest_checkpoint_s,
                        },
                    )
        return self._active[1]

    def definition_for(self, surface: str) -> RewardDefinition:
        """The active definition of `surface`: its built-in rules if none was ever activated, pinned in the
        pointer on first sight so every reader counts them. `UnknownRewardVersion` when the pointer names a
        version that no store holds (the caller dead-letters what it could not score)."""
        active = self.active_definitions()
        if surface not in active:
            now = time.monotonic()
            window = self.config.new_surfaces_window_s
            self._new_surfaces = [t for t in self._new_surfaces if now - t < window]
            if len(self._new_surfaces) >= self.config.max_new_surfaces:
                raise TooManyNewSurfaces(
                    f"surface {surface!r} is new, and {len(self._new_surfaces)} new surfaces were adopted in the last "
                    f"{window:g} s (FLYWHEEL_SIGNALS_MAX_NEW_SURFACES); replay this letter later"
                )
            self._new_surfaces.append(now)
            version = self.definitions.active_map().get(surface) or builtin_definition(surface).version
            self._adopted[surface] = version
            active[surface] = self.definitions.get(version)
        return active[surface]

    def window_us(self, definition: RewardDefinition) -> int:
        return int(round(definition.window(self.settings.window_for(definition.surface)) * 1e6))

    def max_window_us(self) -> int:
        """The longest window of any active definition: feedback whose generation has not come by then is orphan."""
        return max(
            (self.window_us(d) for d in self.active_definitions().values()),
            default=self.window_us(builtin_definition(DEFAULT_SURFACE)),
        )

    # ------------------------------------------------------------------ loop

    def _repair_watermarks(self) -> None:
        """Lower any watermark beyond the wall clock (an event's own time moved it before clocks were arrival):
        once, before this worker's first batch or idle tick reads them (in the loop, so an outage at start is
        waited out like any other)."""
        lowered = self.store.lower_watermarks(self.keys, to_us(_now()) - self.lateness_us)
        if lowered:
            log.warning(
                "watermarks beyond the wall clock lowered to it (an event's own time had moved them)",
                extra={"lanes": lowered},
            )
        self._repaired = True

    def run_once(self) -> int:
        """Poll once, process, commit; returns the number of records sent out."""
        with _gc_paused():
            return self._run_once()

    def _run_once(self) -> int:
        sent = self.flush_outbox()
        records = self._poll()
        assigned = self.consumer.assignment()
        if assigned != self._assigned:
            # a fresh assignment has not fetched anything yet: an empty poll now does not mean a quiet stream
            self._assigned = assigned
            self._last_data = time.monotonic()
        if not len(records):
            if time.monotonic() - self._last_data >= self.config.idle_after_s:
                self._tick_idle()
            return sent + self.flush_outbox()
        self._last_data = time.monotonic()
        try:
            self._process(records)
            self.consumer.commit(records.next_offsets())
        except BaseException:
            # Not committed: read the batch again on the next poll instead of going past it (a Redis
            # outage mid-batch must not skip events; their ids make the second read count nothing twice).
            self._rewind(records)
            raise
        return sent + self.flush_outbox()

    def _poll(self) -> RecordBatch:
        """A poll, then more while the batch is below `poll_max_records` and the broker already holds more records
        (`Consumer.known_backlog`: what is there, never what may come, so a live stream waits for no later
        event). A batch pays fixed costs once (the Lua commit, Kafka's flush, a lake commit, scoring's frames,
        the validator's columns), and one fetch response can hold less than a batch: the embedded broker's about
        3,400 events a partition. Should the group hand out partitions in between, what was gathered is read
        again from its first offsets, and the batch is empty."""
        cfg, consumer = self.config, self.consumer
        epoch = consumer.assignment_epoch()
        parts = [consumer.poll_columns(cfg.poll_max_records, cfg.poll_timeout_s)]
        n = len(parts[0])
        while 0 < n < cfg.poll_max_records and consumer.known_backlog() > 0:
            more = consumer.poll_columns(cfg.poll_max_records - n, cfg.poll_timeout_s)
            if consumer.assignment_epoch() != epoch:
                self._rewind(RecordBatch.concat([*parts, more]))
                return RecordBatch([], [], [], [])
            if not len(more):
                break
            parts.append(more)
            n += len(more)
        return RecordBatch.concat(parts)

    def _rewind(self, records: RecordBatch) -> None:
        """Each partition of `records` sought back to its first offset there, so the next poll reads them again."""
        for (topic, partition), offset in records.first_offsets().items():
            try:
                self.consumer.seek(topic, partition, offset)
            except Exception:  # noqa: BLE001 - a partition revoked meanwhile: its new owner replays from the commit
                log.warning("could not rewind a partition", extra={"partition": partition}, exc_info=True)

    def run(self, stop_event: threading.Event) -> None:
        """Poll and emit until `stop_event` is set, waiting out Kafka, Redis and MLflow outages."""
        log.info("signals worker starting", extra={"topic": self.settings.events_topic, "group": self.group_id})

        def step() -> None:
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

    def _process(self, records: RecordBatch) -> None:
        if not self._repaired:
            self._repair_watermarks()
        refused: list[tuple[int, str]] = []
        events, invalid = decode_batch(records, self.max_window_us(), refused)
        self.stats.count("invalid", invalid)
        self.stats.events += len(events)
        by_partition: dict[int, list[StreamEvent]] = defaultdict(list)
        for e in events:
            by_partition[e.partition].append(e)
        bounds: dict[tuple[int, int], int] = {}
        now_us = to_us(_now())
        for p, evs in by_partition.items():
            bounds[(p, 0)] = max(event_clock_us(e, now_us) for e in evs) - self.lateness_us
            historical = [e.ts_us for e in evs if event_lane(e, self.backfill_after_us)]
            bounds[(p, 1)] = (max(historical) - self.lateness_us) if historical else -(2**62)
        batch = _Batch(self, *self.store.load(self.keys, bounds, {e.generation_id for e in events}), records)
        for i, reason in refused:  # what the contract refuses is dead-lettered by every consumer, with its reason
            batch.dead.append(dead_letter(f"signals: {reason}", batch.source(i), records.values[i] or b""))
        for e in events:  # (partition, offset) order
            batch.add(e)
        self._commit(batch)

    def _tick_idle(self) -> None:
        if not self._repaired:
            self._repair_watermarks()
        assigned = [p for t, p in self.consumer.assignment() if t == self.settings.events_topic]
        if not assigned:
            return
        wm = to_us(_now()) - self.lateness_us - int(self.config.idle_grace_s * 1e6)
        lanes = {(p, lane): wm for p in assigned for lane in (0, 1)}
        batch = _Batch(self, *self.store.load(self.keys, lanes, set()))
        for p, lane in lanes:
            # The historical lane's open windows close by the wall clock, but its watermark stays the replay's
            # event time: a replay that starts after a quiet spell must not find every old window already shut
            # (a default record on arrival, then every feedback event late).
            batch.advance(p, lane, wm, hold=lane == 1)
        self._commit(batch)

    def _commit(self, batch: _Batch) -> None:
        plan = batch.finish()
        if self._adopted:  # the batch's new surfaces, in one pointer write, before their first records can go out
            self.definitions.adopt_all(self._adopted)
            self._adopted = {}
        if batch.dead:  # before the commit: a crash in between re-reads them, so a letter may repeat, never vanish
            self.producer.send_all([d.outgoing(self.settings.dead_letter_topic) for d in batch.dead], timeout_s=30)
        queued = self.store.commit(plan)
        n = sum(len(v) for v in batch.emitted.values())
        if queued != n:
            log.warning("%d of %d records were already emitted (markers set); not sending them again", n - queued, n)

    def flush_outbox(self) -> int:
        """Send committed records to Kafka and the lake; pop the entries only after both succeeded. The entries of
        every assigned partition go together: one send, one lake commit (each entry in it once, by its name), one
        pop; so a batch pays Kafka's flush and the lake's commit once, not once a partition."""
        mine = sorted(p for topic, p in self.consumer.assignment() if topic == self.settings.events_topic)
        found = self.store.outbox_entries(self.keys, mine)
        if not found:
            return 0
        named: list[tuple[str, list[bytes]]] = []
        for raws in found.values():
            for raw in raws:
                entry_id, *lines = raw.split(b"\n")
                named.append((f"signals-{entry_id.decode()}", lines))
        lines = [line for _, entry in named for line in entry]
        recs = decode_lines(b"[" + b",".join(lines) + b"]")
        produce_lines(self.producer, self.settings, lines, recs)
        entries, start = [], 0
        for name, entry in named:
            entries.append((name, recs[start : start + len(entry)]))
            start += len(entry)
        write_lines(REWARDS.at(self.settings.lake_root), entries)
        self.store.pop_outbox(self.keys, {p: len(raws) for p, raws in found.items()})
        first = sum(1 for r in recs if r.revision == 0)
        self.stats.records += first
        self.stats.revisions += len(recs) - first
        metrics.RECORDS.labels("first").inc(first)
        metrics.RECORDS.labels("revision").inc(len(recs) - first)
        return len(recs)

    def _maybe_refit(self) -> None:
        """Start the periodic refit in a thread of its own, so scoring never waits on it (it reads the rewards
        table, once for every surface: `refit_all`); one at a time."""
        every = self.config.refit_every_s
        if every <= 0 or time.monotonic() - self._last_refit < every:
            return
        if self._refitting is not None and self._refitting.is_alive():
            return
        self._last_refit = time.monotonic()
        self._refitting = threading.Thread(target=self.refit, name="signals-refit", daemon=True)
        self._refitting.start()

    def refit(self) -> None:
        """One refit of every surface with enough labels; failures are logged (an outage once per state change)."""
        from signals.satisfaction import refit_all

        try:
            refit_all(self.settings, self.config)
        except Exception as exc:  # noqa: BLE001 - a failed refit keeps the current definition; the stream goes on
            dep = self.health.blame(exc)
            if dep is not None:  # an outage: one line per state change, and the next refit retries
                dep.failed(exc)
            else:
                log.exception("satisfaction refit failed; keeping the active reward definition")
