"""One small Kafka interface with both clients behind it.

kafka-python is the default (the user's choice); confluent-kafka (librdkafka) is
chosen with `FLYWHEEL_KAFKA_CLIENT=confluent`. Components only ever see
`Producer`, `Consumer` and `Record` (or `RecordBatch`, the same records column-wise, for
consumers that handle whole batches and cannot afford one object per record).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from flywheel.bus.security import client_security
from flywheel.bus.types import (
    BrokerUnavailable,
    Consumer,
    MessageTooLarge,
    Outgoing,
    Producer,
    Record,
    RecordBatch,
    next_offsets,
)
from flywheel.settings import Settings

__all__ = [
    "BrokerUnavailable", "Consumer", "MessageTooLarge", "Outgoing", "Producer", "Record", "RecordBatch",
    "ensure_topics", "client_security", "make_consumer", "make_producer", "next_offsets",
]

log = logging.getLogger(__name__)


def make_producer(settings: Settings, **config: object) -> Producer:
    config = {**client_security(settings), **config}
    if settings.kafka_client == "confluent":
        from flywheel.bus.confluent import ConfluentProducer

        return ConfluentProducer(settings.kafka_bootstrap_servers, **config)
    from flywheel.bus.kafka_python import KafkaPythonProducer

    return KafkaPythonProducer(settings.kafka_bootstrap_servers, **config)


def make_consumer(settings: Settings, topics: Sequence[str], group_id: str, **config: object) -> Consumer:
    config = {**client_security(settings), **config}
    if settings.kafka_client == "confluent":
        from flywheel.bus.confluent import ConfluentConsumer

        return ConfluentConsumer(settings.kafka_bootstrap_servers, topics, group_id, **config)
    from flywheel.bus.kafka_python import KafkaPythonConsumer

    return KafkaPythonConsumer(settings.kafka_bootstrap_servers, topics, group_id, **config)


def ensure_topics(settings: Settings, names: Sequence[str] | None = None) -> None:
    """Create the loop's topics (idempotent) with the configured partition count."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    names = list(names or (settings.events_topic, settings.rewards_topic, settings.dead_letter_topic))
    admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap_servers.split(","), **client_security(settings))
    try:
        existing = set(admin.list_topics())
        missing = [n for n in names if n not in existing]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics([NewTopic(n, settings.topic_partitions, 1) for n in missing])
            log.info("created topics %s with %d partitions", missing, settings.topic_partitions)
    finally:
        admin.close()
