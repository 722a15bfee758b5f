"""The collector process: HTTP in (native, Segment, PostHog and OTLP doors), Kafka out.

`app` builds the FastAPI application; `procs` runs N processes on one port. Everything here serves one request at a
time and writes nothing but the events topic (and dead letters); the worker (`ingest.worker`) is a separate process
that never imports from here.

Nothing is imported here: `flywheel ingest collector --workers N`'s supervisor imports `procs` alone, and
importing `app` would create its metrics in the supervisor too (a counter file of its own under
PROMETHEUS_MULTIPROC_DIR).
"""
