"""One `Settings` per process, read from the environment.

Every component reads the same settings; an empty value for a backing service
(Kafka, Redis, MLflow, the model) means "use the embedded default" that
`launcher.embedded` starts or creates.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Configuration for every Flywheel process.

    Environment variables use the `FLYWHEEL_` prefix (`FLYWHEEL_DATA_DIR`), except
    the well-known service URLs, which also answer to their usual names
    (`KAFKA_BOOTSTRAP_SERVERS`, `REDIS_URL`, `MLFLOW_TRACKING_URI`).
    """

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", extra="forbid", populate_by_name=True)

    environment: Literal["development", "production"] = "development"
    data_dir: Path = Field(default=Path("var"), description="Lake, models, MLflow and embedded state.")

    # Kafka
    kafka_bootstrap_servers: str = Field(
        default="",
        validation_alias=AliasChoices("FLYWHEEL_KAFKA_BOOTSTRAP_SERVERS", "KAFKA_BOOTSTRAP_SERVERS"),
        description="host:port[,host:port]; empty starts the embedded Tansu broker.",
    )
    kafka_client: Literal["kafka-python", "confluent"] = "kafka-python"
    embedded_kafka_port: int = 19092
    topic_partitions: int = Field(default=4, ge=1)
    events_topic: str = "flywheel.events"
    rewards_topic: str = "flywheel.rewards"
    dead_letter_topic: str = "flywheel.dead-letter"

    # Redis
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("FLYWHEEL_REDIS_URL", "REDIS_URL"),
        description="When nothing answers here, an embedded Valkey server is started instead.",
    )
    redis_prefix: str = "flywheel:"

    # MLflow
    mlflow_tracking_uri: str = Field(
        default="",
        validation_alias=AliasChoices("FLYWHEEL_MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI"),
        description="Empty: SQLite under data_dir with a local artifact folder.",
    )
    registered_model_name: str = "flywheel-policy"

    # Model
    model_path: str = Field(
        default="",
        description="A local Hugging Face causal LM checkpoint; empty bootstraps the embedded one.",
    )
    device: str = "cpu"

    # Services
    bind_host: str = Field(
        default="127.0.0.1",
        description="Interface every HTTP server binds (collector, serving, gate, trainer API, ingest metrics); "
        "0.0.0.0 serves other hosts (a product's back ends, Prometheus, a Kubernetes Service).",
    )
    serving_port: int = 8000
    collector_port: int = 8001
    gate_port: int = 8002
    trainer_port: int = 8003
    ingest_metrics_port: int = Field(default=9101, ge=0, description="Ingest worker /metrics and health; 0 = off.")
    signals_metrics_port: int = Field(default=9102, ge=0, description="Signals worker /metrics and health; 0 = off.")
    write_keys: str = Field(
        default="dev-write-key",
        description="Comma-separated write keys the collector accepts (HTTP basic auth user).",
    )
    approval_token: str = Field(default="dev-approval-token", description="Bearer token for approvals.")

    # Loop timing
    reward_window_s: float = Field(default=600.0, gt=0, description="Feedback window per generation.")
    allowed_lateness_s: float = Field(default=5.0, ge=0)
    train_interval_s: float = Field(default=3 * 3600.0, gt=0)
    min_train_samples: int = Field(default=32, ge=1)
    challenger_share: float = Field(default=0.2, gt=0, le=1)

    @field_validator("kafka_bootstrap_servers", "mlflow_tracking_uri", "model_path")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()

    @model_validator(mode="after")
    def _refuse_default_secrets_in_production(self) -> Settings:
        if self.environment == "production":
            if "dev-write-key" in self.write_key_set:
                raise ValueError("FLYWHEEL_WRITE_KEYS still holds the development key; set real write keys.")
            if self.approval_token == "dev-approval-token":
                raise ValueError("FLYWHEEL_APPROVAL_TOKEN is the development token; set a secret one.")
        return self

    @property
    def write_key_set(self) -> frozenset[str]:
        return frozenset(k.strip() for k in self.write_keys.split(",") if k.strip())

    @property
    def lake_dir(self) -> Path:
        return self.data_dir / "lake"

    @property
    def embedded_mlflow_uri(self) -> str:
        return f"sqlite:///{(self.data_dir / 'mlflow' / 'mlflow.db').resolve()}"

    @property
    def resolved_mlflow_uri(self) -> str:
        return self.mlflow_tracking_uri or self.embedded_mlflow_uri


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once from the environment)."""
    return Settings()
