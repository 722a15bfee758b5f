"""Prometheus metrics of the signals worker, served by `flywheel signals worker` at `/metrics` on
`settings.bind_host`:`settings.signals_metrics_port` (`FLYWHEEL_SIGNALS_METRICS_PORT`, 9102; 0 = off).

`flywheel_signals_events_total{outcome}` says what became of every event read; once every feedback
event's generation is known or orphaned, the outcomes add up to the events read:
- `generation`: a generation event (its first copy);
- `on_time`: feedback inside its generation's window, counted before the window closed;
- `late`: feedback inside its window that came after the window closed: it produced a revision;
- `out_of_window`: feedback timed after its generation's window: ignored;
- `orphan`: feedback for a generation id with no `generation` event by the time any window would
  have closed (`flywheel signals orphans` lists them from the lake);
- `duplicate`: an event id seen before (or a second generation event for the same id);
- `invalid`: bytes that are not an event;
- `dead_lettered`: an event sent to the dead-letter topic with its reason (a generation whose
  reward definition cannot be found);
- `capped`: feedback beyond its generation's bounds (`max_feedback_per_generation`,
  `max_feedback_bytes`), dead-lettered with the reason.
`flywheel_signals_records_total{kind}` counts records emitted: `first` or `revision` (revised).
Every series exists from the start (at 0), so a dashboard can tell "none" from "not measured".
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

OUTCOMES = (
    "generation", "on_time", "late", "out_of_window", "orphan", "duplicate", "invalid", "dead_lettered", "capped",
)  # fmt: skip

EVENTS = Counter(
    "flywheel_signals_events_total", "Events read by the signals worker, by outcome", ["outcome"]
)
RECORDS = Counter("flywheel_signals_records_total", "Reward records emitted", ["kind"])  # kind: first|revision
LATE_EVENTS = Counter(
    "flywheel_signals_late_events_total", "In-window events that arrived after their window closed"
)
CLOSE_LAG = Histogram(
    "flywheel_signals_close_lag_seconds",
    "Wall-clock time from a window's close (end + allowed lateness) to its record",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
for _outcome in OUTCOMES:
    EVENTS.labels(_outcome)
for _kind in ("first", "revision"):
    RECORDS.labels(_kind)
