"""Connections to the backing services, configured from `Settings`."""

from __future__ import annotations

import redis

from flywheel.settings import Settings


def redis_client(settings: Settings) -> redis.Redis:
    return redis.Redis.from_url(settings.redis_url, socket_connect_timeout=2, health_check_interval=30)


def delete_prefix(client: redis.Redis, prefix: str) -> int:
    """Delete every key under `prefix` (SCAN, then UNLINK in chunks) and return how many: for benchmarks and
    tests sharing one Redis. Their window state would otherwise stay until it expires, about a day later, and
    a few million such keys make every later prefix scan on that Redis take seconds."""
    deleted, chunk = 0, []
    for key in client.scan_iter(match=f"{prefix}*", count=10_000):
        chunk.append(key)
        if len(chunk) == 10_000:
            deleted += int(client.unlink(*chunk))  # type: ignore[arg-type]
            chunk = []
    if chunk:
        deleted += int(client.unlink(*chunk))  # type: ignore[arg-type]
    return deleted


def configure_mlflow(settings: Settings) -> str:
    """Point the mlflow client library at the configured tracking/registry URI."""
    import mlflow

    uri = settings.resolved_mlflow_uri
    if uri.startswith("sqlite:///"):
        settings.data_dir.joinpath("mlflow").mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def experiment_artifact_location(settings: Settings) -> str | None:
    """Local artifact folder for database-backed stores; a tracking server decides for itself."""
    if settings.resolved_mlflow_uri.startswith(("http://", "https://", "databricks")):
        return None
    return (settings.data_dir / "mlflow" / "artifacts").resolve().as_uri()
