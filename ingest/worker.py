"""Ingest worker: Kafka events topic -> validated, de-duplicated rows in the lake, exactly once.

One batch at a time (`run_once`):

1. poll a batch (consumer group, offsets committed by hand);
2. validate each record against the contract (`ingest.fast_validate`); a failure goes to the dead-letter topic
   with its bytes, the reason and `kafka:<topic>/<partition>/<offset>`;
3. de-duplicate by `event_id` (within the batch, then across batches with
   `EventIdLedger`; redelivered records are checked against the lake's positions);
4. write the lake (files visible only when complete), then commit the offsets.

A crash anywhere replays the batch from the last commit; the ledger and the lake's
Kafka positions turn the replay into a no-op for what was already written. Run it
with `python -m ingest.worker` or `flywheel ingest worker` (settings from the env).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

import redis
from tenacity import before_sleep_log, retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from flywheel.bus import (
    BrokerUnavailable,
    Consumer,
    Producer,
    Record,
    ensure_topics,
    make_consumer,
    make_producer,
)
from flywheel.bus import next_offsets as offsets_after
from flywheel.connections import redis_client
from flywheel.settings import Settings
from ingest import metrics
from ingest.collector import kafka_reachable
from ingest.dead_letters import dead_letter
from ingest.dedup import Claim, EventIdLedger
from ingest.fast_validate import LakeRow, validate_records
from ingest.lake_sink import events_table, positions_in_lake, rows_frame, write_events

log = logging.getLogger(__name__)

DEFAULT_GROUP = "flywheel-ingest"


@dataclass(frozen=True, slots=True)
class BatchResult:
    polled: int = 0
    written: int = 0
    dead_lettered: int = 0
    duplicates: int = 0
    already_in_lake: int = 0


class IngestWorker:
    def __init__(
        self,
        settings: Settings,
        *,
        group_id: str = DEFAULT_GROUP,
        batch_size: int = 5000,
        poll_timeout_s: float = 0.5,
        dedup_ttl_s: int = 7 * 24 * 3600,
        connect_attempts: int | None = None,
        pause_before_commit_s: float = 0.0,
        consumer: Consumer | None = None,
        producer: Producer | None = None,
        redis: redis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.group_id = group_id
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.connect_attempts = connect_attempts
        # Fault injection for the crash tests: widens the window between the lake write and the commit.
        self.pause_before_commit_s = pause_before_commit_s
        self._consumer = consumer
        self._producer = producer
        self._ledger = EventIdLedger(redis or redis_client(settings), settings.redis_prefix, dedup_ttl_s)
        self._table = events_table(settings.lake_dir)

    # ------------------------------------------------------------ connecting

    def connect(self) -> None:
        """Reach Kafka, create the topics and join the group, retrying with backoff while it is down."""
        if self._consumer is not None and self._producer is not None:
            return
        stop = stop_after_attempt(self.connect_attempts) if self.connect_attempts else (lambda _: False)
        attempt = retry(
            retry=retry_if_exception_type(BrokerUnavailable),
            wait=wait_exponential(multiplier=0.25, max=5),
            stop=stop,
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True,
        )(self._connect_once)
        attempt()

    def _connect_once(self) -> None:
        bootstrap = self.settings.kafka_bootstrap_servers
        if not kafka_reachable(bootstrap):
            raise BrokerUnavailable(f"Kafka at {bootstrap} does not answer; waiting for it")
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
        log.info("ingest worker connected to %s, group %s", bootstrap, self.group_id)

    # ------------------------------------------------------------ one batch

    def run_once(self) -> BatchResult:
        self.connect()
        assert self._consumer is not None
        records = self._consumer.poll_batch(max_records=self.batch_size, timeout_s=self.poll_timeout_s)
        if not records:
            return BatchResult()
        started = time.perf_counter()
        try:
            result = self._process(records)
        except BaseException:
            # Not committed: go back so this process retries the batch instead of skipping it.
            self._rewind(records)
            raise
        metrics.BATCH_SECONDS.observe(time.perf_counter() - started)
        return result

    def _process(self, records: list[Record]) -> BatchResult:
        assert self._consumer is not None and self._producer is not None
        metrics.EVENTS_IN.labels("worker", "kafka").inc(len(records))
        # msgspec fast path, pydantic for anything it does not accept (same reasons as before).
        valid, refused = validate_records(records)
        letters = [
            dead_letter(reason, f"kafka:{r.topic}/{r.partition}/{r.offset}", r.value).outgoing(
                self.settings.dead_letter_topic
            )
            for r, reason in refused
        ]

        keep, duplicates, in_lake = self._deduplicate(valid)
        if letters:
            self._producer.send_all(letters)
        if keep:
            write_events(self._table, rows_frame([row for _, row in keep]))
        if self.pause_before_commit_s:
            time.sleep(self.pause_before_commit_s)
        self._consumer.commit(offsets_after(records))

        metrics.EVENTS_ACCEPTED.labels("worker").inc(len(keep))
        metrics.EVENTS_REFUSED.labels("worker").inc(len(letters))
        metrics.DEAD_LETTERED.labels("worker").inc(len(letters))
        metrics.DEDUPLICATED.inc(duplicates)
        metrics.SKIPPED_IN_LAKE.inc(in_lake)
        return BatchResult(len(records), len(keep), len(letters), duplicates, in_lake)

    def _deduplicate(self, valid: list[tuple[Record, LakeRow]]) -> tuple[list[tuple[Record, LakeRow]], int, int]:
        first: dict[str, tuple[Record, LakeRow]] = {}
        for pair in valid:
            first.setdefault(pair[1][0], pair)  # row[0] is the event_id
        unique = list(first.values())
        claims = self._ledger.claim([(row[0], f"{r.topic}/{r.partition}/{r.offset}") for r, row in unique])
        keep = [pair for pair, c in zip(unique, claims, strict=True) if c is Claim.NEW]
        replayed = [pair for pair, c in zip(unique, claims, strict=True) if c is Claim.REDELIVERED]
        in_lake = 0
        if replayed:
            present = positions_in_lake(self._table, [r for r, _ in replayed])
            for r, e in replayed:
                if (r.topic, r.partition, r.offset) in present:
                    in_lake += 1
                else:
                    keep.append((r, e))
        duplicates = len(valid) - len(unique) + sum(c is Claim.DUPLICATE for c in claims)
        return keep, duplicates, in_lake

    def _rewind(self, records: list[Record]) -> None:
        if self._consumer is None:
            return
        firsts: dict[tuple[str, int], int] = {}
        for r in records:
            key = (r.topic, r.partition)
            firsts[key] = min(firsts.get(key, r.offset), r.offset)
        try:
            for (topic, partition), offset in firsts.items():
                self._consumer.seek(topic, partition, offset)
        except Exception:  # a partition revoked meanwhile: its new owner replays from the commit
            log.warning("could not rewind after a failed batch", exc_info=True)

    # ------------------------------------------------------------ loop

    def run(self, stop_event: threading.Event) -> None:
        """Process batches until `stop_event` is set; a failed batch is retried with backoff."""
        failures = 0
        while not stop_event.is_set():
            try:
                result = self.run_once()
                failures = 0
                if result.polled:
                    log.debug("batch %s", result)
            except (BrokerUnavailable, redis.RedisError, OSError) as exc:
                failures += 1
                delay = min(5.0, 0.25 * 2**failures)
                log.warning("batch failed (%s); retrying in %.1fs", exc, delay)
                stop_event.wait(delay)
        self.close()

    def close(self) -> None:
        for part in (self._consumer, self._producer):
            if part is not None:
                try:
                    part.close()
                except Exception:
                    log.warning("error while closing", exc_info=True)
        self._consumer = self._producer = None


def main() -> None:
    """Entry point for `python -m ingest.worker`: settings from the environment, stop on SIGTERM/SIGINT."""
    logging.basicConfig(
        level=logging.INFO,
        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":"%(message)s"}',
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    IngestWorker(Settings()).run(stop)


if __name__ == "__main__":
    main()
