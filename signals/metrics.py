"""Prometheus metrics of the signals worker, served by `flywheel signals worker` at `/metrics` on
`settings.bind_host`:`settings.signals_metrics_port` (`FLYWHEEL_SIGNALS_METRICS_PORT`, 9102; 0 = off)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

EVENTS = Counter(
    "flywheel_signals_events_total", "Events read by the signals worker, by outcome", ["outcome"]
)
RECORDS = Counter(
    "flywheel_signals_records_total", "Reward records emitted", ["kind"]
)  # kind: first|revision
LATE_EVENTS = Counter(
    "flywheel_signals_late_events_total", "In-window events that arrived after their window closed"
)
CLOSE_LAG = Histogram(
    "flywheel_signals_close_lag_seconds",
    "Wall-clock time from a window's close (end + allowed lateness) to its record",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
