"""A Kafka producer made on first use, so a process started before Kafka still starts (and answers 503).

Kafka clients connect in their constructor and raise when no broker answers; a process that builds its
producer at start-up would exit. `LazyProducer` asks the `kafka` dependency first (a TCP connect, fast)
and only then builds the client; every failure is a `BrokerUnavailable` and marks the dependency down,
the first success after one marks it up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from flywheel.bus import BrokerUnavailable, Outgoing, Producer
from flywheel.ops.deps import Dependency, describe


class LazyProducer:
    def __init__(self, make: Callable[[], Producer], kafka: Dependency) -> None:
        self._make = make
        self._kafka = kafka
        self._producer: Producer | None = None
        self._lock = threading.Lock()

    def get(self) -> Producer:
        with self._lock:
            if self._producer is None:
                probe = self._kafka.probe()
                if not probe.ok:
                    raise BrokerUnavailable(probe.detail)
                try:
                    self._producer = self._make()
                except Exception as exc:  # kafka-python raises NoBrokersAvailable from its constructor
                    raise BrokerUnavailable(f"cannot connect to Kafka: {describe(exc)}") from exc
            return self._producer

    def send_all(self, messages: Sequence[Outgoing], timeout_s: float = 10.0) -> None:
        try:
            self.get().send_all(messages, timeout_s)
        except BrokerUnavailable as exc:
            self._kafka.failed(exc)
            raise
        self._kafka.recovered()

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.close()
                self._producer = None
