"""Dynamic batching: concurrent requests share a generator's forward passes.

Requests are queued with the `Generator` (one model version) that must answer them. One worker
thread takes the oldest request, waits at most `max_wait_s` from *its arrival* for others for the
same generator (none when the queue already holds a full batch: a busy server never waits), and
runs them as one `generate_batch` call of at most `max_batch` requests. Requests for another
generator keep their place in the queue for the next batch.

What must hold:
- a batch holds requests for one generator only (so one version): a request routed before a weight
  swap finishes on the weights it was routed to, and its event names that version;
- every submitted request's future is settled: with its result, or with the error its own request
  raised; a batch that fails is retried one request at a time, so one bad request fails alone;
- one thread calls `generate_batch` (`workers=1`, the default): forward passes on one device run one
  at a time anyway, and the in-process back end need not be thread-safe. A back end that batches
  continuously itself (a vLLM server) takes `workers>1` and `max_wait_s=0`: several batches in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from serving.generator import Generation, GenerationRequest, Generator

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    generator: Generator
    request: GenerationRequest
    future: Future[Generation] = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)


class Batcher:
    """Queue requests per generator and answer them in shared batches on worker threads (one by default)."""

    def __init__(
        self,
        *,
        max_batch: int = 16,
        max_wait_s: float = 0.002,
        workers: int = 1,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.workers = workers
        self._on_batch = on_batch or (lambda _: None)
        self._queue: deque[_Pending] = deque()
        self._ready = threading.Condition()
        self._stopped = False
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        with self._ready:
            if self._threads:
                return
            self._stopped = False
            self._threads = [
                threading.Thread(target=self._run, name=f"generation-batcher-{i}", daemon=True)
                for i in range(self.workers)
            ]
            for thread in self._threads:
                thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued, then end the worker."""
        with self._ready:
            self._stopped = True
            self._ready.notify_all()
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(timeout=timeout_s)

    def submit(self, generator: Generator, requests: Sequence[GenerationRequest]) -> list[Future[Generation]]:
        """Queue `requests` for `generator`; each future settles when its request is answered."""
        pending = [_Pending(generator, r) for r in requests]
        self.start()  # an app used without its lifespan (or a bench) still answers
        with self._ready:
            self._queue.extend(pending)
            self._ready.notify_all()
        return [p.future for p in pending]

    def _take(self) -> list[_Pending] | None:
        """The next batch (oldest request first, same generator), or None once stopped and drained."""
        with self._ready:
            while not self._queue:
                if self._stopped:
                    return None
                self._ready.wait()
            first = self._queue[0]
            deadline = first.arrived + self.max_wait_s
            while not self._stopped:
                same = sum(1 for p in self._queue if p.generator is first.generator)
                left = deadline - time.monotonic()
                if same >= self.max_batch or left <= 0:
                    break
                self._ready.wait(left)
            batch: list[_Pending] = []
            rest: deque[_Pending] = deque()
            for p in self._queue:
                (batch if p.generator is first.generator and len(batch) < self.max_batch else rest).append(p)
            self._queue = rest
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            self._on_batch(len(batch))
            try:
                results = batch[0].generator.generate_batch([p.request for p in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"the generator answered {len(results)} of {len(batch)} requests")
            except Exception as exc:
                if len(batch) == 1:
                    batch[0].future.set_exception(exc)
                    continue
                log.exception("a batch of %d failed; answering its requests one at a time", len(batch))
                for p in batch:
                    try:
                        p.future.set_result(p.generator.generate_batch([p.request])[0])
                    except Exception as alone:
                        p.future.set_exception(alone)
                continue
            for p, result in zip(batch, results, strict=True):
                p.future.set_result(result)
