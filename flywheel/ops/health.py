"""What a process says about itself: one body shape for `/healthz` and `/readyz` in every process.

    {"process": "signals-worker", "status": "ready" | "not_ready" | "alive",
     "checks": {"kafka": {"ok": true, "detail": "...", "required": true}, "redis": {...}, ...}}

`/readyz` is ready when every required check is ok (else 503). A dependency the process can work
without for a while is reported but not required (serving answers from the split and weights it holds
while Redis or the registry is down; taking every replica out of a load balancer for it would turn an
outage of a side service into one of serving). `/healthz` says the process is alive and runs no check
(a process waiting for Kafka is alive and must not be restarted for it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from flywheel.ops.deps import CheckResult, Dependency, describe

# A check of the process's own state ("polled lately", "a split is loaded"): (ok, detail).
Check = Callable[[], tuple[bool, str]]


class ProcessHealth:
    def __init__(
        self,
        process: str,
        dependencies: Sequence[Dependency] = (),
        checks: dict[str, Check] | None = None,
        *,
        optional: Collection[str] = (),
    ) -> None:
        self.process = process
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

    def liveness(self) -> dict[str, object]:
        return self.body("alive", {})

    def body(self, status: str, results: dict[str, CheckResult]) -> dict[str, object]:
        return {"process": self.process, "status": status,
                "checks": {name: {**r.as_json(), "required": name not in self.optional}
                           for name, r in results.items()}}
