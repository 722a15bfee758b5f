"""The collector process: HTTP in (native, Segment, PostHog and OTLP doors), Kafka out.

`app` builds the FastAPI application; `procs` runs N processes on one port. Everything here serves one request at a
time and writes nothing but the events topic (and dead letters); the worker (`ingest.worker`) is a separate process
that never imports from here.
"""

from __future__ import annotations

from ingest.collector.app import app_from_env, create_app

__all__ = ["app_from_env", "create_app"]
