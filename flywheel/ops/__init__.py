"""The operational runtime every long-running Flywheel process shares.

- `health`: `ProcessHealth`, one `/healthz` / `/readyz` body shape for every process, and the worker loop's
  `Heartbeat` that `/healthz` reads;
- `deps`: Kafka, Redis, MLflow and the lake's disk as `Dependency`s: probes, one log line per state change,
  backoff waits;
- `http`: the endpoints as a FastAPI router (`ops_router`, or `add_ops` with /metrics on a port of its own) or a
  side server for plain workers (`serve_ops`);
- `runtime`: stop signals, `gc.freeze()` after start-up, the worker run loop that waits out outages;
- `producer`: a Kafka producer made on first use, so nothing exits when Kafka is down at start.
"""

from __future__ import annotations

from flywheel.ops.deps import (
    CheckResult,
    Dependency,
    kafka_dependency,
    kafka_reachable,
    lake_dependency,
    mlflow_dependency,
    redis_dependency,
)
from flywheel.ops.health import Heartbeat, ProcessHealth
from flywheel.ops.http import OpsServer, add_ops, default_metrics, ops_router, serve_ops
from flywheel.ops.producer import LazyProducer
from flywheel.ops.runtime import freeze_startup, run_loop, run_worker, stop_on_signals

__all__ = [
    "CheckResult",
    "Dependency",
    "Heartbeat",
    "LazyProducer",
    "OpsServer",
    "ProcessHealth",
    "add_ops",
    "default_metrics",
    "freeze_startup",
    "kafka_dependency",
    "kafka_reachable",
    "lake_dependency",
    "mlflow_dependency",
    "ops_router",
    "redis_dependency",
    "run_loop",
    "run_worker",
    "serve_ops",
    "stop_on_signals",
]
