"""How a client proves who it is to Kafka, and knows the broker is Kafka: the SASL and TLS settings, in
kafka-python's names.

A cluster that enforces ACLs (Strimzi's `KafkaUser`s) knows each process by its SASL user; with SASL_SSL the
connection is TLS and the broker's certificate is verified against `kafka_ssl_cafile` (the cluster's CA; the
system's CAs when empty), host name included. Every client the bus makes (producer, consumer, topic reader,
admin) gets the same settings from here. The confluent client translates the names (`flywheel.bus.confluent`).
"""

from __future__ import annotations

from flywheel.settings import Settings


def client_security(settings: Settings) -> dict[str, object]:
    """The SASL (and TLS) settings in kafka-python's names (the confluent client translates them); none for
    PLAINTEXT."""
    if settings.kafka_security_protocol == "PLAINTEXT":
        return {}
    password = settings.kafka_sasl_password
    config: dict[str, object] = {
        "security_protocol": settings.kafka_security_protocol,
        "sasl_mechanism": settings.kafka_sasl_mechanism,
        "sasl_plain_username": settings.kafka_sasl_username,
        "sasl_plain_password": password.get_secret_value() if password is not None else "",
    }
    if settings.kafka_security_protocol == "SASL_SSL" and settings.kafka_ssl_cafile:
        config["ssl_cafile"] = settings.kafka_ssl_cafile
    return config
