"""Group commit of the collector's sends: concurrent callers share a send and its outcome.

The send function here is a plain recorder that can be held open, so that callers
provably queue behind a send in flight; tests/test_ingest_collector.py runs the same
path against the real broker.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flywheel.bus import BrokerUnavailable, Outgoing
from ingest.collector.group_send import GroupSender


class HeldSend:
    """Records each send; the first one waits until `release` is set."""

    def __init__(self, fail: bool = False) -> None:
        self.sends: list[list[bytes]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail = fail

    def __call__(self, messages: list[Outgoing]) -> None:
        self.sends.append([m.value for m in messages])
        if len(self.sends) == 1:
            self.started.set()
            assert self.release.wait(10)
        if self.fail:
            raise BrokerUnavailable("Kafka did not acknowledge")


def _messages(k: int) -> list[Outgoing]:
    return [Outgoing("events", f"{k}-{i}".encode()) for i in range(3)]


def _queue_behind_first_send(send: HeldSend, callers: int) -> tuple[ThreadPoolExecutor, list]:
    sender = GroupSender(send)
    pool = ThreadPoolExecutor(max_workers=callers)
    first = pool.submit(sender.send_all, _messages(0))
    assert send.started.wait(10)
    rest = [pool.submit(sender.send_all, _messages(k)) for k in range(1, callers)]
    deadline = time.monotonic() + 10
    while sender.queued < callers - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.queued == callers - 1 and len(send.sends) == 1, "the others wait while the first is in flight"
    send.release.set()
    return pool, [first, *rest]


def test_callers_queued_behind_a_send_share_the_next_one():
    send = HeldSend()
    pool, calls = _queue_behind_first_send(send, callers=5)
    for call in calls:
        assert call.result(timeout=10) is None
    pool.shutdown()
    assert send.sends[0] == [f"0-{i}".encode() for i in range(3)]
    assert len(send.sends) == 2, "the four queued callers went out in one send"
    assert sorted(send.sends[1]) == sorted(f"{k}-{i}".encode() for k in range(1, 5) for i in range(3))


def test_a_failed_send_fails_every_caller_that_shared_it():
    send = HeldSend(fail=True)
    pool, calls = _queue_behind_first_send(send, callers=4)
    for call in calls:
        with pytest.raises(BrokerUnavailable):
            call.result(timeout=10)
    pool.shutdown()
    assert len(send.sends) == 2


def test_a_message_too_large_fails_only_the_request_that_holds_it() -> None:
    """Two requests share a send; one holds a message past Kafka's limit: the group is sent again request by
    request, so the other is acknowledged and only the one holding it gets `MessageTooLarge`."""
    from flywheel.bus import MessageTooLarge

    class SizeLimited(HeldSend):
        def __call__(self, messages: list[Outgoing]) -> None:
            super().__call__(messages)
            if any(len(m.value) > 100 for m in messages):
                raise MessageTooLarge("a message is too large for Kafka")

    send = SizeLimited()
    group = GroupSender(send)
    big = [Outgoing("events", b"x" * 1000)]
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(group.send_all, _messages(0))
        assert send.started.wait(10)
        small, large = pool.submit(group.send_all, _messages(1)), pool.submit(group.send_all, big)
        while group.queued < 2:
            time.sleep(0.01)
        send.release.set()
        first.result(10)
        small.result(10)
        with pytest.raises(MessageTooLarge):
            large.result(10)
    assert [b"1-0", b"1-1", b"1-2"] in send.sends, "the small request was sent alone and acknowledged"
