"""A worker killed with SIGKILL mid-batch, again and again, while events keep arriving: the
lake still holds every event exactly once. The worker runs as a real subprocess (the CLI), with
its lake on a local disk and on S3-compatible storage (moto's server, `tests.test_lake_concurrency`'s
fixtures: the worker inherits the `AWS_*` variables that point delta-rs at it)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flywheel.bus import Outgoing, ensure_topics, make_producer
from flywheel.contract import Event
from flywheel.lake.tables import EVENTS
from flywheel.settings import Settings
from launcher.embedded import settings_env
from tests.test_lake_concurrency import moto_endpoint, s3_lake  # noqa: F401  (the S3 server's fixtures)

N_EVENTS = 3000
KILLS = 3


def start_worker(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    cli = Path(sys.executable).parent / "flywheel"
    env = {**os.environ, **settings_env(settings)}
    return subprocess.Popen(
        [
            str(cli),
            "ingest",
            "worker",
            "--group-id",
            "g-crash",
            "--batch-size",
            "150",
            # Every batch pauses between its lake write and its commit: the kills below land there,
            # the worst moment (written, not committed), as well as anywhere else.
            "--pause-before-commit-s",
            "0.3",
        ],
        env=env,
        stdout=open(log, "ab"),  # noqa: SIM115 - the child owns it
        stderr=subprocess.STDOUT,
    )


def rows(settings: Settings) -> int:
    return EVENTS.read(EVENTS.at(settings.lake_root)).height


def wait_for_rows(settings: Settings, more_than: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := rows(settings)) <= more_than and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


@pytest.mark.slow
@pytest.mark.parametrize("store", ["local", "s3"])
def test_sigkilled_worker_leaves_every_event_exactly_once(settings, tmp_path, store, request):
    if store == "s3":
        settings = settings.model_copy(update={"lake_uri": request.getfixturevalue("s3_lake")})
    rng = random.Random(3)
    ensure_topics(settings)
    producer = make_producer(settings)
    done = threading.Event()

    def keep_sending() -> None:
        # Events keep arriving during the kills; ids repeat now and then like client retries do.
        for start in range(0, N_EVENTS, 50):
            batch = [
                Event(event_id=f"e{i}", type="shown", generation_id=f"g{i % 13}", user_id="u")
                for i in range(start, start + 50)
            ]
            batch += batch[:3]
            producer.send_all(
                [Outgoing(settings.events_topic, e.to_bytes(), key=e.generation_id.encode()) for e in batch]
            )
            time.sleep(0.1)
        done.set()

    sender = threading.Thread(target=keep_sending, daemon=True)
    sender.start()
    log = tmp_path / "worker.log"
    seen = 0
    for _ in range(KILLS):
        worker = start_worker(settings, log)
        seen = wait_for_rows(settings, seen, timeout_s=30)  # it is writing batches now
        time.sleep(rng.uniform(0.0, 0.35))
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
    assert done.wait(timeout=60)

    worker = start_worker(settings, log)
    deadline = time.monotonic() + 45
    while rows(settings) < N_EVENTS and time.monotonic() < deadline:
        time.sleep(0.2)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0, log.read_text()[-3000:]
    producer.close()

    lake = EVENTS.read(EVENTS.at(settings.lake_root))
    assert lake.height == N_EVENTS, "every event exactly once"
    assert lake["event_id"].n_unique() == N_EVENTS
    assert (store == "s3") != (settings.lake_dir / "events").exists(), "the lake is where its URI says"
