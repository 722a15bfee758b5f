"""The start-up and run-loop skeleton every long-running worker shares.

- `stop_on_signals()`: SIGTERM / SIGINT set a stop event (the loop finishes its step and returns);
- `freeze_startup()`: `gc.freeze()` once start-up is done: what lives as long as the process is kept
  out of the cyclic collector's walks (measured on the ingest worker and the collector: the collector
  otherwise walks every start-up object after each batch's few thousand allocations);
- `run_loop(step, stop, health)`: call `step` until stopped; a failure the process's `ProcessHealth`
  blames on a dependency marks it down (one log line), waits for it with backoff and goes on where it
  stopped (the step's own commit protocol makes the retry safe); any other error is a bug and raises.
  It beats `health.heartbeat` before each step and after each backoff wait, so `/healthz` fails only
  when one step runs past the heartbeat's bound (a wedged loop), never while an outage is waited out;
- `run_worker(...)`: the above plus the side HTTP server for `/metrics`, `/healthz`, `/readyz`.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
from collections.abc import Callable

from flywheel.ops.deps import Dependency
from flywheel.ops.health import ProcessHealth
from flywheel.ops.http import Metrics, OpsServer, default_metrics, serve_ops

log = logging.getLogger(__name__)


def stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event set by SIGTERM or SIGINT (handlers are only installed from the main thread)."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    return stop


def freeze_startup() -> None:
    gc.freeze()


def run_loop(step: Callable[[], object], stop: threading.Event, health: ProcessHealth, *,
             max_backoff_s: float = 5.0) -> None:
    """Run `step` until `stop` is set, waiting out the outages of `health`'s dependencies."""
    beat = health.heartbeat.beat
    health.heartbeat.arm()
    try:
        _loop(step, stop, health, beat, max_backoff_s)
    finally:
        health.heartbeat.disarm()  # returned (stopped, or raised a bug): shutting down, not wedged


def _loop(step: Callable[[], object], stop: threading.Event, health: ProcessHealth, beat: Callable[[], None],
          max_backoff_s: float) -> None:
    blamed: set[Dependency] = set()
    failures = 0
    while not stop.is_set():
        beat()
        try:
            step()
        except Exception as exc:
            dep = health.blame(exc)
            if dep is None:
                raise
            log.debug("%s step failed on %s", health.process, dep.name, exc_info=True)
            dep.failed(exc)
            blamed.add(dep)
            failures += 1
            dep.wait_until_up(stop, max_wait_s=max_backoff_s, on_wait=beat)
            # Answering again is not serving again (a broker electing leaders): back off before the retry too.
            stop.wait(min(max_backoff_s, 0.05 * 2**failures))
            continue
        for dep in blamed:
            dep.recovered()
        blamed.clear()
        failures = 0


def run_worker(
    health: ProcessHealth,
    loop: Callable[[threading.Event], None],
    stop: threading.Event,
    *,
    port: int,
    host: str = "127.0.0.1",
    metrics: Metrics = default_metrics,
) -> None:
    """Freeze start-up, serve the ops endpoints on `host`:`port` (0: none), run `loop(stop)`, then clean up."""
    freeze_startup()
    server: OpsServer | None = None
    if port:
        try:
            server = serve_ops(port, health, host, metrics)
        except OSError as exc:  # another process on this host holds the port: the work matters more
            log.error("%s does not serve /metrics and health: port taken", health.process,
                      extra={"service": health.process, "host": host, "port": port, "detail": str(exc)})
    try:
        loop(stop)
    finally:
        if server is not None:
            server.stop()
