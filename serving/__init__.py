"""Serving: the model server the registry pushes weights to."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from flywheel.settings import Settings


def build_serving_app(settings: Settings) -> FastAPI:
    """The serving app wired to the real split (Redis), registry (MLflow) and Kafka."""
    from flywheel.bus import make_producer
    from flywheel.connections import redis_client
    from flywheel.traffic import TrafficSplitStore
    from model_registry import ModelRegistry
    from serving.app import create_app
    from serving.pool import PolicyPool

    store = TrafficSplitStore(redis_client(settings), settings)
    registry = ModelRegistry(settings)
    pool = PolicyPool(store.get, lambda v: str(registry.fetch(v)), device=settings.device)
    return create_app(
        pool, make_producer(settings), settings.events_topic, signing_key=settings.serving_key.get_secret_value()
    )


__all__ = ["build_serving_app"]
