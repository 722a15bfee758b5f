"""Group commit for the collector: requests that arrive while a send is in flight share the next one.

Every request must wait until Kafka acknowledged its events. Sent one request at a time,
each pays a full produce-and-acknowledge round trip; sent concurrently, the requests'
flushes wait on each other's messages and contend for the GIL (measured with the confluent
client: 8 requests in flight went at two thirds of the rate of one). Here one caller at a
time is the leader: it sends its own messages together with everything queued meanwhile,
and wakes all the callers it sent for with the outcome. A failed send fails every request
of its group, so no request is acknowledged without its events; a retried request's events
are de-duplicated by `event_id` downstream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flywheel.bus import BrokerUnavailable, Outgoing


@dataclass(slots=True)
class _Request:
    messages: Sequence[Outgoing]
    done: bool = False
    error: BaseException | None = None


class GroupSender:
    """`send_all(messages)` from any thread; returns once Kafka acknowledged them, or raises the send's error
    (for the requests that shared it: a new `BrokerUnavailable`, or a `RuntimeError` chained to the error)."""

    def __init__(self, send: Callable[[list[Outgoing]], None]) -> None:
        self._send = send
        self._changed = threading.Condition()
        self._queued: list[_Request] = []
        self._sending = False

    @property
    def queued(self) -> int:
        """Requests waiting for the next send."""
        with self._changed:
            return len(self._queued)

    def send_all(self, messages: Sequence[Outgoing]) -> None:
        mine = _Request(messages)
        with self._changed:
            self._queued.append(mine)
            while self._sending and not mine.done:
                self._changed.wait()
            if mine.done:  # a leader sent it while we waited
                if isinstance(mine.error, BrokerUnavailable):
                    raise BrokerUnavailable(str(mine.error)) from mine.error
                if mine.error is not None:
                    raise RuntimeError(f"the send this request shared failed: {mine.error!r}") from mine.error
                return
            group, self._queued, self._sending = self._queued, [], True
        error: BaseException | None = None
        try:
            self._send([m for request in group for m in request.messages])
        except BaseException as exc:
            error = exc
        with self._changed:
            for request in group:
                request.done, request.error = True, error
            self._sending = False
            self._changed.notify_all()
        if error is not None:
            raise error
