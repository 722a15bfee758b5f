"""Kafka clients log in as the process's SASL user when the cluster enforces ACLs (Strimzi's KafkaUsers,
k8s/); a half-configured login is refused at start with the variables to set."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flywheel.bus import client_security
from flywheel.bus.confluent import _librdkafka_config
from flywheel.settings import Settings


def test_plaintext_adds_nothing_to_the_clients() -> None:
    assert client_security(Settings()) == {}


def test_sasl_settings_reach_both_clients_in_their_own_names() -> None:
    s = Settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_username="flywheel-serving",
                 kafka_sasl_password="a-password-from-the-kafka-user")  # fmt: skip
    kafka_python = client_security(s)
    assert kafka_python == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512",
                            "sasl_plain_username": "flywheel-serving",
                            "sasl_plain_password": "a-password-from-the-kafka-user"}  # fmt: skip
    assert _librdkafka_config(kafka_python) == {"security.protocol": "SASL_PLAINTEXT",
                                                "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "flywheel-serving",
                                                "sasl.password": "a-password-from-the-kafka-user"}  # fmt: skip


def test_a_sasl_protocol_without_its_user_is_refused_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="FLYWHEEL_KAFKA_SASL_USERNAME and FLYWHEEL_KAFKA_SASL_PASSWORD"):
        Settings(kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_username="flywheel-serving")


def test_production_refuses_a_short_kafka_password_without_echoing_it() -> None:
    common = {"environment": "production", "write_keys": "w" * 32, "serving_key": "s" * 32,
              "approval_token": "a" * 32, "kafka_security_protocol": "SASL_PLAINTEXT",
              "kafka_sasl_username": "flywheel-serving"}  # fmt: skip
    with pytest.raises(ValidationError, match="FLYWHEEL_KAFKA_SASL_PASSWORD is too short") as err:
        Settings(**common, kafka_sasl_password="short-secret")
    assert "short-secret" not in str(err.value)
    assert client_security(Settings(**common, kafka_sasl_password="p" * 32))["sasl_plain_password"] == "p" * 32
