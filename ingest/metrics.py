"""Prometheus metrics of the collector and the ingest workers.

Defined once per process on the default registry (prometheus-client refuses to
register a name twice), so every app or worker built in one process shares them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS_IN = Counter(
    "flywheel_ingest_events_in_total", "Events received, before validation.", ["stage", "source"]
)
EVENTS_ACCEPTED = Counter(
    "flywheel_ingest_events_accepted_total",
    "Events that passed validation and were produced / written.",
    ["stage"],
)
EVENTS_REFUSED = Counter("flywheel_ingest_events_refused_total", "Events that failed validation.", ["stage"])
DEAD_LETTERED = Counter(
    "flywheel_ingest_dead_lettered_total", "Messages written to the dead-letter topic.", ["stage"]
)
DEDUPLICATED = Counter(
    "flywheel_ingest_deduplicated_total", "Events dropped because their event_id was already in the lake."
)
SKIPPED_IN_LAKE = Counter(
    "flywheel_ingest_redelivered_skipped_total",
    "Kafka records skipped because their offset is already in the lake.",
)
IGNORED = Counter(
    "flywheel_collector_ignored_total",
    "Items a door took that are not events, by why: OTLP spans that are not generations, PostHog's own `$` events.",
    ["endpoint", "why"],
)
REQUESTS = Counter("flywheel_collector_requests_total", "Collector HTTP requests.", ["endpoint", "status"])
BROKER_UNAVAILABLE = Counter(
    "flywheel_ingest_broker_unavailable_total",
    "Times Kafka did not acknowledge or could not be reached.",
    ["stage"],
)
CONSUMER_LAG = Gauge(
    "flywheel_ingest_consumer_lag", "Records behind the end of the partition.", ["topic", "partition"]
)
BATCH_SECONDS = Histogram(
    "flywheel_ingest_batch_seconds",
    "Time to validate, de-duplicate, write and commit one batch.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
STAGE_SECONDS = Counter(
    "flywheel_ingest_stage_seconds_total",
    "Time the ingest workers spent per stage of their batches (poll, validate, dedup, write, commit).",
    ["stage"],
)
