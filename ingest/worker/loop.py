"""Ingest worker: Kafka events topic -> validated, de-duplicated rows in the lake's Delta table, exactly once.

One batch at a time (`run_once`):

1. poll a batch column-wise (`Consumer.poll_columns`; consumer group, offsets committed by hand), until
   `batch_size` records or `linger_s` after the first: a Delta commit costs a fixed 15-30 ms, so a batch
   is made big enough to pay for it, and a quiet topic still commits within `linger_s`;
2. on a new assignment, reload each partition's offset from the table and seek to it + 1 (the table,
   not the consumer group, says where reading resumes: `ingest.worker.dedup`);
3. validate against the contract (`flywheel.fast_validate.validate_guarded`, as every consumer of the topic);
4. drop records the table already holds and duplicate event ids (`ingest.worker.dedup.PartitionLedger`);
5. produce every record that could not be decoded, validated or stored to the dead-letter topic, with
   its bytes, the reason and `kafka:<topic>/<partition>/<offset>`, and commit them to the dead-letter
   table with their partitions' offsets;
6. commit the rows with each partition's last offset in one Delta commit, checked on the snapshot that
   commits (`ingest.worker.dedup` argues why that is exactly once); then commit the offsets to the group (sent,
   not waited for: they only feed the lag gauge and a fresh group's start). A commit that fails is never
   retried blindly: the table is reloaded and every partition is sought to its stored offset + 1.

No record stops the worker: each is written or dead-lettered, then passed.
Run it with `python -m ingest.worker` or `flywheel ingest worker` (settings from the env); the process
serves its metrics and health on `settings.bind_host`:`settings.ingest_metrics_port` (`flywheel.ops`), and
waits out a Kafka or lake outage (at start too) with one log line when it goes down and one when it is back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import polars as pl
from deltalake.exceptions import CommitFailedError
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from flywheel.bus import (
    BrokerUnavailable,
    Consumer,
    Producer,
    RecordBatch,
    ensure_topics,
    make_consumer,
    make_producer,
)
from flywheel.fast_validate import validate_guarded
from flywheel.lake.tables import DEAD_LETTERS, EVENTS, CommitRefused
from flywheel.ops import ProcessHealth, kafka_dependency, lake_dependency, run_loop
from flywheel.ops import run_worker as run_with_ops
from flywheel.settings import Settings
from ingest import metrics
from ingest.dead_letters import dead_letter
from ingest.worker.dedup import PartitionLedger
from ingest.worker.lake_sink import storable

log = logging.getLogger(__name__)

DEFAULT_GROUP_PREFIX = "flywheel-ingest"
# Ready while the last poll is younger than this: a worker stuck in a batch or a retry loop is not ready.
READY_POLL_AGE_S = 30.0


@dataclass(frozen=True, slots=True)
class BatchResult:
    polled: int = 0
    written: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    already_in_lake: int = 0


class _StageClock:
    """Adds the time since the previous lap to `flywheel_ingest_stage_seconds_total{stage}`."""

    def __init__(self) -> None:
        self._last = time.perf_counter()

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        metrics.STAGE_SECONDS.labels(stage).inc(now - self._last)
        self._last = now


class IngestWorker:
    def __init__(
        self,
        settings: Settings,
        *,
        group_id: str | None = None,
        batch_size: int = 10_000,  # bench/ingest_pipeline.py: 5000 went about a tenth slower
        poll_timeout_s: float = 0.5,
        linger_s: float = 1.0,
        dedup_ttl_s: int = 7 * 24 * 3600,
        connect_attempts: int | None = None,
        pause_before_commit_s: float = 0.0,
        lag_interval_s: float = 5.0,
        consumer: Consumer | None = None,
        producer: Producer | None = None,
    ) -> None:
        self.settings = settings
        # One group per events topic: deployments sharing a cluster (or tests sharing a broker) must not
        # rebalance each other's workers.
        self.group_id = group_id or f"{DEFAULT_GROUP_PREFIX}.{settings.events_topic}"
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.linger_s = linger_s
        self.connect_attempts = connect_attempts
        # Fault injection for the crash tests: widens the window between the lake write and the commit.
        self.pause_before_commit_s = pause_before_commit_s
        self._consumer = consumer
        self._producer = producer
        lake = settings.lake_root
        keep_log = settings.lake_log_retention_days
        self._events = PartitionLedger(
            EVENTS, EVENTS.at(lake), "ingest", window_s=dedup_ttl_s, log_retention_days=keep_log
        )
        self._letters = PartitionLedger(DEAD_LETTERS, DEAD_LETTERS.at(lake), "ingest", log_retention_days=keep_log)
        self._epoch: int | None = None
        # Lag asks the broker for every partition's end: every few seconds, not per batch.
        self.lag_interval_s = lag_interval_s
        self._lag_reported_at = float("-inf")
        self._lag_labels: set[tuple[str, int]] = set()
        # The newest offsets committed without waiting, per partition since the last assignment: confirmed on close.
        self._uncertain_commit: dict[tuple[str, int], int] = {}
        # Read by the readiness endpoint from its own thread (plain attribute reads).
        self._last_poll_at: float | None = None
        self.kafka = kafka_dependency(settings)
        self.health = ProcessHealth(
            "ingest-worker", [self.kafka, lake_dependency(lake)], {"polling": self.polling}
        )

    # ------------------------------------------------------------ connecting

    def connect(self) -> None:
        """Reach Kafka, create the topics and join the group: `connect_attempts` tries (default 1) with backoff.

        Raises `BrokerUnavailable` while Kafka is down; `run` waits it out (`flywheel.ops.run_loop`).
        """
        if self._consumer is not None and self._producer is not None:
            return
        Retrying(
            retry=retry_if_exception_type(BrokerUnavailable),
            wait=wait_exponential(multiplier=0.25, max=5),
            stop=stop_after_attempt(self.connect_attempts or 1),
            reraise=True,
        )(self._connect_once)

    def _connect_once(self) -> None:
        bootstrap = self.settings.kafka_bootstrap_servers
        probe = self.kafka.probe()
        if not probe.ok:
            raise BrokerUnavailable(probe.detail)
        try:
            ensure_topics(self.settings, [self.settings.events_topic, self.settings.dead_letter_topic])
            if self._producer is None:
                self._producer = make_producer(self.settings)
            if self._consumer is None:
                self._consumer = make_consumer(self.settings, [self.settings.events_topic], self.group_id)
        except BrokerUnavailable:
            raise
        except Exception as exc:  # the client libraries raise their own errors while a broker starts
            raise BrokerUnavailable(f"Kafka at {bootstrap} is not ready: {exc}") from exc
        log.info("ingest worker connected", extra={"bootstrap": bootstrap, "group": self.group_id})

    # ------------------------------------------------------------ one batch

    def run_once(self) -> BatchResult:
        self.connect()
        assert self._consumer is not None
        polled_at = time.perf_counter()
        batch = self._poll()
        metrics.STAGE_SECONDS.labels("poll").inc(time.perf_counter() - polled_at)
        self._last_poll_at = time.monotonic()
        if time.monotonic() - self._lag_reported_at >= self.lag_interval_s:
            self.report_lag()
        if not len(batch):
            return BatchResult()
        started = time.perf_counter()
        try:
            result = self._process(batch)
        except (CommitFailedError, CommitRefused) as exc:
            # Someone else committed for one of our partitions (a stale owner, or us being the stale one): never
            # retried blindly. The table, reloaded, says what is in; reading resumes there.
            log.warning("lake commit refused (%s); reloading the table and seeking to its offsets", exc)
            self._resume_from_lake(batch)
            return BatchResult(polled=len(batch))
        except BaseException:
            # Not committed: go back to the table's offsets, so this process retries the batch instead of
            # skipping it (the lake says what is in).
            self._resume_from_lake(batch)
            raise
        metrics.BATCH_SECONDS.observe(time.perf_counter() - started)
        return result

    def _poll_once(self, max_records: int, timeout_s: float) -> RecordBatch:
        assert self._consumer is not None
        poll_columns = getattr(self._consumer, "poll_columns", None)
        if poll_columns is not None:
            return poll_columns(max_records=max_records, timeout_s=timeout_s)
        return RecordBatch.from_records(self._consumer.poll_batch(max_records, timeout_s))

    def _poll(self) -> RecordBatch:
        """Up to `batch_size` records, polled until full or `linger_s` after the first; empty on a new assignment
        (the table's offsets are sought first: whatever the group's position gave is read again from there)."""
        batch = self._poll_once(self.batch_size, self.poll_timeout_s)
        if self._new_assignment():
            self._resume_from_lake(batch)
            return _EMPTY
        parts, n, deadline = [batch], len(batch), time.monotonic() + self.linger_s
        while 0 < n < self.batch_size and (left := deadline - time.monotonic()) > 0:
            more = self._poll_once(self.batch_size - n, min(left, self.poll_timeout_s))
            if self._new_assignment():
                self._resume_from_lake(RecordBatch.concat(parts + [more]))
                return _EMPTY
            parts.append(more)
            n += len(more)
        return RecordBatch.concat(parts)

    def _new_assignment(self) -> bool:
        epoch_of = getattr(self._consumer, "assignment_epoch", None)
        epoch = epoch_of() if epoch_of is not None else None
        if epoch == self._epoch:
            return False
        # Our last group commit may be older than the new owners': it is no longer ours to confirm.
        self._epoch = epoch
        self._uncertain_commit = {}
        return True

    def _resume_from_lake(self, batch: RecordBatch | None = None) -> None:
        """Reload both tables' offsets of the assigned partitions and seek each to its stored offset + 1; a
        partition the events table has never seen goes back to the first offset `batch` read of it, if any."""
        assert self._consumer is not None
        assigned = self._consumer.assignment()
        stored = self._events.reload(assigned)
        self._letters.reload(assigned)
        first = batch.first_offsets() if batch is not None and len(batch) else {}
        try:
            for key in sorted(assigned):
                offset = stored[key]
                target = offset + 1 if offset is not None else first.get(key)
                if target is not None:
                    self._consumer.seek(key[0], key[1], target)
        except Exception:  # a partition revoked meanwhile: its new owner seeks to the table's offset
            log.warning("could not seek to the lake's offsets", exc_info=True)

    # ------------------------------------------------------------ operational surface

    def report_lag(self) -> None:
        """Set the consumer-lag gauge per assigned partition (and drop partitions no longer assigned)."""
        self._lag_reported_at = time.monotonic()
        lag_of = getattr(self._consumer, "lag", None)
        if lag_of is None:
            return
        try:
            lag: dict[tuple[str, int], int] = lag_of()
        except Exception as exc:  # a metric must never fail a batch; the next report retries
            log.warning("could not measure consumer lag: %s", exc)
            return
        for topic, partition in self._lag_labels - lag.keys():
            metrics.CONSUMER_LAG.remove(topic, str(partition))
        for (topic, partition), behind in lag.items():
            metrics.CONSUMER_LAG.labels(topic, str(partition)).set(behind)
        self._lag_labels = set(lag)

    def polling(self) -> tuple[bool, str]:
        """(ok, why): connected to Kafka and polled within the last `READY_POLL_AGE_S` seconds."""
        if self._consumer is None:
            return False, "not connected to Kafka yet"
        if self._last_poll_at is None:
            return False, "connected to Kafka, not polled yet"
        age = time.monotonic() - self._last_poll_at
        if age > READY_POLL_AGE_S:
            return False, f"last poll {age:.0f}s ago (limit {READY_POLL_AGE_S:.0f}s): stuck in a batch or a retry"
        return True, "connected and polling"

    def _process(self, batch: RecordBatch) -> BatchResult:
        """Validate, de-duplicate, write, dead-letter, commit. Nothing a record holds makes this raise: a record
        that cannot be decoded, validated, partitioned or written is dead-lettered with its reason and committed
        past. Only the broker and the lake's I/O raise (the batch is then retried)."""
        assert self._consumer is not None and self._producer is not None
        ranges = batch.offset_range()
        if any(not self._events.owns(key) for key in ranges):
            # Records of a partition whose offset this worker has not read from the table (a consumer that
            # does not count assignments): read it, and read the records again from there.
            self._resume_from_lake(batch)
            return BatchResult()
        metrics.EVENTS_IN.labels("worker", "kafka").inc(len(batch))
        clock = _StageClock()
        valid, refused = validate_guarded(batch)
        clock.lap("validate")
        ends = {key: end - 1 for key, (_, end) in ranges.items()}  # the last offset read of each partition
        valid, more_refused = storable(valid)
        refused += more_refused
        selection = self._events.select(valid)
        clock.lap("dedup")
        letters = self._dead_letters(batch, refused)
        if letters:
            clock.lap("dead_letter")
        if self.pause_before_commit_s:
            time.sleep(self.pause_before_commit_s)
        # Even when nothing is left to write: the partitions' offsets move forward in the table.
        self._events.commit(selection.keep.drop("_i"), ends)
        written = selection.keep.height
        clock.lap("write")
        # Not waited for: the lake, not the group, says where reading resumes (`dedup`); the group's offsets
        # feed the lag gauge and a fresh group's start. Measured: 0.2 us an event with kafka-python.
        commit = {key: end for key, (_, end) in ranges.items()}
        self._consumer.commit(commit, wait=False)
        self._uncertain_commit.update(commit)
        clock.lap("commit")

        metrics.EVENTS_ACCEPTED.labels("worker").inc(written)
        metrics.EVENTS_REFUSED.labels("worker").inc(letters)
        metrics.DEAD_LETTERED.labels("worker").inc(letters)
        metrics.DEDUPLICATED.inc(selection.duplicates)
        metrics.SKIPPED_IN_LAKE.inc(selection.already_in_lake)
        return BatchResult(len(batch), written, letters, selection.duplicates, selection.already_in_lake)

    def _dead_letters(self, batch: RecordBatch, refused: list[tuple[int, str]]) -> int:
        """Produce the refused records to the dead-letter topic, then commit those the dead-letter table does not
        hold yet, with the offsets of their partitions (a replayed batch skips what it committed before)."""
        assert self._producer is not None
        if not refused:
            return 0
        letters = [
            (i, dead_letter(reason, f"kafka:{batch.topics[i]}/{batch.partitions[i]}/{batch.offsets[i]}",
                            batch.values[i] or b""))
            for i, reason in sorted(refused)
        ]  # fmt: skip
        # Before the commits: a crash in between re-reads these records and dead-letters them again.
        self._producer.send_all([d.outgoing(self.settings.dead_letter_topic) for _, d in letters])
        held = {key: -1 if offset is None else offset for key, offset in self._letters.committed.items()}
        new = [(i, d) for i, d in letters if batch.offsets[i] > held.get((batch.topics[i], batch.partitions[i]), -1)]
        if new:
            ends: dict[tuple[str, int], int] = {}
            for i, _ in new:
                key = (batch.topics[i], batch.partitions[i])
                ends[key] = max(ends.get(key, -1), batch.offsets[i])
            frame = pl.DataFrame(
                [(d.reason, d.source, d.original, d.received_at) for _, d in new],
                schema=DEAD_LETTERS.schema, orient="row",
            )  # fmt: skip
            self._letters.commit(frame, ends)
        return len(letters)

    # ------------------------------------------------------------ loop

    def run(self, stop_event: threading.Event) -> None:
        """Process batches until `stop_event` is set; a batch failed by Kafka or the lake is retried once
        the failed one answers again (backoff, one log line per outage)."""
        def step() -> None:
            result = self.run_once()
            if result.polled:
                log.debug("batch %s", result)

        try:
            run_loop(step, stop_event, self.health)
        finally:
            self.close()

    def close(self) -> None:
        if self._consumer is not None and self._uncertain_commit:
            try:  # the last commit was sent without waiting: make sure of it, so a restart does not re-read
                self._consumer.commit(self._uncertain_commit)
            except Exception:
                log.warning("could not confirm the last commit; a restart re-reads and skips those records",
                            exc_info=True)
        for part in (self._consumer, self._producer):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.warning("error while closing", exc_info=True)
        self._consumer = self._producer = None


_EMPTY = RecordBatch([], [], [], [])


def run_worker(
    worker: IngestWorker, stop_event: threading.Event, metrics_port: int, metrics_host: str = "127.0.0.1"
) -> None:
    """Run `worker` until `stop_event`, serving metrics and health on `metrics_host`:`metrics_port` (0: not served)."""
    run_with_ops(worker.health, worker.run, stop_event, port=metrics_port, host=metrics_host)


def main() -> None:
    """Entry point for `python -m ingest.worker`: settings from the environment, stop on SIGTERM/SIGINT."""
    from flywheel.logs import configure_logging
    from flywheel.ops import stop_on_signals

    configure_logging(verbose=False)
    stop = stop_on_signals()
    settings = Settings()
    run_worker(IngestWorker(settings), stop, settings.ingest_metrics_port, settings.bind_host)


if __name__ == "__main__":
    main()
