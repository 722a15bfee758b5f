"""The backing services a process depends on (Kafka, Redis, MLflow): their state, and waiting for them.

A `Dependency` knows how to probe its service cheaply (a TCP connect, a PING, a file check) and which
exceptions mean the service failed. Its state changes are what gets logged: ONE line when it goes
down (with why) and ONE when it is back (with how long it was down), never a line per retry or per
failed request, and never a traceback for an outage.

Two sources move the state: probes (the readiness endpoint, `wait_until_up`) and failures reported by
the code that used the service (`failed`). A reported failure holds for `hold_s` even when the probe
answers again (a broker whose port is open but which refuses work is still down for us), unless the
next use succeeds first (`recovered`). That keeps a flapping service from writing a line per scrape.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from prometheus_client import Gauge
from tenacity import Retrying, retry_if_result, wait_exponential

from flywheel.bus import BrokerUnavailable
from flywheel.settings import Settings

log = logging.getLogger(__name__)

UP = Gauge("flywheel_dependency_up", "1 while a backing service answers this process, else 0", ["dependency"],
           multiprocess_mode="liveall")


@dataclass(frozen=True, slots=True)
class CheckResult:
    ok: bool
    detail: str

    def as_json(self) -> dict[str, object]:
        return {"ok": self.ok, "detail": self.detail}


Probe = Callable[[], str]  # returns what it found ("PONG from ..."); raises when the service does not answer
Matches = Callable[[BaseException], bool]


# user:password@ in any URL an error message quotes (MLflow's and SQLAlchemy's name their database URL).
_URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def describe(exc: BaseException) -> str:
    """One line about `exc` for logs and `/readyz`: its type and first line, with URL credentials removed.

    >>> describe(ConnectionError("cannot reach postgresql://mlflow:s3cret@db:5432/mlflow"))
    'ConnectionError: cannot reach postgresql://***@db:5432/mlflow'
    """
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = _URL_CREDENTIALS.sub(r"\g<scheme>***@", text)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Dependency:
    """One backing service as this process sees it. Thread-safe: probed by HTTP threads and the main loop."""

    def __init__(self, name: str, probe: Probe, matches: Matches, *, hold_s: float = 30.0) -> None:
        self.name = name
        self._probe = probe
        self.matches = matches
        self.hold_s = hold_s
        self._lock = threading.Lock()
        self._ok: bool | None = None
        self._detail = "not checked yet"
        self._down_since: float | None = None
        self._failed_at: float | None = None
        self.reported_failures = 0  # how often the code using the service saw it fail (`failed`)

    # ------------------------------------------------------------ state

    @property
    def state(self) -> CheckResult:
        return CheckResult(bool(self._ok), self._detail)

    def probe(self) -> CheckResult:
        """Ask the service now, without changing the state."""
        try:
            return CheckResult(True, self._probe())
        except Exception as exc:  # a probe that fails says why, whatever the client library raised
            return CheckResult(False, describe(exc))

    def check(self) -> CheckResult:
        """Probe, update the state (logging a change) and return it."""
        result = self.probe()
        with self._lock:
            held = self._failed_at is not None and time.monotonic() - self._failed_at < self.hold_s
        if result.ok and held:
            return self.state  # the last use failed moments ago: still down, for the reason it gave
        self._set(result.ok, result.detail)
        return result

    def failed(self, exc: BaseException | str) -> None:
        """The code that used the service saw it fail."""
        with self._lock:
            self._failed_at = time.monotonic()
            self.reported_failures += 1
        self._set(False, exc if isinstance(exc, str) else describe(exc))

    def recovered(self, detail: str = "answering again") -> None:
        """The code that used the service succeeded with it."""
        with self._lock:
            self._failed_at = None
            was_ok = self._ok
        if not was_ok:
            self._set(True, detail)

    def _set(self, ok: bool, detail: str) -> None:
        with self._lock:
            previous, self._ok, self._detail = self._ok, ok, detail
            now = time.monotonic()
            down_for = now - self._down_since if self._down_since is not None else 0.0
            if not ok and previous is not False:
                self._down_since = now
            elif ok:
                self._down_since = None
        UP.labels(self.name).set(1 if ok else 0)
        if ok == previous:
            return
        fields = {"dependency": self.name, "detail": detail}
        if not ok:
            log.warning("%s is down (%s); waiting for it", self.name, detail, extra=fields)
        elif previous is False:
            log.info("%s is back up", self.name, extra={**fields, "down_s": round(down_for, 1)})
        else:
            log.info("%s is up", self.name, extra=fields)

    # ------------------------------------------------------------ waiting

    def wait_until_up(self, stop: threading.Event, *, max_wait_s: float = 5.0,
                      on_wait: Callable[[], None] | None = None) -> bool:
        """Probe with exponential backoff (0.25 s doubling to `max_wait_s`) until it answers or `stop` is set.

        `on_wait` is called after each wait (a loop's heartbeat: waiting for a dependency is not wedged).
        Logs nothing itself: the caller reported the failure (`failed`) and reports the success of its
        next use (`recovered`). Returns whether it answered.
        """
        def sleep(seconds: float) -> None:
            stop.wait(seconds)  # a stop request ends the wait at once
            if on_wait is not None:
                on_wait()

        retrying = Retrying(
            wait=wait_exponential(multiplier=0.25, max=max_wait_s),
            retry=retry_if_result(lambda ok: not ok),
            stop=lambda _: stop.is_set(),
            sleep=sleep,
            retry_error_callback=lambda _: False,
        )
        return bool(retrying(lambda: self.probe().ok))


# ---------------------------------------------------------------- the three services


def kafka_reachable(bootstrap: str, timeout_s: float = 0.5) -> bool:
    """Whether any bootstrap server accepts a TCP connection."""
    return _kafka_answering(bootstrap, timeout_s) is not None


def _kafka_answering(bootstrap: str, timeout_s: float) -> str | None:
    for hostport in bootstrap.split(","):
        host, _, port = hostport.strip().rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
            return hostport.strip()
        except (OSError, ValueError):
            continue
    return None


def is_kafka_error(exc: BaseException) -> bool:
    if isinstance(exc, BrokerUnavailable):
        return True
    module = type(exc).__module__ or ""
    return module.startswith(("kafka.", "confluent_kafka"))


def kafka_dependency(settings: Settings) -> Dependency:
    bootstrap = settings.kafka_bootstrap_servers

    def probe() -> str:
        answering = _kafka_answering(bootstrap, 0.5)
        if answering is None:
            raise BrokerUnavailable(f"Kafka at {bootstrap} does not answer")
        return f"{answering} accepts connections"

    return Dependency("kafka", probe, is_kafka_error)


def is_redis_error(exc: BaseException) -> bool:
    import redis

    return isinstance(exc, redis.RedisError)


def redis_dependency(settings: Settings) -> Dependency:
    import redis

    # Its own client with short timeouts: a probe must answer a readiness request quickly.
    client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=0.5, socket_timeout=0.5)
    where = urlparse(settings.redis_url)
    target = f"{where.hostname}:{where.port or 6379}"

    def probe() -> str:
        client.ping()
        return f"PONG from {target}"

    return Dependency("redis", probe, is_redis_error)


def is_mlflow_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith(("mlflow", "sqlalchemy", "requests", "urllib3"))


def mlflow_dependency(settings: Settings) -> Dependency:
    uri = settings.resolved_mlflow_uri

    def probe() -> str:
        if uri.startswith("sqlite:///"):
            path = Path(uri.removeprefix("sqlite:///"))
            if not path.parent.is_dir():
                raise FileNotFoundError(f"no folder for the MLflow database {path}")
            return f"SQLite store at {path}"
        if uri.startswith(("http://", "https://")):
            import httpx

            reply = httpx.get(uri.rstrip("/") + "/health", timeout=1.0)
            reply.raise_for_status()
            return f"{uri} answers"
        return f"{urlparse(uri).scheme} store (not probed)"

    return Dependency("mlflow", probe, is_mlflow_error)


def lake_dependency(lake: str | Path) -> Dependency:
    """The lake's storage: a full or unmounted disk, or object storage that does not answer, is an outage like
    Kafka's, waited out the same way. (A lost commit race is not: the writer handles it.)"""
    from deltalake.exceptions import CommitFailedError, DeltaError, SchemaMismatchError

    from flywheel.lake import is_remote

    def probe() -> str:
        if isinstance(lake, str) and is_remote(lake):
            return f"object storage at {lake} (probed by each commit)"
        lake_dir = Path(lake)
        lake_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(lake_dir, os.W_OK):
            raise PermissionError(f"the lake {lake_dir} is not writable")
        return f"{lake_dir} is writable"

    def is_outage(exc: BaseException) -> bool:
        if isinstance(exc, CommitFailedError | SchemaMismatchError):
            return False
        return isinstance(exc, OSError | DeltaError)

    return Dependency("lake", probe, is_outage)
