"""What a process says about itself: one body shape for `/healthz` and `/readyz` in every process.

    {"process": "signals-worker", "status": "ready" | "not_ready" | "alive" | "not_alive",
     "checks": {"kafka": {"ok": true, "detail": "...", "required": true}, "redis": {...}, ...}}

`/readyz` is ready when every required check is ok (else 503). A dependency the process can work
without for a while is reported but not required (serving answers from the split and weights it holds
while Redis or the registry is down; taking every replica out of a load balancer for it would turn an
outage of a side service into one of serving).

`/healthz` says whether the process is alive: it probes no dependency (a process waiting for Kafka is
alive and must not be restarted for it), but a worker loop's `Heartbeat` must be fresh. The loop
(`flywheel.ops.run_loop`) beats once per iteration and while it waits out an outage with backoff, so
only a loop stuck inside one iteration for longer than `loop_stale_after_s` answers 503 "not_alive",
and the orchestrator restarts it. A process without a loop (an HTTP server) never arms its heartbeat:
its liveness is answering at all.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

from flywheel.ops.deps import CheckResult, Dependency, describe

# A check of the process's own state ("polled lately", "a split is loaded"): (ok, detail).
Check = Callable[[], tuple[bool, str]]

LOOP_STALE_AFTER_S = 600.0
"""How long a worker loop may go without a beat before `/healthz` fails: many times the longest iteration
expected of any Flywheel loop (a batch, or the rollout controller's tick plus its 30 s wait). A process whose
iterations may legitimately take longer passes its own bound to `ProcessHealth`."""


class Heartbeat:
    """When a worker loop last showed progress (a monotonic clock). Disarmed until the loop starts, and again
    once it has returned (a process shutting down is not wedged).

    >>> beat = Heartbeat(stale_after_s=60.0)
    >>> beat.check()
    (True, 'no worker loop running')
    >>> beat.arm(); beat.check()[0]
    True
    """

    def __init__(self, stale_after_s: float = LOOP_STALE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s={stale_after_s}: must be > 0 seconds, several times the loop's "
                             "longest expected iteration")  # fmt: skip
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None  # None: disarmed

    @property
    def armed(self) -> bool:
        return self._last is not None

    def arm(self) -> None:
        self.beat()

    def beat(self) -> None:
        with self._lock:
            self._last = self._clock()

    def disarm(self) -> None:
        with self._lock:
            self._last = None

    def check(self) -> tuple[bool, str]:
        with self._lock:
            last = self._last
        if last is None:
            return True, "no worker loop running"
        age = self._clock() - last
        if age > self.stale_after_s:
            return False, f"no loop iteration for {age:.0f} s (bound {self.stale_after_s:g} s): wedged"
        return True, f"last loop iteration {age:.1f} s ago (bound {self.stale_after_s:g} s)"


class ProcessHealth:
    def __init__(
        self,
        process: str,
        dependencies: Sequence[Dependency] = (),
        checks: dict[str, Check] | None = None,
        *,
        optional: Collection[str] = (),
        loop_stale_after_s: float = LOOP_STALE_AFTER_S,
    ) -> None:
        self.process = process
        self.heartbeat = Heartbeat(loop_stale_after_s)
        self.dependencies = list(dependencies)
        self.checks: dict[str, Check] = dict(checks or {})
        self.optional = frozenset(optional)

    def add_check(self, name: str, check: Check) -> None:
        self.checks[name] = check

    def dependency(self, name: str) -> Dependency:
        for dep in self.dependencies:
            if dep.name == name:
                return dep
        raise KeyError(f"{self.process} has no dependency {name!r}")

    def blame(self, exc: BaseException) -> Dependency | None:
        """The dependency whose failure `exc` is (walking its causes), or None for an error of our own."""
        seen: BaseException | None = exc
        while seen is not None:
            for dep in self.dependencies:
                if dep.matches(seen):
                    return dep
            seen = seen.__cause__ or seen.__context__
        return None

    def readiness(self) -> tuple[bool, dict[str, object]]:
        results: dict[str, CheckResult] = {dep.name: dep.check() for dep in self.dependencies}
        for name, check in self.checks.items():
            try:
                ok, detail = check()
            except Exception as exc:  # a check that fails says not ready, with why
                ok, detail = False, f"check failed: {describe(exc)}"
            results[name] = CheckResult(ok, detail)
        ready = all(r.ok for name, r in results.items() if name not in self.optional)
        return ready, self.body("ready" if ready else "not_ready", results)

    def liveness(self) -> tuple[bool, dict[str, object]]:
        """(alive, body): alive unless a running worker loop's heartbeat is stale (see the module docstring)."""
        if not self.heartbeat.armed:
            return True, self.body("alive", {})
        ok, detail = self.heartbeat.check()
        return ok, self.body("alive" if ok else "not_alive", {"loop": CheckResult(ok, detail)})

    def body(self, status: str, results: dict[str, CheckResult]) -> dict[str, object]:
        return {"process": self.process, "status": status,
                "checks": {name: {**r.as_json(), "required": name not in self.optional}
                           for name, r in results.items()}}
