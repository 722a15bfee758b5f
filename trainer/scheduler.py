"""Run training cycles on a schedule, one at a time across every replica.

- APScheduler interval job (`settings.train_interval_s`), stored in a SQLAlchemy job store
  (SQLite under data_dir by default), so a restarted trainer keeps its next run time.
- Missed runs (the process was down) coalesce into one run; one instance at a time per process.
- A Redis lock (renewed while the cycle runs) makes replicas skip while another one trains;
  each replica keeps its own job store, the lock is what they share.
- The job store holds no secret: a job is a reference to `scheduled_cycle` with the trainer
  config and the id of the scheduler that runs it; the settings (Redis URL with its password,
  tokens, keys) stay in this process's memory and are looked up by that id when the job runs.
- A cycle failed by an outage (Redis, MLflow) is logged once per outage (`flywheel.ops`) and retried
  with backoff (from 5 s, doubling, at most the interval) instead of waiting a whole interval;
  `health` answers the trainer API's `/readyz`.
- Every finished cycle is counted by outcome on `/metrics` (`flywheel_trainer_cycles_total`:
  registered, skipped, stopped, failed, outage), so an alert can say a cycle failed without reading logs.
- Liveness: a running cycle beats the process's heartbeat each time it looks at its stop flag (every optimizer
  step, scoring chunk and own-sample prompt), so `/healthz` fails when a cycle makes no progress for
  `settings.trainer_stale_after_s` (a wedged cycle: the orchestrator restarts the process); between cycles the
  heartbeat is disarmed, so waiting an interval is never mistaken for being stuck.
- Shutdown is bounded: `shutdown()` (SIGTERM) sets the running cycle's stop, so it ends within one optimizer
  step or scoring chunk with nothing registered (`trainer.cycle`'s docstring: where it looks, what is lost),
  and stores that cycle's next run `OWED_RUN_DELAY_S` after the shutdown, so the next start runs it at once
  instead of an interval later.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED, JobExecutionEvent
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import Counter

from flywheel.connections import redis_client
from flywheel.ops import Heartbeat, ProcessHealth, mlflow_dependency, redis_dependency
from flywheel.settings import Settings, get_settings
from trainer.config import TrainerConfig
from trainer.cycle import CycleResult

log = logging.getLogger(__name__)
JOB_ID = "flywheel-trainer-cycle"
DEFAULT_CYCLE = "trainer.cycle:run_cycle"
OWED_RUN_DELAY_S = 30.0  # a stopped cycle runs this long after the shutdown at the earliest (or at the next start)
# The settings of each scheduler in this process, by scheduler id: what a stored job names
# instead of the settings themselves.
_SETTINGS: dict[str, Settings] = {}
_RUNS: dict[str, _Run] = {}  # and how each one stops its cycle
CYCLES = Counter("flywheel_trainer_cycles", "Training cycles finished, by outcome", ["outcome"])


class BeatingStop(threading.Event):
    """A cycle's stop flag that also says the cycle is alive: each look at it beats `heartbeat` while that is
    armed (the scheduler arms it for the cycle's run only), since a cycle looks at its stop wherever it makes
    progress (`trainer.cycle`'s docstring). An Event still, so a cycle needs no change to be watched."""

    def __init__(self, heartbeat: Heartbeat | None = None) -> None:
        super().__init__()
        self.heartbeat = heartbeat

    def is_set(self) -> bool:
        if self.heartbeat is not None and self.heartbeat.armed:
            self.heartbeat.beat()
        return super().is_set()


@dataclass
class _Run:
    """A scheduler's cycle as its shutdown sees it: `stop` asks it to end (and its looks beat the heartbeat),
    `lock` is held while it runs, `owed` says the last one was stopped (so it is run again at the next start)."""

    stop: BeatingStop = field(default_factory=BeatingStop)
    lock: threading.Lock = field(default_factory=threading.Lock)
    owed: bool = False


def lock_key(settings: Settings) -> str:
    return f"{settings.redis_prefix}trainer:cycle-lock"


@contextlib.contextmanager
def cycle_lock(client: redis.Redis, key: str, lease_s: float = 60.0) -> Iterator[bool]:
    """Yield True while holding the replica-wide lock, False when another holder has it.

    The lease is renewed every lease/3 seconds while held, so a long cycle keeps it and a
    crashed replica's lock expires by itself after `lease_s`.
    """
    lock = client.lock(key, timeout=lease_s, blocking=False, thread_local=False)
    if not lock.acquire():
        yield False
        return
    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(lease_s / 3):
            try:
                lock.reacquire()
            except redis.RedisError:
                log.warning("could not renew the trainer lock %s", key, exc_info=True)

    renewer = threading.Thread(target=renew, name="trainer-lock-renewal", daemon=True)
    renewer.start()
    try:
        yield True
    finally:
        stop.set()
        renewer.join()
        with contextlib.suppress(redis.exceptions.LockError):  # expired meanwhile: nothing to release
            lock.release()


def _resolve(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def guarded_cycle(settings: Settings, config: TrainerConfig, cycle: str = DEFAULT_CYCLE,
                  stop: threading.Event | None = None) -> CycleResult:
    """One cycle under the replica-wide lock; skipped (with the reason) when another replica trains.

    `stop` goes to a cycle that takes one (`run_cycle` does; a stand-in without it runs to its end)."""
    with cycle_lock(redis_client(settings), lock_key(settings)) as held:
        if not held:
            return CycleResult("skipped", "another replica is training right now")
        run = _resolve(cycle)
        stoppable = stop is not None and "stop" in inspect.signature(run).parameters
        result: CycleResult = run(settings, config, progress=False, **({"stop": stop} if stoppable else {}))
    log.info("trainer cycle %s: %s", result.status, result.reason)
    return result


def scheduled_cycle(scheduler_id: str, config: dict[str, Any], cycle: str = DEFAULT_CYCLE) -> CycleResult:
    """The job APScheduler stores and runs: plain, secret-free arguments only.

    The settings are this process's: those of the scheduler `scheduler_id` (it registered them
    before starting), else the environment's.
    """
    settings = _SETTINGS.get(scheduler_id) or get_settings()
    run = _RUNS.get(scheduler_id)
    if run is None:
        return guarded_cycle(settings, TrainerConfig.from_dict(config), cycle)
    heartbeat = run.stop.heartbeat
    with run.lock:
        if heartbeat is not None:
            heartbeat.arm()
        try:
            result = guarded_cycle(settings, TrainerConfig.from_dict(config), cycle, run.stop)
        finally:
            if heartbeat is not None:
                heartbeat.disarm()  # between cycles the trainer waits; it is not wedged
        run.owed = result.status == "stopped"
    return result


class TrainerScheduler:
    """The interval job that runs `guarded_cycle`, with a persistent job store."""

    def __init__(
        self,
        settings: Settings,
        config: TrainerConfig | None = None,
        *,
        interval_s: float | None = None,
        jobstore_url: str | None = None,
        cycle: str = DEFAULT_CYCLE,
    ) -> None:
        self.interval_s = float(interval_s or settings.train_interval_s)
        if jobstore_url is None:
            settings.data_dir.mkdir(parents=True, exist_ok=True)
            jobstore_url = f"sqlite:///{(settings.data_dir / 'trainer-schedule.db').resolve()}"
        self._id = uuid.uuid4().hex
        _SETTINGS[self._id] = settings
        self._kwargs = {"scheduler_id": self._id, "config": (config or TrainerConfig()).to_dict(), "cycle": cycle}
        self._scheduler = BackgroundScheduler(
            jobstores={"default": SQLAlchemyJobStore(url=jobstore_url)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone="UTC",
        )
        self.results: list[CycleResult] = []
        self.health = ProcessHealth(
            "trainer-scheduler",
            [redis_dependency(settings), mlflow_dependency(settings)],
            {"scheduler": self._running},
            loop_stale_after_s=settings.trainer_stale_after_s,
        )
        self._run = _RUNS[self._id] = _Run(stop=BeatingStop(self.health.heartbeat))
        self._outage_retries = 0
        self._scheduler.add_listener(self._on_job, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)

    def _running(self) -> tuple[bool, str]:
        if not self._scheduler.running:
            return False, "the scheduler is not running"
        next_run = self.next_run_time()
        return True, f"next cycle at {next_run.isoformat() if next_run else 'none'}"

    def _on_job(self, event: JobExecutionEvent) -> None:
        if event.exception is None:
            if self._outage_retries:
                for known in self.health.dependencies:
                    known.recovered()
            self._outage_retries = 0
            if isinstance(event.retval, CycleResult):
                self.results.append(event.retval)
                CYCLES.labels(event.retval.status).inc()
            return
        dep = self.health.blame(event.exception)
        if dep is None:
            CYCLES.labels("failed").inc()
            log.error("trainer cycle failed", extra={"error": repr(event.exception)})
            return
        CYCLES.labels("outage").inc()
        dep.failed(event.exception)  # one line per outage
        self._outage_retries += 1
        delay = min(self.interval_s, 5.0 * 2 ** min(self._outage_retries - 1, 10))
        job = self._scheduler.get_job(JOB_ID)
        if job is not None:
            job.modify(next_run_time=datetime.now(UTC) + timedelta(seconds=delay))

    def start(self) -> datetime | None:
        """Start; an existing job keeps its next run time (a restart does not reset the clock)."""
        self._scheduler.start(paused=True)
        job = self._scheduler.get_job(JOB_ID)
        trigger = IntervalTrigger(seconds=self.interval_s, timezone="UTC")
        if job is None:
            job_ref = "trainer.scheduler:scheduled_cycle"
            self._scheduler.add_job(job_ref, trigger, id=JOB_ID, name="training cycle", kwargs=self._kwargs)
        else:
            job.modify(kwargs=self._kwargs)  # new settings / config apply from the next run on
            if getattr(job.trigger, "interval", None) != trigger.interval:
                job.reschedule(trigger)  # a changed interval starts a new clock
        self._scheduler.resume()
        return self.next_run_time()

    def next_run_time(self) -> datetime | None:
        job = self._scheduler.get_job(JOB_ID)
        return job.next_run_time if job else None

    def run_now(self) -> None:
        """Move the next run to now (a manual trigger that still goes through the lock)."""
        job = self._scheduler.get_job(JOB_ID)
        if job is None:
            raise RuntimeError("the scheduler is not started")
        job.modify(next_run_time=datetime.now(UTC))

    def _owe_at_next_start(self) -> None:
        """Not from the job listener (APScheduler's shutdown holds the job store's lock while it waits), and a
        little ahead of now: its shutdown processes due jobs once more, which would move a due one an interval on."""
        job = self._scheduler.get_job(JOB_ID)
        if job is not None:
            job.modify(next_run_time=datetime.now(UTC) + timedelta(seconds=OWED_RUN_DELAY_S))

    def shutdown(self, wait: bool = True) -> None:
        """Stop: a cycle in progress is asked to stop (see the module docstring) and, with `wait`, waited for."""
        if self._scheduler.running:
            self._scheduler.pause()  # no new run starts
            self._run.stop.set()
            if wait:
                with self._run.lock:  # a cycle in progress ends within a step (trainer.cycle)
                    if self._run.owed:  # run it as soon as a scheduler starts on this job store again
                        self._owe_at_next_start()
            self._scheduler.shutdown(wait=wait)
        _SETTINGS.pop(self._id, None)
        _RUNS.pop(self._id, None)
