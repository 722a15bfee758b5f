"""The trainer's schedule: persistent across restarts, one cycle at a time across replicas."""

from __future__ import annotations

import time
from pathlib import Path

import redis

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
        resp = client.post("/api/run", headers={"Authorization": f"Bearer {settings.approval_token}"})
        assert resp.status_code == 202
        deadline = time.monotonic() + 20
        while not scheduler.results and time.monotonic() < deadline:
            time.sleep(0.1)
        status = client.get("/api/status").json()
    finally:
        scheduler.shutdown()
    assert [r["reason"] for r in status["recent"]] == ["recorded"]
    assert status["interval_s"] == 3600
