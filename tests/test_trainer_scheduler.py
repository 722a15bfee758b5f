"""The trainer's schedule: persistent across restarts, one cycle at a time across replicas."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
import redis
from pydantic import SecretStr

from flywheel.settings import Settings
from trainer.config import TrainerConfig
from trainer.cycle import CycleResult
from trainer.scheduler import TrainerScheduler, cycle_lock, guarded_cycle, lock_key

# A stand-in for run_cycle: what is under test here is when cycles run, not what they train.
HOLD_S = 1.2


def recording_cycle(settings: Settings, config: TrainerConfig, progress: bool = False) -> CycleResult:
    client = redis.Redis.from_url(settings.redis_url)
    start = time.time()
    time.sleep(HOLD_S)
    client.rpush(f"{settings.redis_prefix}spans", f"{start}:{time.time()}")
    return CycleResult("skipped", "recorded")


def test_a_restarted_scheduler_keeps_its_next_run_time(settings: Settings, tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'jobs.db'}"
    first = TrainerScheduler(settings, interval_s=3600, jobstore_url=store)
    planned = first.start()
    first.shutdown()
    time.sleep(0.05)  # a fresh schedule would now land later than the stored one
    second = TrainerScheduler(settings, interval_s=3600, jobstore_url=store)
    try:
        assert second.start() == planned
    finally:
        second.shutdown()
    third = TrainerScheduler(settings, interval_s=7200, jobstore_url=store)
    try:
        assert third.start() > planned  # a changed interval is a new schedule
    finally:
        third.shutdown()


def test_two_schedulers_never_train_at_once(settings: Settings, tmp_path: Path) -> None:
    replicas = [
        TrainerScheduler(
            settings,
            interval_s=1,
            jobstore_url=f"sqlite:///{tmp_path / f'jobs-{i}.db'}",
            cycle="test_trainer_scheduler:recording_cycle",
        )  # fmt: skip
        for i in range(2)
    ]
    for r in replicas:
        r.start()
    time.sleep(4.5)
    for r in replicas:
        r.shutdown()
    raw = redis.Redis.from_url(settings.redis_url).lrange(f"{settings.redis_prefix}spans", 0, -1)
    spans = sorted(tuple(map(float, s.decode().split(":"))) for s in raw)
    assert len(spans) >= 2
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end, f"two cycles overlapped: {spans}"
    results = [res for r in replicas for res in r.results]
    assert any(res.reason == "another replica is training right now" for res in results)


def test_guarded_cycle_skips_while_the_lock_is_held(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    with cycle_lock(client, lock_key(settings)) as held:
        assert held
        result = guarded_cycle(settings, TrainerConfig(), cycle="test_trainer_scheduler:recording_cycle")
    assert result.status == "skipped" and result.reason == "another replica is training right now"
    assert (
        guarded_cycle(settings, TrainerConfig(), cycle="test_trainer_scheduler:recording_cycle").reason
        == "recorded"
    )


def test_the_job_store_holds_no_secret(settings: Settings, tmp_path: Path) -> None:
    secrets = {
        "approval_token": "approval-token-that-must-not-be-stored",
        "write_keys": "write-key-that-must-not-be-stored",
    }
    redis_password = "redis-password-that-must-not-be-stored"
    # No Redis call happens while the job is only stored, so the password need not be real.
    s = Settings.model_validate(
        {
            **settings.model_dump(),
            **secrets,
            "redis_url": f"redis://:{redis_password}@127.0.0.1:6379/0",
        }
    )
    store = tmp_path / "jobs.db"
    scheduler = TrainerScheduler(s, interval_s=3600, jobstore_url=f"sqlite:///{store}")
    scheduler.start()
    scheduler.shutdown()
    with sqlite3.connect(store) as db:
        rows = [bytes(r[0]) for r in db.execute("SELECT job_state FROM apscheduler_jobs")]
    assert len(rows) == 1 and b"scheduled_cycle" in rows[0]  # the job is there ...
    for secret in [*secrets.values(), redis_password]:
        assert secret.encode() not in rows[0]  # ... and no secret in it
    assert b"redis://" not in rows[0] and b"approval_token" not in rows[0]


@pytest.mark.parametrize(
    "case", ["missing", "empty", "scheme-only", "wrong", "basic", "revoked", "viewer", "approver", "admin"]
)
def test_the_api_triggers_a_cycle_now_only_for_an_approver(
    settings: Settings, tmp_path: Path, case: str
) -> None:
    from fastapi.testclient import TestClient

    from flywheel.identity import TokenStore
    from trainer.api import create_app

    admin = "bootstrap-admin-token-of-the-trainer"
    settings = settings.model_copy(update={"approval_token": SecretStr(admin)})
    store = TokenStore.from_settings(settings)
    issued = {role: store.issue(f"{role}-1", role) for role in ("viewer", "approver")}
    revoked = store.issue("gone", "approver")
    store.revoke("gone")
    headers, status = {
        "missing": ({}, 401),
        "empty": ({"Authorization": "Bearer "}, 401),
        "scheme-only": ({"Authorization": "Bearer"}, 401),
        "wrong": ({"Authorization": "Bearer wrong"}, 401),
        "basic": ({"Authorization": f"Basic {admin}"}, 401),
        "revoked": ({"Authorization": f"Bearer {revoked}"}, 401),
        "viewer": ({"Authorization": f"Bearer {issued['viewer']}"}, 403),
        "approver": ({"Authorization": f"Bearer {issued['approver']}"}, 202),
        "admin": ({"Authorization": f"Bearer {admin}"}, 202),
    }[case]
    scheduler = TrainerScheduler(settings, interval_s=3600, jobstore_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                                 cycle="test_trainer_scheduler:recording_cycle")  # fmt: skip
    planned = scheduler.start()
    try:
        client = TestClient(create_app(settings, scheduler))
        resp = client.post("/api/run", headers=headers)
        assert resp.status_code == status, resp.text
        if status != 202:
            assert scheduler.next_run_time() == planned and scheduler.results == []  # nothing triggered
        else:
            deadline = time.monotonic() + 20
            while not scheduler.results and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [r.reason for r in scheduler.results] == ["recorded"]
    finally:
        scheduler.shutdown()


def test_the_api_triggers_a_cycle_now_only_with_the_token(settings: Settings, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from trainer.api import create_app

    scheduler = TrainerScheduler(settings, interval_s=3600, jobstore_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                                 cycle="test_trainer_scheduler:recording_cycle")  # fmt: skip
    planned = scheduler.start()
    try:
        client = TestClient(create_app(settings, scheduler))
        assert client.post("/api/run").status_code == 401
        assert client.post("/api/run", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert scheduler.next_run_time() == planned and scheduler.results == []
        token = settings.approval_token.get_secret_value()
        resp = client.post("/api/run", headers={"Authorization": f"Bearer {token}"})
        assert resp.status_code == 202
        deadline = time.monotonic() + 20
        while not scheduler.results and time.monotonic() < deadline:
            time.sleep(0.1)
        status = client.get("/api/status").json()
    finally:
        scheduler.shutdown()
    assert [r["reason"] for r in status["recent"]] == ["recorded"]
    assert status["interval_s"] == 3600


def broken_cycle(settings: Settings, config: TrainerConfig, progress: bool = False) -> CycleResult:
    raise ValueError("a bug of the cycle's own, not an outage")


@pytest.mark.parametrize(("cycle", "outcome"), [("recording_cycle", "skipped"), ("broken_cycle", "failed")])
def test_each_finished_cycle_is_counted_by_outcome(
    settings: Settings, tmp_path: Path, cycle: str, outcome: str
) -> None:
    from prometheus_client import REGISTRY

    def count() -> float:
        return REGISTRY.get_sample_value("flywheel_trainer_cycles_total", {"outcome": outcome}) or 0.0

    before = count()
    scheduler = TrainerScheduler(settings, interval_s=3600, jobstore_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                                 cycle=f"test_trainer_scheduler:{cycle}")  # fmt: skip
    scheduler.start()
    try:
        scheduler.run_now()
        deadline = time.monotonic() + 20
        while count() == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert count() == before + 1  # what the FlywheelTrainingCycleFailed alert (k8s/) reads
    finally:
        scheduler.shutdown()


# A stand-in cycle that makes progress (looks at its stop) until told to hang, then hangs without looking.
HANG = threading.Event()
RELEASE = threading.Event()


def hanging_cycle(settings: Settings, config: TrainerConfig, progress: bool = False,
                  stop: threading.Event | None = None) -> CycleResult:  # fmt: skip
    assert stop is not None
    while not HANG.is_set():
        stop.is_set()  # where a real cycle looks: an optimizer step, a scoring chunk, an own-sample prompt
        time.sleep(0.05)
    RELEASE.wait(30)
    return CycleResult("skipped", "released")


def test_a_wedged_cycle_fails_healthz_while_one_making_progress_and_the_wait_between_cycles_do_not(
    settings: Settings, tmp_path: Path
) -> None:
    HANG.clear()
    RELEASE.clear()
    stale_s = 0.6
    scheduler = TrainerScheduler(settings.model_copy(update={"trainer_stale_after_s": stale_s}), interval_s=3600,
                                 jobstore_url=f"sqlite:///{tmp_path / 'jobs.db'}",
                                 cycle="test_trainer_scheduler:hanging_cycle")  # fmt: skip
    beat = scheduler.health.heartbeat
    scheduler.start()
    try:
        assert beat.check() == (True, "no worker loop running")  # waiting for the next run is not wedged
        scheduler.run_now()
        deadline = time.monotonic() + 20
        while not beat.armed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert beat.armed
        time.sleep(3 * stale_s)  # the cycle keeps looking at its stop: alive however long it runs
        assert beat.check()[0]
        HANG.set()  # now it makes no progress
        time.sleep(2 * stale_s)
        healthy, why = beat.check()
        assert not healthy, why
        RELEASE.set()  # it ends: disarmed, healthy again
        deadline = time.monotonic() + 20
        while beat.armed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert beat.check() == (True, "no worker loop running")
    finally:
        RELEASE.set()
        scheduler.shutdown()
