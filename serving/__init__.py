"""Serving: the model server the registry pushes weights to."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

    from flywheel.settings import Settings


def build_serving_app(settings: Settings) -> FastAPI:
    """The serving app wired to the real split (Redis), registry (MLflow) and Kafka; starts whether or not
    they answer yet, and says on `/readyz` which do not."""
    from flywheel.bus import make_producer
    from flywheel.connections import redis_client
    from flywheel.ops import LazyProducer, ProcessHealth, kafka_dependency, mlflow_dependency, redis_dependency
    from flywheel.traffic import TrafficSplitStore
    from model_registry import ModelRegistry
    from serving.app import create_app
    from serving.pool import PolicyPool

    if settings.environment == "production" and not settings.serving_api_key_set:
        raise ValueError("FLYWHEEL_SERVING_API_KEYS is empty: in production serving answers only callers with a key "
                         "(comma-separated; k8s/README.md, 'Rotate secrets')")
    kafka = kafka_dependency(settings)
    # Redis and the registry are not required: the split and weights held in memory keep serving.
    health = ProcessHealth("serving", [kafka, redis_dependency(settings), mlflow_dependency(settings)],
                           optional={"redis", "mlflow"})
    import threading

    from serving.pool import aliased_checkpoints, watch_split

    redis = redis_client(settings)
    store = TrafficSplitStore(redis, settings)
    registry = ModelRegistry(settings)
    backend = None
    if settings.serving_backend == "vllm":  # versions run on vLLM; routing, signing and logging are the same
        from flywheel.lm.vllm import ServerOptions, VLLMBackend

        backend = VLLMBackend(settings.vllm_url, ServerOptions(python=settings.vllm_python,
                                                               kv_cache_gb=settings.vllm_kv_cache_gb))
    pool = PolicyPool(store.get, aliased_checkpoints(registry), device=settings.device,
                      loader=backend.load if backend else None, release=backend.release if backend else None)
    # A gate's change reaches serving at once through pub/sub; the refresher's poll is the fallback.
    watching = threading.Event()
    watch_split(redis, store.channel, pool.refresh, watching)
    # Made on first use: serving starts (and answers 503) while Kafka is down.
    producer = LazyProducer(lambda: make_producer(settings), kafka)

    def shut_down() -> None:  # an app run in a test or a benchmark leaves no client behind
        watching.set()
        producer.close()
        if backend is not None:  # the vLLM servers serving started go with it
            backend.close()

    return create_app(
        pool, producer, settings.events_topic, health=health, signing_key=settings.serving_key.get_secret_value(),
        on_shutdown=shut_down, api_keys=settings.serving_api_key_set, metrics_port=settings.serving_metrics_port,
        bind_host=settings.bind_host,
        # vLLM batches continuously itself: hand it each request at once, several batches in flight
        max_batch_wait_s=0.0 if backend is not None else 0.002, batch_workers=8 if backend is not None else 1,
    )


__all__ = ["build_serving_app"]
