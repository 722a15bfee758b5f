"""The simulated users' stream mode keeps a bound on what waits for serving when serving is slower than it.

Serving here is a stand-in HTTP server that holds every request until the test lets it go: a serving
that is slower than any stream, which the real one cannot be made to be on demand. The simulator, its
HTTP clients and its thread pool are the real ones.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from simulator.contexts import held_out_contexts
from simulator.users import UserSimulator


class StuckServing(ThreadingHTTPServer):
    """Answers every request with 503, but only once `release` is set; counts what it holds at once."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.holding = self.most_held = self.received = 0


class _Handler(BaseHTTPRequestHandler):
    server: StuckServing

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        with self.server.lock:
            self.server.received += 1
            self.server.holding += 1
            self.server.most_held = max(self.server.most_held, self.server.holding)
        self.server.release.wait(60)
        with self.server.lock:
            self.server.holding -= 1
        self.send_response(503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's signature
        pass


@pytest.fixture
def stuck_serving() -> Iterator[StuckServing]:
    server = StuckServing()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


def test_a_stream_faster_than_serving_sheds_what_exceeds_max_in_flight_and_counts_it(
    stuck_serving: StuckServing,
) -> None:
    url = f"http://127.0.0.1:{stuck_serving.server_address[1]}"
    sim = UserSimulator(url, url, "key", n_users=10, rate_per_s=2000.0, max_in_flight=3,
                        contexts=held_out_contexts(20, 0, preset="test"))  # fmt: skip
    stop = threading.Event()
    (stream,) = sim.start(stop, max_steps=40)
    deadline = time.monotonic() + 60
    # Every arrival after the third finds three requests waiting on serving: it is shed, not queued.
    while (sim.stats.shed < 37 or stuck_serving.holding < 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sim.stats.shed == 37 and stuck_serving.holding == 3
    stuck_serving.release.set()
    stream.join(timeout=60)
    assert not stream.is_alive()
    assert stuck_serving.received == 3 and stuck_serving.most_held == 3
    assert sim.stats.errors == 3 and sum(sim.stats.served.values()) == 0  # the three got serving's 503
