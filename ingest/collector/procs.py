"""`flywheel ingest collector --workers N`: N processes serving one port, each with its own listening socket.

uvicorn's own `workers=N` shares one listening socket between its processes, and an async server idle in its
event loop accepts every connection that arrives: under light load one process took all of them and the others
none. Here each process binds its own socket with SO_REUSEPORT, so the kernel spreads new connections over the
processes by hashing their addresses. The parent only supervises: it forwards SIGTERM / SIGINT, and when a
process dies on its own it stops the others and exits with that process's code, for the process manager
(Kubernetes, systemd) to restart the whole collector.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import time
from multiprocessing.process import BaseProcess
from types import FrameType

log = logging.getLogger("flywheel.ingest.collector")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


COLLECTOR_APP = "ingest.collector.app:app_from_env"


def serve_one(host: str, port: int, log_level: str, app: str = COLLECTOR_APP) -> None:
    """One collector process: its own socket, its own app (and Kafka producer) built from the environment."""
    import uvicorn

    from flywheel.settings import get_settings

    sock = listening_socket(host, port)
    # No access log, as with one process (`flywheel ingest collector`): a line per batch drowns the rest, and a
    # client's query string (where one may put its write key) is not ours to keep.
    config = uvicorn.Config(app, factory=True, log_level=log_level, access_log=False, proxy_headers=False,
                            timeout_keep_alive=get_settings().http_keep_alive_s)
    uvicorn.Server(config).run(sockets=[sock])


def serve(host: str, port: int, workers: int, log_level: str = "info", app: str = COLLECTOR_APP) -> int:
    """Run `workers` collector processes on host:port until SIGTERM / SIGINT or until one dies; the exit code.
    `app`: "module:factory" of the ASGI app each process builds (the benchmark serves its bare app so too)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise SystemExit("--workers above 1 needs SO_REUSEPORT (Linux, macOS, BSD)")
    # Fail here, with a clear error, when the port is taken by something that did not ask to share it.
    try:
        listening_socket(host, port).close()
    except OSError as exc:
        raise SystemExit(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    from prometheus_client import multiprocess

    context = multiprocessing.get_context("spawn")
    procs: list[BaseProcess] = [
        context.Process(target=serve_one, args=(host, port, log_level, app), name=f"collector-{i}", daemon=False)
        for i in range(workers)
    ]
    stopping = False

    def stop(_signum: int, _frame: FrameType | None) -> None:
        # SIGTERM to each process whatever came in: after a Ctrl-C the terminal has already sent them SIGINT,
        # and a second SIGINT would make uvicorn skip its graceful shutdown.
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for proc in procs:
            proc.start()
        log.info("collector: %d processes on %s:%d (pids %s)", workers, host, port, [p.pid for p in procs])
        code = 0
        while any(proc.is_alive() for proc in procs):
            for proc in procs:
                if proc.exitcode is not None and not stopping:
                    log.error("collector process %s (pid %s) exited with %s: stopping the others",
                              proc.name, proc.pid, proc.exitcode)
                    code = proc.exitcode or 1
                    stop(signal.SIGTERM, None)
            time.sleep(0.2)
        for proc in procs:
            proc.join()
            if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and proc.pid is not None:
                multiprocess.mark_process_dead(proc.pid)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
