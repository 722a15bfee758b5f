"""Group commit for the collector: requests that arrive while a send is in flight share the next one.

Every request must wait until Kafka acknowledged its events. Sent one request at a time,
each pays a full produce-and-acknowledge round trip; sent concurrently, the requests'
flushes wait on each other's messages and contend for the GIL (measured with the confluent
client: 8 requests in flight went at two thirds of the rate of one). Here one caller at a
time is the leader: it sends its own messages together with everything queued meanwhile,
and wakes all the callers it sent for with the outcome. A failed send fails every request
of its group, so no request is acknowledged without its events; a retried request's events
are de-duplicated by `event_id` downstream. A message too large for Kafka is one request's fault: the group is
then sent again request by request, so only the request that holds it fails (`MessageTooLarge`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flywheel.bus import BrokerUnavailable, MessageTooLarge, Outgoing


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
                if isinstance(mine.error, MessageTooLarge):
                    raise MessageTooLarge(str(mine.error)) from mine.error
                if mine.error is not None:
                    raise RuntimeError(f"the send this request shared failed: {mine.error!r}") from mine.error
                return
            group, self._queued, self._sending = self._queued, [], True
        errors: dict[int, BaseException] = {}
        try:
            self._send([m for request in group for m in request.messages])
        except MessageTooLarge as exc:
            if len(group) == 1:
                errors[0] = exc
            else:  # whose message it was: each request alone (what was written already is de-duplicated downstream)
                for k, request in enumerate(group):
                    try:
                        self._send(list(request.messages))
                    except BaseException as alone:  # noqa: BLE001 - handed to that request's caller
                        errors[k] = alone
        except BaseException as exc:
            errors = dict.fromkeys(range(len(group)), exc)
        with self._changed:
            for k, request in enumerate(group):
                request.done, request.error = True, errors.get(k)
            self._sending = False
            self._changed.notify_all()
        error = errors.get(next(k for k, request in enumerate(group) if request is mine))
        if error is not None:
            raise error
